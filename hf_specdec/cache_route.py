"""Which cache path a call takes: dynamic (eager), or static with each whole step captured as a CUDA graph.

The caller's `cache_implementation` decides when given: `"static"` runs on static caches with the forwards
transformers would compile, `"dynamic"` on the eager dynamic path. With none (the default), a call on CUDA takes the
static path with its whole step captured as CUDA graphs of the *eager* forwards (no inductor compile: capture costs
seconds, not minutes) whenever its step can be captured; a `compile_config` adds compiled forwards inside the same
captured step. Anything that cannot be captured (a CPU model, a placement over several devices or with offloaded
weights: `placement.capture_blocker`, a hybrid, host work inside the step) keeps the dynamic path, and the reason is
said once per process. On the CPU nothing changes. A tensor-parallel target (one device per rank) is captured.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import GenerationConfig, GenerationMixin, PreTrainedModel

from hf_specdec import compat, placement, step_graph
from hf_specdec.model_guard import fingerprint
from hf_specdec.recurrent import is_hybrid
from hf_specdec.static_cache import StaticPlan

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

logger = logging.getLogger("hf_specdec")

#: Set to 0 to keep the default route on the dynamic cache on CUDA (the behaviour before the captured default).
DEFAULT_STATIC_ENV = "HF_SPECDEC_DEFAULT_STATIC"

#: Methods whose whole step can be captured on the static path (others run eagerly there, so the default keeps them
#: on the dynamic path).
CAPTURABLE_METHODS = ("draft", "ngram", "mtp", "early_exit", "eagle3", "dflash", "gemma4_assistant", "suffix")

#: Why each other method's steps are not captured (what a capture would need: a static-cache port of its state). Every
#: method is captured now; a new one that is not names its reason here.
UNCAPTURED_METHODS: dict[str, str] = {}

#: Methods that read the target's activations through forward hooks: their target's forward is never compiled (the
#: hooks would not run as written inside compiled code); on a GPU its eager forwards are captured with the step.
HOOKED_METHODS = ("mtp", "eagle3", "dflash", "gemma4_assistant")

_SAID: set[str] = set()


@dataclass(frozen=True)
class CacheRoute:
    """The cache path of one call."""

    static: bool  # static caches (transformers' `StaticCache`, fixed shapes)
    compile: bool  # forwards compiled as plain `generate` would (asked for: cache_implementation="static" or a
    #: compile_config); otherwise eager forwards, captured with the whole step on a GPU
    by_default: bool  # chosen by hf_specdec (no cache_implementation given): a step that turns out uncapturable
    #: falls back to the dynamic path instead of being refused


def default_blocker(model: PreTrainedModel, spec: Any, generation_config: GenerationConfig, cache: Any) -> str | None:
    """Why a call with no `cache_implementation` cannot take the captured static path (None: it can), from what is
    known before any proposer or model work. The step's own capturability is checked once the loop's parts exist
    (`hf_specdec.decoding.capture_blocker`)."""
    from hf_specdec.model_support import alibi_from_columns

    if os.environ.get(DEFAULT_STATIC_ENV, "1") == "0":
        return f"{DEFAULT_STATIC_ENV}=0"
    device = placement.input_device(model)  # not `model.device`: `meta` when accelerate offloads the first weights
    if device.type != "cuda":
        return None if device.type == "cpu" else f"the model is on {device.type}, not CUDA"
    blocker = placement.capture_blocker(model, spec.draft_model if spec.method in ("draft", "suffix") else None)
    if blocker is not None:  # several devices, offloaded weights, a draft on another device than the target
        return blocker
    if model.config.is_encoder_decoder:
        return "encoder-decoder targets run on the dynamic cache"
    if spec.draft_tokenizer is not None:
        return "a draft with another tokenizer re-encodes text on the host every step"
    if spec.method not in CAPTURABLE_METHODS:
        why = UNCAPTURED_METHODS.get(spec.method, "its steps decide on the host")
        return f"method={spec.method!r} is not captured: {why}"
    if spec.draft_confidence_threshold:
        return "draft_confidence_threshold learns on the host every step"
    if spec.num_speculative_tokens_schedule not in ("constant", "adaptive"):
        return f"the {spec.num_speculative_tokens_schedule!r} schedule decides on the host every step"
    if any(m is not None and is_hybrid(m) for m in (model, spec.draft_model)):
        return "hybrid models (recurrent layers) run eagerly"
    if any(m is not None and alibi_from_columns(m) for m in (model, spec.draft_model)):
        return "MPT-style ALiBi (bias from cache columns) is exact only on the dynamic cache"
    if spec.on_step is not None:
        return "on_step reads every step on the host"
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate hands back the dynamic cache"
    if cache is not None and getattr(cache, "_is_user_defined", False):
        return "a past_key_values of the caller's is filled on the dynamic path"
    return None


def choose_route(
    model: PreTrainedModel, spec: Any, generation_config: GenerationConfig, cache: Any = None
) -> CacheRoute:
    """The call's cache path before the proposer is built (see the module docstring)."""
    asked = generation_config.cache_implementation
    if asked == "static":
        return CacheRoute(static=True, compile=True, by_default=False)
    if asked is not None or placement.input_device(model).type == "cpu":  # "dynamic", or the CPU: unchanged
        return CacheRoute(static=False, compile=False, by_default=False)
    blocker = default_blocker(model, spec, generation_config, cache)
    if blocker is not None:
        say_once(blocker)
        return CacheRoute(static=False, compile=False, by_default=True)
    return CacheRoute(static=True, compile=generation_config.compile_config is not None, by_default=True)


