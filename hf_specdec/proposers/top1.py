"""`Top1Proposer`: each row's drafts within its budget (0..k) for the step, from the inner proposer.

Rows that would run past the draft's position limit (or a user `max_draft_len`), rows whose budget from the loop
(its room and its schedule: `hf_specdec.draft_budgets`) is 0, and rows for which the inner proposer finds nothing
get 0 drafts and simply decode one token through the same batched target forward. The inner proposer runs only
for the rows that may speculate (a sub-batch for stateless proposers on dynamic caches, zero budgets otherwise),
and its result is merged back with `-1` ids and zero probabilities. `build_proposer` always wraps its proposer in
one, so every proposer's drafts pass the same limits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.base import Proposal, Proposer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_specdec.sampling.processors import StepSampling
    from hf_specdec.static_cache import StaticPlan

__all__ = ["Top1Proposer", "length_budget"]


def length_budget(
    seq_lengths: torch.Tensor,  # [B] real tokens per row (left padding excluded)
    limit: int | None,
) -> torch.Tensor | None:  # [B] most drafts a row may have under the limit, or None without a limit
    """Drafts d a row may have so that `seq_len + d < limit`: the draft then never sees a position >= limit."""
    if limit is None:
        return None
    return (limit - 1 - seq_lengths).clamp(min=0)


class Top1Proposer(Proposer):
    """
    Wraps a proposer and gives each row its own draft budget in 0..k per step (vLLM's Top-1 proposer, generalised
    from "0 or k" to any length per row).

    A row's budget is the smallest of what the loop gives it (its room before `max_length` and its schedule's
    choice: `hf_specdec.draft_budgets`) and what keeps `seq_len + d < min(inner.max_positions, max_draft_len)`.
    Rows with budget 0 are not shown to the inner proposer; when no row may speculate, the inner proposer is not
    called at all (the step is a plain decode).

    Args:
        inner (`Proposer`): The proposer that drafts (n-gram, draft model, ...).
        max_draft_len (`int`, *optional*): Rows whose length (prompt + generated, padding excluded) plus their
            drafts would reach this stop speculating; combined with the inner proposer's `max_positions`.
    """

    def __init__(self, inner: Proposer, max_draft_len: int | None = None) -> None:
        self.inner = inner
        limits = [n for n in (inner.max_positions, max_draft_len) if n is not None]
        self.limit = min(limits) if limits else None

    @property
    def returns_probs(self) -> bool:  # type: ignore[override]
        return self.inner.returns_probs

    @property
    def max_positions(self) -> int | None:  # type: ignore[override]
        return self.inner.max_positions

    def use_static(self, plan: StaticPlan) -> None:
        self.static = plan
        self.inner.use_static(plan)

    def attach(self, target: PreTrainedModel) -> None:
        self.inner.attach(target)

    def calibrate(self, time_verify: Callable[[int], float]) -> None:
        self.inner.calibrate(time_verify)

    def detach(self) -> None:
        self.inner.detach()

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        self.inner.prefill(batch, sampling)

    def budgets(self, batch: RaggedBatch, budget: torch.Tensor) -> torch.Tensor:  # [B]
        """The loop's budgets ([B]) under the length limit."""
        by_length = length_budget(batch.lengths - batch.pad_lengths, self.limit)
        return budget if by_length is None else torch.minimum(budget, by_length)

    @property
    def capturable(self) -> bool:  # type: ignore[override]
        return self.inner.capturable

    def plan_step(self, batch: RaggedBatch) -> Hashable | None:
        return self.inner.plan_step(batch)

    def after_step(self) -> None:
        self.inner.after_step()

    def host_rows(self, batch: RaggedBatch) -> torch.Tensor | None:
        return self.inner.host_rows(batch)

    def read_host_rows(self, lengths: list[int], rows: list[list[int]]) -> None:
        self.inner.read_host_rows(lengths, rows)

    def propose(
        self,
        batch: RaggedBatch,
        max_draft_tokens: torch.Tensor,  # [B] the loop's budgets
        sampling: StepSampling,
        trim: Callable[[Proposal], torch.Tensor] | None = None,
    ) -> Proposal:
        """Drafts within each row's budget; `trim` (a schedule's, after drafting) may keep fewer of them."""
        budget = self.budgets(batch, max_draft_tokens.clone())  # [B]
        if self.static is not None and trim is None:
            # Fixed shapes, no host sync: every row goes to the inner proposer (budget 0 drafts nothing), width k.
            return _clip(self.inner.propose(batch, budget, sampling), budget, width=self.static.k)
        speculating = budget > 0  # [B]
        num_speculating, width = 0, 0
        if batch.batch_size:  # the step's one read of the budgets: how many rows draft, and the most drafts
            num_speculating, width = torch.stack([speculating.sum(), budget.max()]).tolist()
        if num_speculating == 0:
            proposal = Proposal.empty(batch.batch_size, batch.device)
        elif self.inner.stateless and self.static is None and num_speculating < batch.batch_size:
            # A sub-batch of the speculating rows (dynamic caches; static ones keep one shape: zero budgets)
            rows = speculating.nonzero().squeeze(1)  # [B']
            proposal = self._merge(
                batch.batch_size, rows, self.inner.propose(_sub_batch(batch, rows), budget[rows], sampling, width)
            )
        else:
            proposal = self.inner.propose(batch, budget, sampling, width)
        if trim is not None:  # a schedule may keep fewer of the drafts it has seen (e.g. by their keys)
            budget = torch.minimum(budget, trim(proposal))
        proposal = _clip(proposal, budget)
        if self.static is not None and proposal.draft_token_ids.shape[1]:  # a static verify: width 1 or 1 + k
            proposal = _clip(proposal, budget, width=self.static.k)
        return proposal

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        self.inner.commit(batch, num_accepted)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.inner.select_rows(keep)

    @staticmethod
    def _merge(batch_size: int, rows: torch.Tensor, sub: Proposal) -> Proposal:
        """Scatter a sub-batch's proposal back into the full batch (-1 ids, zero probabilities elsewhere)."""
        device = sub.draft_token_ids.device
        width = sub.draft_token_ids.shape[1]
        ids = torch.full((batch_size, width), -1, dtype=torch.long, device=device)  # [B, k]
        ids[rows] = sub.draft_token_ids
        num = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        num[rows] = sub.num_draft_tokens
        probs = keys = None
        if sub.draft_probs is not None:
            probs = sub.draft_probs.new_zeros((batch_size, *sub.draft_probs.shape[1:]))  # [B, k, V]
            probs[rows] = sub.draft_probs
        if sub.draft_keys is not None:
            keys = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
            keys[rows] = sub.draft_keys
        return Proposal(draft_token_ids=ids, num_draft_tokens=num, draft_probs=probs, draft_keys=keys)


