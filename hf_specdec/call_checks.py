"""The checks of a `generate` call's own settings: the SpecDecoder, generate's arguments, ALiBi, speculation_type.

Each refuses, with an error that says what to pass instead, a call that hf_specdec would not run exactly like plain
`generate`. What a check needs to know about a model, a cache or a proposer stays in that module
(`model_support`, `recurrent`, `seq2seq`, the proposers); `hf_specdec.plan.CallPlan.build` calls all of them, in
one order, before any model work.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from hf_specdec import compat
from hf_specdec.config import MAX_SPECULATIVE_TOKENS, SpecDecoder
from hf_specdec.model_support import check_alibi_call

#: model_kwargs that `generate` prepares and this package handles itself.
HANDLED_MODEL_KWARGS = {
    "attention_mask",
    "position_ids",
    *compat.CACHE_NAMES,  # `past_key_values`, `cache` from transformers 5.24
    "use_cache",
    "logits_to_keep",
    "encoder_outputs",  # encoder-decoder targets: generate ran the encoder (`hf_specdec.seq2seq`)
}


def check_spec_decoder(spec_decoder: Any) -> SpecDecoder:
    """The call's `SpecDecoder`, or an error that says how to pass one."""
    if spec_decoder is None:
        raise ValueError(
            "hf_specdec.generate needs a spec_decoder: model.generate(..., custom_generate=hf_specdec.generate, "
            "spec_decoder=hf_specdec.SpecDecoder(method='ngram', num_speculative_tokens=5))."
        )
    if not isinstance(spec_decoder, SpecDecoder):
        raise TypeError(
            f"spec_decoder must be a hf_specdec.SpecDecoder, got {type(spec_decoder).__name__}: build one with "
            "hf_specdec.SpecDecoder(draft_model=...) or hf_specdec.SpecDecoder(method='ngram')."
        )
    return spec_decoder


def check_alibi_columns(
    model: PreTrainedModel, spec: SpecDecoder, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict
) -> None:
    """MPT-style ALiBi (bias from cache columns) is exact only for one unpadded row on the dynamic cache."""
    mask = None if model.config.is_encoder_decoder else model_kwargs.get("attention_mask")  # [B, P] decoder mask
    padded = mask is not None and not bool(mask.all())
    static = config.cache_implementation == "static"
    for role, checked in (("target", model), ("draft", spec.draft_model)):
        if checked is not None:
            check_alibi_call(checked, role, input_ids.shape[0], padded, static)


def check_call(
    model: PreTrainedModel, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict[str, Any]
) -> None:
    """Raise a clear error for every generate setting this package does not support."""
    text = model.config.get_text_config()
    floor_scale = getattr(text, "floor_scale", None) if getattr(text, "attn_temperature_tuning", False) else None
    if floor_scale and 2 * config.max_length + MAX_SPECULATIVE_TOKENS >= floor_scale:
        # Llama 4's NoPE layers scale queries by the count of cached columns once it reaches floor_scale - 1; the
        # ragged cache's count (holes included, up to about twice the row before compaction) is not plain's.
        raise NotImplementedError(
            f"{type(model).__name__} scales attention by cache length past {floor_scale} columns "
            f"(attn_temperature_tuning), which hf_specdec reproduces exactly only for max_length below "
            f"{(floor_scale - MAX_SPECULATIVE_TOKENS) // 2} (got {config.max_length}): lower max_new_tokens, or "
            "generate without speculation."
        )
    if config.num_beams is not None and config.num_beams > 1:
        raise ValueError(
            f"Speculative decoding does not combine with beam search (num_beams={config.num_beams}): pass num_beams=1."
        )
    if config.use_cache is False or model_kwargs.get("use_cache") is False:
        origin = "was passed"
        if getattr(model.generation_config, "use_cache", None) is False:  # e.g. MPT's config defaults to it
            origin = f"is {type(model).__name__}'s default (its generation_config sets it) unless you passed it"
        raise ValueError(
            f"Speculative decoding needs the KV cache, but use_cache=False {origin}: pass use_cache=True to generate."
        )
    if config.output_attentions or config.output_hidden_states:
        raise NotImplementedError(
            f"output_attentions={config.output_attentions} / output_hidden_states={config.output_hidden_states} "
            "were requested, which hf_specdec does not return (see docs/usage.md): drop them, and if you need them run "
            "one forward over the result, model(out.sequences, attention_mask=..., position_ids=..., "
            "output_hidden_states=True), which "
            "gives plain decoding's values for every token in one pass (output_scores / output_logits are supported)."
        )
    if config.cache_implementation not in (None, "dynamic", "static"):
        raise NotImplementedError(
            f"cache_implementation={config.cache_implementation!r} is not supported by hf_specdec: it runs on its own "
            "DynamicCache (the default) or StaticCache (cache_implementation='static', compiled on a GPU); pass one "
            "of those."
        )
    unknown = sorted(set(model_kwargs) - HANDLED_MODEL_KWARGS)
    if unknown:
        raise NotImplementedError(
            f"hf_specdec does not support the model inputs {unknown} yet (text-only decoder inputs are supported): "
            "generate without speculation for this call."
        )
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"hf_specdec needs non-empty input_ids of shape [B, L], got shape {tuple(input_ids.shape)}.")


def check_speculation_type(speculation_type: Any, spec: SpecDecoder | None = None) -> None:
    """Raise for transformers' `speculation_type` values that this call does not run (only "dflash", as
    `SpecDecoder(method="dflash")`)."""
    if speculation_type is None or (speculation_type == "dflash" and (spec is None or spec.method == "dflash")):
        return
    if speculation_type == "dflash":
        raise ValueError(
            f"speculation_type='dflash' was set but the SpecDecoder has method={spec.method!r}: pass "
            "SpecDecoder(method='dflash', draft_model=<the DFlash drafter>), or drop speculation_type."
        )
    raise NotImplementedError(
        f"speculation_type={speculation_type!r} is not supported by hf_specdec (it runs speculation_type='dflash' "
        "with a DFlash drafter as assistant_model): drop speculation_type, or call hf_specdec.uninstall() and use "
        "transformers' own assisted decoding."
    )