def say_once(reason: str) -> None:
    """Tell the user once per process why a default call on CUDA runs on the eager dynamic path."""
    if reason in _SAID:
        return
    _SAID.add(reason)
    logger.warning(
        "hf_specdec: this call runs on the eager dynamic cache, not the captured static path (%s). Outputs are the "
        "same; pass cache_implementation='dynamic' to choose it explicitly, or see docs/usage.md ('The default "
        "path on a GPU').",
        reason,
    )


#: Set to 0 to keep static-cache steps uncaptured (a compiled forward per model call, each its own CUDA graph).
CAPTURE_ENV = "HF_SPECDEC_CAPTURE_STEPS"

#: Static caches get at least this many columns (and 4 verifies' worth) beyond max_length + k + 1 for holes that
#: lagging rows leave between two compactions ...
STATIC_HOLE_ROOM = 16

#: ... rounded up to a multiple of this (which adds more room for holes): calls whose prompts differ by a few tokens
#: get caches of one length, so a server's compiled forwards and captured steps see a few shapes, not one per prompt
#: length.
STATIC_LENGTH_BUCKET = 256


#: Drafting methods the static-cache path does not run, as its refusal names them (none now).
STATIC_UNSUPPORTED_METHODS: dict[str, str] = {}


def static_plan(
    model: PreTrainedModel,
    spec: SpecDecoder,
    generation_config: GenerationConfig,
    cache: Any = None,
    compile_forwards: bool = True,
) -> StaticPlan:
    """Static caches for this call: on a GPU its whole steps captured as CUDA graphs, with the forwards compiled
    where transformers' own rules allow it and `compile_forwards` asks for it (else eager forwards, captured)."""
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
            "targets whose drafts share their tokenizer): drop cache_implementation='static'."
        )
    k = spec.max_speculative_tokens
    # Room for every token, one verify's slots, and holes that lagging rows leave between two compactions.
    needed = generation_config.max_length + k + 1 + max(STATIC_HOLE_ROOM, 4 * (k + 1))
    max_columns = -(-needed // STATIC_LENGTH_BUCKET) * STATIC_LENGTH_BUCKET

    def compiled_for(m: PreTrainedModel) -> Callable | None:
        if not compile_forwards:  # the default route: eager forwards, captured with the whole step
            return None
        if m is model and spec.method in HOOKED_METHODS:  # they read its states through hooks: eager
            return None
        if not isinstance(m, GenerationMixin):  # MTP layers: run layer by layer, never compiled
            return None
        if is_hybrid(m):  # the recurrent rollback hooks the mixers and re-runs them: hybrids run eagerly
            return None
        where = placement.placement(m)
        if where.spread or where.offloaded:  # accelerate's hooks move tensors between devices in Python: eager
            return None
        guard = fingerprint([m])  # a forward hook or a replaced weight since the last compile: compile anew
        if plan.capture_steps:  # the loop captures whole steps: forwards compiled without graphs of their own
            return compat.compiled_call_without_graphs(m, generation_config, guard)
        return compat.compiled_call(m, generation_config, guard)

    plan = StaticPlan(k=k, max_columns=max_columns, compiled_call=compiled_for)
    plan.hybrid = any(m is not None and is_hybrid(m) for m in (model, spec.draft_model))
    plan.can_capture = (
        not plan.hybrid
        and placement.input_device(model).type == step_graph.GRAPHS.device_type
        and placement.capture_blocker(model, spec.draft_model if spec.method in ("draft", "suffix") else None) is None
        and os.environ.get(CAPTURE_ENV, "1") != "0"
    )
    return plan
