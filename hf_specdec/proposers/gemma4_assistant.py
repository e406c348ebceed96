"""`Gemma4AssistantProposer`: drafts with a Gemma 4 assistant (`Gemma4AssistantForCausalLM`), batched and ragged.

This is transformers' `SinglePositionMultiTokenCandidateGenerator` (`generate(assistant_model=<a Gemma 4
assistant>)`), for any batch. The assistant keeps no cache of its own: every draft step is one query at the
position of the row's newest token, which cross-attends to the target's own keys and values (of the target's
last non-shared layer of each attention type, "full" and "sliding"), over the tokens before the newest one. Its
input is the target's embedding of the newest token next to the target's last hidden state at the token before
(the one that predicted it); later steps feed the drafted token and the assistant's own projected state, at the
same position. The keys, values and hidden state come from the verify the loop runs anyway (`VerifyCapture`). On
static caches `gemma4_assistant_static.StaticGemma4AssistantProposer` drafts k steps (capturable steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from hf_specdec import compat
from hf_specdec.batch import RaggedBatch
from hf_specdec.model_support import check_attention_implementation
from hf_specdec.placement import module_device, placement
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal, widest
from hf_specdec.proposers.mtp import _draw
from hf_specdec.proposers.target_states import TargetStateDrafter, VerifyCapture, allowed_keys
from hf_specdec.sampling.processors import StepSampling

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["Gemma4AssistantProposer", "check_gemma4_assistant", "is_gemma4_assistant"]

ASSISTANT_CLASS_PREFIXES = ("Gemma4Assistant", "Gemma4UnifiedAssistant")


def is_gemma4_assistant(model: object) -> bool:
    """Whether `model` is a Gemma 4 assistant (transformers routes those to its single-position generator)."""
    return type(model).__name__.startswith(ASSISTANT_CLASS_PREFIXES)


def kv_source_layers(target: PreTrainedModel) -> dict[str, int]:
    """Per attention type, the target's last layer that computes its own keys (the one Gemma 4 stores for sharing)."""
    config = target.config.get_text_config()
    layer_types = list(getattr(config, "layer_types", None) or [])
    first_shared = config.num_hidden_layers - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    return {
        kind: max(i for i in range(first_shared) if layer_types[i] == kind) for kind in set(layer_types[:first_shared])
    }


def check_gemma4_assistant(target: PreTrainedModel, assistant: PreTrainedModel) -> dict[str, int]:
    """Raise a clear error unless `assistant` can draft for `target`; return `kv_source_layers(target)`."""
    where = placement(target)
    if where.spread:
        raise NotImplementedError(
            f"A Gemma 4 assistant attends to the target's own keys and values in place, but this target computes on "
            f"several devices ({where.describe()}), which hf_specdec does not support for assistants yet: load the "
            "target on one GPU (offloading weights to the CPU or the disk works), or use method='draft' or prompt "
            "lookup."
        )
    if not is_gemma4_assistant(assistant):
        raise TypeError(
            "SpecDecoder(method='gemma4_assistant') needs a Gemma4AssistantForCausalLM or "
            f"Gemma4UnifiedAssistantForCausalLM as draft_model, got {type(assistant).__name__}: use method='draft' "
            "for a causal LM draft."
        )
    name = type(target).__name__
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    if not name.startswith("Gemma4") or decoder is None or not hasattr(decoder, "layers"):
        raise NotImplementedError(
            f"A Gemma 4 assistant drafts from a Gemma 4 target's keys and values, but the target is {name}: "
            "hf_specdec runs Gemma 4 assistants on Gemma 4 text targets (Gemma4ForCausalLM; Gemma 3n targets are "
            "not supported yet); use another draft for this target."
        )
    config = target.config.get_text_config()
    sources = kv_source_layers(target)
    needed = {"full_attention", "sliding_attention"}
    if set(sources) != needed:
        raise NotImplementedError(
            f"{name} has non-shared layer types {sorted(sources)}, but a Gemma 4 assistant reads the keys of one "
            f"'full_attention' and one 'sliding_attention' layer: use another draft for this target."
        )
    backbone = getattr(assistant.config, "backbone_hidden_size", None)
    if backbone != config.hidden_size:
        raise ValueError(
            f"The assistant was built for targets of hidden size {backbone} (backbone_hidden_size), but {name} has "
            f"hidden_size={config.hidden_size}: load the assistant checkpoint that belongs to this target."
        )
    draft_config = assistant.config.get_text_config()
    if draft_config.vocab_size != config.vocab_size:
        raise ValueError(
            f"The assistant's vocabulary ({draft_config.vocab_size}) differs from the target's ({config.vocab_size}): "
            "load the assistant checkpoint that belongs to this target."
        )
    for kind, layer_idx in sources.items():
        source = decoder.layers[layer_idx].self_attn
        heads = source.k_proj.out_features // source.head_dim
        drafts = [
            layer.self_attn for layer in assistant.model.layers if layer.self_attn.layer_type == kind
        ]  # the assistant's layers of that type attend to the source layer's keys
        for attn in drafts:
            draft_heads = draft_config.num_attention_heads // attn.num_key_value_groups
            if (attn.head_dim, draft_heads) != (source.head_dim, heads):
                raise ValueError(
                    f"The assistant's {kind} layers expect keys of {draft_heads} heads x {attn.head_dim}, but the "
                    f"target's layer {layer_idx} has {heads} x {source.head_dim}: load the assistant checkpoint that "
                    "belongs to this target."
                )
    check_attention_implementation(assistant)
    return sources


