"""The `custom_generate` entry point, and `install()` / `uninstall()` of the opt-in generate hook.

`generate(model, input_ids, ...)` is called by transformers' own `generate` after it prepared the
inputs, logits processors and stopping criteria; it validates the call, builds the ragged batch
and the proposer, runs the speculative loop and returns what plain `generate` would return.
`install()` wraps `GenerationMixin.generate` so that `spec_decoder=`, `assistant_model=`,
`prompt_lookup_num_tokens=` and `use_mtp=` route here (with `streamer`, `tokenizer` and `stop_strings` forwarded,
which transformers does not pass to custom decoders); `uninstall()` puts the original back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_specdec.batch import RaggedBatch
from hf_specdec.config import MAX_SPECULATIVE_TOKENS, SpecDecoder
from hf_specdec.decoding import SpeculativeLoop
from hf_specdec.metrics import SpecDecodeStats
from hf_specdec.proposers.base import Proposer
from hf_specdec.proposers.top1 import Top1Proposer
from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.schedules import HeuristicSchedule, SpeculationSchedule
from hf_specdec.stopping import StopRules

#: model_kwargs that `generate` prepares and this package handles itself.
HANDLED_MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep"}


@dataclass
class SpecDecodeOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the call's speculative-decoding statistics."""

    spec_stats: SpecDecodeStats | None = None


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    spec_decoder: SpecDecoder | None = None,
    spec_streamer: Any = None,
    spec_tokenizer: Any = None,
    spec_stop_strings: str | list[str] | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | SpecDecodeOutput:
    """Speculative decoding as a `custom_generate` callable for `model.generate`.

    Use as `model.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec)`. transformers
    does not forward `streamer`, `tokenizer` or `stop_strings` to custom decoders, so pass them here as
    `spec_streamer=`, `spec_tokenizer=` and `spec_stop_strings=` (or set them on the `SpecDecoder`, or use
    `hf_specdec.install()`, which forwards the usual names).
    """
    spec = _check_spec_decoder(spec_decoder)
    _check_call(model, input_ids, generation_config, model_kwargs)
    streamer = spec_streamer if spec_streamer is not None else spec.streamer
    tokenizer = spec_tokenizer if spec_tokenizer is not None else spec.tokenizer
    if spec_stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                "stop strings need the tokenizer: pass spec_tokenizer=tokenizer (or SpecDecoder(tokenizer=...))."
            )
        stopping_criteria = StoppingCriteriaList(
            [*stopping_criteria, StopStringCriteria(tokenizer=tokenizer, stop_strings=spec_stop_strings)]
        )
    if streamer is not None:
        streamer.put(input_ids.cpu())

    batch = _ragged_batch(input_ids, model_kwargs.get("attention_mask"), generation_config.max_length, spec)
    seeds = row_seeds(spec.seed, batch.batch_size).to(batch.device)
    sampling = StepSampling(processors=logits_processor, do_sample=bool(generation_config.do_sample), seeds=seeds)
    pad = generation_config._pad_token_tensor
    stop_rules = StopRules(
        stopping_criteria,
        pad_token_id=int(pad.reshape(-1)[0]) if pad is not None else None,
        max_length=generation_config.max_length,
        batch_size=batch.batch_size,
    )
    loop = SpeculativeLoop(
        model=model,
        proposer=build_proposer(spec, model),
        batch=batch,
        sampling=sampling,
        stop_rules=stop_rules,
        num_speculative_tokens=spec.max_speculative_tokens,
        max_length=generation_config.max_length,
        streamer=streamer,
        output_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        output_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
    )
    result = loop.run()
    loop.proposer.finish()
    spec.last_stats = loop.stats
    if generation_config.return_dict_in_generate:
        return SpecDecodeOutput(
            sequences=result.sequences, scores=result.scores, logits=result.logits, spec_stats=loop.stats
        )
    return result.sequences