def _sub_batch(batch: RaggedBatch, rows: torch.Tensor) -> RaggedBatch:
    return RaggedBatch(
        token_ids=batch.token_ids[rows],
        lengths=batch.lengths[rows],
        pad_lengths=batch.pad_lengths[rows],
        row_ids=batch.row_ids[rows],
        prompt_width=batch.prompt_width,
    )


def _clip(proposal: Proposal, budget: torch.Tensor, width: int | None = None) -> Proposal:
    """Enforce each row's budget ([B]): ids past it become -1, probabilities 0; trim to the longest row, or pad
    or trim to a fixed `width` (static caches: no host sync)."""
    num = torch.minimum(proposal.num_draft_tokens, budget)  # [B]
    if width is None:
        width = int(num.max().item()) if num.numel() else 0
    missing = max(0, width - proposal.draft_token_ids.shape[1])
    drafted = torch.arange(width, device=num.device) < num[:, None]  # [B, k]
    ids = torch.where(drafted, F.pad(proposal.draft_token_ids, (0, missing), value=-1)[:, :width], -1)  # [B, k]
    probs = proposal.draft_probs
    if probs is not None:
        probs = F.pad(probs, (0, 0, 0, missing))[:, :width] * drafted[:, :, None]  # [B, k, V]
    return Proposal(draft_token_ids=ids, num_draft_tokens=num, draft_probs=probs, draft_keys=proposal.draft_keys)
