"""`DraftModelProposer`: a smaller HF causal LM with the target's vocabulary drafts k tokens per row.

The draft keeps its own KV cache (`CacheView`) over the same ragged batch. Each step it first feeds
what it has not seen yet (the target's last token, plus the last draft after a full accept: 1 or 2
tokens per row, ragged), then one token per draft position, all rows in one forward each. Greedy
calls take the draft's argmax (one-hot drafts); sampling calls sample from the draft's processed
distribution q and return q, as exact speculative sampling needs. With a `ConfidenceThreshold` (HF's
`assistant_confidence_threshold`) a row stops drafting after a low-probability draft. `max_positions` is the
draft's position limit: its prefill skips rows already past it, and `Top1Proposer` keeps drafts below it.
The draft runs where its owner placed it (on the target's first device, another GPU, or spread by its own
`device_map`): its `CacheView` feeds it token ids on its own device and brings its logits back to the batch's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedModel

from hf_specdec import placement
from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.first_shapes import builds_plans_per_shape
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal, Proposer, widest
from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.static_cache import StaticCacheView

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder
    from hf_specdec.schedules import ConfidenceThreshold


def output_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the model's output embedding, i.e. the size of the logits' last dimension."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.shape[0]
    return model.config.get_text_config().vocab_size


def check_draft_model(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Raise a clear error when the draft cannot serve this target."""
    if type(draft).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant")):
        raise NotImplementedError(
            f"{type(draft).__name__} drafts from the target's shared KV states, which hf_specdec does not support "
            "yet. Supported: a causal LM draft (same or another tokenizer), prompt lookup, MTP layers, early exit; "
            "for this assistant call hf_specdec.uninstall() and use transformers' own (batch 1) assisted decoding."
        )
    placement.check_has_data(draft, "draft model", placement.input_device(target))
    if draft.config.is_encoder_decoder and not target.config.is_encoder_decoder:
        raise ValueError(f"The draft model {type(draft).__name__} is an encoder-decoder; use a decoder-only draft.")
    target_vocab, draft_vocab = output_vocab_size(target), output_vocab_size(draft)
    if target_vocab != draft_vocab:
        raise ValueError(
            f"The draft's vocabulary ({draft_vocab} logits) differs from the target's ({target_vocab}): the draft must "
            "share the target's tokenizer (e.g. a smaller model of the same family), or use method='ngram'."
        )