def build_proposer(spec: SpecDecoder, model: PreTrainedModel) -> Top1Proposer:
    """The proposer that `spec` describes, checked against the target model.

    It is always wrapped in a `Top1Proposer`, the one place where per-row draft budgets are decided (the draft's
    position limit, `max_draft_len`, the k schedule); its cost is a few [B] tensor ops per step.
    """
    k = spec.max_speculative_tokens
    inner: Proposer
    if spec.method == "draft":
        from hf_specdec.proposers.draft_model import DraftModelProposer, check_draft_model
        from hf_specdec.schedules import ConfidenceThreshold

        check_draft_model(model, spec.draft_model)
        threshold = spec.draft_confidence_threshold
        inner = DraftModelProposer(spec.draft_model, k, ConfidenceThreshold(threshold) if threshold else None)
    elif spec.method == "mtp":
        from hf_specdec.proposers.mtp import MTPProposer, resolve_mtp_model

        inner = MTPProposer(model, resolve_mtp_model(model, spec.mtp_model), k)
    else:
        from hf_specdec.proposers.ngram import NgramProposer

        inner = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    schedule = _build_schedule(spec, model, inner)
    return Top1Proposer(inner, max_draft_len=spec.max_draft_len, schedule=schedule)


def _build_schedule(spec: SpecDecoder, model: PreTrainedModel, inner: Proposer) -> SpeculationSchedule | None:
    schedule = spec.num_speculative_tokens_schedule
    if schedule == "adaptive":
        from hf_specdec.adaptive import AdaptiveSchedule

        key = {"draft": f"draft:{id(spec.draft_model)}", "mtp": "mtp"}.get(
            spec.method, f"ngram:{spec.prompt_lookup_min}-{spec.prompt_lookup_max}"
        )
        return AdaptiveSchedule(spec.num_speculative_tokens, model, key, propose_first=inner.proposes_cheaply)
    if schedule.startswith("heuristic"):

        def persist(k: int) -> None:  # HF's "heuristic" keeps the final k for the next call
            spec.num_speculative_tokens = k
            if spec.draft_model is not None:
                spec.draft_model.generation_config.num_assistant_tokens = k

        on_finish = persist if schedule == "heuristic" else None
        return HeuristicSchedule(spec.num_speculative_tokens, spec.max_speculative_tokens, on_finish)
    return None


def row_seeds(seed: int | list[int] | None, batch_size: int) -> torch.Tensor:  # [B] int64
    """The seed of each row: `seed + i` for an int, the list as given, or draws from torch's global generator."""
    if seed is None:
        return row_random.random_seeds(batch_size)
    if isinstance(seed, int):
        if seed + batch_size > 2**63:
            raise ValueError(
                f"SpecDecoder(seed={seed}) plus the row index overflows int64 for {batch_size} rows: use a smaller seed."
            )
        return seed + torch.arange(batch_size)
    if len(seed) != batch_size:
        raise ValueError(
            f"SpecDecoder(seed=[...]) gives {len(seed)} per-row seeds but the batch has {batch_size} rows "
            "(num_return_sequences included): pass one seed per row, or a single int (row i then uses seed + i)."
        )
    return torch.tensor(seed, dtype=torch.long)


def _check_spec_decoder(spec_decoder: Any) -> SpecDecoder:
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


def _check_call(
    model: PreTrainedModel, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict[str, Any]
) -> None:
    """Raise a clear error for every generate setting this package does not support."""
    if model.config.is_encoder_decoder:
        raise NotImplementedError(
            f"{type(model).__name__} is an encoder-decoder model; hf_specdec supports decoder-only targets for now. "
            "Call generate without spec_decoder/custom_generate for this model."
        )
    if config.num_beams is not None and config.num_beams > 1:
        raise ValueError(
            f"Speculative decoding does not combine with beam search (num_beams={config.num_beams}): pass num_beams=1."
        )
    if config.use_cache is False or model_kwargs.get("use_cache") is False:
        raise ValueError("Speculative decoding needs the KV cache (use_cache=False was passed): drop use_cache=False.")
    if config.output_attentions or config.output_hidden_states:
        raise NotImplementedError(
            f"output_attentions={config.output_attentions} / output_hidden_states={config.output_hidden_states} "
            "were requested, which hf_specdec does not support yet: drop them "
            "(output_scores and output_logits are supported)."
        )
    if config.cache_implementation not in (None, "dynamic"):
        raise NotImplementedError(
            f"cache_implementation={config.cache_implementation!r} is not supported by hf_specdec yet: it keeps its own "
            "DynamicCache per call; drop cache_implementation."
        )
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() > 0:
        raise NotImplementedError(
            "Continuing from a filled past_key_values is not supported by hf_specdec yet: pass the full prompt instead."
        )
    unknown = sorted(set(model_kwargs) - HANDLED_MODEL_KWARGS)
    if unknown:
        raise NotImplementedError(
            f"hf_specdec does not support the model inputs {unknown} yet (text-only decoder inputs are supported): "
            "generate without speculation for this call."
        )
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"hf_specdec needs non-empty input_ids of shape [B, L], got shape {tuple(input_ids.shape)}.")


