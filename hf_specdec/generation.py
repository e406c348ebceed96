"""The `custom_generate` entry point: `generate(model, input_ids, ...)`.

transformers' own `generate` calls it after it prepared the inputs, logits processors and stopping criteria. It
reads as the call's path: build the call plan (`hf_specdec.plan`: every check, the route, the proposer), build the
loop (`hf_specdec.decoding`), run it, and return what plain `generate` would return. `hf_specdec.routing` routes
transformers' own speculation arguments here.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from hf_specdec import compat, model_guard
from hf_specdec.attention_backends import without_cudnn_attention
from hf_specdec.call_checks import HANDLED_MODEL_KWARGS, check_speculation_type
from hf_specdec.config import SpecDecoder
from hf_specdec.decoding import LoopOutput, SpeculativeLoop
from hf_specdec.locks import model_call_lock
from hf_specdec.metrics import SpecDecodeStats
from hf_specdec.plan import CallPlan, build_proposer, row_seeds

# Re-exported: where callers and tests have always found them.
__all__ = [
    "HANDLED_MODEL_KWARGS",
    "SpecDecodeEncoderDecoderOutput",
    "SpecDecodeOutput",
    "build_proposer",
    "check_speculation_type",
    "generate",
    "row_seeds",
]


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
    with contextlib.ExitStack() as setup, model_guard.read_once():  # each model is read once while the call is set up
        plan = CallPlan.build(
            model,
            input_ids,
            generation_config,
            spec_decoder,
            model_kwargs,
            logits_processor,
            stopping_criteria,
            streamer=spec_streamer,
            tokenizer=spec_tokenizer,
            stop_strings=spec_stop_strings,
        )
        if plan.static is None:  # the dynamic path meets new (query, key) lengths every step: cuDNN's plans for each
            setup.enter_context(without_cudnn_attention(input_ids.device))  # would be built on the host
        _stream_prompt(plan, input_ids, inspect.currentframe())
        # A call on a GPU's static path (captured steps, compiled forwards) runs alone on its model
        # (`hf_specdec.locks`): its caches are allocated and its graphs destroyed under the lock, never during
        # another call's capture.
        serial = plan.static is not None and (plan.static.can_capture or plan.static.compiled_call(model) is not None)
        setup.enter_context(model_call_lock(model, serial))
        loop = build_loop(model, plan)
        lock = setup.pop_all()  # held until the call ends
    with lock:
        result = loop.run()
    plan.spec.last_stats = loop.stats
    return outputs(plan, result, loop.stats)


def build_loop(model: PreTrainedModel, plan: CallPlan) -> SpeculativeLoop:
    """The decoding loop of a planned call."""
    return SpeculativeLoop(
        model=model,
        proposer=plan.proposer,
        batch=plan.batch,
        sampling=plan.sampling,
        stop_rules=plan.stop_rules,
        num_speculative_tokens=plan.spec.max_speculative_tokens,
        max_length=plan.max_length,
        streamer=plan.streamer,
        output_scores=plan.output_scores,
        output_logits=plan.output_logits,
        static=plan.static,
        exact=plan.exact,
        handoff=plan.handoff,
        view_factory=plan.view_factory,
        on_step=plan.spec.on_step,
        schedule=plan.schedule,
    )


def _stream_prompt(plan: CallPlan, input_ids: torch.Tensor, frame: Any) -> None:
    """Put the prompt into the call's streamer, as plain `generate` does; warn once per call when transformers kept
    a `streamer=` from this `custom_generate` call (it streamed the prompt there and nothing more would come)."""
    dropped = _streamer_transformers_kept(frame)
    if dropped is not None and dropped is not plan.streamer:
        warnings.warn(
            "model.generate(streamer=...) was called with custom_generate=hf_specdec.generate: transformers streamed "
            "the prompt but does not pass the streamer on to a custom_generate callable, so it gets nothing more "
            "from this call. Pass it as spec_streamer=streamer (or SpecDecoder(streamer=...), or call "
            "hf_specdec.install() and pass streamer= without custom_generate=).",
            UserWarning,
            stacklevel=4,
        )
    if plan.streamer is not None and dropped is not plan.streamer:  # not put twice when given under both names
        plan.streamer.put(input_ids.cpu())


def outputs(plan: CallPlan, result: LoopOutput, stats: SpecDecodeStats) -> torch.LongTensor | SpecDecodeOutput:
    """What plain `generate` returns for this call: the sequences, or its output class plus `spec_stats`."""
    if plan.return_dict and plan.encoder is not None:
        return SpecDecodeEncoderDecoderOutput(
            sequences=result.sequences, scores=result.scores, logits=result.logits, spec_stats=stats
        )
    if plan.return_dict:
        return SpecDecodeOutput(
            sequences=result.sequences,
            scores=result.scores,
            logits=result.logits,
            **compat.generate_output_fields(result.cache),
            spec_stats=stats,
        )
    return result.sequences


def _streamer_transformers_kept(frame: Any) -> Any:
    """The `streamer=` of the `GenerationMixin.generate` call that called this `custom_generate` callable, or None.

    transformers' `generate` puts the prompt into its `streamer` and then calls a `custom_generate` callable
    without it (it forwards only the callable's own extra parameters). The streamer is still a local of that
    `generate` frame, read here only to warn the caller (`frame` is `hf_specdec.generate`'s own frame; a wrapper
    or two in between are allowed) and never to stream into it: streaming would make the output depend on
    transformers' private locals. Returns None when no such call is on the stack, or it had no streamer (as in
    `install()`'s routed calls and the `custom_generate` Hub repository, which pass `spec_streamer=` instead).
    """
    try:
        for _ in range(4):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            code = frame.f_code
            if code.co_name == "generate" and code.co_filename == _TRANSFORMERS_GENERATE_FILE:
                found = frame.f_locals
                return found.get("streamer") if callable(found.get("custom_generate")) else None
        return None
    finally:
        del frame  # frames hold their locals: drop the reference at once


def _transformers_generate_file() -> str:
    from transformers.generation import utils

    return utils.__file__


_TRANSFORMERS_GENERATE_FILE = _transformers_generate_file()
