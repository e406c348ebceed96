"""Per-row draft-length schedules and HF's assistant knobs, with transformers' meaning.

A `SpeculationSchedule` gives each row its draft budget for the next step and learns from what the target
accepted; the loop asks it and tells it (`hf_specdec.draft_budgets.DraftBudgets`). `HeuristicSchedule` is HF's
`num_assistant_tokens_schedule="heuristic"` (+2 after a fully accepted step, -1 otherwise, per row) and
`"heuristic_transient"`; `ConfidenceThreshold` is HF's `assistant_confidence_threshold` (a row stops drafting after
a draft token whose probability is below it; the threshold is re-fit to the accept/reject history like HF's ROC
rule). The cost-model schedule lives in `hf_specdec.adaptive`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.base import Proposal

__all__ = ["ConfidenceThreshold", "HeuristicSchedule", "SpeculationSchedule"]


class SpeculationSchedule:
    """Base class: every row may draft `max_k` tokens every step (HF's "constant" schedule)."""

    #: a schedule decides on the host: no captured graph reads its tensors (`graph_reuse` leaves them out, also on
    #: the CPU, where host and device tensors look alike)
    host_only = True
    #: `observe` and `select_rows` take host tensors (the dynamic loop's one read per step brings them)
    observes_on_host = False

    def __init__(self, max_k: int) -> None:
        self.max_k = int(max_k)

    def start(self, batch_size: int, device: torch.device) -> None:
        """Called once per generate call, before the first step."""

    def calibrate(self, time_verify: Callable[[int], float]) -> None:
        """Called once per call after step 0 (the prefill) with a function timing a target forward of a given width."""

    def budgets(self, batch: RaggedBatch) -> torch.Tensor:  # [B] int64 drafts each row may have this step
        return torch.full((batch.batch_size,), self.max_k, dtype=torch.long, device=batch.device)

    def host_budgets(self, batch: RaggedBatch) -> torch.Tensor | None:  # [B] int64 on the host, or None
        """`budgets` decided on the host (the dynamic loop then reads nothing for them); None: decided on the
        device (a subclass that overrides `budgets` alone)."""
        if type(self).budgets is not SpeculationSchedule.budgets:
            return None
        return torch.full((batch.batch_size,), self.max_k, dtype=torch.long)

    def trim(self, proposal: Proposal) -> torch.Tensor:  # [B] int64 drafts each row keeps of those proposed
        """After proposing: how many of each row's drafts to verify (all of them by default)."""
        return proposal.num_draft_tokens

    def observe(
        self, num_draft_tokens: torch.Tensor, num_accepted: torch.Tensor, draft_keys: torch.Tensor | None = None
    ) -> None:
        """After each step: drafts per row ([B]), how many of them the target accepted ([B]) and, for a step planned
        before proposing, the drafts' keys ([B], `Proposal.draft_keys`)."""

    def discard_timing(self) -> None:
        """The step just run took longer than such steps will (a warm-up, a CUDA graph capture, a compaction):
        a schedule that learns step costs leaves it out."""

    def restart_timing(self) -> None:
        """Host work between the step's choice and its device work (a draft's catch-up after steps without drafts)
        is not the step's own cost: a schedule that times steps starts its clock again."""

    def ran_plain_steps(self, steps: int) -> None:  # noqa: B027
        """The planned step just observed was a block of `steps` plain steps (one graph, one host read)."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows `keep` ([B'] indices) stay in the batch; the others finished."""

    def finish(self) -> None:
        """Called once after the call's last step."""


class HeuristicSchedule(SpeculationSchedule):
    """
    HF's `"heuristic"` / `"heuristic_transient"` schedules, per row: a row whose drafts were all accepted drafts 2
    more next step, any other drafting row 1 fewer (at least 1), capped at `max_k`.

    Args:
        initial_k (`int`): Drafts per row at the start of the call (HF's `num_assistant_tokens`).
        max_k (`int`): Cap (the batch's scratch space holds at most this many drafts).
        on_finish (`Callable[[int], None]`, *optional*): Receives the rows' final draft length (rounded mean) after
            the call; the persistent `"heuristic"` schedule writes it back to where `initial_k` came from.
    """

    def __init__(self, initial_k: int, max_k: int, on_finish: Callable[[int], None] | None = None) -> None:
        super().__init__(max_k)
        self.initial_k = int(initial_k)
        self.on_finish = on_finish
        self.k_rows: torch.Tensor | None = None  # [B] current draft length of each row
        self.last_k = self.initial_k

    def start(self, batch_size: int, device: torch.device) -> None:
        self.k_rows = torch.full((batch_size,), min(self.initial_k, self.max_k), dtype=torch.long, device=device)

    def budgets(self, batch: RaggedBatch) -> torch.Tensor:  # [B]
        assert self.k_rows is not None, "start() must run before budgets()"
        return self.k_rows

    def observe(
        self, num_draft_tokens: torch.Tensor, num_accepted: torch.Tensor, draft_keys: torch.Tensor | None = None
    ) -> None:
        assert self.k_rows is not None
        drafted = num_draft_tokens > 0  # [B] rows with no drafts keep their length
        grown = torch.where(num_accepted >= num_draft_tokens, self.k_rows + 2, (self.k_rows - 1).clamp(min=1))
        self.k_rows = torch.where(drafted, grown.clamp(max=self.max_k), self.k_rows)
        if bool(drafted.any()):
            self.last_k = round(float(self.k_rows[drafted].float().mean()))

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.k_rows is not None:
            self.k_rows = self.k_rows[keep]

    def finish(self) -> None:
        if self.on_finish is not None:
            self.on_finish(self.last_k)


class ConfidenceThreshold:
    """
    HF's `assistant_confidence_threshold`: a draft row stops after a token whose draft probability is below `value`
    (that token is still proposed). After each step the threshold is re-fit to all (probability, accepted) pairs
    seen so far in the call: the candidate threshold minimising `false-positive rate + 3 * false-negative rate`
    (HF's ROC rule, computed here without scikit-learn), once at least 6 pairs with both outcomes exist.

    Args:
        value (`float`): Initial threshold in (0, 1).
        adapt (`bool`, *optional*, defaults to `True`): Re-fit the threshold as above.
    """

    MIN_SAMPLES = 6

    def __init__(self, value: float, adapt: bool = True) -> None:
        self.value = float(value)
        self.adapt = adapt
        self.probs: list[float] = []
        self.matches: list[int] = []

    def update(
        self,
        token_probs: torch.Tensor,  # [B, k] draft probability of each drafted token (-1 where not drafted)
        num_accepted: torch.Tensor,  # [B]
    ) -> None:
        """Record each row's drafts up to its first rejection (accepted = 1, first rejected = 0), then re-fit."""
        if not self.adapt:
            return
        probs, accepted = token_probs.tolist(), num_accepted.tolist()
        for row_probs, n in zip(probs, accepted):
            drafted = [p for p in row_probs if p >= 0]
            self.probs += drafted[: n + 1]
            self.matches += [1] * min(n, len(drafted)) + ([0] if n < len(drafted) else [])
        if len(self.probs) >= self.MIN_SAMPLES and 0 < sum(self.matches) < len(self.matches):
            self.value = best_threshold(torch.tensor(self.probs), torch.tensor(self.matches))


def best_threshold(probs: torch.Tensor, matches: torch.Tensor) -> float:
    """Threshold t minimising FPR + 3 * FNR when "p >= t" predicts acceptance (probs, matches: [N], both classes)."""
    candidates = torch.unique(probs).flip(0)  # [T] descending
    predicted = probs[None, :] >= candidates[:, None]  # [T, N]
    positive = matches.bool()[None, :]
    fpr = (predicted & ~positive).sum(1) / (~positive).sum()
    fnr = 1 - (predicted & positive).sum(1) / positive.sum()
    return float(candidates[int(torch.argmin(fpr + 3 * fnr))])