class DraftModelProposer(Proposer):
    """Drafts with a small causal LM; batched over rows, one forward per draft position."""

    reads_host_budget = True

    def __init__(
        self,
        draft_model: PreTrainedModel,
        num_speculative_tokens: int,
        confidence_threshold: ConfidenceThreshold | None = None,
    ) -> None:
        self.draft_model = draft_model
        self.num_speculative_tokens = num_speculative_tokens
        self.confidence_threshold = confidence_threshold
        self.max_positions = draft_position_limit(draft_model)
        self.view: CacheView | None = None
        # Static caches: most tokens any row may be ahead of the draft's cache (host-side, no sync). It is 2 after a
        # step that drafted (the last draft and the bonus), and grows by 1 per step without drafts (one token each).
        self.behind = 1
        self.proposed = False
        #: builds the draft's view (an encoder-decoder target's drafts cross-attend to its encoder output)
        self.view_factory: Callable[[PreTrainedModel, RaggedBatch], CacheView] | None = None
        self._drafted_probs: torch.Tensor | None = None  # [B, k] draft probability of each drafted token

    @property
    def returns_probs(self) -> bool:  # type: ignore[override]
        return True

    @property
    def capturable(self) -> bool:  # type: ignore[override]
        """HF's confidence threshold learns on the host from each step; without it a static step is device work."""
        return self.confidence_threshold is None

    def new_view(self, batch: RaggedBatch) -> CacheView:
        """The draft's cache over the batch (early exit runs a truncated target through its own view)."""
        if self.static is not None:
            return StaticCacheView(self.draft_model, batch.batch_size, batch.pad_lengths, self.static)
        if self.view_factory is not None:
            return self.view_factory(self.draft_model, batch)
        return CacheView(self.draft_model, batch.batch_size, batch.pad_lengths)

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        self.view = self.new_view(batch)
        if self.static is None:
            # Dynamic caches: the first step that drafts catches the draft up on everything it has not seen (the
            # catch-up takes any backlog), so a draft the schedule never uses (a useless one) never prefills.
            return
        num_new = batch.lengths - 1  # [B]
        if self.max_positions is not None:
            # A row that is already at the draft's position limit can never draft: the draft never sees it.
            num_new = torch.where(batch.lengths - batch.pad_lengths < self.max_positions, num_new, 0)
        if batch.prompt_width > 1 and int(num_new.max().item()) > 0:
            self.view.forward(batch.token_ids, num_new, logits_to_keep=1)
        if builds_plans_per_shape(batch.device) and isinstance(self.view, StaticCacheView):
            self._warm_catch_up(batch)

    def _warm_catch_up(self, batch: RaggedBatch) -> None:
        """Run each catch-up width this call could need once, now, each forward then undone (a GPU, the draft's
        first calls). A forward's first run at a new shape builds its kernels' plans (cuBLAS, cuDNN attention):
        measured on an H100 with an 8B target, the first re-probe after many plain steps caught the draft up in
        new widths and took 0.65 s more, making that call 2x slower than the next. The draft's first call
        pays it instead, once per width per process. The slots fed are the scratch past each row's tokens (any
        ids: only the shape matters) at positions the draft was built for."""
        assert isinstance(self.view, StaticCacheView)
        warmed = _WARM_WIDTHS.setdefault(self.draft_model, set())
        view = self.view
        longest = int(batch.prompt_width)
        fits = [w for w in CATCH_UP_WIDTHS if w not in warmed and view.offset_bound + w <= view.max_columns
                and (self.max_positions is None or longest + w <= self.max_positions)]  # fmt: skip
        if not fits or view.recurrent is not None:
            return
        before = view.cached_lengths
        for width in fits:
            view.forward(batch.token_ids, torch.full_like(before, width), width=width, eager=True)
            view.rollback(before)
            warmed.add(width)
        view.offset_bound = int(view.offset.item())  # back where the prefill left it (rollback moved the offset)

    def propose(
        self,
        batch: RaggedBatch,
        max_draft_tokens: torch.Tensor,  # [B]
        sampling: StepSampling,
        width: int | None = None,
        host_budget: np.ndarray | None = None,  # [B] max_draft_tokens on the host (dynamic caches), or None
    ) -> Proposal:
        """k forwards of the draft, each row drafting while within its budget. With `host_budget` (and no confidence
        threshold, which stops rows on the device) every forward's width is the host's: nothing is read."""
        assert self.view is not None, "prefill() must run before propose()"
        static = self.static is not None
        if static:  # fixed shapes: k forwards, the first 2 slots wide (catch-up), the others 1 (no host sync)
            k = self.num_speculative_tokens
        else:
            k = widest(max_draft_tokens, width)
        if k == 0:
            return Proposal.empty(batch.batch_size, batch.device)
        self.proposed = True
        rows = torch.arange(batch.batch_size, device=batch.device)
        draft_ids = torch.full((batch.batch_size, k), -1, dtype=torch.long, device=batch.device)  # [B, k]
        draft_probs: list[torch.Tensor] = []
        token_probs: list[torch.Tensor] = []
        lengths = batch.lengths.clone()  # [B] tokens known per row, drafts included
        confident = torch.ones_like(max_draft_tokens, dtype=torch.bool)  # [B] rows still above the threshold
        threshold = self.confidence_threshold
        host = None  # [B] the host's copy of `lengths` while it knows each row's drafts
        if host_budget is not None and threshold is None and not static and batch.host_lengths is not None:
            host = batch.host_lengths.copy() if self.view.host_columns() is not None else None
        if host is not None and builds_plans_per_shape(batch.device):
            self._catch_up_dynamic(batch, max_draft_tokens > 0, host, host_budget > 0)
        for j in range(k):
            drafting = (max_draft_tokens > j) & confident  # [B]
            if threshold is not None and j > 0 and not static and not bool(drafting.any()):
                break  # every row stopped on a low-confidence draft: skip the remaining draft forwards
            if static and j == 0:
                # Every row the draft can still serve catches up, drafting or not: steps that drafted leave it at most
                # 2 behind (one 2-slot forward, the same graph for 1 and 2), steps without drafts 1 more each.
                servable = self._servable(batch)
                self._catch_up(batch, servable)
                num_new = torch.where(servable, lengths - self.view.cached_lengths, 0)  # [B] at most 2
                logits = self.view.forward(batch.token_ids, num_new, width=2)  # [B, 2, V]
                last = logits[rows, (num_new - 1).clamp(min=0)]  # [B, V]
            elif static:
                num_new = drafting.long()  # [B]
                logits = self.view.forward(batch.token_ids, num_new, width=1)  # [B, 1, V]
                last = logits[rows, (num_new - 1).clamp(min=0)]  # [B, V]
            else:
                host_new = None
                if host is not None:
                    host_new = np.where(host_budget > j, host - self.view.host.cached, 0)  # [B] num_new, on the host
                    host += host_budget > j
                newest = None  # every row feeds one token: plain decoding's few operations (`forward_newest`)
                if host_new is not None and np.all(host_new == 1):
                    newest = self.view.forward_newest(batch.token_ids, keep=False)  # [B, 1, V] or None
                if newest is not None:
                    last = newest[:, 0]  # [B, V]
                else:
                    num_new = torch.where(drafting, lengths - self.view.cached_lengths, 0)  # [B]
                    if host_new is not None and np.max(host_new) > 2:  # a backlog: each row's last slot only
                        last = self._last_logits(batch, num_new, host_new)  # [B, V]
                    else:
                        logits = self.view.forward(batch.token_ids, num_new, host_num_new=host_new)  # [B, w, V]
                        last = logits[rows, (num_new - 1).clamp(min=0)]  # [B, V]
            scores = sampling.process(batch.token_ids, lengths[:, None], drafting[:, None], last[:, None])[:, 0]
            if sampling.do_sample:
                probs = torch.softmax(scores, dim=-1)  # [B, V]
                race = sampling_exponentials(sampling, j, probs.shape[-1])  # [B, V]
                tokens = (probs / race).argmax(dim=-1)  # [B]
                draft_probs.append(probs)
            else:
                tokens = scores.argmax(dim=-1)  # [B]
            if threshold is not None:
                # HF's confidence rule: the draft keeps its low-confidence token, then that row stops drafting.
                probs_j = draft_probs[-1] if sampling.do_sample else torch.softmax(scores, dim=-1)  # [B, V]
                p_token = probs_j.gather(1, tokens[:, None])[:, 0]  # [B]
                token_probs.append(torch.where(drafting, p_token, -1.0))
                confident = confident & (p_token >= threshold.value)
            tokens = torch.where(drafting, tokens, -1)
            draft_ids[:, j] = tokens
            write_at = lengths.clamp(max=batch.capacity - 1)
            batch.token_ids[rows, write_at] = torch.where(drafting, tokens, batch.token_ids[rows, write_at])
            lengths = lengths + drafting.long()
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, k', V]
        num_draft = (draft_ids >= 0).sum(1)  # [B]
        width = int(num_draft.max().item()) if threshold is not None and not static else k
        self._drafted_probs = torch.stack(token_probs, dim=1)[:, :width] if token_probs else None  # [B, k']
        return Proposal(
            draft_token_ids=draft_ids[:, :width],
            num_draft_tokens=num_draft,
            draft_probs=probs[:, :width] if probs is not None else None,
            host_num_draft_tokens=np.minimum(host_budget, k)
            if host is not None
            else None,  # every row drafts its budget
        )

    def _last_logits(self, batch: RaggedBatch, num_new: torch.Tensor, host_new: np.ndarray) -> torch.Tensor:  # [B, V]
        """A dynamic forward that feeds a backlog (the prompt, or the tokens of steps without drafts) and returns each
        row's last slot's logits only: the head runs on the slots some row ends at (`logits_to_keep` as indices), not
        on the whole backlog (3 rows x 229 slots of SmolLM2's 49k-word head took 0.9 s of a 9 s CPU call)."""
        ends = np.maximum(host_new - 1, 0)  # [B] each row's last slot (0 for rows fed nothing)
        keep = np.unique(ends)  # [n] sorted
        device = batch.device
        logits = self.view.forward(
            batch.token_ids, num_new, logits_to_keep=torch.from_numpy(keep).to(device), host_num_new=host_new
        )  # [B, n, V]
        at = torch.from_numpy(np.searchsorted(keep, ends)).to(device)  # [B] each row's slot among those kept
        return logits[torch.arange(batch.batch_size, device=device), at]

    def plan_step(self, batch: RaggedBatch) -> Hashable | None:
        """The key of a drafting step's graph: always 2 (the draft at most 2 behind, which its first forward of 2
        slots takes). After steps without drafts the draft first catches up here, eagerly, before the step's graph
        (`_catch_up`)."""
        if not self.capturable:
            return None
        if self.behind > 2 and self.view is not None and self.static is not None:
            self._catch_up(batch, self._servable(batch))
        self.behind = 2  # 1 behind (a first step, or after a catch-up) runs the same 2-slot forward as 2 behind
        return self.behind

    def _catch_up(self, batch: RaggedBatch, servable: torch.Tensor) -> None:  # servable: [B] bool
        """Static caches: feed the draft every token it has not seen but each row's newest one or two, in
        `catch_up_widths` forwards (eager, outside any graph), so that at most 2 are left for the step's first
        forward. It is behind by one token per step without drafts: 2 tokens per forward took a forward per two
        plain steps (63 forwards after the adaptive schedule's 128 plain steps between two re-measurements of a
        useless draft, each an eager forward of the whole draft: on the CPU as long as 60 replayed plain steps).
        Uncompiled also where the step's forwards are compiled: a compile per catch-up width would cost seconds."""
        assert self.view is not None
        for width in catch_up_widths(self.behind - 1):
            num_new = (batch.lengths - 1 - self.view.cached_lengths).clamp(min=0, max=width)  # [B] leaves the newest
            servable_new = torch.where(servable, num_new, 0)
            self.view.forward(batch.token_ids, servable_new, logits_to_keep=1, width=width, eager=True)  # (unread)
        self.behind = min(self.behind, 2)

    def _catch_up_dynamic(
        self,
        batch: RaggedBatch,
        drafting: torch.Tensor,  # [B] bool: rows that draft this step
        host_lengths: np.ndarray,  # [B] the batch's lengths on the host
        host_drafting: np.ndarray,  # [B] bool: `drafting` on the host
    ) -> None:
        """Dynamic caches: a drafting row more than 2 tokens behind (after plain steps, or its prompt at the first
        drafting step) first catches up in `catch_up_widths` forwards, leaving its newest token to the first draft
        forward. The widths a draft meets are then a few fixed ones rather than every backlog: a forward's first run
        at a new shape costs 50-1000 ms on a GPU (`first_shapes`). Only there: elsewhere one forward of the backlog
        costs less than several."""
        assert self.view is not None and self.view.host is not None
        behind = np.where(host_drafting, host_lengths - self.view.host.cached, 0)  # [B] tokens the draft lacks
        most = int(np.max(behind, initial=0))
        if most <= 2:
            return
        for width in catch_up_widths(most - 1):
            host_new = np.where(host_drafting, np.clip(host_lengths - 1 - self.view.host.cached, 0, width), 0)
            num_new = torch.where(drafting, (batch.lengths - 1 - self.view.cached_lengths).clamp(0, width), 0)
            self.view.forward(batch.token_ids, num_new, logits_to_keep=1, host_num_new=host_new)  # (logits unread)

    def _servable(self, batch: RaggedBatch) -> torch.Tensor:  # [B] bool
        """Rows whose tokens all sit at positions the draft was built for (the others never draft again)."""
        if self.max_positions is None:
            return torch.ones_like(batch.lengths, dtype=torch.bool)
        return batch.lengths - batch.pad_lengths <= self.max_positions

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        assert self.view is not None
        if self.confidence_threshold is not None and self._drafted_probs is not None:
            self.confidence_threshold.update(self._drafted_probs, num_accepted)
            self._drafted_probs = None
        # The newest token of each row (recovered or bonus) was never seen by the draft.
        host = {} if batch.host_lengths is None or self.static is not None else {"host_cached": batch.host_lengths - 1}
        self.view.rollback(batch.lengths - 1, **host)
        self.behind = 2 if self.proposed else self.behind + 1
        self.proposed = False

    def select_rows(self, keep: torch.Tensor, host_keep: np.ndarray | None = None) -> None:
        if self.view is not None:
            self.view.select_rows(keep, **({} if host_keep is None else {"host_keep": host_keep}))
        self._drafted_probs = None


