"""Adaptive speculation length: per row and step, the draft count k that maximises tokens per second.

With per-position acceptance a, k drafts yield `(1 - a^(k+1)) / (1 - a)` tokens per step on average; a step
whose verify is w = k + 1 wide costs `step_time(w)`, measured online from the loop's own steps (the time
between successive proposals, drafting included, smoothed per batch size and width, kept per target model
across calls). Each row gets `argmax_k tokens(a_row, k) / step_time(k + 1)`, and 0 unless speculating beats
a plain one-token step by a margin, so speculation switches itself off where it does not pay. A row's
acceptance is a decayed count with an optimistic prior: a row left at k = 0 drifts back to a probe.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from hf_specdec.batch import RaggedBatch
from hf_specdec.schedules import SpeculationSchedule

__all__ = ["AdaptiveSchedule", "StepCosts", "best_num_drafts", "expected_tokens"]

#: Per-model cost tables, shared by every call on that target (the first call pays the measuring steps).
_COSTS: weakref.WeakKeyDictionary[object, dict[str, StepCosts]] = weakref.WeakKeyDictionary()


def expected_tokens(acceptance: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Tokens a step emits on average with k drafts of per-position acceptance a: sum_{j=0..k} a^j."""
    a = acceptance.clamp(0.0, 1.0)
    geometric = (1 - a ** (k + 1)) / (1 - a).clamp(min=1e-6)
    return torch.where(a >= 1 - 1e-6, (k + 1).to(a.dtype), geometric)


def best_num_drafts(
    acceptance: torch.Tensor,  # [B] per-position acceptance of each row
    step_times: torch.Tensor,  # [K + 1] seconds of a step of verify width w = 1..K+1 (index w - 1)
    margin: float = 0.03,
) -> torch.Tensor:  # [B] int64 in 0..K
    """The k in 0..K maximising expected tokens per second for each row; 0 unless it beats plain by `margin`."""
    ks = torch.arange(step_times.shape[0], device=acceptance.device)  # [K + 1]
    rate = expected_tokens(acceptance[:, None].float(), ks[None, :].float()) / step_times[None, :].float()  # [B, K+1]
    best_rate, best_k = rate.max(dim=1)  # [B]
    plain_rate = rate[:, 0]
    return torch.where(best_rate > plain_rate * (1 + margin), best_k, 0)


@dataclass
class StepCosts:
    """Smoothed step time per verify width (1..max_k+1) for one batch size; unseen widths are interpolated."""

    max_k: int
    smoothing: float = 0.3
    times: dict[int, float] = field(default_factory=dict)  # width -> seconds (EMA)
    counts: dict[int, int] = field(default_factory=dict)
    last_seen: dict[int, int] = field(default_factory=dict)  # width -> `steps` when it was last sampled
    steps: int = 0  # steps decided with this table (across calls)

    def record(self, width: int, seconds: float) -> None:
        n = self.counts.get(width, 0)
        # The first sample of a width is often a warm-up outlier: the second one replaces it.
        alpha = 1.0 if n <= 1 else self.smoothing
        self.times[width] = alpha * seconds + (1 - alpha) * self.times.get(width, seconds)
        self.counts[width] = n + 1
        self.last_seen[width] = self.steps

    def table(self, prior_slope: float = 0.1) -> torch.Tensor:  # [max_k + 1] seconds for widths 1..max_k+1
        """Step time of every width: measured, else linear between measured neighbours, else extrapolated.

        Past the widest measured width the slope of the measured points is used; with only the plain step
        measured, an optimistic `prior_slope` (share of a plain step per extra width) makes the first probe.
        """
        known = sorted(self.times)
        base = self.times[1]
        out = []
        for w in range(1, self.max_k + 2):
            lower = max((x for x in known if x <= w), default=1)
            upper = min((x for x in known if x >= w), default=None)
            if upper is not None:
                span = upper - lower
                t = (
                    self.times[lower]
                    if span == 0
                    else self.times[lower] + (w - lower) * (self.times[upper] - self.times[lower]) / span
                )
            else:
                widest = known[-1]
                slope = (self.times[widest] - base) / (widest - 1) if widest > 1 else prior_slope * base
                t = self.times[widest] + (w - widest) * max(slope, 0.0)
            out.append(t)
        return torch.tensor(out)


