"""The `custom_generate` entry point: `generate(model, input_ids, ...)`.

transformers' own `generate` calls it after it prepared the inputs, logits processors and stopping
criteria; it validates the call, builds the ragged batch and the proposer, runs the speculative
loop and returns what plain `generate` would return. `hf_specdec.routing` routes transformers'
own speculation arguments here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from hf_specdec import compat, proposers
from hf_specdec.batch import RaggedBatch
from hf_specdec.config import MAX_SPECULATIVE_TOKENS, SpecDecoder
from hf_specdec.continuation import CacheHandoff, check_continuation_cache
from hf_specdec.decoding import SpeculativeLoop
from hf_specdec.exact import ExactPath, needs_exact_path
from hf_specdec.metrics import SpecDecodeStats
from hf_specdec.model_support import check_alibi_call, check_supported_cache
from hf_specdec.proposers.base import Proposer
from hf_specdec.proposers.top1 import Top1Proposer
from hf_specdec.recurrent import check_recurrent_call, is_hybrid
from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.schedules import HeuristicSchedule, SpeculationSchedule
from hf_specdec.static_cache import StaticPlan
from hf_specdec.stopping import StopRules

#: model_kwargs that `generate` prepares and this package handles itself.
HANDLED_MODEL_KWARGS = {
    "attention_mask",
    "position_ids",
    *compat.CACHE_NAMES,  # `past_key_values`, `cache` from transformers 5.24
    "use_cache",
    "logits_to_keep",
    "encoder_outputs",  # encoder-decoder targets: generate ran the encoder (`hf_specdec.seq2seq`)
}


@dataclass
class SpecDecodeOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the call's speculative-decoding statistics."""

    spec_stats: SpecDecodeStats | None = None


@dataclass
class SpecDecodeEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """`GenerateEncoderDecoderOutput` plus the call's speculative-decoding statistics."""

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
    check_supported_cache(model)
    _check_call(model, input_ids, generation_config, model_kwargs)
    if spec.draft_model is not None and spec.method == "draft":
        check_supported_cache(spec.draft_model, role="draft", needs_positions=not model.config.is_encoder_decoder)
    _check_alibi_columns(model, spec, input_ids, generation_config, model_kwargs)
    check_speculation_type(getattr(generation_config, "speculation_type", None), spec)
    check_recurrent_call(model, spec, generation_config, model_kwargs)
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

    encoder = None
    decoder_mask = model_kwargs.get("attention_mask")
    if model.config.is_encoder_decoder:  # generate ran the encoder; its attention_mask is the encoder's
        from hf_specdec.seq2seq import check_seq2seq_target, encoder_state

        check_seq2seq_target(model, input_ids.shape[0], spec.method)
        encoder, decoder_mask = encoder_state(model_kwargs), None
    static = None
    if generation_config.cache_implementation == "static":
        static = static_plan(model, spec, generation_config, compat.get_cache(model_kwargs))
    handoff = (
        None
        if static or is_hybrid(model)  # hybrids: no cache to adopt or hand back (refused above)
        else build_handoff(model, spec, input_ids, generation_config, compat.get_cache(model_kwargs))
    )
    batch = RaggedBatch.from_prompts(
        input_ids, decoder_mask, generation_config.max_length + spec.max_speculative_tokens + 1
    )
    seeds = row_seeds(spec.seed, batch.batch_size).to(batch.device)
    sampling = StepSampling(processors=logits_processor, do_sample=bool(generation_config.do_sample), seeds=seeds)
    pad = generation_config._pad_token_tensor
    stop_rules = StopRules(
        stopping_criteria,
        pad_token_id=int(pad.reshape(-1)[0]) if pad is not None else None,
        max_length=generation_config.max_length,
        batch_size=batch.batch_size,
    )
    exact = None
    if needs_exact_path(sampling, stopping_criteria):
        exact = ExactPath(logits_processor, stopping_criteria, stop_rules.pad_token_id)
        if generation_config.cache_implementation == "static":
            names = sorted({type(p).__name__ for p in (*logits_processor, *stopping_criteria)})
            raise NotImplementedError(
                f"This call has logits processors or stopping criteria off hf_specdec's vectorised allow-list "
                f"(among {names}), which run on the exact position-by-position path; that path does not run on "
                "static caches yet: drop cache_implementation='static' (the default dynamic cache supports them)."
            )
    loop = SpeculativeLoop(
        model=model,
        proposer=build_proposer(spec, model, tokenizer, encoder, static=static is not None),
        batch=batch,
        sampling=sampling,
        stop_rules=stop_rules,
        num_speculative_tokens=spec.max_speculative_tokens,
        max_length=generation_config.max_length,
        streamer=streamer,
        output_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        output_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
        static=static,
        exact=exact,
        handoff=handoff,
        view_factory=seq2seq_views(encoder),
        on_step=spec.on_step,
    )
    result = loop.run()
    loop.proposer.finish()
    spec.last_stats = loop.stats
    if generation_config.return_dict_in_generate and encoder is not None:
        return SpecDecodeEncoderDecoderOutput(
            sequences=result.sequences, scores=result.scores, logits=result.logits, spec_stats=loop.stats
        )
    if generation_config.return_dict_in_generate:
        return SpecDecodeOutput(
            sequences=result.sequences,
            scores=result.scores,
            logits=result.logits,
            **compat.generate_output_fields(result.cache),
            spec_stats=loop.stats,
        )
    return result.sequences


