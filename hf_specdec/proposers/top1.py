"""`Top1Proposer`: decides, per row and step, how many drafts a row may have (0..k), then runs the inner proposer.

Rows that would run past the draft's position limit (or a user `max_draft_len`), rows whose schedule gives
them no drafts this step, and rows for which the inner proposer finds nothing get 0 drafts and simply decode
one token through the same batched target forward. The inner proposer runs only for the rows that may
speculate (a sub-batch for stateless proposers on dynamic caches, zero budgets otherwise), and its result is
merged back with `-1` ids and zero probabilities. `build_proposer` always wraps its proposer in one, so this is
the single place where per-row draft budgets are decided.
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
    from hf_specdec.schedules import SpeculationSchedule
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

    A row's budget is the smallest of: what the decoding loop allows (room left before `max_length`), what the
    schedule gives it this step (`schedule`, e.g. HF's heuristic or the adaptive cost model), and what keeps
    `seq_len + d < min(inner.max_positions, max_draft_len)`. Rows with budget 0 are not shown to the inner
    proposer; when no row may speculate, the inner proposer is not called at all (the step is a plain decode).

    Args:
        inner (`Proposer`): The proposer that drafts (n-gram, draft model, ...).
        max_draft_len (`int`, *optional*): Rows whose length (prompt + generated, padding excluded) plus their
            drafts would reach this stop speculating; combined with the inner proposer's `max_positions`.
        schedule (`SpeculationSchedule`, *optional*): Per-row draft budgets per step; `None` means always k.
    """

    def __init__(
        self,
        inner: Proposer,
        max_draft_len: int | None = None,
        schedule: SpeculationSchedule | None = None,
    ) -> None:
        self.inner = inner
        limits = [n for n in (inner.max_positions, max_draft_len) if n is not None]
        self.limit = min(limits) if limits else None
        self.schedule = schedule
        self.last_num_draft_tokens: torch.Tensor | None = None  # [B] drafts of the latest proposal
        # Static caches with a schedule that decides on the host (`plan_step`): the step's draft width (0 or k),
        # the rows' budgets on the device (filled before the step's graph), and what it accepted (for after_step).
        self.planned_width: int | None = None
        self.planned_budgets: torch.Tensor | None = None  # [B]
        self.last_num_accepted: torch.Tensor | None = None  # [B]
        self.last_draft_keys: torch.Tensor | None = None  # [B] keys of the latest planned drafts (prompt lookup)

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
        if self.schedule is not None:
            self.schedule.calibrate(time_verify)
        self.inner.calibrate(time_verify)

    def detach(self) -> None:
        self.inner.detach()

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        if self.schedule is not None:
            self.schedule.start(batch.batch_size, batch.device)
        self.inner.prefill(batch, sampling)

    def budgets(self, batch: RaggedBatch, max_draft_tokens: torch.Tensor) -> torch.Tensor:  # [B]
        """Drafts each row may have this step: the loop's room, the schedule's choice and the length limit."""
        budget = max_draft_tokens.clone()  # [B]
        if self.schedule is not None:
            planned = self.planned_budgets if self.planned_width is not None else None
            budget = torch.minimum(budget, planned if planned is not None else self.schedule.budgets(batch))
        by_length = length_budget(batch.lengths - batch.pad_lengths, self.limit)
        if by_length is not None:
            budget = torch.minimum(budget, by_length)
        return budget

    @property
    def capturable(self) -> bool:  # type: ignore[override]
        """A static step is device work alone when the schedule (if any) decides on the host before drafting."""
        return self.inner.capturable and (self.schedule is None or getattr(self.schedule, "plans_on_host", False))

    def plan_step(self, batch: RaggedBatch) -> Hashable | None:
        """The schedule's choice for this step, made on the host before its device work: no row drafts (one
        graph) or some rows do, each up to its budget, at the fixed width k (the inner proposer's graph)."""
        if not self.capturable:
            return None
        if self.schedule is not None:
            budgets = self.schedule.host_budgets(batch)  # [B] (host)
            if self.planned_budgets is None:
                self.planned_budgets = budgets.to(batch.device)
            else:
                self.planned_budgets.copy_(budgets)  # in place: the graphs read it there
            self.planned_width = self.static.k if bool((budgets > 0).any()) else 0
            if self.planned_width == 0:
                return ("plain",)
        inner = self.inner.plan_step(batch)
        return None if inner is None else ("draft", inner)

    def after_step(self, measured: bool = True) -> None:
        if self.schedule is not None and not measured:
            self.schedule.discard_timing()
        if self.planned_width is not None and self.last_num_accepted is not None:
            self.schedule.observe(self.last_num_draft_tokens, self.last_num_accepted, self.last_draft_keys)
        self.inner.after_step()

    def propose(self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling) -> Proposal:
        if self.static is not None and (self.schedule is None or self.planned_width is not None):
            # Fixed shapes, no host sync: every row goes to the inner proposer (budget 0 drafts nothing), width k;
            # or, when the schedule planned no drafts at all, no row does.
            if self.planned_width == 0:
                proposal = Proposal.empty(batch.batch_size, batch.device)
            else:
                budget = self.budgets(batch, max_draft_tokens)  # [B]
                proposal = _clip(self.inner.propose(batch, budget, sampling), budget, width=self.static.k)
                if proposal.draft_keys is not None and self.planned_width is not None:
                    self.last_draft_keys = proposal.draft_keys  # the schedule reads them after the step
            self.last_num_draft_tokens = proposal.num_draft_tokens
            return proposal
        budget = self.budgets(batch, max_draft_tokens)  # [B]
        speculating = budget > 0  # [B]
        num_speculating = int(speculating.sum().item()) if batch.batch_size else 0
        if num_speculating == 0:
            proposal = Proposal.empty(batch.batch_size, batch.device)
        elif self.inner.stateless and self.static is None and num_speculating < batch.batch_size:
            # A sub-batch of the speculating rows (dynamic caches; static ones keep one shape: zero budgets)
            rows = speculating.nonzero().squeeze(1)  # [B']
            proposal = self._merge(
                batch.batch_size, rows, self.inner.propose(_sub_batch(batch, rows), budget[rows], sampling)
            )
        else:
            proposal = self.inner.propose(batch, budget, sampling)
        if self.schedule is not None:  # a schedule may keep fewer of the drafts it has seen (e.g. by their keys)
            budget = torch.minimum(budget, self.schedule.trim(proposal))
        proposal = _clip(proposal, budget)
        if self.static is not None and proposal.draft_token_ids.shape[1]:  # a static verify: width 1 or 1 + k
            proposal = _clip(proposal, budget, width=self.static.k)
        self.last_num_draft_tokens = proposal.num_draft_tokens
        return proposal

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        if self.schedule is not None and self.last_num_draft_tokens is not None:
            if self.planned_width is not None:  # a planned step: the schedule reads it after the step (no sync)
                self.last_num_accepted = num_accepted
            else:
                self.schedule.observe(self.last_num_draft_tokens, num_accepted)
        self.inner.commit(batch, num_accepted)

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.schedule is not None:
            self.schedule.select_rows(keep)
        self.last_num_draft_tokens = None
        self.inner.select_rows(keep)

    def finish(self) -> None:
        """Called once after the loop: lets the schedule keep what it learned (HF's persistent "heuristic")."""
        if self.schedule is not None:
            self.schedule.finish()

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
