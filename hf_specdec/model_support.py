"""Which models hf_specdec can run exactly: checked on the model's cache and layer kinds before any model work.

Speculation rolls rejected positions back and reads holes through explicit 4-D masks, which is exact only for
plain attention KV caches (full, sliding-window and chunked attention: masks built from the column map). A model
whose state is recurrent (RWKV, Mamba, xLSTM, recurrent Gemma, linear attention, gated delta-net hybrids) is
refused up front. The check reads what transformers itself would build for the model (the cache
layer types of `DynamicCache(config=...)`), not a list of model names: `SUPPORTED_LAYER_TYPES` is the one
allow-set to extend when `hf_specdec.cache` learns a new layer kind.
"""

from __future__ import annotations

import inspect

from transformers import PreTrainedModel, cache_utils

#: Cache layer types (transformers' `layer_types` names) whose rollback and masks `hf_specdec.cache` implements.
#: "dummy": a layer that keeps no cache (Gemma 4's KV-shared layers reuse an earlier layer's keys): nothing to roll back.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "dummy"})

#: The attention implementations that take the explicit 4-D masks with holes this package builds.
SUPPORTED_ATTENTION = ("sdpa", "eager")


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
    if "past_key_values" not in parameters or not supports_cache:
        raise NotImplementedError(
            f"The {role} model {name} keeps its own recurrent or custom state instead of a transformers Cache of "
            "attention keys and values, which speculative decoding cannot roll back exactly in hf_specdec: "
            "generate without speculation for this model."
        )
    for needed in ("position_ids", "attention_mask") if needs_positions else ():
        if needed not in parameters:
            raise NotImplementedError(
                f"The {role} model {name} does not take `{needed}`, which hf_specdec passes explicitly to keep "
                "positions and masks exact over a ragged batch: generate without speculation for this model."
            )
    unsupported = sorted(set(model_layer_types(model)) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise NotImplementedError(
            f"The {role} model {name} has cache layer types {unsupported}, which hf_specdec cannot roll back "
            f"exactly yet (supported: {sorted(SUPPORTED_LAYER_TYPES)}): generate without speculation for this model."
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
