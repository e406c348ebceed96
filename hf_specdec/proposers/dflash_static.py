"""`StaticDFlashProposer`: the DFlash drafter on static caches, with fixed shapes so a whole step can be one CUDA graph.

The drafter's cache is a `StaticDFlashContextView` (a `StaticCacheView`): one drafter forward writes the new context
columns (the target's states of newly committed tokens, holes where a row has fewer) and the block's columns at the
shared write offset, reads the block, and masks the block's columns again. It runs in `commit`, right after the verify
whose layer states it reads (hooks that keep references the same captured step consumes), at the verify's own width:
the newest token is known there, so the block's output is kept for the next `propose`, which only turns it into
drafts. No host read, no host state that a replay would not reproduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.dflash import DFlashProposer, read_block
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.static_cache import StaticCacheView

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["StaticDFlashContextView", "StaticDFlashProposer"]


class StaticDFlashContextView(StaticCacheView):
    """The drafter's context on a static cache: as `DFlashContextView`, each block slot sees every context column and
    the whole block; sliding layers `|query position - key position| <= window`."""

    def feed(
        self,
        context: torch.Tensor,  # [B, c, n * H] the target's states at target_layer_ids of the new context tokens
        index: torch.Tensor,  # [B, c] their buffer indices, -1 for slots a row does not use
        block_embeds: torch.Tensor,  # [B, s, H] the newest token's embedding, then the mask token's
        anchor: torch.Tensor,  # [B] buffer index of the newest token (the block's first slot)
    ) -> torch.Tensor:  # [B, s, H] the drafter's output over the block
        size = block_embeds.shape[1]
        pad = self.pad_lengths[:, None]  # [B, 1]
        block_index = anchor[:, None] + torch.arange(size, device=anchor.device)  # [B, s]
        slots = torch.cat([index, block_index], dim=1)  # [B, c + s] context columns, then the block's
        self.claim_columns(slots)
        positions = torch.where(slots >= 0, slots - pad, 0).clamp(min=0)  # [B, c + s]
        # Context columns hold indices below the anchor; columns at or past it are this block's (earlier blocks' are
        # holes again): every block slot sees all of them.
        allowed = (self.column_index >= 0)[:, None, :].expand(-1, size, -1)  # [B, s, L]
        key_positions = (self.column_index - pad)[:, None, :]  # [B, 1, L]
        hidden = read_block(self, block_embeds, context, positions, allowed, block_index - pad, key_positions,
                            **self.forward_kwargs)  # fmt: skip
        self.advance(slots.shape[1])
        self.cached_lengths = torch.maximum(self.cached_lengths, index.max(dim=1).values + 1)
        self.rollback(self.cached_lengths)  # the block's columns become holes: only context stays
        return hidden


class StaticDFlashProposer(DFlashProposer):
    """`DFlashProposer` on static caches (`use_static`): one drafter forward per step, in `commit`.

    `commit` feeds the tokens the verify committed (but the newest) as context, in one forward of the verify's width
    (a verify commits at most that many), together with the block anchored at the newest token, and keeps the
    block's output; `propose` turns it into min(k, block_size - 1) drafts per row. A step without drafts (the
    adaptive schedule's plain step) still runs the drafter forward: it keeps the context in step.
    """

    capturable = True  # fixed widths, no host read: a static step can be captured

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        assert self.static is not None, "StaticDFlashProposer runs on static caches: call use_static(plan) first"
        self.view = StaticDFlashContextView(self.drafter, batch.batch_size, batch.pad_lengths, self.static)
        self.context_lengths = torch.zeros_like(batch.lengths)
        self.block_hidden = torch.zeros(batch.batch_size, self.block_size, self.drafter.config.hidden_size,
                                        dtype=self.drafter.dtype, device=batch.device)  # [B, s, H]  # fmt: skip
        self.seen_prompt = False  # host: set once, by step 0's (uncaptured) commit
        self.seen_forwards = self.capture.count

    def _block_output(self, batch: RaggedBatch) -> torch.Tensor | None:  # [B, s, H]
        return self.block_hidden if self.seen_prompt else None

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        """Feed the committed tokens' states (but the newest's) and read the block at the newest token."""
        assert self.view is not None and self.context_lengths is not None
        states = self._verified_states()  # [B, w, nH] fed slot s holds buffer index context_lengths + s
        start = self.context_lengths  # [B]
        num_new = (batch.lengths - 1 - start).clamp(min=0)  # [B] at most w: a verify commits at most its width
        slots = torch.arange(states.shape[1], device=batch.device)  # [w]
        index = start[:, None] + slots  # [B, w]
        real = (slots < num_new[:, None]) & (index >= batch.pad_lengths[:, None])
        self.block_hidden = self.view.feed(states.to(self.drafter.dtype), torch.where(real, index, -1),
                                           self._block_embeds(batch), batch.lengths - 1)  # fmt: skip
        self.context_lengths = torch.maximum(start, batch.lengths - 1)
        self.seen_prompt = True

    def select_rows(self, keep: torch.Tensor) -> None:
        raise NotImplementedError("rows never leave a static batch: they stay, masked, until the call ends")


@register("dflash", static=True)
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> StaticDFlashProposer:
    """`method="dflash"` on static caches."""
    context.require_decoder_only(spec.method, target)
    return StaticDFlashProposer(target, spec.draft_model, spec.max_speculative_tokens)
