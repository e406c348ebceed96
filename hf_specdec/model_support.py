"""Which models hf_specdec can run exactly: checked on the model's cache and layer kinds before any model work.

Speculation rolls rejected positions back and reads holes through explicit 4-D masks, which is exact only for
plain attention KV caches (full, sliding-window and chunked attention: masks built from the column map) and for
transformers' `linear_attention` cache layers (gated delta-net, Mamba2 and KDA hybrids: `hf_specdec.recurrent`).
A model whose state is recurrent outside a transformers Cache (RWKV, Mamba, xLSTM, recurrent Gemma) is refused
up front. The check reads what transformers itself would build for the model (the cache
layer types of `DynamicCache(config=...)`), not a list of model names: `SUPPORTED_LAYER_TYPES` is the one
allow-set to extend when `hf_specdec.cache` learns a new layer kind.

ALiBi models: BLOOM and Falcon with `alibi=True` compute each key's bias from the cumulative sum of the 2-D attention
mask (`alibi_from_mask`), so a 2-D mask with zeros at the holes gives every key the position plain decoding gives
it; MPT computes its bias from the cache column index, which equals the key's position only where the cache has no
holes (one row without left padding on the dynamic cache, where rollback only crops): other calls are refused
(`check_alibi_call`).
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel, cache_utils

from hf_specdec import compat

#: Cache layer types (transformers' `layer_types` names) whose rollback and masks `hf_specdec.cache` implements
#: (`linear_attention`: the recurrent layers of hybrids, rolled back by `hf_specdec.recurrent`; "dummy": a layer that
#: keeps no cache, as Gemma 4's KV-shared layers reuse an earlier layer's keys: nothing to roll back).
SUPPORTED_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "linear_attention", "dummy"}
)

#: The attention implementations that take the explicit 4-D masks with holes this package builds.
SUPPORTED_ATTENTION = ("sdpa", "eager")


#: ALiBi models whose key bias is `slope * (cumsum(mask) - 1)` of the 2-D attention mask (`build_alibi_tensor` in
#: modeling_bloom / modeling_falcon): exact over the column map with holes. Falcon only with `config.alibi=True`.
ALIBI_FROM_MASK = frozenset({"bloom", "falcon"})

#: ALiBi models whose key bias comes from the cache column index (`build_mpt_alibi_tensor`): holes would shift it.
ALIBI_FROM_COLUMNS = frozenset({"mpt"})


def _model_type(model: PreTrainedModel) -> str:
    return getattr(model.config.get_text_config(decoder=True), "model_type", "")


def alibi_from_mask(model: PreTrainedModel) -> bool:
    """Whether `model` takes its ALiBi key positions from the 2-D attention mask (then `CacheView` passes one)."""
    model_type = _model_type(model)
    config = model.config.get_text_config(decoder=True)
    return model_type in ALIBI_FROM_MASK and (model_type != "falcon" or bool(getattr(config, "alibi", False)))


def alibi_from_columns(model: PreTrainedModel) -> bool:
    """Whether `model`'s ALiBi bias follows the cache column index (MPT): exact only without holes."""
    return _model_type(model) in ALIBI_FROM_COLUMNS


def check_alibi_call(model: PreTrainedModel, role: str, batch_size: int, padded: bool, static: bool) -> None:
    """Refuse, before any model work, a call in which `model`'s ALiBi bias (from cache columns) would leave plain
    decoding's: a column is the key's position only for one row without left padding on the dynamic cache (its
    `CacheView` is aligned: rollback crops, no hole is ever made)."""
    if not alibi_from_columns(model):
        return
    problems = [f"a batch of {batch_size} rows"] if batch_size > 1 else []
    problems += ["left padding"] if padded else []
    problems += ['cache_implementation="static"'] if static else []
    if problems:
        raise NotImplementedError(
            f"The {role} model {type(model).__name__} ({_model_type(model)!r}) computes its ALiBi bias from the cache "
            "column index, which is each token's position only for a single row without padding on the dynamic cache "
            "(hf_specdec's ragged cache otherwise leaves holes between columns, and the bias would differ from plain "
            f"decoding), but this call has {' and '.join(problems)}: speculate on one unpadded prompt per call with "
            "the dynamic cache, use an ALiBi model that takes its positions from the attention mask (BLOOM, Falcon "
            "with alibi=True), or generate without speculation."
        )


def model_layer_types(model: PreTrainedModel) -> list[str]:
    """The cache layer type of each decoder layer, as transformers infers it for `DynamicCache(config=...)`."""
    config = model.config.get_text_config(decoder=True)
    infer = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    if infer is not None:
        try:
            return list(infer(config)[0])
        except (AttributeError, TypeError, ValueError, KeyError):
            pass  # configs this transformers helper cannot read: fall back to the config's own field
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"]
    return ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"]


