"""`StaticEagle3Proposer`: the EAGLE-3 head on static caches, with fixed shapes so a whole step can be one CUDA graph.

The head's cache is a `StaticEagle3ContextView` (a `StaticCacheView` fed embeddings and hidden states: every feed
writes its slots at the shared write offset; holes, rollback and compaction are `StaticCacheView`'s). The context is
fed in `commit`, right after the verify whose layer states it reads (hooks on the target's decoder layers: Python
that runs when a step is captured and only keeps references to the forward's outputs, which the same captured step
consumes), at the verify's own width, and the head's output at each row's newest token is kept for the next
`propose`, which runs exactly k head forwards. No host read, no host state that a replay would not reproduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.eagle3 import Eagle3Proposer
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.static_cache import StaticCacheView

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["StaticEagle3ContextView", "StaticEagle3Proposer"]


class StaticEagle3ContextView(StaticCacheView):
    """The head's cache on a static cache: column p (p > pad) holds the head's layer over `[embed(token p) ‖
    fc(states at p - 1)]` at position `p - 1 - pad`, as `Eagle3ContextView`'s does on a dynamic cache."""

    def feed(
        self,
        embeds: torch.Tensor,  # [B, s, H] embeddings of the fed tokens
        hidden: torch.Tensor,  # [B, s, H] fc(target states of the previous token), or the head's previous output
        index: torch.Tensor,  # [B, s] buffer index of each slot's token, -1 for slots a row does not use
    ) -> torch.Tensor:  # [B, s, H] the head's output per slot
        valid = index >= 0  # [B, s]
        position_ids = torch.where(valid, index - 1 - self.pad_lengths[:, None], 0).clamp(min=0)  # [B, s]
        mask = self.write_columns(index, valid, valid)
        out = self.model(embeds, hidden, mask, position_ids, self.cache, **self.forward_kwargs)  # [B, s, H]
        self.advance(index.shape[1])
        self.cached_lengths = torch.maximum(self.cached_lengths, index.max(dim=1).values + 1)
        return out


class StaticEagle3Proposer(Eagle3Proposer):
    """`Eagle3Proposer` on static caches (`use_static`): k head forwards per drafting step, whatever the budgets.

    Per step: `propose` drafts from the head's output at the newest token (kept by the last commit), feeding each
    draft back (k - 1 forwards of width 1), then masks the drafts' columns again; `commit` feeds the committed
    tokens' context in one forward of the verify's width (1 + k, or 1 in a step that drafted nothing: at most that
    many tokens are committed) and keeps the output at each row's newest token.
    """

    capturable = True  # fixed widths, no host read: a static step can be captured

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        assert self.static is not None, "StaticEagle3Proposer runs on static caches: call use_static(plan) first"
        self.view = StaticEagle3ContextView(self.head, batch.batch_size, batch.pad_lengths, self.static)
        self.context_end = batch.pad_lengths + 1  # a row's first real token has no previous state: no column
        self.verify_start = torch.zeros_like(batch.lengths)  # the prefill feeds every buffer index from 0
        self.newest = torch.zeros(batch.batch_size, self.head.config.hidden_size, dtype=self.head.dtype,
                                  device=batch.device)  # [B, H] the head's output at each row's newest token  # fmt: skip
        self.seen_prompt = False  # host: set once, by step 0's (uncaptured) commit
        self.seen_forwards = self.capture.count

    def _draft_width(self, max_draft_tokens: torch.Tensor, width: int | None) -> int:
        return self.num_speculative_tokens  # fixed: rows with smaller budgets feed holes

    def _newest_output(self, batch: RaggedBatch) -> torch.Tensor | None:  # [B, H]
        return self.newest if self.seen_prompt else None

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        """Feed the context of the tokens the verify committed; keep the output at each row's newest token."""
        assert self.view is not None and self.context_end is not None
        hidden, index = self._new_context(batch)  # [B, w, H], [B, w]
        if hidden is not None:
            tokens = batch.token_ids.gather(1, index.clamp(0, batch.capacity - 1))  # [B, w]
            out = self.view.feed(self._embed(tokens), hidden, index)  # [B, w, H]
            num_new = (index >= 0).sum(1)  # [B] a row's fed slots come first
            rows = torch.arange(batch.batch_size, device=batch.device)
            newest = out[rows, (num_new - 1).clamp(min=0)]  # [B, H]
            self.newest = torch.where(num_new[:, None] > 0, newest, self.newest)
        self.context_end = torch.maximum(self.context_end, batch.lengths)
        self.verify_start = batch.lengths - 1  # the next verify feeds from the newest token
        self.seen_prompt = True

    def select_rows(self, keep: torch.Tensor) -> None:
        raise NotImplementedError("rows never leave a static batch: they stay, masked, until the call ends")


@register("eagle3", static=True)
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> StaticEagle3Proposer:
    """`SpecDecoder(draft_head=...)` on static caches."""
    context.require_decoder_only(spec.method, target)
    return StaticEagle3Proposer(target, spec.draft_head, spec.max_speculative_tokens)
