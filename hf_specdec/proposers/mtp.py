"""`MTPProposer`: drafts with the target's own multi-token-prediction (MTP) layers, batched and ragged.

Models whose config has `num_mtp_layers` (DeepSeek-V3, GLM-4.5, ...) ship n extra decoder layers that
transformers loads into `transformers.modeling_layers.MtpModel`. MTP layer d at token index p mixes the
embedding of token p with a previous hidden state (the target's last hidden state at p-1 for d = 0, MTP
layer d-1's output at p-1 otherwise) and predicts token p+1. Draft step j runs layer j mod n on the newest
token, so k > n cycles through the layers. Each layer keeps its own KV cache (`MtpLayerView`, a
`CacheView`; on static caches `StaticMtpLayerView`, fed a fixed catch-up width so that a whole step can be
captured as one CUDA graph); the target's last hidden states come from a forward hook on its decoder, live only
while the `generate` call runs.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from hf_specdec import compat
from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.placement import module_device
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal, Proposer, widest
from hf_specdec.proposers.draft_model import sampling_exponentials
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.static_cache import StaticCacheView, StaticPlan

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["MTPProposer", "MtpLayerView", "check_mtp_target", "resolve_mtp_model"]

#: MtpModels loaded from a target's checkpoint, so that repeated `generate` calls do not reload them.
_LOADED_MTP_MODELS: weakref.WeakKeyDictionary[PreTrainedModel, PreTrainedModel] = weakref.WeakKeyDictionary()


def num_mtp_layers(model: PreTrainedModel) -> int:
    """The number of MTP layers the model's config declares (0 when it has none)."""
    return int(getattr(model.config.get_text_config(), "num_mtp_layers", None) or 0)


def check_mtp_target(model: PreTrainedModel) -> int:
    """Raise a clear error unless `model` carries MTP layers; return their number."""
    n = num_mtp_layers(model)
    if n < 1:
        raise ValueError(
            f"SpecDecoder(method='mtp') needs a target with multi-token-prediction layers (`num_mtp_layers` >= 1 in "
            f"its config), but {type(model).__name__} has num_mtp_layers={n}: use method='draft' (with a smaller "
            "model sharing the tokenizer) or method='ngram' (prompt lookup) for this model."
        )
    return n


def resolve_mtp_model(target: PreTrainedModel, mtp_model: Any = None) -> PreTrainedModel:
    """The `MtpModel` to draft with: `mtp_model` if given (checked), else the target checkpoint's MTP layers."""
    from transformers.modeling_layers import MtpModel

    n = check_mtp_target(target)
    if mtp_model is None:
        mtp_model = _LOADED_MTP_MODELS.get(target)
    if mtp_model is None:
        device = module_device(target.get_decoder().layers[-1])  # not its weights' device: `meta` when offloaded
        try:
            mtp_model = MtpModel.from_pretrained(target, device_map={"": device})
        except Exception as error:  # noqa: BLE001 - re-raised with what to do
            raise ValueError(
                f"Could not load the MTP layers of {type(target).__name__} from its checkpoint "
                f"{target.config.name_or_path!r} ({type(error).__name__}: {error}). Load the target with "
                "from_pretrained from a checkpoint that contains its MTP weights, or pass "
                "SpecDecoder(method='mtp', mtp_model=MtpModel(...))."
            ) from error
        _LOADED_MTP_MODELS[target] = mtp_model.eval()
    if not isinstance(mtp_model, MtpModel):
        raise TypeError(
            f"mtp_model must be a transformers.modeling_layers.MtpModel, got {type(mtp_model).__name__}: build it "
            "with MtpModel.from_pretrained(target) or MtpModel(target, num_mtp_layers)."
        )
    if len(mtp_model.layers) != n:
        raise ValueError(
            f"mtp_model has {len(mtp_model.layers)} MTP layers but the target's config says num_mtp_layers={n}: "
            "build the MtpModel from this target."
        )
    return mtp_model


