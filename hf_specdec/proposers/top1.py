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

import numpy as np
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

    def host_budgets(self, batch: RaggedBatch, budget: np.ndarray | None) -> np.ndarray | None:  # [B]
        """`budgets` on the host, from the host's copies of the lengths (None when the host lacks either)."""
        if budget is None or batch.host_lengths is None or batch.host_pad_lengths is None:
            return None
        if self.limit is None:
            return budget
        return np.minimum(budget, np.maximum(self.limit - 1 - (batch.host_lengths - batch.host_pad_lengths), 0))

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
        trim: Callable[[Proposal], torch.Tensor | np.ndarray] | None = None,
        host_budget: np.ndarray | None = None,  # [B] the loop's budgets on the host, when it knows them
    ) -> Proposal:
        """Drafts within each row's budget; `trim` (a schedule's, after drafting) may keep fewer of them. With
        `host_budget` nothing is read here: the most drafts a row may have is the host's (and, for an inner
        proposer that `reads_host_budget`, so are the drafts' counts)."""
        host = self.host_budgets(batch, host_budget) if self.static is None else None  # [B] or None
        if host is not None and not host.any():  # no row drafts (the host knows): a plain step, nothing to clip
            proposal = Proposal.empty(batch.batch_size, batch.device)
            if trim is not None:
                trim(proposal)  # the schedule sees every step's proposal
            return proposal
        budget = self.budgets(batch, max_draft_tokens.clone())  # [B]
        if self.static is not None and trim is None:
            # Fixed shapes, no host sync: every row goes to the inner proposer (budget 0 drafts nothing), width k.
            return _clip(self.inner.propose(batch, budget, sampling), budget, width=self.static.k)
        speculating = budget > 0  # [B]
        num_speculating, width = 0, 0
        if host is not None and batch.batch_size:
            num_speculating, width = int((host > 0).sum()), int(np.max(host))
        elif batch.batch_size:  # one read of the budgets: how many rows draft, and the most drafts
            num_speculating, width = torch.stack([speculating.sum(), budget.max()]).tolist()
        if num_speculating == 0:
            proposal = Proposal.empty(batch.batch_size, batch.device)
        elif host is not None and self.inner.reads_host_budget:  # rows with budget 0 draft nothing: no sub-batch
            proposal = self.inner.propose(batch, budget, sampling, width, host_budget=host)
        elif self.inner.stateless and self.static is None and num_speculating < batch.batch_size:
            # A sub-batch of the speculating rows (dynamic caches; static ones keep one shape: zero budgets); with the
            # host's budgets the rows are the host's (copied to the device, nothing read)
            host_rows = np.flatnonzero(host > 0) if host is not None else None  # [B']
            rows = torch.from_numpy(host_rows).to(batch.device) if host is not None else speculating.nonzero()[:, 0]
            sub = self.inner.propose(_sub_batch(batch, rows), budget[rows], sampling, width)
            proposal = self._merge(batch.batch_size, rows, host_rows, sub)
        else:
            proposal = self.inner.propose(batch, budget, sampling, width)
        if trim is not None:  # a schedule may keep fewer of the drafts it has seen (e.g. by their keys)
            kept = trim(proposal)  # [B] on the device, or on the host for a proposal with host counts
            if not isinstance(kept, np.ndarray):
                budget = torch.minimum(budget, kept)
            elif (kept < proposal.host_num_draft_tokens).any():  # a cut: it goes to the device (one copy)
                host = kept if host is None else np.minimum(host, kept)
                budget = torch.minimum(budget, torch.from_numpy(kept).to(budget.device))
        if proposal.host_num_draft_tokens is None:
            host = None
        proposal = _clip(proposal, budget, host_budget=host)
        if self.static is not None and proposal.draft_token_ids.shape[1]:  # a static verify: width 1 or 1 + k
            proposal = _clip(proposal, budget, width=self.static.k)
        return proposal

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        self.inner.commit(batch, num_accepted)

    def select_rows(self, keep: torch.Tensor, host_keep: np.ndarray | None = None) -> None:
        """Rows `keep` stay; `host_keep` (the same on the host) goes to an inner proposer that `reads_host_budget`."""
        if host_keep is not None and self.inner.reads_host_budget:
            self.inner.select_rows(keep, host_keep=host_keep)
        else:
            self.inner.select_rows(keep)

    @staticmethod
    def _merge(
        batch_size: int,
        rows: torch.Tensor,  # [B'] the sub-batch's rows
        host_rows: np.ndarray | None,  # [B'] the same on the host, when the host has them
        sub: Proposal,
    ) -> Proposal:
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
        host_num = None
        if sub.host_num_draft_tokens is not None:
            host_num = np.zeros(batch_size, dtype=np.int64)
            host_num[host_rows if host_rows is not None else rows.cpu().numpy()] = sub.host_num_draft_tokens
        return Proposal(draft_token_ids=ids, num_draft_tokens=num, draft_probs=probs, draft_keys=keys,
                        host_num_draft_tokens=host_num)  # fmt: skip


def _sub_batch(batch: RaggedBatch, rows: torch.Tensor) -> RaggedBatch:
    return RaggedBatch(
        token_ids=batch.token_ids[rows],
        lengths=batch.lengths[rows],
        pad_lengths=batch.pad_lengths[rows],
        row_ids=batch.row_ids[rows],
        prompt_width=batch.prompt_width,
    )


def _clip(
    proposal: Proposal, budget: torch.Tensor, width: int | None = None, host_budget: np.ndarray | None = None
) -> Proposal:
    """Enforce each row's budget ([B]): ids past it become -1, probabilities 0; trim to the longest row, or pad
    or trim to a fixed `width` (static caches: no host sync). With the proposal's host counts and `host_budget`
    the longest row is known on the host."""
    num = torch.minimum(proposal.num_draft_tokens, budget)  # [B]
    host_num = None
    if proposal.host_num_draft_tokens is not None and host_budget is not None:
        host_num = np.minimum(proposal.host_num_draft_tokens, host_budget)  # [B]
    if width is None and host_num is not None:
        width = int(np.max(host_num)) if len(host_num) else 0
    elif width is None:
        width = int(num.max().item()) if num.numel() else 0
    missing = max(0, width - proposal.draft_token_ids.shape[1])
    drafted = torch.arange(width, device=num.device) < num[:, None]  # [B, k]
    ids = torch.where(drafted, F.pad(proposal.draft_token_ids, (0, missing), value=-1)[:, :width], -1)  # [B, k]
    probs = proposal.draft_probs
    if probs is not None:
        probs = F.pad(probs, (0, 0, 0, missing))[:, :width] * drafted[:, :, None]  # [B, k, V]
    return Proposal(draft_token_ids=ids, num_draft_tokens=num, draft_probs=probs, draft_keys=proposal.draft_keys,
                    host_num_draft_tokens=host_num, host_draft_keys=proposal.host_draft_keys)  # fmt: skip