#: Set to 0 to keep static-cache steps uncaptured (a compiled forward per model call, each its own CUDA graph).
CAPTURE_ENV = "HF_SPECDEC_CAPTURE_STEPS"

#: Static caches get at least this many columns beyond max_length + k + 1 for holes between compactions.
STATIC_HOLE_ROOM = 64


#: Drafting methods the static-cache path does not run, as its refusal names them.
STATIC_UNSUPPORTED_METHODS = {
    "early_exit": "early-exit drafts",
    "gemma4_assistant": "Gemma 4 assistants",
    "dflash": "DFlash drafters",
}


def static_plan(
    model: PreTrainedModel, spec: SpecDecoder, generation_config: GenerationConfig, cache: Any = None
) -> StaticPlan:
    """Static caches for this call, and the compiled forwards transformers' own rules allow (CUDA: graphs)."""
    unsupported = None
    if model.config.is_encoder_decoder:
        unsupported = f"an encoder-decoder target ({type(model).__name__})"
    elif spec.method in STATIC_UNSUPPORTED_METHODS or spec.draft_tokenizer is not None:
        unsupported = STATIC_UNSUPPORTED_METHODS.get(spec.method, "a draft with another tokenizer")
    elif cache is not None and int(cache.get_seq_length()) > 0:
        unsupported = "continuing a filled past_key_values"
    if unsupported:
        raise NotImplementedError(
            f"cache_implementation='static' does not support {unsupported} in hf_specdec yet (it covers decoder-only "
            "targets with a draft model, prompt lookup or MTP): drop cache_implementation='static'."
        )
    k = spec.max_speculative_tokens
    # Room for every token, one verify's slots, and holes that lagging rows leave between two compactions.
    max_columns = generation_config.max_length + k + 1 + max(STATIC_HOLE_ROOM, 4 * (k + 1))

    def compiled_for(m: PreTrainedModel) -> Callable | None:
        if m is model and spec.method == "mtp":  # MTP reads the target's hidden states through a forward hook
            return None
        if is_hybrid(m):  # the recurrent rollback hooks the mixers and re-runs them: hybrids run eagerly
            return None
        if plan.capture_steps:  # the loop captures whole steps: forwards compiled without graphs of their own
            return compat.compiled_call_without_graphs(m, generation_config)
        return compat.compiled_call(m, generation_config)

    plan = StaticPlan(k=k, max_columns=max_columns, compiled_call=compiled_for)
    plan.hybrid = any(m is not None and is_hybrid(m) for m in (model, spec.draft_model))
    plan.can_capture = (
        not plan.hybrid
        and model.device.type == "cuda"
        and compat.compiled_call(model, generation_config) is not None
        and spec.method != "mtp"
        and os.environ.get(CAPTURE_ENV, "1") != "0"
    )
    return plan