def check_supported_cache(model: PreTrainedModel, role: str = "target", needs_positions: bool = True) -> None:
    """Raise a clear error, before any model work, if `model`'s cache is not one hf_specdec rolls back exactly.

    `needs_positions=False` for the drafts of encoder-decoder targets: `hf_specdec.seq2seq` sets their positions
    itself (a hook on the decoder's position table), for decoders whose forward takes no `position_ids`."""
    name = type(model).__name__
    if model.config.is_encoder_decoder:
        return  # encoder-decoder targets are checked (and refused or routed) by the generate entry
    parameters = dict(inspect.signature(model.forward).parameters)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        # A subclass that forwards **kwargs (a wrapper around a real causal LM) takes what its base class takes.
        for base in type(model).__mro__[1:]:
            forward = base.__dict__.get("forward")
            if forward is not None:
                parameters.update(inspect.signature(forward).parameters)
    supports_cache = getattr(type(model), "_supports_default_dynamic_cache", lambda: True)()
    if compat.cache_parameter(parameters) is None or not supports_cache:
        raise NotImplementedError(
            f"The {role} model {name} keeps its own recurrent or custom state instead of a transformers Cache of "
            "attention keys and values, which speculative decoding cannot roll back exactly in hf_specdec: "
            "generate without speculation for this model."
        )
    needed_inputs = ("position_ids", "attention_mask") if needs_positions else ()
    if alibi_from_mask(model) or alibi_from_columns(model):  # no position embeddings: ALiBi from mask or columns
        needed_inputs = ("attention_mask",)
    for needed in needed_inputs:
        if needed not in parameters:
            raise NotImplementedError(
                f"The {role} model {name} does not take `{needed}`, which hf_specdec passes explicitly to keep "
                "positions and masks exact over a ragged batch: generate without speculation for this model."
            )
    bidirectional = bidirectional_attention(model)
    if bidirectional:
        raise ValueError(
            f"The {role} model {name} attends bidirectionally ({', '.join(bidirectional)} with is_causal=False, "
            "config.is_decoder=False): every token sees later ones, so its outputs change as text is appended and "
            "speculative decoding cannot reproduce plain generate. Load it as a decoder: "
            f"{name}.from_pretrained(..., is_decoder=True)."
        )
    unsupported = sorted(set(model_layer_types(model)) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise NotImplementedError(
            f"The {role} model {name} has cache layer types {unsupported}, which hf_specdec cannot roll back "
            f"exactly yet (supported: {sorted(SUPPORTED_LAYER_TYPES)}): generate without speculation for this model."
        )


def bidirectional_attention(model: PreTrainedModel) -> list[str]:
    """The self-attention classes of a decoder-only model that attend both ways: BERT-style models loaded without
    `is_decoder=True`. Cross-attention modules (`encoder_attn`, `crossattention`: a Whisper or BART decoder's) are
    non-causal by nature and not counted."""
    if getattr(model.config, "is_decoder", False):
        return []
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        decoder = model
    modules = (decoder if isinstance(decoder, torch.nn.Module) else model).named_modules()
    return sorted(
        {
            type(m).__name__
            for name, m in modules
            if getattr(m, "is_causal", None) is False
            and hasattr(m, "layer_idx")
            and not any(cross in name for cross in ("encoder_attn", "cross"))  # a decoder's cross-attention
        }
    )


def check_attention_implementation(model: PreTrainedModel) -> None:
    """Raise if the model's attention cannot take the explicit 4-D masks this package builds.

    Every `CacheView` checks this; which models are supported at all (`check_supported_cache`) is checked once per
    call by the generate entry, for the target and the draft (MTP layers are checked with their target)."""
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"hf_specdec needs attn_implementation 'sdpa' or 'eager' (it passes explicit 4-D masks with holes), "
            f"but {type(model).__name__} uses {impl!r}: load it with attn_implementation='sdpa'."
        )


def capture_hint(models: list[PreTrainedModel]) -> str:
    """What the user can change when a step of these models cannot be captured as a CUDA graph ("" if nothing known).

    transformers' "eager" experts implementation routes tokens to experts with host reads (`nonzero` per expert),
    which CUDA graphs refuse; its "grouped_mm" and "batched_mm" implementations compute the same experts on the
    device — but torch's grouped_mm outside bfloat16 (measured: float32 on an H100, torch 2.11) copies between host
    and device, which a capture refuses too, so such models are pointed at "batched_mm"."""

    def named(implementation: str, bf16_ok: bool = False) -> str:
        return ", ".join(sorted({
            type(m).__name__ for m in models
            if compat.experts_implementation(m) == implementation
            and not (bf16_ok and m.dtype == torch.bfloat16)
        }))  # fmt: skip

    hint = ""
    if eager := named("eager"):
        hint += (
            f" {eager} routes tokens to its experts with host reads (experts_implementation='eager'): load it "
            "with experts_implementation='grouped_mm' (or 'batched_mm', or call model.set_experts_implementation(...)) "
            "to capture its steps."
        )
    if grouped := named("grouped_mm", bf16_ok=True):
        hint += (
            f" {grouped} computes its experts with torch's grouped_mm outside bfloat16, which copies between host and "
            "device: run it in bfloat16, or call model.set_experts_implementation('batched_mm') to capture its steps."
        )
    return hint
