"""`DFlashProposer`: block drafting with a DFlash drafter fed by the target's hidden states, batched and ragged.

This is transformers' `DFlashTokenCandidateGenerator` (`generate(assistant_model=drafter,
speculation_type="dflash")`), for any batch. The drafter (`MuseGlimmerAssistantModel`) has no embedding and no
head: it borrows the target's. Its keys and values over the past are projections of the target's hidden states at
`config.target_layer_ids` (concatenated, for every committed token but the newest), kept in its own cache. Each step
it reads one block of `block_size` slots: the newest token, then `mask_token_id` placeholders; all slots attend to
the whole context and to each other, and the target's head turns the placeholders' outputs into up to
`block_size - 1` drafts in one forward. The hidden states come from the verify the loop runs anyway
(`VerifyCapture`); rejected positions never enter the drafter's cache. On static caches
`dflash_static.StaticDFlashProposer` feeds context and block in `commit` (capturable steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from hf_specdec import compat
from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.compat import crop_cache
from hf_specdec.model_support import check_attention_implementation
from hf_specdec.placement import input_device, module_device
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal
from hf_specdec.proposers.mtp import _draw
from hf_specdec.proposers.target_states import TargetStateDrafter, VerifyCapture
from hf_specdec.sampling.processors import StepSampling

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["DFlashProposer", "check_dflash_drafter"]


def check_dflash_drafter(drafter: object) -> int:
    """Raise a clear error unless `drafter` is a DFlash drafter; return its `block_size`."""
    config = getattr(drafter, "config", None)
    needed = ("block_size", "mask_token_id", "target_layer_ids")
    missing = [name for name in needed if getattr(config, name, None) is None]
    if missing or not hasattr(drafter, "encoder"):
        raise TypeError(
            f"speculation_type='dflash' needs a DFlash drafter as assistant_model (a MuseGlimmerAssistantModel, whose "
            f"config has {', '.join(needed)}), but got {type(drafter).__name__}"
            + (f" (its config lacks {missing})" if missing else "")
            + ": pass the drafter checkpoint, or drop speculation_type to draft with a causal LM."
        )
    block = int(config.block_size)
    if block < 2:
        raise ValueError(
            f"The DFlash drafter's block_size is {block}; it drafts block_size - 1 tokens, so it needs >= 2."
        )
    return block


class DFlashContextView(CacheView):
    """The drafter's cache over the ragged batch: one column per committed token whose target states it has seen.

    Column map, masks' dtype, compaction and row selection are `CacheView`'s; `feed` appends context columns (the
    target's states of newly committed tokens, with holes) and reads one block after them, whose own columns are
    cropped again once the block has been read (only context stays)."""

    def feed(
        self,
        context: torch.Tensor,  # [B, c, n * H] the target's states at target_layer_ids of the new context tokens
        index: torch.Tensor,  # [B, c] their buffer indices, -1 for slots a row does not use
        block_embeds: torch.Tensor,  # [B, s, H] the newest token's embedding, then the mask token's
        anchor: torch.Tensor,  # [B] buffer index of the newest token (the block's first slot)
    ) -> torch.Tensor:  # [B, s, H] the drafter's output over the block
        size = block_embeds.shape[1]
        device = block_embeds.device
        pad = self.pad_lengths[:, None]  # [B, 1]
        block_index = anchor[:, None] + torch.arange(size, device=device)  # [B, s]
        context_positions = torch.where(index >= 0, index - pad, 0).clamp(min=0)  # [B, c]
        position_ids = torch.cat([context_positions, block_index - pad], dim=1)  # [B, c + s]
        keys = torch.cat([self.column_index, index], dim=1)  # [B, W + c] context columns, -1 = hole
        real = keys >= 0
        key_positions = torch.cat([keys - pad, block_index - pad], dim=1)[:, None, :]  # [B, 1, W + c + s]
        allowed = torch.cat([real, torch.ones_like(block_index, dtype=torch.bool)], dim=1)[:, None, :]  # [B, 1, K]
        allowed = allowed.expand(-1, size, -1)  # [B, s, K]: every block slot sees all context and the whole block
        hidden = read_block(self, block_embeds, context, position_ids, allowed, block_index - pad, key_positions)
        crop_cache(self.cache, -size)  # the block is read, not kept
        self.column_index = keys
        self.cached_lengths = torch.maximum(self.cached_lengths, index.max(dim=1).values + 1)
        self.rollback(self.cached_lengths)  # compacts when holes dominate
        return hidden


def read_block(
    view: CacheView,
    block_embeds: torch.Tensor,  # [B, s, H]
    context: torch.Tensor,  # [B, c, n * H]
    position_ids: torch.Tensor,  # [B, c + s]
    allowed: torch.Tensor,  # [B, s, K] bool: which keys each block slot sees
    query_positions: torch.Tensor,  # [B, s] the block slots' positions
    key_positions: torch.Tensor,  # [B, 1, K] the keys' positions
    **forward_kwargs: object,
) -> torch.Tensor:  # [B, s, H]
    """One drafter forward over new context and a block, with a mask per layer type (sliding layers, DFlashCache's
    meaning: |query position - key position| <= window), on the dynamic or the static view's cache."""
    masks = {"full_attention": allowed}
    if view.sliding_window is not None:
        distance = (query_positions[:, :, None] - key_positions).abs()  # [B, s, K]
        masks["sliding_attention"] = allowed & (distance <= view.sliding_window)
    types = set(view.layer_types or ["full_attention"])
    masks = {name: view._to_model_format(masks[name][:, None]) for name in types}
    return view.model(
        noise_embeds=block_embeds,
        context_hidden_states=context,
        attention_mask=masks,
        position_ids=position_ids,
        **compat.cache_kwargs(view.model, view.cache),
        use_cache=True,
        **forward_kwargs,
    ).last_hidden_state


class DFlashProposer(TargetStateDrafter):
    """Drafts up to min(k, block_size - 1) tokens per row in one drafter forward over a block of placeholders.

    Args:
        target (`PreTrainedModel`): The model being decoded; its embeddings, head and hidden states are used.
        drafter (`MuseGlimmerAssistantModel`): The DFlash drafter trained for this target.
        num_speculative_tokens (`int`): The most drafts per row and step (at most block_size - 1 are drafted).
    """

    def __init__(self, target: PreTrainedModel, drafter: PreTrainedModel, num_speculative_tokens: int) -> None:
        self.block_size = check_dflash_drafter(drafter)
        check_dflash_target(target, drafter)
        self.target = target
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.layer_ids = [int(i) for i in drafter.config.target_layer_ids]
        self.num_target_layers = target.config.get_text_config().num_hidden_layers
        last = self.num_target_layers - 1  # transformers' hidden_states[-1] is the decoder's normed output
        inner = [i for i in self.layer_ids if i != last]
        # the layers' states where the batch is (a target spread over devices computes them on several)
        self.capture = VerifyCapture(
            target,
            layer_ids=inner,
            keep_last_hidden=last in self.layer_ids,
            device=input_device(target),
            keep_inputs=False,
        )
        self.view: DFlashContextView | None = None
        self.context_lengths: torch.Tensor | None = None  # [B] buffer indices [0, n) have entered the context
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # context not yet fed: [B, c, nH], [B, c]
        self.seen_forwards = 0

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        self.view = DFlashContextView(self.drafter, batch.batch_size, batch.pad_lengths)
        self.context_lengths = torch.zeros_like(batch.lengths)
        self.pending = []
        self.seen_forwards = self.capture.count

    def propose(
        self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling, width: int | None = None
    ) -> Proposal:
        assert self.view is not None, "prefill() must run before propose()"
        budget = max_draft_tokens.clamp(max=self.block_size - 1)  # [B]
        # One forward drafts the whole block whatever the budgets: draw the widest budget there can be (rows past
        # their own budget draw nothing), known on the host, so proposing reads nothing back from the device.
        k = min(self.num_speculative_tokens, self.block_size - 1) if batch.batch_size else 0
        hidden = self._block_output(batch) if k else None  # [B, s, H]
        if hidden is None:  # step 0: the drafts need the prefill's states
            return Proposal.empty(batch.batch_size, batch.device)
        head = self.target.get_output_embeddings()  # the target's head: its last device, if spread
        logits = head(hidden[:, 1 : k + 1].to(module_device(head), head.weight.dtype))
        logits = logits.to(batch.device, torch.float32)  # [B, k, V]
        rows = torch.arange(batch.batch_size, device=batch.device)
        draft_ids = torch.full((batch.batch_size, k), -1, dtype=torch.long, device=batch.device)  # [B, k]
        draft_probs: list[torch.Tensor] = []
        for j in range(k):  # one forward drafted the block; processors still see each draft's own prefix
            drafting = budget > j  # [B]
            token, probs = _draw(sampling, batch, batch.lengths + j, drafting, logits[:, j], j)  # [B], [B, V]
            draft_ids[:, j] = torch.where(drafting, token, -1)
            if probs is not None:
                draft_probs.append(probs)
            write_at = (batch.lengths + j).clamp(max=batch.capacity - 1)
            batch.token_ids[rows, write_at] = torch.where(drafting, token, batch.token_ids[rows, write_at])
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, k, V]
        return Proposal(draft_token_ids=draft_ids, num_draft_tokens=budget, draft_probs=probs)

    def _block_output(self, batch: RaggedBatch) -> torch.Tensor | None:  # [B, s, H]
        """Feed the queued context and read the block at each row's newest token (None before the first commit)."""
        if not self.pending:
            return None
        context = torch.cat([states for states, _ in self.pending], dim=1)  # [B, c, nH]
        index = torch.cat([index for _, index in self.pending], dim=1)  # [B, c]
        self.pending = []
        return self.view.feed(context.to(self.drafter.dtype), index, self._block_embeds(batch), batch.lengths - 1)

    def _block_embeds(self, batch: RaggedBatch) -> torch.Tensor:  # [B, s, H]
        """The block's inputs: the newest token's embedding, then the mask token's."""
        mask_id = int(self.drafter.config.mask_token_id)
        block_ids = torch.full((batch.batch_size, self.block_size), mask_id, dtype=torch.long, device=batch.device)
        block_ids[:, 0] = batch.last_token_ids()
        return _plain_embeddings(self.target, block_ids).to(batch.device, self.drafter.dtype)

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        """Queue the target's states of the tokens committed this step but the newest (the next block's anchor)."""
        assert self.context_lengths is not None
        states = self._verified_states()  # [B, w, nH] fed slot s holds buffer index context_lengths + s
        start = self.context_lengths
        num_new = batch.lengths - 1 - start  # [B]
        width = int(num_new.max().item()) if batch.batch_size else 0
        if width > 0:
            slots = torch.arange(width, device=batch.device)  # [c]
            index = start[:, None] + slots  # [B, c]
            real = (slots < num_new[:, None]) & (index >= batch.pad_lengths[:, None])
            self.pending.append((states[:, :width], torch.where(real, index, -1)))
        self.context_lengths = batch.lengths - 1

    def _verified_states(self) -> torch.Tensor:  # [B, w, nH]
        """The target's states at `target_layer_ids` in its latest forward (read once: the capture drops them)."""
        capture = self.capture
        if capture.count == self.seen_forwards:
            raise RuntimeError(
                "DFlashProposer did not see the target's latest forward: the loop must call attach(target) before "
                "the target's prefill."
            )
        self.seen_forwards = capture.count
        states = [
            capture.last_hidden if i == self.num_target_layers - 1 else capture.layer_outputs[i] for i in self.layer_ids
        ]
        capture.forget()  # read once: nothing of the verify's outlives its step
        return torch.cat(states, dim=-1)

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.view is not None:
            self.view.select_rows(keep)
        if self.context_lengths is not None:
            self.context_lengths = self.context_lengths[keep]
        self.pending = [(states[keep], index[keep]) for states, index in self.pending]