def build_handoff(
    model: PreTrainedModel, spec: SpecDecoder, input_ids: torch.Tensor, config: GenerationConfig, cache: Any
) -> CacheHandoff | None:
    """The cache handoff of this call: adopt a filled `past_key_values`, and fill the caller's cache (or the one a
    `return_dict_in_generate` output carries) like plain decoding; None when nobody will see the cache."""
    if model.config.is_encoder_decoder:
        if cache is not None and cache.get_seq_length() > 0:
            raise NotImplementedError(
                "Continuing a filled past_key_values is supported for decoder-only targets only: pass the whole "
                f"decoder prompt to {type(model).__name__} without past_key_values."
            )
        return None  # the returned output carries no cache (the EncoderDecoderCache is not handed back)
    if cache is None:
        if not config.return_dict_in_generate:
            return None
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    past = check_continuation_cache(cache, input_ids)
    if past and spec.method in ("mtp", "gemma4_assistant", "dflash"):
        raise NotImplementedError(
            f"method={spec.method!r} cannot continue a filled past_key_values (it drafts from the target's states "
            "of the forward that filled it, which hf_specdec did not see): pass the full conversation without "
            "past_key_values, or use a draft model or prompt lookup."
        )
    # generate creates a cache of its own when the caller passed none; fill it only when the output returns it.
    if not past and not config.return_dict_in_generate and not getattr(cache, "_is_user_defined", True):
        return None
    return CacheHandoff(cache, past)


def build_proposer(
    spec: SpecDecoder, model: PreTrainedModel, tokenizer: Any = None, encoder: Any = None, static: bool = False
) -> Top1Proposer:
    """The proposer that `spec` describes, checked against the target model.

    The method's registered constructor (`hf_specdec.proposers`) builds and checks it; it is always wrapped in a `Top1Proposer`, the one place where per-row draft budgets are decided (the draft's
    position limit, `max_draft_len`, the k schedule); its cost is a few [B] tensor ops per step.
    """
    inner = proposers.build(spec, model, proposers.ProposerContext(tokenizer=tokenizer, encoder=encoder, static=static))
    schedule = _build_schedule(spec, model, inner, static)
    return Top1Proposer(inner, max_draft_len=spec.max_draft_len, schedule=schedule)


def _build_schedule(
    spec: SpecDecoder, model: PreTrainedModel, inner: Proposer, static: bool = False
) -> SpeculationSchedule | None:
    schedule = spec.num_speculative_tokens_schedule
    if schedule == "adaptive":
        from hf_specdec.adaptive import AdaptiveSchedule, model_serial

        key = f"ngram:{spec.prompt_lookup_min}-{spec.prompt_lookup_max}"
        if spec.draft_model is not None:
            key = f"{spec.method}:{model_serial(spec.draft_model)}"
        elif spec.method != "ngram":
            key = "mtp" if spec.method == "mtp" else f"exit:{spec.early_exit_layers}"
        return AdaptiveSchedule(
            spec.num_speculative_tokens,
            model,
            key,
            inner.proposes_cheaply,
            draft_share=_draft_share(spec, model),
            static=static,
        )
    if schedule.startswith("heuristic"):

        def persist(k: int) -> None:  # HF's "heuristic" keeps the final k for the next call
            spec.num_speculative_tokens = k
            if spec.draft_model is not None:
                spec.draft_model.generation_config.num_assistant_tokens = k

        on_finish = persist if schedule == "heuristic" else None
        return HeuristicSchedule(spec.num_speculative_tokens, spec.max_speculative_tokens, on_finish)
    return None


def seq2seq_views(encoder: Any) -> Callable | None:
    """The CacheView factory of an encoder-decoder call (None: the loop's plain CacheView)."""
    if encoder is None:
        return None
    from hf_specdec.seq2seq import view_factory

    return view_factory(encoder)


def _draft_share(spec: SpecDecoder, model: PreTrainedModel) -> float:
    """What drafting one token costs next to a one-token target forward, before the adaptive schedule measures it:
    the draft's parameters over the target's (the share of the target's layers for early exit and MTP)."""
    layers = max(1, getattr(model.config.get_text_config(), "num_hidden_layers", 1) or 1)
    if spec.method == "early_exit":
        return spec.early_exit_layers / layers
    if spec.method == "mtp":
        return 1 / layers
    if spec.draft_model is None:
        return 0.0
    return min(1.0, sum(p.numel() for p in spec.draft_model.parameters()) / sum(p.numel() for p in model.parameters()))


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


def _check_alibi_columns(
    model: PreTrainedModel, spec: SpecDecoder, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict
) -> None:
    """MPT-style ALiBi (bias from cache columns) is exact only for one unpadded row on the dynamic cache."""
    mask = None if model.config.is_encoder_decoder else model_kwargs.get("attention_mask")  # [B, P] decoder mask
    padded = mask is not None and not bool(mask.all())
    static = config.cache_implementation == "static"
    for role, checked in (("target", model), ("draft", spec.draft_model)):
        if checked is not None:
            check_alibi_call(checked, role, input_ids.shape[0], padded, static)


def _check_call(
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