def _ragged_batch(
    input_ids: torch.Tensor,  # [B, P]
    attention_mask: torch.Tensor | None,  # [B, P] or None (generate drops an all-ones mask)
    max_length: int,
    spec: SpecDecoder,
) -> RaggedBatch:
    batch_size, prompt_width = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        pad_lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
    else:
        mask = attention_mask.to(device=device, dtype=torch.long)
        bad = (mask[:, 1:] < mask[:, :-1]).any(1) | (mask.sum(1) == 0)  # [B] right-padded or empty rows
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                "hf_specdec needs left-padded batches (padding first, then the prompt), but the attention_mask of "
                f"row {row} is {mask[row].tolist()} (padding after a prompt token, or no token at all): set "
                "tokenizer.padding_side = 'left' before tokenizing."
            )
        pad_lengths = (mask == 0).sum(1)
    capacity = max_length + spec.max_speculative_tokens + 1
    token_ids = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, C]
    token_ids[:, :prompt_width] = input_ids
    return RaggedBatch(
        token_ids=token_ids,
        lengths=torch.full((batch_size,), prompt_width, dtype=torch.long, device=device),
        pad_lengths=pad_lengths,
        row_ids=torch.arange(batch_size, device=device),
        prompt_width=prompt_width,
    )


# --- install() / uninstall() ----------------------------------------------------------------------

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


def uninstall() -> None:
    """Undo `install()`: `GenerationMixin.generate` is the original function again."""
    global _original_generate
    if _original_generate is None:
        return
    GenerationMixin.generate = _original_generate
    _original_generate = None


def is_installed() -> bool:
    return _original_generate is not None


def _routed_generate(original):  # noqa: ANN001, ANN202
    @functools.wraps(original)
    def generate_with_speculation(self, *args: Any, **kwargs: Any):  # noqa: ANN001, ANN202
        if kwargs.get("custom_generate") is not None:  # the caller chose its decoder: leave the call as it is
            return original(self, *args, **kwargs)
        spec = _spec_from_kwargs(self, kwargs)
        if spec is None:
            return original(self, *args, **kwargs)
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
    lookup = kwargs.pop("prompt_lookup_num_tokens", None) or getattr(config, "prompt_lookup_num_tokens", None)
    use_mtp = kwargs.pop("use_mtp", None) or getattr(config, "use_mtp", None)
    if spec is not None:
        if assistant is not None or lookup or use_mtp:
            raise ValueError(
                "Pass either spec_decoder= or assistant_model=/prompt_lookup_num_tokens=/use_mtp=, not both."
            )
        return spec
    if use_mtp:
        # HF drafts one token per MTP layer; num_assistant_tokens= asks for more (the layers then cycle).
        from hf_specdec.proposers.mtp import check_mtp_target

        k = kwargs.pop("num_assistant_tokens", None) or check_mtp_target(model)
        return SpecDecoder(method="mtp", num_speculative_tokens=min(int(k), MAX_SPECULATIVE_TOKENS))
    if assistant is not None:
        knobs = {name: _assistant_knob(name, kwargs, config, assistant) for name in HF_ASSISTANT_DEFAULTS}
        return SpecDecoder(
            draft_model=assistant,
            num_speculative_tokens=min(int(knobs["num_assistant_tokens"]), MAX_SPECULATIVE_TOKENS),
            num_speculative_tokens_schedule=knobs["num_assistant_tokens_schedule"],
            draft_confidence_threshold=float(knobs["assistant_confidence_threshold"]) or None,
        )
    if lookup:
        max_n = kwargs.pop("max_matching_ngram_size", None) or getattr(config, "max_matching_ngram_size", None) or 2
        return SpecDecoder(method="ngram", num_speculative_tokens=int(lookup), prompt_lookup_max=int(max_n))
    return None


#: HF's assistant knobs and transformers' defaults for them (`GenerationConfig._get_default_generation_params`).
HF_ASSISTANT_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}


def _assistant_knob(name: str, kwargs: dict[str, Any], config: GenerationConfig, assistant: PreTrainedModel) -> Any:
    """An assistant knob as HF resolves it: the call's kwarg, the target's generation_config, the assistant's, default."""
    value = kwargs.pop(name, None)
    for source in (config, getattr(assistant, "generation_config", None)):
        if value is None:
            value = getattr(source, name, None)
    return HF_ASSISTANT_DEFAULTS[name] if value is None else value