def check_dflash_target(target: PreTrainedModel, drafter: PreTrainedModel) -> None:
    """Raise a clear error unless `drafter` can draft for `target` (sizes, layer ids, a head to borrow)."""
    config = target.config.get_text_config()
    name = type(target).__name__
    if target.config.is_encoder_decoder or target.get_output_embeddings() is None:
        raise NotImplementedError(
            f"A DFlash drafter borrows a decoder-only target's embeddings and head, but {name} is not one: use "
            "another draft for this target."
        )
    if drafter.config.hidden_size != config.hidden_size:
        raise ValueError(
            f"The DFlash drafter has hidden_size={drafter.config.hidden_size} but {name} has {config.hidden_size}: "
            "load the drafter checkpoint trained for this target."
        )
    layers = config.num_hidden_layers
    bad = [i for i in drafter.config.target_layer_ids if not 0 <= int(i) < layers]
    if bad:
        raise ValueError(
            f"The DFlash drafter reads target layers {list(drafter.config.target_layer_ids)}, but {name} has {layers} "
            f"layers (bad: {bad}): load the drafter checkpoint trained for this target."
        )
    if not 0 <= int(drafter.config.mask_token_id) < config.vocab_size:
        raise ValueError(
            f"The DFlash drafter's mask_token_id={drafter.config.mask_token_id} is not in {name}'s vocabulary "
            f"({config.vocab_size}): load the drafter checkpoint trained for this target."
        )
    check_attention_implementation(drafter)


def _plain_embeddings(target: PreTrainedModel, token_ids: torch.Tensor) -> torch.Tensor:  # [B, s, H]
    """The target's input embeddings of `token_ids`, without an `embed_norm` its embedding may apply (as HF's DFlash
    generator: the drafter was trained on the table's rows)."""
    table = target.get_input_embeddings()
    token_ids = token_ids.to(module_device(table))  # where the table computes (offloaded: not its weight's `meta`)
    norm = getattr(table, "embed_norm", None)
    if norm is None:
        return table(token_ids)
    try:
        table.embed_norm = torch.nn.Identity()
        return table(token_ids)
    finally:
        table.embed_norm = norm


@register("dflash")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> DFlashProposer:
    """`method="dflash"`: a DFlash block drafter fed the target's layer states (decoder-only targets)."""
    context.require_decoder_only(spec.method, target)
    return DFlashProposer(target, spec.draft_model, spec.max_speculative_tokens)
