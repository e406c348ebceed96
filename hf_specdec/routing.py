"""`install()` / `uninstall()`: the opt-in hook that routes transformers' own speculation arguments to hf_specdec.

`install()` wraps `GenerationMixin.generate` so that `spec_decoder=`, `assistant_model=`, `prompt_lookup_num_tokens=`,
`use_mtp=`, `assistant_early_exit=` (and `assistant_model=` with a Gemma 4 assistant, an EAGLE-3 head from
`load_draft_head`, or with `speculation_type="dflash"`) run through `hf_specdec.generate` (with `streamer`, `tokenizer` and `stop_strings` forwarded, which
transformers does not pass to custom decoders); every other call is left exactly as it is. `uninstall()` puts the
original back. It also routes `spec_decoder=` through transformers' continuous batching (`generate_batch`,
`init_continuous_batching`, `continuous_batching_context_manager`) and paged `generate`
(`hf_specdec.continuous_batching`).
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import GenerationConfig, GenerationMixin, PreTrainedModel

from hf_specdec.call_checks import check_speculation_type
from hf_specdec.config import MAX_SPECULATIVE_TOKENS, SpecDecoder
from hf_specdec.generation import generate
from hf_specdec.proposers.eagle3_head import is_eagle3_head
from hf_specdec.proposers.gemma4_assistant import is_gemma4_assistant

_original_generate = None


def install() -> None:
    """Route `model.generate(spec_decoder=...)`, `assistant_model=`, `prompt_lookup_num_tokens=`, `use_mtp=` here.

    Idempotent. Other calls of `generate` are left exactly as they are; `uninstall()` restores the original.
    """
    global _original_generate
    if _original_generate is not None:
        return
    _original_generate = GenerationMixin.generate
    GenerationMixin.generate = _routed_generate(_original_generate)
    _continuous_batching_entry().install_cb()


def uninstall() -> None:
    """Undo `install()`: `GenerationMixin.generate` is the original function again."""
    global _original_generate
    if _original_generate is None:
        return
    GenerationMixin.generate = _original_generate
    _original_generate = None
    _continuous_batching_entry().uninstall_cb()


def _continuous_batching_entry():  # noqa: ANN202 (a module)
    """`hf_specdec.continuous_batching.entry`, imported when routing is installed (it imports transformers' CB)."""
    import importlib

    return importlib.import_module("hf_specdec.continuous_batching.entry")


def is_installed() -> bool:
    return _original_generate is not None


def _routed_generate(original):  # noqa: ANN001, ANN202
    @functools.wraps(original)
    def generate_with_speculation(self, *args: Any, **kwargs: Any):  # noqa: ANN001, ANN202
        if kwargs.get("custom_generate") is generate and kwargs.get("cache_implementation") == "paged":
            # transformers takes its paged route before calling a custom decoder: continuous batching here too
            kwargs.pop("custom_generate")
            spec = kwargs.pop("spec_decoder", None) or SpecDecoder()
            inputs = args[0] if args else kwargs.pop("inputs", None)
            return _continuous_batching_entry().paged_generate(self, inputs, kwargs, spec)
        if kwargs.get("custom_generate") is not None:  # the caller chose its decoder: leave the call as it is,
            if kwargs["custom_generate"] is generate and kwargs.get("spec_streamer") is None:
                # but for ours, stream into streamer= (transformers would not pass it on)
                kwargs["spec_streamer"] = kwargs.pop("streamer", None)
            return original(self, *args, **kwargs)
        spec = _spec_from_kwargs(self, kwargs)
        if spec is None:
            return original(self, *args, **kwargs)
        if kwargs.get("cache_implementation") == "paged":  # transformers' paged route: continuous batching
            inputs = args[0] if args else kwargs.pop("inputs", None)
            return _continuous_batching_entry().paged_generate(self, inputs, kwargs, spec)
        kwargs.update(
            custom_generate=generate,
            spec_decoder=spec,
            spec_streamer=kwargs.pop("streamer", None),
            spec_tokenizer=kwargs.pop("tokenizer", None),
            spec_stop_strings=kwargs.pop("stop_strings", None),
        )
        return original(self, *args, **kwargs)

    generate_with_speculation.__hf_specdec__ = True
    return generate_with_speculation


def _spec_from_kwargs(model: PreTrainedModel, kwargs: dict[str, Any]) -> SpecDecoder | None:
    """The SpecDecoder a routed call asks for (popping the kwargs stock generate would act on), or None."""
    spec = kwargs.pop("spec_decoder", None)
    config = kwargs.get("generation_config") or model.generation_config
    assistant = kwargs.pop("assistant_model", None)
    lookup = kwargs.pop("prompt_lookup_num_tokens", None)
    if lookup is None:
        lookup = getattr(config, "prompt_lookup_num_tokens", None)
    if lookup is not None and (isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 1):
        # Stock transformers refuses it too ("Invalid max_matching_ngram_size or num_output_tokens").
        raise ValueError(
            f"prompt_lookup_num_tokens={lookup!r} is invalid: it is the number of draft tokens prompt lookup proposes "
            "per step and must be an int >= 1 (typical values: 3-10); leave it out to decode without prompt lookup."
        )
    use_mtp = kwargs.pop("use_mtp", None) or getattr(config, "use_mtp", None)
    early_exit = kwargs.pop("assistant_early_exit", None)
    early_exit = early_exit if early_exit is not None else getattr(config, "assistant_early_exit", None)
    if kwargs.get("assistant_tokenizer") is not None and kwargs.get("tokenizer") is None:
        raise ValueError(
            "assistant_tokenizer= was passed without tokenizer=: a draft with another tokenizer needs the target's "
            "tokenizer too (tokenizer=...), as in transformers."
        )
    speculation_type = kwargs.get("speculation_type") or getattr(config, "speculation_type", None)
    check_speculation_type(speculation_type)
    if spec is not None:
        if assistant is not None or lookup or use_mtp or early_exit is not None:
            raise ValueError(
                "Pass either spec_decoder= or assistant_model=/prompt_lookup_num_tokens=/use_mtp=/"
                "assistant_early_exit=, not both."
            )
        return spec
    if early_exit is not None:  # HF's precedence: early exit first, drafting with the target itself
        return SpecDecoder(
            method="early_exit", early_exit_layers=early_exit, **_assistant_schedule(kwargs, config, model)
        )
    if use_mtp:
        # HF drafts one token per MTP layer; num_assistant_tokens= asks for more (the layers then cycle), with HF's
        # meaning (a constant k). Without it the adaptive schedule picks 0..layers drafts per step.
        from hf_specdec.proposers.mtp import check_mtp_target

        k = _check_positive("num_assistant_tokens", kwargs.pop("num_assistant_tokens", None))
        schedule = "adaptive" if k is None else "constant"
        k = min(k or int(check_mtp_target(model)), MAX_SPECULATIVE_TOKENS)
        return SpecDecoder(method="mtp", num_speculative_tokens=k, num_speculative_tokens_schedule=schedule)
    if speculation_type == "dflash" or (assistant is not None and is_gemma4_assistant(assistant)):
        return _drafter_spec(kwargs, config, assistant, speculation_type)
    if assistant is not None and is_eagle3_head(assistant):  # hf_specdec's own: an EAGLE-3 head from load_draft_head
        if kwargs.get("assistant_confidence_threshold"):
            raise ValueError(
                f"assistant_confidence_threshold={kwargs['assistant_confidence_threshold']!r} does not apply to an "
                "EAGLE-3 head (its drafts are not cut by confidence): drop it."
            )
        kwargs.pop("assistant_confidence_threshold", None)
        schedule = _assistant_schedule(kwargs, config, assistant)
        schedule.pop("draft_confidence_threshold", None)
        return SpecDecoder(method="eagle3", draft_head=assistant, **schedule)
    if assistant is not None:
        # HF's universal assisted generation: another tokenizer when both tokenizers are given (drafts go through
        # text; no confidence threshold, as the draft's probabilities are over another vocabulary).
        draft_tokenizer = kwargs.pop("assistant_tokenizer", None) if kwargs.get("tokenizer") is not None else None
        schedule = _assistant_schedule(kwargs, config, assistant)
        if draft_tokenizer is not None:
            schedule["draft_confidence_threshold"] = None
        return SpecDecoder(draft_model=assistant, draft_tokenizer=draft_tokenizer, **schedule)
    if lookup:
        max_n = kwargs.pop("max_matching_ngram_size", None)
        max_n = _check_positive(
            "max_matching_ngram_size", max_n if max_n is not None else getattr(config, "max_matching_ngram_size", None)
        )
        # HF's prompt lookup has no schedule: k = prompt_lookup_num_tokens every step. Here it is the most drafts the
        # adaptive schedule may give a row, unless the caller names a schedule (num_assistant_tokens_schedule=).
        named = kwargs.pop("num_assistant_tokens_schedule", None) or getattr(
            config, "num_assistant_tokens_schedule", None
        )
        return SpecDecoder(
            method="ngram",
            num_speculative_tokens=min(lookup, MAX_SPECULATIVE_TOKENS),
            prompt_lookup_max=max_n or 2,
            num_speculative_tokens_schedule=named or "adaptive",
        )
    return None


def _drafter_spec(
    kwargs: dict[str, Any], config: GenerationConfig, assistant: PreTrainedModel | None, speculation_type: Any
) -> SpecDecoder:
    """HF's two drafters fed by the target's own states: a Gemma 4 assistant (`assistant_model=`, transformers'
    `SinglePositionMultiTokenCandidateGenerator`) and DFlash (`speculation_type="dflash"` with `assistant_model=`,
    its `DFlashTokenCandidateGenerator`). HF checks the Gemma 4 assistant first; neither reads a confidence threshold."""
    if assistant is None:
        raise ValueError(
            "speculation_type='dflash' needs the DFlash drafter as assistant_model=: "
            "model.generate(..., assistant_model=drafter, speculation_type='dflash')."
        )
    if kwargs.get("assistant_confidence_threshold"):
        raise ValueError(
            f"assistant_confidence_threshold={kwargs['assistant_confidence_threshold']!r} does not apply to a "
            f"{type(assistant).__name__} (transformers' own route ignores it too): drop it."
        )
    kwargs.pop("assistant_confidence_threshold", None)
    if is_gemma4_assistant(assistant):
        schedule = _assistant_schedule(kwargs, config, assistant)
        schedule.pop("draft_confidence_threshold", None)
        return SpecDecoder(method="gemma4_assistant", draft_model=assistant, **schedule)
    # DFlash drafts a block of block_size - 1 tokens every step (no schedule in HF): here k <= block_size - 1,
    # num_assistant_tokens= asking for fewer.
    from hf_specdec.proposers.dflash import check_dflash_drafter

    block = check_dflash_drafter(assistant) - 1
    k = _check_positive("num_assistant_tokens", kwargs.pop("num_assistant_tokens", None))
    for name in ("num_assistant_tokens_schedule", "speculation_type"):
        kwargs.pop(name, None)
    k = min(k or block, block, MAX_SPECULATIVE_TOKENS)
    return SpecDecoder(
        method="dflash", draft_model=assistant, num_speculative_tokens=k, num_speculative_tokens_schedule="constant"
    )


def _check_positive(name: str, value: Any) -> int | None:
    """`value` as an int >= 1, or None when not given; anything else is refused as stock transformers refuses it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name}={value!r} is invalid: it must be an int >= 1 (it is a number of draft tokens or an n-gram size); "
            f"leave it out to use the default."
        )
    return value


def _assistant_schedule(kwargs: dict[str, Any], config: GenerationConfig, assistant: PreTrainedModel) -> dict[str, Any]:
    """The SpecDecoder schedule settings for HF's assistant knobs (`num_assistant_tokens`, its schedule and the
    confidence threshold), popped from the call's kwargs.

    When the caller set none of them (in the call, the target's generation_config or the assistant's), the adaptive
    schedule with `SpecDecoder`'s default k: it speculates only where that pays. When any is set, HF's meaning:
    each knob resolved as HF resolves it, with HF's defaults for the others (k = 20, constant, threshold 0.4).
    """
    knobs: dict[str, Any] = {}
    for name in HF_ASSISTANT_DEFAULTS:
        value = kwargs.pop(name, None)
        for source in (config, getattr(assistant, "generation_config", None)):
            if value is None:
                value = getattr(source, name, None)
        knobs[name] = value
    if all(value is None for value in knobs.values()):
        return {"num_speculative_tokens_schedule": "adaptive"}
    knobs = {name: HF_ASSISTANT_DEFAULTS[name] if value is None else value for name, value in knobs.items()}
    k = _check_positive("num_assistant_tokens", knobs["num_assistant_tokens"])
    return {
        "num_speculative_tokens": min(k, MAX_SPECULATIVE_TOKENS),
        "num_speculative_tokens_schedule": knobs["num_assistant_tokens_schedule"],
        "draft_confidence_threshold": float(knobs["assistant_confidence_threshold"]) or None,
    }


#: HF's assistant knobs and transformers' defaults for them (`GenerationConfig._get_default_generation_params`).
HF_ASSISTANT_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}
