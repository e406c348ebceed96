"""Suffix decoding with a draft model (`SpecDecoder(method="suffix", draft_model=draft)`): per row, the better draft.

SuffixDecoding's hybrid mode (Oliaro et al. 2024; ArcticInference pairs it with a model drafter): a row takes the
suffix trees' draft where their score beats what the model's drafts are worth, and the draft model's otherwise. The
suffix score is the drafts the tree expects accepted (the sum of the draft's branch probabilities, `suffix_search`);
the model's worth is measured, not guessed: a running mean of the drafts the target accepted per row and step where
the model drafted (`model_worth`, 1.0 before any). Each step the suffix trees draft first (host work, microseconds);
the draft model then drafts only for the rows that still want it, and not at all when none does: calls whose
requests repeat earlier outputs skip the model's forwards. The choice reads only what the rows' history decided
(the trees, the measured worth), never this step's model drafts, so sampled rows keep the target's law (a proposal
chosen after looking at its own random draws would not).

A model whose drafts are worth less than `MIN_MODEL_WORTH` accepted tokens a step drafts again only every
`REPROBE_EVERY` steps, to notice when that changes. The model drafts at most `MODEL_K` tokens a row (the draft
model's own default k), whatever k the suffix trees use (24 by default). The adaptive schedule sees every row's
drafts and their keys: the suffix trees' match-length buckets, and `MODEL_KEY` for the model's.

On static caches (a GPU's default captured step) the trees draft in `plan_step`, before the step's device work, and
the same host choice picks the step's graph: one without the model's forwards when no row wants them, one with them
otherwise (the model drafts for every row there, and the rows that take the trees' drafts drop its drafts). The
model's worth learns from the step's one host read, which brings the rows' new lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers import draft_model as draft_model_module
from hf_specdec.proposers import suffix as suffix_module
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.proposers.suffix_search import MATCH_BUCKETS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_specdec.batch import RaggedBatch
    from hf_specdec.config import SpecDecoder
    from hf_specdec.proposers.draft_model import DraftModelProposer
    from hf_specdec.proposers.suffix import SuffixProposer
    from hf_specdec.sampling.processors import StepSampling
    from hf_specdec.static_cache import StaticPlan

__all__ = ["SuffixHybridProposer"]

#: The most drafts the model makes per row and step (SpecDecoder's default k for a draft model).
MODEL_K = 5
#: The adaptive schedule's key of the model's drafts (after the suffix trees' match-length buckets).
MODEL_KEY = len(MATCH_BUCKETS) + 2
#: Below this many accepted drafts per row and step, the model drafts only every `REPROBE_EVERY` steps.
MIN_MODEL_WORTH = 0.25
REPROBE_EVERY = 32
#: Weight of the latest step in the running mean of the model's worth.
WORTH_DECAY = 0.1


class SuffixHybridProposer(Proposer):
    """Per row, the suffix trees' draft or the draft model's, whichever is worth more (see the module doc).

    Args:
        suffix (`SuffixProposer`): Drafts from the suffix trees (its k bounds every row's drafts).
        model (`DraftModelProposer`): The draft model.
    """

    returns_probs = True  # the model's rows sample from the draft's distribution
    stateless = False
    proposes_cheaply = True  # every row proposes, the schedule then chooses how many to verify from the keys

    def __init__(self, suffix: SuffixProposer, model: DraftModelProposer) -> None:
        self.suffix = suffix
        self.model = model
        model.num_speculative_tokens = min(model.num_speculative_tokens, MODEL_K)
        self.num_speculative_tokens = suffix.num_speculative_tokens
        self.max_positions = model.max_positions  # `Top1Proposer` keeps every row's drafts below the model's limit
        self.model_worth = 1.0  # measured accepted drafts per row and step where the model drafted
        self.steps_without_model = 0
        self.model_rows: np.ndarray | None = None  # [B] bool: rows the model drafted for in the latest step
        self.lengths_before: np.ndarray | None = None  # [B] the rows' lengths when that step proposed
        self.use_model: torch.Tensor | None = None  # [B] bool, static caches: `model_rows` where the step reads it
        self.model_runs = False  # static caches: whether this step's graph runs the model's forwards

    def use_static(self, plan: StaticPlan) -> None:
        self.static = plan
        self.suffix.use_static(plan)
        self.model.use_static(plan)

    @property
    def capturable(self) -> bool:  # type: ignore[override]
        """On static caches: host drafts planned before the step, and the model's captured forwards."""
        return self.static is not None and self.model.capturable

    def attach(self, target: PreTrainedModel) -> None:
        self.suffix.attach(target)
        self.model.attach(target)

    def detach(self) -> None:
        self.suffix.detach()
        self.model.detach()

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        self.suffix.prefill(batch, sampling)
        self.model.prefill(batch, sampling)
        self.model_rows = None
        self.model_runs = False
        if self.static is not None:
            self.use_model = torch.zeros(batch.batch_size, dtype=torch.bool, device=batch.device)

    def calibrate(self, time_verify: Callable[[int], float]) -> None:
        self.suffix.calibrate(time_verify)
        self.model.calibrate(time_verify)

    def _wants_model(self, budgets: np.ndarray) -> np.ndarray:  # [B] bool
        """Rows whose suffix draft is worth less than the model's (none while a useless model waits to re-probe)."""
        probing = self.model_worth >= MIN_MODEL_WORTH or self.steps_without_model >= REPROBE_EVERY
        if not probing:
            return np.zeros(len(budgets), np.bool_)
        return (self.suffix.scores[: len(budgets)] < self.model_worth) & (budgets > 0)

    def plan_step(self, batch: RaggedBatch) -> Hashable | None:
        """Static caches: the trees draft for every row now; the rows that want the model's drafts choose the graph
        (with or without the model's forwards) and are written where the step reads them."""
        self.suffix.plan_step(batch)
        self.model_rows = self._wants_model(self.suffix.full_budgets)
        self.lengths_before = self.suffix.state[:, 1].copy()
        self.use_model.copy_(torch.from_numpy(self.model_rows))
        self.model_runs = bool(np.any(self.model_rows))  # host numpy, decided before the step: no device read
        if not self.model_runs:
            self.steps_without_model += 1
            return ("suffix",)
        self.steps_without_model = 0
        inner = self.model.plan_step(batch)  # the draft catches up on the steps it missed
        return None if inner is None else ("model", inner)

    def propose(
        self,
        batch: RaggedBatch,
        max_draft_tokens: torch.Tensor,  # [B] int64, 0..k
        sampling: StepSampling,
        width: int | None = None,
    ) -> Proposal:
        """The suffix trees' drafts, then the model's for the rows whose suffix draft is worth less than its."""
        if self.static is not None:  # planned (`plan_step`): fixed shapes, no host read
            ours = self.suffix.propose(batch, max_draft_tokens, sampling)
            if not self.model_runs:
                return ours
            budgets = torch.where(self.use_model, max_draft_tokens.clamp(max=self.model.num_speculative_tokens), 0)
            return _merge(ours, self.model.propose(batch, budgets, sampling), self.use_model)
        if batch.batch_size == 0:
            return Proposal.empty(0, batch.device)
        ours = self.suffix.propose(batch, max_draft_tokens, sampling)  # one host read of the budgets, inside
        budgets = self.suffix.budgets  # [B] host copy of max_draft_tokens
        self.lengths_before = self.suffix.state[:, 1].copy()  # [B] host: what each row holds now
        wants_model = self.model_rows = self._wants_model(budgets)  # [B]
        if not wants_model.any():
            self.steps_without_model += 1
            return ours
        self.steps_without_model = 0
        model_budgets = np.where(wants_model, np.minimum(budgets, self.model.num_speculative_tokens), 0)  # [B]
        theirs = self.model.propose(
            batch, torch.from_numpy(model_budgets).to(batch.device), sampling, width=int(np.max(model_budgets))
        )  # the width from the host copy: no device read
        return _merge(ours, theirs, torch.from_numpy(wants_model).to(batch.device))

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        """Both follow the committed tokens; on dynamic caches the model's worth learns from its rows now."""
        self.suffix.commit(batch, num_accepted)  # dynamic caches: reads the new lengths to the host
        self.model.commit(batch, num_accepted)
        if self.static is None:
            self._learn()
        elif not self.model_runs:
            # The model's static catch-up counts the tokens it has not seen (1 per step without its drafts); a step
            # of the trees' drafts commits up to k + 1 (a host counter: the same change at every replay).
            self.model.behind += self.num_speculative_tokens

    def host_rows(self, batch: RaggedBatch) -> torch.Tensor | None:
        return self.suffix.host_rows(batch)

    def read_host_rows(self, lengths: list[int], rows: list[list[int]]) -> None:
        """Static caches: the step's host read (the trees' new tokens); the model's worth learns from its rows."""
        self.suffix.read_host_rows(lengths, rows)
        self._learn()

    def _learn(self) -> None:
        """The model's worth, from the drafts the target accepted on the rows it drafted for (host lengths: the
        suffix trees' own copy after the step, against the one before it)."""
        rows = self.model_rows
        if rows is not None and rows.any() and self.lengths_before is not None:
            accepted = self.suffix.state[:, 1] - self.lengths_before - 1  # [B] drafts accepted this step
            mean = float(accepted[rows].clip(min=0).mean())
            self.model_worth += WORTH_DECAY * (mean - self.model_worth)
        self.model_rows = None

    def after_step(self) -> None:
        self.suffix.after_step()
        self.model.after_step()

    def select_rows(self, keep: torch.Tensor) -> None:
        self.suffix.select_rows(keep)
        self.model.select_rows(keep)
        self.model_rows = self.lengths_before = None


def _merge(ours: Proposal, theirs: Proposal, model_rows: torch.Tensor) -> Proposal:  # model_rows: [B] bool
    """One proposal: the model's drafts, probabilities and key on `model_rows`, the suffix trees' elsewhere (their
    drafts one-hot where probabilities are needed)."""
    width = max(ours.draft_token_ids.shape[1], theirs.draft_token_ids.shape[1])
    pad = lambda ids: F.pad(ids, (0, width - ids.shape[1]), value=-1)  # noqa: E731 - [B, w] -> [B, width]
    ids = torch.where(model_rows[:, None], pad(theirs.draft_token_ids), pad(ours.draft_token_ids))  # [B, width]
    counts = torch.where(model_rows, theirs.num_draft_tokens, ours.num_draft_tokens)  # [B]
    keys = torch.where(model_rows, MODEL_KEY, ours.draft_keys)  # [B]
    probs = theirs.draft_probs  # [B, w', V] or None (greedy: one-hot drafts)
    if probs is not None:
        probs = F.pad(probs, (0, 0, 0, width - probs.shape[1]))  # [B, width, V]
        one_hot = torch.zeros_like(probs).scatter_(-1, ids.clamp(min=0)[..., None], 1.0)  # [B, width, V] no host read
        probs = torch.where(model_rows[:, None, None], probs, one_hot)
    return Proposal(draft_token_ids=ids, num_draft_tokens=counts, draft_probs=probs, draft_keys=keys)


@register("suffix", when=lambda spec: spec.draft_model is not None)
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> SuffixHybridProposer:
    """`method="suffix"` with `draft_model=`: suffix decoding, and the draft model where the trees have nothing
    better."""
    return SuffixHybridProposer(
        suffix_module.from_spec(spec, target, context), draft_model_module.from_spec(spec, target, context)
    )