class _MtpLayerFeed:
    """Feeding one MTP layer its tokens and their previous hidden states (the dynamic and the static view's own
    column bookkeeping: `_claim_columns` before the layer's forward, `_fed` after)."""

    model: PreTrainedModel
    layer_idx: int
    layer_type: str | None
    layer_device: torch.device  # where MTP layer `layer_idx` computes
    embed_device: torch.device  # where the shared input embedding computes (the target's first device)
    rope_device: torch.device  # where the shared RoPE computes

    def feed(
        self,
        token_ids: torch.Tensor,  # [B, C] the batch's token buffer
        start: torch.Tensor,  # [B] buffer index of each row's first fed token
        num_new: torch.Tensor,  # [B] tokens fed per row
        previous_hidden: torch.Tensor,  # [B, w, H] the previous hidden state of each fed token
    ) -> torch.Tensor:  # [B, w, H] the layer's output hidden states (garbage past num_new)
        """Run the MTP layer on tokens [start, start + num_new) of each row, appending them to its cache."""
        mtp = self.model
        width = previous_hidden.shape[1]
        offsets = torch.arange(width, device=token_ids.device)  # [w]
        index = start[:, None] + offsets  # [B, w]
        valid = offsets < num_new[:, None]  # [B, w]
        input_ids = torch.where(valid, token_ids.gather(1, index.clamp(max=token_ids.shape[1] - 1)), 0)  # [B, w]
        real = valid & (index > self.pad_lengths[:, None] + self.layer_idx)  # [B, w]
        position_ids = torch.where(valid, (index - self.pad_lengths[:, None]).clamp(min=0), 0)  # [B, w]
        mask = self._claim_columns(index, valid, real)
        if isinstance(mask, dict):
            mask = mask[self.layer_type]
        # A target spread over devices shares its embedding (first device) and head (last) with the MTP layers
        # (placed with its last layer): each part gets its inputs on its own device.
        layer_device = self.layer_device
        embeds = mtp.embed_tokens(input_ids.to(self.embed_device))  # [B, w, H]
        embeds = embeds.to(layer_device, previous_hidden.dtype)
        previous_hidden, mask, position_ids = (
            previous_hidden.to(layer_device),
            mask.to(layer_device) if mask is not None else None,
            position_ids.to(layer_device),
        )
        rope = None
        if mtp.rotary_emb is not None:
            # transformers >= 5.23 marks per-layer RoPE parameters; 5.17 has none (no layer_type argument)
            rope_kwargs = {"layer_type": self.layer_type} if getattr(mtp, "has_per_layer_rope", False) else {}
            rope = mtp.rotary_emb(embeds, position_ids=position_ids.to(self.rope_device), **rope_kwargs)
            if isinstance(rope, (tuple, list)):  # (cos, sin)
                rope = tuple(r.to(layer_device) if isinstance(r, torch.Tensor) else r for r in rope)
        hidden = mtp.layers[self.layer_idx](
            embeds,
            previous_hidden,
            position_embeddings=rope,
            attention_mask=mask,
            position_ids=position_ids,
            **compat.cache_kwargs(mtp.layers[self.layer_idx], self.cache),
            use_cache=True,
            **self.forward_kwargs,
        )  # [B, w, H]
        if mtp.use_shared_post_norm:
            hidden = mtp.shared_post_norm(hidden)
        self._fed(width)
        self.cached_lengths = torch.where(
            num_new > 0, torch.maximum(self.cached_lengths, start + num_new), self.cached_lengths
        )
        return hidden.to(token_ids.device)  # [B, w, H] on the batch's device (no copy on one device)

    def find_devices(self) -> None:
        """Where this layer, the shared embedding and RoPE compute (a target placed with a `device_map`)."""
        mtp = self.model
        self.layer_device = module_device(mtp.layers[self.layer_idx])
        self.embed_device = module_device(mtp.embed_tokens)
        rope = mtp.rotary_emb
        self.rope_device = module_device(rope) if rope is not None else self.layer_device