class Gemma4AssistantProposer(TargetStateDrafter):
    """Drafts up to k tokens per row with a Gemma 4 assistant reading the target's shared keys and values.

    Args:
        target (`PreTrainedModel`): The Gemma 4 model being decoded.
        assistant (`Gemma4AssistantForCausalLM`): Its assistant checkpoint.
        num_speculative_tokens (`int`): The most drafts per row and step, k.
    """

    def __init__(self, target: PreTrainedModel, assistant: PreTrainedModel, num_speculative_tokens: int) -> None:
        self.sources = check_gemma4_assistant(target, assistant)
        self.target = target
        self.assistant = assistant
        self.num_speculative_tokens = num_speculative_tokens
        self.sliding_window = int(target.config.get_text_config().sliding_window)
        self.eager = assistant.config.get_text_config()._attn_implementation == "eager"
        self.capture = VerifyCapture(target, cache_layers=list(self.sources.values()))
        self.seen_forwards = 0  # the target forwards read so far (the first is the prefill)
        # What the latest verify left, per row: the target's hidden state at the token before the newest one,
        # and its keys/values with the columns the newest token's query may see.
        self.hidden: torch.Tensor | None = None  # [B, H]
        self.shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # type -> keys, values [B, h, W, D]
        self.allowed: dict[str, torch.Tensor] = {}  # type -> [B, W] bool

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        self.hidden = None
        self.shared_kv, self.allowed = {}, {}
        self.seen_forwards = self.capture.count

    def propose(
        self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling, width: int | None = None
    ) -> Proposal:
        k = widest(max_draft_tokens, width)
        if k == 0 or self.hidden is None:  # step 0: the drafts need the prefill's states
            return Proposal.empty(batch.batch_size, batch.device)
        rows = torch.arange(batch.batch_size, device=batch.device)
        anchor = batch.lengths  # [B] the newest token sits at anchor - 1
        position_ids = (anchor - 1 - batch.pad_lengths)[:, None]  # [B, 1]
        masks = {kind: self._mask_format(allowed[:, None, None, :]) for kind, allowed in self.allowed.items()}
        embed = self.target.get_input_embeddings()
        token = batch.last_token_ids()  # [B]
        hidden = self.hidden[:, None]  # [B, 1, H]
        draft_ids = torch.full((batch.batch_size, k), -1, dtype=torch.long, device=batch.device)  # [B, k]
        draft_probs: list[torch.Tensor] = []
        for j in range(k):
            embedded = embed(token[:, None].to(module_device(embed))).to(hidden.device, hidden.dtype)  # [B, 1, H]
            inputs = torch.cat([embedded, hidden], dim=-1)  # [B, 1, 2H]
            logits, hidden = compat.gemma4_assistant_step(self.assistant, inputs, position_ids, masks, self.shared_kv)
            drafting = max_draft_tokens > j  # [B]
            token, probs = _draw(sampling, batch, anchor + j, drafting, logits[:, 0].float(), j)  # [B], [B, V]
            draft_ids[:, j] = torch.where(drafting, token, -1)
            if probs is not None:
                draft_probs.append(probs)
            write_at = (anchor + j).clamp(max=batch.capacity - 1)  # processors of later drafts read this one
            batch.token_ids[rows, write_at] = torch.where(drafting, token, batch.token_ids[rows, write_at])
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, k, V]
        return Proposal(draft_token_ids=draft_ids, num_draft_tokens=max_draft_tokens.clone(), draft_probs=probs)

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        """Keep what the verify computed at each row's last accepted token (the one before the newest)."""
        capture = self.capture
        if capture.count == self.seen_forwards or capture.last_hidden is None:
            raise RuntimeError(
                "Gemma4AssistantProposer did not see the target's latest forward: the loop must call attach(target) "
                "before the target's prefill."
            )
        prefill = self.hidden is None
        self.seen_forwards = capture.count
        # The last accepted token's slot, counted from the end of the fed slots: a verify fed [newest, drafts],
        # so slot num_accepted; the prefill (no drafts) fed the prompt, whose last slot it is.
        from_end = num_accepted - (1 if prefill else capture.width)  # [B] < 0
        rows = torch.arange(batch.batch_size, device=batch.device)
        hidden = capture.last_hidden  # [B, w', H]
        self.hidden = hidden[rows, hidden.shape[1] + from_end]  # [B, H]
        query = capture.width + from_end  # [B]
        self.shared_kv = {kind: capture.kv[idx] for kind, idx in self.sources.items()}
        width = self.shared_kv["full_attention"][0].shape[2]  # W
        mask = capture.attention_mask
        if isinstance(mask, dict):  # the keys the last accepted token saw in full attention: every real one
            full = allowed_keys(mask["full_attention"], query)  # [B, W]
        else:  # one row without holes (no explicit mask): column j holds token j
            columns = torch.arange(width, device=batch.device)[None]  # [1, W]
            full = columns < (batch.lengths - 1)[:, None]  # [B, W]
        # Sliding layers see the last window + 1 of those (transformers' assistant masks: distance <= window from
        # the newest token's perspective, over keys that end one before it). A row's real columns are in order.
        newer = full.flip(1).cumsum(1).flip(1)  # [B, W] real keys at or after each column
        self.allowed = {"full_attention": full, "sliding_attention": full & (newer <= self.sliding_window + 1)}

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.hidden is not None:
            self.hidden = self.hidden[keep]
        self.shared_kv = {kind: (k[keep], v[keep]) for kind, (k, v) in self.shared_kv.items()}
        self.allowed = {kind: allowed[keep] for kind, allowed in self.allowed.items()}

    def _mask_format(self, allowed: torch.Tensor) -> torch.Tensor:
        if not self.eager:
            return allowed
        blocked = torch.finfo(self.assistant.dtype).min
        return torch.zeros(allowed.shape, dtype=self.assistant.dtype, device=allowed.device).masked_fill(
            ~allowed, blocked
        )


@register("gemma4_assistant")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> Gemma4AssistantProposer:
    """`method="gemma4_assistant"`: a Gemma 4 assistant reading the target's keys and last hidden state (decoder-only targets)."""
    context.require_decoder_only(spec.method, target)
    return Gemma4AssistantProposer(target, spec.draft_model, spec.max_speculative_tokens)