#: Forward widths of a draft's catch-up on static caches, widest first (`catch_up_widths`).
CATCH_UP_WIDTHS = (256, 128, 64, 32, 16, 8, 4, 2)

#: per draft model, the catch-up widths its first calls ran once (`DraftModelProposer._warm_catch_up`)
_WARM_WIDTHS: weakref.WeakKeyDictionary[PreTrainedModel, set[int]] = weakref.WeakKeyDictionary()


def catch_up_widths(backlog: int) -> list[int]:
    """Forward widths that feed `backlog` tokens, or all but one: the widest first, each slot a token of the row
    that is furthest behind (so no slot is a hole there), at most `ceil(backlog / 256) + 7` forwards of at most 8
    shapes. The catch-up runs eagerly, where a wide forward costs about what a narrow one does (launch-bound)."""
    widths = []
    for width in CATCH_UP_WIDTHS:
        while backlog >= width:
            widths.append(width)
            backlog -= width
    return widths


def draft_position_limit(draft_model: PreTrainedModel) -> int | None:
    """The number of positions the draft was built for (`max_position_embeddings`, GPT-2's `n_positions`)."""
    limit = getattr(draft_model.config.get_text_config(), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def sampling_exponentials(sampling: StepSampling, position: int, vocab: int) -> torch.Tensor:  # [B, V]
    """The Exp(1) draws of the exponential race that samples draft position `position`."""
    return sampling.draw_exponentials(row_random.STREAM_DRAFT + position, vocab)


def confidence_threshold(spec: SpecDecoder) -> ConfidenceThreshold | None:
    """HF's `assistant_confidence_threshold` as the call's `ConfidenceThreshold` (None when off)."""
    from hf_specdec.schedules import ConfidenceThreshold

    threshold = spec.draft_confidence_threshold
    return ConfidenceThreshold(threshold) if threshold else None


@register("draft")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> DraftModelProposer:
    """`method="draft"`: a draft model sharing the target's tokenizer (encoder-decoder drafts cross-attend)."""
    check_draft_model(target, spec.draft_model)
    proposer = DraftModelProposer(spec.draft_model, spec.max_speculative_tokens, confidence_threshold(spec))
    if context.encoder is not None:  # the draft cross-attends to the target's encoder output
        from hf_specdec.seq2seq import check_seq2seq_draft, view_factory

        check_seq2seq_draft(target, spec.draft_model, context.encoder.hidden.shape[-1])
        proposer.view_factory = view_factory(context.encoder)
    return proposer