class MtpLayerView(_MtpLayerFeed, CacheView):
    """The KV cache of one MTP layer over the ragged batch: a `CacheView` fed hidden states, not token ids.

    Column map, masks, rollback and compaction are `CacheView`'s. Layer d has no entry for the first d+1
    real tokens of a row (there is no previous hidden state for them), so those columns stay holes. Fed
    slots need not follow the cached prefix: a cycling draft step (k > n) feeds one token further on.
    """

    def __init__(self, mtp_model: PreTrainedModel, layer_idx: int, batch_size: int, pad_lengths: torch.Tensor):
        super().__init__(mtp_model, batch_size, pad_lengths)
        self.layer_idx = layer_idx
        self.layer_type = self.layer_types[layer_idx] if self.layer_types is not None else None
        self.find_devices()

    def _claim_columns(
        self,
        index: torch.Tensor,  # [B, w] buffer index of each fed slot
        valid: torch.Tensor,  # [B, w]
        real: torch.Tensor,  # [B, w]
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The fed slots become new columns at the end of the map (the DynamicCache appends them)."""
        self.column_index = torch.cat([self.column_index, torch.where(real, index, -1)], dim=1)  # [B, W + w]
        return self._attention_mask(torch.where(valid, index, -1), self.column_index)

    def _fed(self, width: int) -> None:
        pass


class StaticMtpLayerView(_MtpLayerFeed, StaticCacheView):
    """One MTP layer's KV cache on a static cache (fixed shapes: its steps can be captured with the target's).

    Every feed writes its slots at the shared write offset, as `StaticCacheView.forward` does; rollback, holes
    and compaction are `StaticCacheView`'s."""

    def __init__(
        self,
        mtp_model: PreTrainedModel,
        layer_idx: int,
        batch_size: int,
        pad_lengths: torch.Tensor,
        plan: StaticPlan,
    ):
        super().__init__(mtp_model, batch_size, pad_lengths, plan)
        self.layer_idx = layer_idx
        self.layer_type = self.layer_types[layer_idx] if self.layer_types is not None else None
        self.find_devices()

    def _claim_columns(
        self, index: torch.Tensor, valid: torch.Tensor, real: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The fed slots take the columns at the shared write offset (compacting first if they would not fit)."""
        return self.write_columns(index, valid, real)

    def _fed(self, width: int) -> None:
        self.advance(width)


class MTPProposer(Proposer):
    """Drafts k tokens per row with the target's n MTP layers (draft step j uses layer j mod n).

    Per step, MTP layer d first catches up on the committed tokens it has not seen (their previous hidden
    states come from the last verify, or from layer d-1 in an earlier step, kept in a small ring per layer),
    then drafts at the newest position, all in one forward per layer. Entries that only a cycling step
    (j >= n) wrote, or that hold a rejected draft, are rolled back after the verify; every kept entry is
    exactly what a step-by-step run of the MTP chain over the accepted tokens would hold.

    Args:
        target (`PreTrainedModel`): The model being decoded; its decoder's output feeds MTP layer 0.
        mtp_model (`MtpModel`): Its MTP layers (`MtpModel.from_pretrained(target)`, see `resolve_mtp_model`).
        num_speculative_tokens (`int`): The most drafts per row and step, k (any k >= 1; k > n cycles).
    """

    def __init__(self, target: PreTrainedModel, mtp_model: PreTrainedModel, num_speculative_tokens: int) -> None:
        self.target = target
        self.mtp_model = mtp_model
        self.head_device = module_device(mtp_model.shared_head)  # the target's head (its last device, if spread)
        self.num_layers = len(mtp_model.layers)
        self.num_speculative_tokens = num_speculative_tokens
        self.ring_size = num_speculative_tokens + self.num_layers + 4
        #: static caches: the tokens each layer's catch-up feeds per step, fixed (a catch-up covers what the last
        #: step committed, at most max(k, n) + 1 tokens; a wider backlog would only leave drafts less informed)
        self.catch_up_width = max(num_speculative_tokens, self.num_layers) + 2
        self.views: list[MtpLayerView | StaticMtpLayerView] = []
        #: [n, B, R + 1, H] ring d: previous hidden states for layer d (slot R takes the writes of unused slots)
        self.rings: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None  # [B] the batch's lengths as of the last commit
        self.fed_end: torch.Tensor | None = None  # [n, B] per layer: end of the entries fed in the first cycle
        self.proposed = False
        self.seen_prompt = False  # whether the target's prefill states were fed to the layers
        self._captured: torch.Tensor | None = None  # [B, w, H] the target decoder's latest output
        self._hook: Any = None

    #: on static caches a step feeds fixed widths and stores without host reads: it can be captured
    capturable = True

    @property
    def returns_probs(self) -> bool:  # type: ignore[override]
        return True

    # --- the target's hidden states ----------------------------------------------------------------

    def attach(self, target: PreTrainedModel) -> None:
        owner = threading.get_ident()

        def capture(module: torch.nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() != owner:  # another thread's call (or plain generate) on the shared model
                return
            hidden = getattr(output, "last_hidden_state", None)
            self._captured = hidden if hidden is not None else output[0]

        self.detach()
        self._hook = target.get_decoder().register_forward_hook(capture)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._captured = None

    def _take_captured(self, width: int | None = None) -> torch.Tensor:  # [B, w, H]
        """The target decoder's output of its latest forward (prefill or verify), consumed once."""
        hidden, self._captured = self._captured, None
        if hidden is None or (width is not None and hidden.shape[1] != width):
            raise RuntimeError(
                "MTPProposer did not see the target's latest forward: the loop must call attach(target) before the "
                "target's prefill, and nothing else may run the target between verify and commit."
            )
        return hidden

    # --- the loop's calls -----------------------------------------------------------------------------

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        n, size = self.num_layers, batch.batch_size
        hidden_size = self.mtp_model.config.hidden_size
        dtype = self.mtp_model.dtype
        if self.static is not None:
            self.views = [StaticMtpLayerView(self.mtp_model, d, size, batch.pad_lengths, self.static) for d in range(n)]
        else:
            self.views = [MtpLayerView(self.mtp_model, d, size, batch.pad_lengths) for d in range(n)]
        self.rings = torch.zeros(n, size, self.ring_size + 1, hidden_size, dtype=dtype, device=batch.device)
        self.lengths = batch.lengths.clone()
        self.fed_end = torch.zeros(n, size, dtype=torch.long, device=batch.device)
        self.seen_prompt = False

    def _feed_prompt(self, batch: RaggedBatch, prompt: torch.Tensor) -> torch.Tensor:  # [B, 1, H]
        """Feed every layer the prompt but its last token, from the target's prefill states `prompt` [B, P, H].

        Returns the last token's state, which step 0's commit stores like any verify's.
        """
        width = batch.prompt_width - 1
        previous = prompt[:, :width]  # [B, P-1, H] the target's hidden states at 0..P-2
        start = torch.zeros_like(batch.lengths)
        num = torch.full_like(batch.lengths, width)
        if width > 0:  # a one-token prompt leaves the layers nothing to feed
            for d, view in enumerate(self.views):
                self._store(d, start, num, previous)
                shifted = torch.nn.functional.pad(previous[:, :-1], (0, 0, 1, 0))  # [B, P-1, H] one index later
                previous = view.feed(batch.token_ids, start, num, shifted)  # [B, P-1, H]
                self.fed_end[d] = start + num
        self.seen_prompt = True
        return prompt[:, width:]

    def propose(
        self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling, width: int | None = None
    ) -> Proposal:
        assert self.rings is not None, "prefill() must run before propose()"
        # static caches: fixed shapes, k draft steps (rows with smaller budgets draft nothing past them)
        k = self.num_speculative_tokens if self.static is not None else widest(max_draft_tokens, width)
        if k == 0 or not self.seen_prompt:  # step 0: drafts need the target's state of the newest token
            return Proposal.empty(batch.batch_size, batch.device)
        self.proposed = True
        rows = torch.arange(batch.batch_size, device=batch.device)
        draft_ids = torch.full((batch.batch_size, k), -1, dtype=torch.long, device=batch.device)  # [B, k]
        draft_probs: list[torch.Tensor] = []
        anchor = batch.lengths  # [B] the newest token sits at anchor - 1
        carry = None  # [B, H] output of the previous draft step
        for j in range(max(k, self.num_layers)):
            d = j % self.num_layers
            drafting = max_draft_tokens > j  # [B]
            if j < self.num_layers:
                hidden, num = self._catch_up(batch, d, torch.where(drafting, anchor + j, anchor))
                carry = hidden[rows, (num - 1).clamp(min=0)]  # [B, H]
            else:
                carry = self.views[d].feed(batch.token_ids, anchor - 1 + j, drafting.long(), carry[:, None])[:, 0]
            if j >= k:
                continue
            head = self.mtp_model._project_to_logits(carry.to(self.head_device))  # [B, V] where the head computes
            logits = head.to(batch.device, torch.float32)  # [B, V]
            tokens, probs = _draw(sampling, batch, anchor + j, drafting, logits, j)
            draft_ids[:, j] = torch.where(drafting, tokens, -1)
            if probs is not None:
                draft_probs.append(probs)
            write_at = (anchor + j).clamp(max=batch.capacity - 1)
            batch.token_ids[rows, write_at] = torch.where(drafting, tokens, batch.token_ids[rows, write_at])
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, k, V]
        return Proposal(draft_token_ids=draft_ids, num_draft_tokens=max_draft_tokens.clone(), draft_probs=probs)

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        assert self.rings is not None and self.lengths is not None
        verified = self._take_captured()  # [B, w, H] the verify's hidden states at lengths-1 ..
        if not self.seen_prompt:  # step 0's verify was the prefill: [B, P, H]
            verified = self._feed_prompt(batch, verified)
        width = verified.shape[1]
        self._store(0, self.lengths - 1, torch.full_like(self.lengths, width), verified)
        if not self.proposed:  # no propose this step: catch up on the committed tokens now
            for d in range(self.num_layers):
                self._catch_up(batch, d, batch.lengths - 1)
        self.proposed = False
        for view, end in zip(self.views, self.fed_end):
            view.rollback(torch.minimum(batch.lengths - 1, end))
        self.lengths = batch.lengths.clone()

    def select_rows(self, keep: torch.Tensor) -> None:
        for view in self.views:
            view.select_rows(keep)
        if self.fed_end is not None:
            self.fed_end = self.fed_end[:, keep]
        if self.rings is not None:
            self.rings = self.rings[:, keep]
        if self.lengths is not None:
            self.lengths = self.lengths[keep]

    # --- helpers ---------------------------------------------------------------------------------------

    def _catch_up(self, batch: RaggedBatch, d: int, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed layer d its tokens [cached, end) per row; returns its outputs [B, w, H] and the counts [B]."""
        assert self.rings is not None
        view = self.views[d]
        start = view.cached_lengths
        num = (end - start).clamp(min=0)  # [B]
        if self.static is not None:  # a fixed width: no host read
            width = self.catch_up_width
            num = num.clamp(max=width)
        else:
            width = int(num.max().item())
        self.fed_end[d] = torch.maximum(start, end)
        if width == 0:
            return self.rings.new_zeros(start.shape[0], 1, self.rings.shape[-1]), num
        positions = start[:, None] - 1 + torch.arange(width, device=start.device)  # [B, w] of the previous states
        slots = (positions % self.ring_size)[:, :, None].expand(-1, -1, self.rings.shape[-1])  # [B, w, H]
        previous = self.rings[d].gather(1, slots) * (positions >= 0)[:, :, None]  # [B, w, H]
        hidden = view.feed(batch.token_ids, start, num, previous)  # [B, w, H]
        if d + 1 < self.num_layers:
            self._store(d + 1, start, num, hidden)
        return hidden, num

    def _store(self, d: int, start: torch.Tensor, num: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep hidden[i, m] ([B, w, H], the state at index start[i] + m, m < num[i]) in ring d."""
        assert self.rings is not None
        hidden = hidden.to(self.rings.device)  # the target's last layer may sit on another device than the batch
        offsets = torch.arange(hidden.shape[1], device=hidden.device)
        valid = (offsets < num[:, None]) & (offsets >= num[:, None] - self.ring_size)  # [B, w]
        # Distinct ring slots for the kept states (at most R of them); the others all go to the spare slot R.
        slots = torch.where(valid, (start[:, None] + offsets) % self.ring_size, self.ring_size)  # [B, w]
        index = slots[:, :, None].expand(-1, -1, self.rings.shape[-1])  # [B, w, H]
        self.rings[d].scatter_(1, index, hidden.to(self.rings.dtype))


def _draw(
    sampling: StepSampling,
    batch: RaggedBatch,
    prefix_lengths: torch.Tensor,  # [B] tokens before the drafted one
    drafting: torch.Tensor,  # [B] bool
    logits: torch.Tensor,  # [B, V] float32
    position: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [B], probs [B, V] or None
    """One draft token per row: the argmax, or a sample from the processed distribution q (returned)."""
    scores = sampling.process(batch.token_ids, prefix_lengths[:, None], drafting[:, None], logits[:, None])[:, 0]
    if not sampling.do_sample:
        return scores.argmax(dim=-1), None
    probs = torch.softmax(scores, dim=-1)  # [B, V]
    race = sampling_exponentials(sampling, position, probs.shape[-1])  # [B, V]
    return (probs / race).argmax(dim=-1), probs


@register("mtp")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> MTPProposer:
    """`method="mtp"`: the target's multi-token-prediction layers (its own, or `spec.mtp_model`)."""
    return MTPProposer(target, resolve_mtp_model(target, spec.mtp_model), spec.max_speculative_tokens)