class AdaptiveSchedule(SpeculationSchedule):
    """
    Chooses each row's k per step from its measured acceptance and the measured step costs (see module doc).

    Args:
        max_k (`int`): Largest k a row may get (`SpecDecoder.num_speculative_tokens`).
        model (`object`): The target model: cost tables are kept per model (weakly) and shared across calls.
        cost_key (`str`): Which proposer the costs belong to (e.g. `"ngram"`, `"draft:<id>"`).
        margin (`float`, *optional*, defaults to 0.03): Speculate only when the predicted rate beats plain by this.
        prior_acceptance (`float`, *optional*, defaults to 0.5), prior_weight (`float`, *optional*, defaults to 2):
            The prior a row's acceptance starts from (and drifts back to while the row does not speculate).
        decay (`float`, *optional*, defaults to 0.9): Per-step decay of a speculating row's counts.
        idle_decay (`float`, *optional*, defaults to 0.97): Per-step decay while a row drafts nothing.
        refresh_every (`int`, *optional*, defaults to 64): Steps after which the plain-step time is re-measured.
    """

    def __init__(
        self,
        max_k: int,
        model: object,
        cost_key: str,
        margin: float = 0.03,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        idle_decay: float = 0.97,
        refresh_every: int = 64,
    ) -> None:
        super().__init__(max_k)
        self.tables = _COSTS.setdefault(model, {}) if model is not None else {}
        self.cost_key = cost_key
        self.margin = margin
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.decay, self.idle_decay = decay, idle_decay
        self.refresh_every = refresh_every
        self.accepted = self.trials = torch.zeros(0)  # [B] decayed counts per row
        self.pending: tuple[int, int, float] | None = None  # (batch size, width, start) of the step in flight
        self.last_k: torch.Tensor | None = None  # [B] the latest budgets (for tests and stats)

    def costs(self, batch_size: int) -> StepCosts:
        return self.tables.setdefault(f"{self.cost_key}:B{batch_size}:k{self.max_k}", StepCosts(self.max_k))

    def start(self, batch_size: int, device: torch.device) -> None:
        self.accepted = torch.zeros(batch_size, device=device)
        self.trials = torch.zeros(batch_size, device=device)
        self.pending = None

    def acceptance(self) -> torch.Tensor:  # [B]
        return (self.accepted + self.prior_acceptance * self.prior_weight) / (self.trials + self.prior_weight)

    def budgets(self, batch: RaggedBatch) -> torch.Tensor:  # [B]
        now = time.perf_counter()
        self._close_step(now)
        costs = self.costs(batch.batch_size)
        costs.steps += 1
        stale = costs.steps - costs.last_seen.get(1, -(10**9)) > self.refresh_every
        if 1 not in costs.times or costs.counts.get(1, 0) < 2 or stale:
            k = torch.zeros(batch.batch_size, dtype=torch.long, device=batch.device)  # measure a plain step
        else:
            k = best_num_drafts(self.acceptance(), costs.table().to(batch.device), self.margin)
        self.last_k = k
        self.pending = (batch.batch_size, 0, now)
        return k

    def observe(self, num_draft_tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
        drafted = num_draft_tokens > 0  # [B]
        # Each drafted position up to the first rejection is one Bernoulli trial of the acceptance a.
        trials = num_accepted + (num_accepted < num_draft_tokens).long()  # [B]
        decay = torch.where(drafted, self.decay, self.idle_decay)
        self.accepted = self.accepted * decay + num_accepted.float()
        self.trials = self.trials * decay + trials.float()
        if self.pending is not None:
            batch_size, _, start = self.pending
            width = 1 + int(num_draft_tokens.max().item()) if num_draft_tokens.numel() else 1
            self.pending = (batch_size, width, start)

    def _close_step(self, now: float) -> None:
        """Attribute the time since the previous proposal to that step's batch size and verify width."""
        if self.pending is not None and self.pending[1] > 0:
            batch_size, width, start = self.pending
            self.costs(batch_size).record(width, now - start)
        self.pending = None

    def select_rows(self, keep: torch.Tensor) -> None:
        self.accepted = self.accepted[keep]
        self.trials = self.trials[keep]
        # The step that retired rows cost what its batch size cost: its time is still attributed to it.
