"""Adaptive speculation length: per step, the verify width that maximises expected tokens per second.

Two measured ingredients, both kept per target model across calls (weakly: they go with the model):

- **What a step costs** (`StepCosts`): each call at a batch size times one target forward of three widths right
  after the prefill (`calibrate`: 1, 2 and k + 1 on the first call, the others interpolated until later calls
  time them, each width three times, the fastest kept; so no call pays more than three extra forwards), because on real hardware the
  cost is far from linear in the width (on a 2-core CPU SmolLM2 takes 61 ms for 1 token, 105 ms for 2, 82 ms
  for 5). The loop's own steps then refine it, per context-length bucket (long contexts make wide verifies
  dearer): a width measured in a bucket costs what it took there; others scale the calibrated forward like the
  bucket's plain steps and add the measured drafting cost per draft (draft models).
- **What drafts are worth** (`AcceptanceStats`): for each draft key (a small category the proposer gives each
  row's drafts: the matched n-gram length for prompt lookup, one category for draft models), the probability
  S(j) that the first j drafts are all accepted, estimated from every verified step (censored at the drafts that
  step had), decayed so that it follows the text, with a prior that keys not seen for a while drift back to.
  Each row's own record then scales its estimate (`AdaptiveSchedule.row_factors`): how a kind of draft fares
  varies more between texts than between kinds.

Each step the batch verifies at one width W (a row with fewer drafts leaves holes), so the schedule picks
`W = argmax_W sum_rows (1 + sum_{j <= min(d_row, W-1)} S_row(j)) / cost(W)`, and W = 1 (plain decoding through
the same forward) unless speculating beats it by a margin: speculation switches itself off where it does not
pay. For a proposer that drafts for free (n-gram) the decision is taken after proposing, from the drafts and
their keys; for a draft model it is taken before drafting, from the one key's statistics.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_specdec.batch import RaggedBatch
from hf_specdec.first_shapes import builds_plans_per_shape
from hf_specdec.model_guard import model_serial
from hf_specdec.proposers.base import Proposal
from hf_specdec.ranks import RankAgreement
from hf_specdec.schedules import SpeculationSchedule

__all__ = [
    "AcceptanceStats", "AdaptiveSchedule", "StepCosts", "best_width", "calibration_widths", "context_bucket",
    "model_serial",
]  # fmt: skip


def best_width(
    survival: torch.Tensor,  # [B, K] S(j): probability that a row's drafts 1..j are all accepted
    num_drafts: torch.Tensor,  # [B] drafts each row has (0..K)
    step_times: torch.Tensor,  # [K + 1] seconds of a step of verify width W = 1..K+1 (index W - 1)
    margin: float = 0.03,
) -> tuple[int, torch.Tensor]:
    """The verify width W maximising expected tokens per second, and the drafts each row verifies at it ([B]).

    At width W row r verifies min(d_r, W - 1) drafts and emits `1 + sum_{j <= that} S_r(j)` tokens on average.
    W = 1 (no drafts) unless the best width's rate beats plain decoding's by `margin`.
    """
    batch_size, max_k = survival.shape
    ks = torch.arange(max_k + 1)  # [K + 1] drafts per row at width W = k + 1
    accepted = torch.cat([torch.zeros(batch_size, 1), survival.float().cumsum(1)], dim=1)  # [B, K + 1]
    used = torch.minimum(ks[None, :], num_drafts[:, None].cpu())  # [B, K + 1]
    tokens = batch_size + accepted.gather(1, used).sum(0)  # [K + 1] expected tokens of the batch per width
    rate = tokens / step_times[: max_k + 1].float()  # [K + 1]
    rate[int(num_drafts.max()) + 1 :] = 0.0  # wider than any row's drafts: the verify would not be that wide
    best = int(rate.argmax())
    if best == 0 or rate[best] <= rate[0] * (1 + margin):
        best = 0
    return best + 1, used[:, best]


def calibration_widths(max_k: int) -> list[int]:
    """The verify widths calibration times for drafts of up to `max_k` (dynamic caches): every width up to 9 (small
    widths cost irregularly on a CPU: a 2-token forward can cost more than a 5-token one), then 13, 17, 25, 33 and
    k + 1; other widths are interpolated until the loop's own steps measure them. With k = 24 (suffix decoding's
    default) that is 12 widths to time instead of 25, so calibration ends after half as many calls."""
    grid = [w for w in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 25, 33) if w <= max_k + 1]
    return sorted({*grid, max_k + 1})


#: after this many plain steps in a row, drafting steps' measured costs are forgotten (`AdaptiveSchedule.explore`)
REPROBE_AFTER = 128
#: the longest interval between re-probes that keep finding drafting not worth choosing (`AdaptiveSchedule.explore`)
REPROBE_AFTER_MAX = 1024


class AcceptanceStats:
    """
    Per draft key, the chance S(j) that drafts 1..j are all accepted (a product-limit estimate over steps).

    A step with d drafts of which a were accepted puts the key "at risk" at positions 1..min(a + 1, d) and, when
    a < d, records a rejection at position a + 1. Counts of a key decay by `decay` per observation (recent text
    counts more) and by `idle_decay` per step without one (a key that was switched off drifts back to the prior,
    so it gets re-tried now and then); the prior is `prior_weight` observations of per-position acceptance
    `prior`, optimistic, so that every kind of draft is tried before it is judged.
    """

    not_step_state = True  # shared by every call on a model (`step_graph.state_owners` skips it)

    def __init__(
        self,
        max_k: int,
        prior: float = 0.9,
        prior_weight: float = 2.0,
        decay: float = 0.995,
        idle_decay: float = 0.999,
    ) -> None:
        self.max_k = max_k
        self.prior, self.prior_weight = prior, prior_weight
        self.decay, self.idle_decay = decay, idle_decay
        self.at_risk = torch.zeros(0, max_k)  # [keys, K] on the host: beyond the prior
        self.rejected = torch.zeros(0, max_k)  # [keys, K]

    def _grow(self, num_keys: int) -> None:
        if num_keys > self.at_risk.shape[0]:
            extra = num_keys - self.at_risk.shape[0]
            self.at_risk = torch.cat([self.at_risk, torch.zeros(extra, self.max_k)])
            self.rejected = torch.cat([self.rejected, torch.zeros(extra, self.max_k)])

    def survival(self, keys: torch.Tensor) -> torch.Tensor:  # [B, K] for keys [B] (host)
        self._grow(int(keys.max()) + 1 if keys.numel() else 0)
        at_risk = self.at_risk[keys] + self.prior_weight  # [B, K]
        rejected = self.rejected[keys] + self.prior_weight * (1 - self.prior)
        return (1 - rejected / at_risk).clamp(0, 1).cumprod(1)

    def idle(self, steps: int) -> None:
        """`steps` plain steps: every key's counts fade by `idle_decay` per step."""
        self.at_risk *= self.idle_decay**steps
        self.rejected *= self.idle_decay**steps

    def record(self, keys: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """One step: per row its key, drafts and accepted drafts ([B] each, host); rows with no drafts are skipped."""
        rows = drafted > 0
        if not bool(rows.any()):  # a plain step: every key is idle
            self.idle(1)
            return
        keys, drafted, accepted = keys[rows], drafted[rows], accepted[rows]
        self._grow(int(keys.max()) + 1)
        seen = torch.bincount(keys, minlength=self.at_risk.shape[0])  # [keys] observations this step
        factor = torch.where(seen > 0, self.decay ** seen.double(), self.idle_decay).float()[:, None]
        self.at_risk *= factor
        self.rejected *= factor
        positions = torch.arange(self.max_k)  # [K]
        risk = (positions[None, :] < torch.minimum(accepted + 1, drafted)[:, None]).float()  # [B', K]
        reject = (positions[None, :] == accepted[:, None]) & (accepted < drafted)[:, None]  # [B', K]
        self.at_risk.index_add_(0, keys, risk)
        self.rejected.index_add_(0, keys, reject.float())


def context_bucket(context_length: float) -> int:
    """Step costs are kept per power of two of the rows' mean context length (64 at least): longer contexts
    make every width dearer, and wide verifies more so (SmolLM2 on 2 cores, 100 -> 1500 tokens: a 1-token
    forward 65 -> 75 ms, a 5-token one 87 -> 164 ms)."""
    return 1 << max(6, math.ceil(math.log2(max(context_length, 1.0))))


@dataclass
class MeasuredSteps:
    """The loop's own steps at one context bucket: seconds per verify width, and plain step / forward."""

    not_step_state = True  # shared by every call on a model (`step_graph.state_owners` skips it)

    seconds: dict[int, float] = field(default_factory=dict)  # width -> seconds of a whole step (`recent`'s least)
    samples: dict[int, int] = field(default_factory=dict)  # width -> steps measured
    recent: dict[int, list[float]] = field(default_factory=dict)  # width -> the latest `WINDOW` step times
    ratio: float = 1.0  # average of a plain (width 1) step over the calibrated 1-token forward

    #: step times kept per width. The least of them is the width's cost: what disturbs a step only adds to it (a
    #: garbage collection, a graph's first launch, a kernel's first compile, a busy host). On an H100 whose host
    #: was shared, eager plain steps took 22 ms, then 40 ms for a second, then 22 ms again: a drafting step
    #: measured in such a second looked twice its cost next to plain steps measured outside it, and drafting
    #: was switched off (the median of the recent steps followed the slow second). A lasting rise shows after
    #: `WINDOW` steps, a fall at once.
    WINDOW = 7

    def add(self, width: int, seconds: float) -> None:
        recent = self.recent.setdefault(width, [])
        recent.append(seconds)
        del recent[: -self.WINDOW]
        self.seconds[width] = min(recent)
        self.samples[width] = self.samples.get(width, 0) + 1

    def forget(self, width: int) -> None:
        """Drop what was measured of `width`: it is measured anew."""
        for measured in (self.seconds, self.samples, self.recent):
            measured.pop(width, None)


@dataclass
class StepCosts:
    """
    Seconds of a whole step (drafting, verify and the loop's work) of each verify width at one batch size, per
    context bucket.

    A width the loop has run at least `min_samples` times in a context bucket costs what its steps took there.
    Any other width W costs `forward[W] * ratio + draft_cost * (W - 1)`: the calibrated forward scaled like the
    bucket's plain steps (which carries over what calibration did not see: the loop's own work, a longer context,
    a first call in a process running slower while the allocator warms up) plus the drafting, measured as what
    wide steps took beyond their scaled forward (0 for proposers that draft every step: their cost is in every
    step, plain ones included). Samples are clipped to 0.5..2x the calibrated forward (plus drafting), so a JIT
    compile or a hiccup of the machine is not taken for the cost of a width.
    """

    not_step_state = True  # shared by every call on a model (`step_graph.state_owners` skips it)

    forward: dict[int, float] = field(default_factory=dict)  # width -> seconds of one calibrated target forward
    calibrated: bool = False  # False: borrowed from the nearest calibrated batch size (met mid-call)
    timed: dict[int, int] = field(default_factory=dict)  # width -> times timed (each call times a few widths)
    per_call: int = 3  # widths timed per call, until every width was timed `max_passes` times
    max_passes: int = 3
    contexts: dict[int, MeasuredSteps] = field(default_factory=dict)  # context bucket -> measured steps
    draft_cost: float = 0.0  # seconds per draft token, for proposers that draft only when asked to
    draft_prior: float = 0.0  # what `draft_cost` is taken to be before drafting was measured, and fades back to
    draft_measured: bool = False  # a drafting step was measured: `draft_cost` is no longer the prior alone
    #: the latest measured drafting costs per draft (`MeasuredSteps.WINDOW` of them): `draft_cost` fades no lower
    #: than half their median (`record`)
    draft_samples: list[float] = field(default_factory=list)
    #: a step wider than 1 was measured since the last calibration: more widths are worth timing (a draft that is
    #: never used, e.g. a useless one, pays calibration in its first call only)
    drafted_since_calibration: bool = False
    passes: int = 0  # calibration passes so far (the second corrects a first slowed by warm-up or a compile)
    smoothing: float = 0.1  # weight of a new sample
    min_samples: int = 2
    idle_decay: float = 0.99  # per plain step: a drafting cost not re-measured fades (speculation is re-tried)
    plain_streak: int = 0  # static caches: plain steps chosen in a row, across calls (`AdaptiveSchedule.explore`)
    #: plain steps in a row before the next re-probe: `REPROBE_AFTER`, doubled (up to `REPROBE_AFTER_MAX`) by each
    #: re-probe, back to `REPROBE_AFTER` when two steps in a row draft by choice (`AdaptiveSchedule.explore`)
    reprobe_after: int = REPROBE_AFTER

    def calibrate(self, time_verify: Callable[[int], float], widths: Sequence[int]) -> None:
        """Time a forward of `per_call` widths (the fastest of all timings of a width is kept): those timed least,
        1, 2 and the widest first, so that a first call pays three forwards and interpolation covers the rest."""
        ends = {widths[0], widths[0] + 1, widths[-1]}
        order = sorted(widths, key=lambda w: (self.timed.get(w, 0), w not in ends, w))
        for w in [w for w in order if self.timed.get(w, 0) < self.max_passes][: self.per_call]:
            seconds = time_verify(w)
            self.forward[w] = min(self.forward.get(w, seconds), seconds)
            self.timed[w] = self.timed.get(w, 0) + 1
        self.calibrated = True
        self.drafted_since_calibration = False
        self.passes += 1

    def complete(self, widths: Sequence[int]) -> bool:
        """Every width timed `max_passes` times: no more timing."""
        return all(self.timed.get(w, 0) >= self.max_passes for w in widths)

    def covers(self, widths: Sequence[int]) -> bool:
        """Every width is timed or lies between two timed widths."""
        return bool(self.forward) and min(self.forward) <= widths[0] and max(self.forward) >= widths[-1]

    def forward_at(self, width: int) -> float:
        """The timed forward of `width`, or a linear interpolation between the nearest timed widths around it."""
        if width in self.forward:
            return self.forward[width]
        below = max(w for w in self.forward if w < width)
        above = min(w for w in self.forward if w > width)
        share = (width - below) / (above - below)
        return self.forward[below] + share * (self.forward[above] - self.forward[below])

    def at(self, bucket: int) -> MeasuredSteps:
        """The measured steps of a context bucket; a new bucket starts from the nearest one's ratio."""
        if bucket not in self.contexts:
            nearest = min(self.contexts, key=lambda b: abs(math.log2(b / bucket)), default=None)
            self.contexts[bucket] = MeasuredSteps(ratio=self.contexts[nearest].ratio if nearest else 1.0)
        return self.contexts[bucket]

    def record(self, width: int, bucket: int, seconds: float, drafts_separately: bool, clip: bool = True) -> None:
        """A step of verify width `width` in context bucket `bucket` took `seconds`; `drafts_separately`: the
        proposer drafted only for this width (a draft model), so the step's cost beyond its forward is drafting.
        `clip=False` (captured steps, whose cost is far from the eager forward timed at calibration, and which
        are recorded only once steady) takes the time as it is."""
        if not self.forward or not min(self.forward) <= width <= max(self.forward):
            return
        steps = self.at(bucket)
        scaled = self.forward_at(width) * steps.ratio  # the forward as this bucket's plain steps suggest
        drafting = self.draft_cost * (width - 1) if drafts_separately else 0.0
        if clip:
            seconds = min(max(seconds, 0.5 * scaled), 2.0 * scaled + 2.0 * drafting)
        self.drafted_since_calibration |= width > 1
        if width == 1:
            steps.ratio += self.smoothing * (seconds / self.forward[1] - steps.ratio)
            # Fading lets drafting be re-tried after a cost measured too high, but not below half of what drafting
            # was measured to cost: the prior is the draft's share of the target's parameters, while an eager draft
            # on a GPU costs its kernel launches (an 8B target's re-probes at acceptance 0 drafted 22% of a call's
            # steps with the cost faded to the prior).
            floor = 0.5 * statistics.median(self.draft_samples) if self.draft_samples else 0.0
            target = max(self.draft_prior, floor)
            self.draft_cost = target + (self.draft_cost - target) * self.idle_decay
        elif drafts_separately:
            sample = max(seconds - scaled, 0.0) / (width - 1)
            self.draft_samples = [*self.draft_samples, sample][-MeasuredSteps.WINDOW :]
            self.draft_cost += self.smoothing * (sample - self.draft_cost)
            self.draft_measured = True
        steps.add(width, seconds)

    def step_time(self, width: int, bucket: int) -> float:
        steps = self.at(bucket)
        if steps.samples.get(width, 0) >= self.min_samples:
            return steps.seconds[width]
        return self.forward_at(width) * steps.ratio + self.draft_cost * (width - 1)

    def table(self, max_width: int, bucket: int) -> torch.Tensor:  # [max_width] seconds of widths 1..max_width
        return torch.tensor([self.step_time(w, bucket) for w in range(1, max_width + 1)])


@dataclass
class ModelMemory:
    """What the adaptive schedule learned about one target model, per proposer (`cost_key`)."""

    not_step_state = True  # shared by every call on a model (`step_graph.state_owners` skips it)

    costs: dict[tuple[str, int], StepCosts] = field(default_factory=dict)  # (cost_key, batch size) -> costs
    stats: dict[tuple[str, int], AcceptanceStats] = field(default_factory=dict)  # (cost_key, max_k) -> stats


#: Per target model (weakly: it goes with the model), shared by every call on it.
_MEMORY: weakref.WeakKeyDictionary[object, ModelMemory] = weakref.WeakKeyDictionary()


@dataclass
class _Step:
    """The step in flight: its cost table, context bucket, start time and verify width."""

    costs: StepCosts
    bucket: int  # context bucket of the step
    start: float
    width: int = 1
    steps: int = 1  # plain steps the step ran back to back (one graph): its time covers them all
    measured: bool = True  # False: the step ran a warm-up, a capture or a compaction (`discard_timing`)


class AdaptiveSchedule(SpeculationSchedule):
    """
    Chooses the verify width per step and each row's drafts from measured costs and acceptance (see module doc).

    Args:
        max_k (`int`): Most drafts a row may get (`SpecDecoder.num_speculative_tokens`).
        model (`object`): The target model: costs and statistics are kept per model (weakly), across calls.
        cost_key (`str`): Which proposer the statistics and overheads belong to (e.g. `"ngram:1-4"`, `"draft:<id>"`).
        acceptance_key (`str`, *optional*): Which drafts the acceptance statistics belong to, when finer than
            `cost_key` (a draft model's version: `model_guard.model_version`; a changed draft costs the same but is
            judged anew).
        propose_first (`bool`): The proposer drafts for free (n-gram): every row proposes k drafts and the choice
            is made from them; otherwise the choice is made before drafting.
        margin (`float`, *optional*, defaults to 0.05): Speculate only when the expected rate beats plain by this
            (step costs are measured to a few percent on a busy machine).
        row_weight (`float`, *optional*, defaults to 1.0): How many expected accepted drafts of evidence a row needs
            before its own record moves its estimate away from its key's (see `row_factors`).
        row_decay (`float`, *optional*, defaults to 0.97): Per step, what a row's record keeps of its past.
        row_doubt (`float`, *optional*, defaults to 2.0): How many standard deviations below its keys' expectation
            a row's accepted drafts must fall before the row is judged worse than its keys (see `row_factors`).
        draft_share (`float`, *optional*, defaults to 0.0): What drafting one token costs, as a share of a one-token
            target forward, until it is measured (a draft model's parameters over the target's): without it a
            draft as large as the target would look free where wide verifies cost little more than narrow ones.
        static (`bool`, *optional*, defaults to False): The call runs on static caches. Its step costs are kept
            apart from the dynamic path's (a captured step on a GPU costs a third of an eager one); what drafts are
            worth is shared.
        agreement (`RankAgreement`, *optional*): A tensor-parallel target's ranks. Costs are timed per rank, so
            every rank takes the first rank's cost table: the same choices, hence the same forwards on every rank.
    """

    #: dynamic caches, a draft model: a choice to draft nothing holds this many steps before the next choice. What
    #: moves the choice (row records fading, the drafting cost fading to its prior, idle keys drifting back) moves a
    #: few percent per step, and choosing costs about 60 host operations: a step of a small target on the CPU, or
    #: of an eager 8B one on a GPU, is bound by the host's operations.
    PLAIN_HOLD = 4
    observes_on_host = True  # it learns on the host: the dynamic loop hands it the step's read

    def __init__(
        self,
        max_k: int,
        model: object,
        cost_key: str,
        propose_first: bool,
        margin: float = 0.05,
        row_weight: float = 1.0,
        row_decay: float = 0.97,
        row_doubt: float = 2.0,
        draft_share: float = 0.0,
        static: bool = False,
        acceptance_key: str | None = None,
        agreement: RankAgreement | None = None,
    ) -> None:
        super().__init__(max_k)
        #: a tensor-parallel target's ranks: each decides from the first rank's cost table (`hf_specdec.ranks`)
        self.agreement = agreement
        self.memory = _MEMORY.setdefault(model, ModelMemory()) if model is not None else ModelMemory()
        self.stats = self.memory.stats.setdefault((acceptance_key or cost_key, max_k), AcceptanceStats(max_k))
        self.cost_key = cost_key
        self.costs_name = f"{cost_key}@static" if static else cost_key  # step costs are kept per path
        self.static = static
        #: the verify widths a step can have: on static caches 1 (no drafts) or 1 + k (rows with fewer drafts
        #: carry masked slots), so only those two are timed and every drafting step costs the full width
        self.widths: Sequence[int] = (1, max_k + 1) if static else calibration_widths(max_k)
        #: static caches: plain steps to measure before their cost is trusted. Calibration times eager forwards,
        #: but captured steps cost far less (a third on an H100 at batch 1), and not in the same proportion for
        #: plain and drafting steps: each kind's cost is taken from its own steady steps (`explore_plain`).
        self.plain_samples_needed = 2 if static else 0
        self.drafting_steps = 0  # steps of this call that drafted (static: plain steps are explored after a few)
        self.held = 0  # steps the latest choice to draft nothing still holds (`PLAIN_HOLD`)
        self.idle_steps = 0  # plain steps whose per-step fading is not applied yet (`_settle`)
        self.propose_first = propose_first
        self.margin = margin
        self.time_verify: Callable[[int], float] | None = None
        self.device = torch.device("cpu")  # the call's (`start`)
        self.keys = torch.zeros(0, dtype=torch.long)  # [B] (host) draft keys of the step in flight
        self.pending: _Step | None = None  # the step in flight
        self.first_step = True  # the call's first step is not measured
        self.prefilling = False  # True until step 0, whose verify is the prefill, has asked for its budgets
        self.row_weight, self.row_decay, self.row_doubt = row_weight, row_decay, row_doubt
        self.draft_share = 0.0 if propose_first else draft_share
        self.row_accepted = torch.zeros(0)  # [B] (host) drafts each row got accepted, decayed per step
        self.row_expected = torch.zeros(0)  # [B] (host) what its keys' statistics expected of those drafts
        self.row_variance = torch.zeros(0)  # [B] (host) the variance of that expectation (the steps' sum)
        self.row_doubted = torch.zeros(0, dtype=torch.bool)  # [B] (host) rows judged worse than their keys
        #: [2, B, K + 1] (host) this step's expected accepted drafts of 0..K drafts, and their second moments
        self.expected: torch.Tensor | None = None

    def costs(self, batch_size: int) -> StepCosts:
        """This batch size's costs: a few widths timed at each call's first step until all are timed (`calibrate`),
        else borrowed from the nearest batch size."""
        costs = self.memory.costs.get((self.costs_name, batch_size))
        widths = self.widths
        known = costs is not None and costs.calibrated and costs.covers(widths)
        settled = known and (costs.complete(widths) or (costs.passes >= 2 and not costs.drafted_since_calibration))
        if self.time_verify is not None and not settled:
            # Static caches: the eager forwards timed here only seed the costs until captured steps are measured,
            # so one pass (the model's first call) is enough. So on a GPU, where a width's first forward is timed
            # again (`SpeculativeLoop.time_verify`): the later passes only took the minimum of noisy timings. There
            # the dynamic path times every width in the model's first call, which warms up anyway (its steps are
            # not timed, `first_shapes`), so that later calls time nothing (k = 4: 10 forwards, about 0.2 s of an
            # 8B target on an H100, against 4 more in the second call, 6% of it, before).
            gpu = builds_plans_per_shape(self.device)
            if costs is None or not costs.calibrated:
                per_call = len(widths) if gpu and not self.static else 3
                costs = StepCosts(max_passes=1 if self.static or gpu else 3, per_call=per_call)
            costs.calibrate(self.time_verify, widths)
        elif not known:
            nearby = [(abs(b - batch_size), b) for (key, b), c in self.memory.costs.items()
                      if key == self.costs_name and c.calibrated and c.covers(widths)]  # fmt: skip
            if not nearby:
                raise RuntimeError("AdaptiveSchedule has no step costs: calibrate() must run after the prefill.")
            costs = StepCosts(forward=dict(self.memory.costs[(self.costs_name, min(nearby)[1])].forward))
        if self.draft_share:  # follows the fastest forward timed so far (a first timing may include a compile)
            costs.draft_prior = self.draft_share * costs.forward_at(1)
            if not costs.draft_measured:
                costs.draft_cost = costs.draft_prior
        self.memory.costs[(self.costs_name, batch_size)] = costs
        return costs

    def calibrate(self, time_verify: Callable[[int], float]) -> None:
        self.time_verify = time_verify

    def start(self, batch_size: int, device: torch.device) -> None:
        self._settle()
        self.device = device
        self.pending = None
        self.held = 0
        self.drafting_steps = 0
        self.prefilling = True
        self.row_accepted = torch.zeros(batch_size)
        self.row_expected = torch.zeros(batch_size)
        self.row_variance = torch.zeros(batch_size)
        self.row_doubted = torch.zeros(batch_size, dtype=torch.bool)
        self.expected = None

    def row_factors(self) -> torch.Tensor:  # [B] (host)
        """How each row's drafts fare against what their keys' statistics expect: (w + accepted) / (w + expected).

        Acceptance varies far more between texts than between kinds of drafts: long n-gram matches are accepted
        82% of the time on average, yet in some answers never. Each row's survival S(j) is scaled by this factor
        (a gamma-frailty estimate), so a row whose drafts keep failing stops drafting after a few tries, and one
        whose drafts do better than expected drafts more; its record fades by `row_decay` per step, so a row
        that stopped is tried again later.

        A row is judged worse than its keys only once its accepted drafts fall `row_doubt` standard deviations
        below what they expected (until then its factor is 1; from then on, for the rest of the call, it is the
        estimate, which fades back towards 1 as above): a single step whose drafts were all rejected
        happens by chance (at S(1) = 0.75, one step in four), and judged alone it cut a good draft's estimate to
        a third, keeping it off for some 35 steps (on an H100, sampled calls at acceptance 0.5 drafted in 6-40% of
        their steps, against 95% in others). A row whose drafts never pass is still stopped after one to four
        tries, the fewer the better its keys.
        """
        factor = (self.row_weight + self.row_accepted) / (self.row_weight + self.row_expected)
        return torch.where((factor >= 1) | self.row_doubted, factor, torch.ones_like(factor))

    @property
    def plans_on_host(self) -> bool:
        """Whether the choice is made before drafting, on the host alone (`host_budgets`): a draft model's steps
        can then be captured as CUDA graphs, one for drafting steps and one for steps without drafts."""
        return not self.propose_first or self.static

    def budgets(self, batch: RaggedBatch) -> torch.Tensor:  # [B]
        return self.host_budgets(batch).to(batch.device)

    def host_budgets(self, batch: RaggedBatch) -> torch.Tensor:  # [B] (host)
        """Drafts each row may have this step, decided on the host; also starts timing the step."""
        planned_keys = self.keys  # static prompt lookup: the keys of the row's previous drafts (`observe`)
        self.keys = torch.zeros(batch.batch_size, dtype=torch.long)  # a draft model's rows have one key
        if self.prefilling:  # step 0 (the prefill) drafts nothing: its costs are not known, and it is plain's own
            self.prefilling = False
            return torch.zeros(batch.batch_size, dtype=torch.long)
        now = time.perf_counter()
        step = self.pending
        if step is not None and not self.first_step and step.measured:  # a call's first step pays warm-ups
            step.costs.record(
                step.width,
                step.bucket,
                (now - step.start) / step.steps,
                drafts_separately=not self.propose_first,
                clip=not self.static,
            )
        self.first_step = self.pending is None
        if self.held and step is not None and step.costs.plain_streak < step.costs.reprobe_after:
            # the latest choice drafts nothing and still holds (until a re-probe is due): no new choice
            self.held -= 1
            step.costs.plain_streak += 1  # as `explore` counts every plain step
            self.pending = _Step(step.costs, step.bucket, time.perf_counter())
            return torch.zeros(batch.batch_size, dtype=torch.long)
        costs = self.costs(batch.batch_size)
        self.time_verify = None  # calibrate once per call, at the call's first batch size
        if self.static:  # a static step attends over the whole static length: its cost does not follow the context
            bucket = context_bucket(1.0)
        elif batch.host_lengths is not None and batch.host_pad_lengths is not None:  # the host's copies: no read
            bucket = context_bucket(
                float(np.mean(batch.host_lengths - batch.host_pad_lengths)) if batch.batch_size else 0.0
            )
        else:
            bucket = context_bucket(
                float((batch.lengths - batch.pad_lengths).float().mean()) if batch.batch_size else 0.0
            )
        self.pending = _Step(costs, bucket, time.perf_counter())
        full = torch.full((batch.batch_size,), self.max_k, dtype=torch.long)  # [B]
        if self.propose_first and not self.static:  # chosen after proposing, from the drafts' keys (`trim`)
            return full
        if self.propose_first and planned_keys.shape[0] == batch.batch_size:
            # Static prompt lookup, planned before its device work: every drafting step verifies k + 1 slots, so
            # trimming rows saves nothing; whether to draft is judged by each row's previous drafts' keys.
            self.keys = planned_keys
        return self._choose(self.keys, full)

    def discard_timing(self) -> None:
        if self.pending is not None:
            self.pending.measured = False

    def restart_timing(self) -> None:
        if self.pending is not None:
            self.pending.start = time.perf_counter()

    def ran_plain_steps(self, steps: int) -> None:
        """A block of `steps` plain steps: its time is per step, and what fades per step fades `steps - 1` more
        times (each row's record, the idle keys' counts) while the streak before a re-probe grows by as many."""
        extra = steps - 1
        if self.pending is not None:
            self.pending.steps = steps
            self.pending.costs.plain_streak += extra
        self.idle_steps += extra

    def _settle(self) -> None:
        """Apply the fading owed for plain steps (`idle_steps`): each row's record and every key's counts fade per
        step, which plain steps leave to the next choice or observation, in one operation each."""
        if self.idle_steps:
            self._fade_rows(self.idle_steps)
            self.stats.idle(self.idle_steps)
            self.idle_steps = 0

    def finish(self) -> None:
        self._settle()  # the keys' counts are shared with later calls

    def _fade_rows(self, steps: int) -> None:
        """Each row's record fades by `row_decay` per step (whether the row stands doubted does not)."""
        fade = self.row_decay**steps
        self.row_accepted *= fade
        self.row_expected *= fade
        self.row_variance *= fade

    def trim(self, proposal: Proposal) -> torch.Tensor | np.ndarray:  # [B]
        """The drafts each row keeps: on the device, or on the host (numpy) for a proposal with host counts."""
        host = proposal.host_num_draft_tokens
        if proposal.host_draft_keys is not None:
            self.keys = torch.from_numpy(proposal.host_draft_keys)
        elif proposal.draft_keys is not None:
            self.keys = proposal.draft_keys.cpu()
        else:  # one category
            self.keys = torch.zeros(len(proposal.num_draft_tokens), dtype=torch.long)
        if not self.propose_first:  # decided before drafting
            return host if host is not None else proposal.num_draft_tokens
        num = torch.from_numpy(host) if host is not None else proposal.num_draft_tokens.cpu()
        chosen = self._choose(self.keys, num)
        return chosen.numpy() if host is not None else chosen.to(proposal.num_draft_tokens.device)

    def select_rows(self, keep: torch.Tensor) -> None:
        self._settle()
        self.held = 0  # other rows: choose anew
        keep = keep.cpu()
        self.row_accepted, self.row_expected = self.row_accepted[keep], self.row_expected[keep]
        self.row_variance, self.row_doubted = self.row_variance[keep], self.row_doubted[keep]

    def _choose(self, keys: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:  # [B] host
        self.expected = None
        self.held = 0
        if not bool((num_drafts > 0).any()):
            return torch.zeros_like(num_drafts)
        assert self.pending is not None, "budgets() runs before each step's choice"
        self._settle()
        table = self.pending.costs.table(self.max_k + 1, self.pending.bucket)  # [K + 1]
        if self.agreement is not None:  # tensor parallelism: ranks' timings differ, their choices must not
            table = self.agreement.agree(table)
        if self.static:
            table[1:] = table[-1]
        survival = self.stats.survival(keys)  # [B, K]
        # accepted drafts A of d drafts: E[A] = sum_{j<=d} S(j), E[A^2] = sum_{j<=d} (2j - 1) S(j)
        odd = torch.arange(1, 2 * self.max_k, 2, dtype=survival.dtype)  # [K] 2j - 1
        moments = torch.stack([survival, survival * odd])  # [2, B, K]
        self.expected = torch.cat([torch.zeros(2, len(keys), 1), moments.cumsum(2)], dim=2)  # [2, B, K + 1]
        survival = (survival * self.row_factors()[:, None]).clamp(max=1.0)
        budgets = best_width(survival, num_drafts, table, self.margin)[1]
        drafting = bool((budgets > 0).any())
        if drafting:
            self.drafting_steps += 1
        explore = self.explore(drafting)
        if explore is not None:
            return num_drafts.clone() if explore else torch.zeros_like(budgets)
        if not drafting and not self.static and not self.propose_first and self.pending.costs.plain_streak:
            self.held = self.PLAIN_HOLD - 1  # (not right after a re-probe's forgetting: the next step chooses anew)
        return budgets

    def explore(self, drafting: bool) -> bool | None:
        """The kind of step to run now to measure its cost (True: draft, False: plain), or None (as chosen).

        After `REPROBE_AFTER` plain steps in a row (across calls) what drafting steps were measured to cost is
        forgotten, so that a cost measured too high (a contended GPU, a first run's kernel loads), or one that has
        since fallen, does not keep drafting off for good: the next choices fall back on the calibrated forwards
        and the drafting cost, which fades towards its prior during plain steps. Dynamic caches then draft only if
        those estimates say it pays (a useless draft's statistics keep it off).

        Static caches also explore: calibration times eager forwards, whose first runs on a GPU carry one-time
        costs and whose proportions are not a captured step's; so each kind is trusted only once
        `plain_samples_needed` of its own steady steps were timed at this batch size: drafting is tried first
        (until measured, however poor the drafts look), then, after three drafting steps, plain steps. Costs are
        kept across calls: only a model's first call at a batch size pays these few steps. After a re-probe's
        forgetting a useless draft costs two drafting steps (and a draft model's catch-up of the tokens it missed).

        Re-probes back off: each one doubles the interval to the next, up to `REPROBE_AFTER_MAX`, until two steps
        in a row draft by choice (a re-probe found that drafting pays), which set it back to `REPROBE_AFTER`. One
        such step alone does not: estimates fading back towards drafting try a step now and then, and a useless
        draft fails it. A re-probe costs little beside 128 plain steps for a small draft (about 1% on an H100 at
        batch 1), but not for a deep one: on an H200, a 28-layer draft's re-probes and catch-ups took 10% of a
        Qwen3-8B target's 256-token call at acceptance 0 (docs/benchmarks.md)."""
        if self.pending is None:
            return None
        costs = self.pending.costs
        if drafting and costs.plain_streak == 0:  # a second drafting step by choice in a row: drafting pays again
            costs.reprobe_after = REPROBE_AFTER
        costs.plain_streak = 0 if drafting else costs.plain_streak + 1
        if costs.plain_streak > costs.reprobe_after:  # re-measure drafting now and then: costs change, and err
            costs.plain_streak = 0
            costs.reprobe_after = min(2 * costs.reprobe_after, REPROBE_AFTER_MAX)  # reset above
            for width in range(2, self.max_k + 2):
                costs.at(self.pending.bucket).forget(width)  # measured anew, as in a first call
        if not self.plain_samples_needed:
            return None
        samples = costs.at(self.pending.bucket).samples
        if not drafting and samples.get(self.max_k + 1, 0) < self.plain_samples_needed:
            self.drafting_steps += 1
            return True
        if drafting and self.drafting_steps > 3 and samples.get(1, 0) < self.plain_samples_needed:
            return False
        return None

    def observe(
        self, num_draft_tokens: torch.Tensor, num_accepted: torch.Tensor, draft_keys: torch.Tensor | None = None
    ) -> None:
        if draft_keys is not None:  # a planned step's drafts came with keys after the choice (static prompt lookup)
            self.keys = draft_keys.to("cpu", copy=True)  # a host copy, also on the CPU (the step rewrites its own)
        drafted, accepted = num_draft_tokens.cpu(), num_accepted.cpu()
        if not drafted.any():  # a plain step: it only fades what is kept, which waits for `_settle`
            self.idle_steps += 1
            self.expected = None  # (its zero drafts were expected to accept nothing)
            if self.pending is not None:
                self.pending.width = 1
            return
        self._settle()
        self.stats.record(self.keys, drafted, accepted)
        self._fade_rows(1)
        if self.expected is not None:
            mean, square = self.expected.gather(2, drafted[None, :, None].expand(2, -1, 1))[:, :, 0]  # [B] each
            self.row_accepted += accepted.float()
            self.row_expected += mean
            self.row_variance += square - mean**2
            self.row_doubted |= self.row_accepted < self.row_expected - self.row_doubt * self.row_variance.sqrt()
            self.expected = None
        if self.pending is not None:
            self.pending.width = 1 + int(drafted.max()) if drafted.numel() else 1
            if self.static and self.pending.width > 1:
                self.pending.width = self.max_k + 1
