"""The transformers (and torch) internals hf_specdec relies on, gathered in one place.

Each helper names the private API it wraps, so that a transformers upgrade that moves one breaks here, in one
module, not across the package. Covered: transformers 5.17 (the GPU image) to 5.24 (which renamed the models'
`past_key_values` argument and output field to `cache`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.nn.modules import module as torch_module
from transformers import CompileConfig, DynamicCache, GenerationConfig, PreTrainedModel, StaticCache, cache_utils
from transformers.generation import utils as generation_utils

from hf_specdec import model_slots

#: The cache layer of layers that keep no cache (Gemma 4's KV-shared layers); None on transformers without it.
DUMMY_LAYER = getattr(cache_utils, "DummyLayer", None)

#: The name of the cache in `generate`'s model_kwargs, the models' forwards and their outputs: transformers 5.24
#: renamed `past_key_values` to `cache` (`generation.utils.ALL_CACHE_NAMES`; the old name is a deprecated alias).
CACHE_ARGUMENT: str = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"

#: Both names a cache may come under (a caller's kwargs, a forward hook's kwargs, remote code).
CACHE_NAMES: tuple[str, ...] = ("cache", "past_key_values")

#: module class -> the keyword its forward takes the cache by.
_CACHE_ARGUMENTS: dict[type, str] = {}


def forward_parameters(module: torch.nn.Module) -> dict[str, inspect.Parameter]:
    """The parameters of `module.forward` (through transformers' `deprecate_kwarg` wrappers)."""
    return dict(inspect.signature(module.forward).parameters)


def cache_parameter(parameters: dict[str, inspect.Parameter]) -> str | None:
    """The parameter of a forward that takes a transformers Cache: `past_key_values`, or on transformers >= 5.24
    `cache` (unless annotated as a dict: XLM and Flaubert long took a `cache` of their own); None if neither."""
    if CACHE_ARGUMENT == "cache" and "cache" in parameters and "dict" not in str(parameters["cache"].annotation):
        return "cache"
    return "past_key_values" if "past_key_values" in parameters else None


def cache_argument(module: torch.nn.Module) -> str:
    """The keyword `module.forward` takes its cache by: `cache` on transformers >= 5.24, `past_key_values` before
    (and on remote code written for it); `CACHE_ARGUMENT` when the forward names neither (it takes **kwargs)."""
    name = _CACHE_ARGUMENTS.get(type(module))
    if name is None:
        name = cache_parameter(forward_parameters(module)) or CACHE_ARGUMENT
        _CACHE_ARGUMENTS[type(module)] = name
    return name


def cache_kwargs(module: torch.nn.Module, cache: object) -> dict[str, object]:
    """`{name: cache}` to pass `cache` to `module`'s forward under the name it takes."""
    return {cache_argument(module): cache}


def get_cache(kwargs: dict[str, Any]) -> Any:
    """The cache in `generate`'s model_kwargs (or a forward's kwargs) under either name, or None."""
    for name in (CACHE_ARGUMENT, *CACHE_NAMES):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


@functools.cache
def _generate_marks_callers_caches() -> bool:
    """Whether `generate` marks a cache the caller passed (`_is_user_defined`, transformers 5.17 on): then a cache
    in its model_kwargs without the mark is the one it made itself."""
    try:
        source = inspect.getsource(generation_utils.GenerationMixin._prepare_cache_for_generation)
    except (AttributeError, OSError, TypeError):
        return False
    return "_is_user_defined" in source


def caller_passed_cache(cache: object) -> bool:
    """Whether `cache`, from `generate`'s model_kwargs, is a past_key_values the caller passed (plain `generate`
    fills it in place). Before transformers 5.17 nothing tells it from the cache `generate` makes: assumed so."""
    if cache is None:
        return False
    return bool(getattr(cache, "_is_user_defined", False)) or not _generate_marks_callers_caches()


def output_cache(outputs: Any) -> Any:
    """The cache a model or generate output carries: its field `cache` on transformers >= 5.24, `past_key_values`
    before."""
    fields = getattr(type(outputs), "__dataclass_fields__", {})
    return getattr(outputs, next((n for n in CACHE_NAMES if n in fields), CACHE_ARGUMENT), None)


def generate_output_fields(cache: object) -> dict[str, object]:
    """`{field: cache}` for a `GenerateDecoderOnlyOutput` (its field is `cache` from transformers 5.24)."""
    fields = getattr(generation_utils.GenerateDecoderOnlyOutput, "__dataclass_fields__", {})
    return {next((n for n in CACHE_NAMES if n in fields), CACHE_ARGUMENT): cache}


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called")  # fmt: skip


def global_module_hooks() -> tuple:
    """torch's global forward and forward-pre module hooks (`torch.nn.modules.module._global_forward_hooks` and
    kin, which `register_module_forward_hook` fills) as (kind, ((handle id, hook id), ...)) pairs."""
    return tuple(
        (kind, tuple((k, id(v)) for k, v in getattr(torch_module, kind, {}).items())) for kind in _GLOBAL_HOOKS
    )


def compiled_call(
    model: PreTrainedModel, generation_config: GenerationConfig, guard: Hashable = None
) -> Callable | None:
    """`model`'s compiled `__call__` exactly when plain `generate` would compile its decoding steps, else None.

    Honours transformers' own knobs with their meaning: `generation_config.disable_compile`, `compile_config`
    (`GenerationMixin._valid_auto_compile_criteria`: a compileable cache on CUDA-like hardware, no CPU/disk offload,
    a compileable quantizer) and `PreTrainedModel.get_compiled_call` (one `torch.compile` per model and config,
    shared with plain `generate`). `guard` is what the model's forward can see (`model_guard.fingerprint`): when it
    differs from the one the call was compiled under (a hook, say, which dynamo does not guard by default), the
    forward is compiled anew.
    """
    probe = {CACHE_ARGUMENT: StaticCache(config=model.config, max_cache_len=1)}
    if not model._valid_auto_compile_criteria(probe, generation_config):
        return None
    settings = (generation_config.compile_config or CompileConfig()).to_dict()
    return _guarded_compile(model, settings, guard, lambda: model.get_compiled_call(generation_config.compile_config))


def compiled_call_without_graphs(
    model: PreTrainedModel, generation_config: GenerationConfig, guard: Hashable = None
) -> Callable | None:
    """`compiled_call`'s forward with the same compile settings but no CUDA graphs of its own, for a caller that
    captures a whole step (with these calls inside) as one graph: `mode="reduce-overhead"` becomes inductor's
    default, `"max-autotune"` becomes `"max-autotune-no-cudagraphs"`. None exactly when `compiled_call` is None.

    Compiled once per model, settings and `guard` (cached here, apart from `PreTrainedModel.get_compiled_call`'s
    single slot, so that plain `generate` calls in between do not recompile either)."""
    if compiled_call(model, generation_config, guard) is None:
        return None
    settings = (generation_config.compile_config or CompileConfig()).to_dict()
    mode = settings.get("mode")
    settings["mode"] = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
    if settings.get("options"):
        settings["options"] = {**settings["options"], "triton.cudagraphs": False}
        settings["mode"] = None  # torch.compile takes either a mode or options
    return _guarded_compile(model, settings, guard)


#: the attribute under which a model holds {compile settings: (guard, its compiled __call__)} (`model_slots`: a
#: module-level table keyed weakly by the model kept every compiled model alive, the compiled call referring to it)
_COMPILED_CALLS = "_hf_specdec_compiled_calls"


def _guarded_compile(
    model: torch.nn.Module, settings: dict, guard: Hashable, first: Callable[[], Callable] | None = None
) -> Callable:
    """`torch.compile(model.__call__, **settings)`, once per settings and guard (`first()` makes the first one)."""
    key = repr(sorted(settings.items(), key=lambda item: item[0]))
    calls = model_slots.held(model, _COMPILED_CALLS, dict)
    known = calls.get(key)
    if known is not None and known[0] == guard:
        return known[1]
    # A guard that changed needs a trace of its own: dynamo keeps compiled code per code object, and its cached
    # entries for `Module.__call__` (traced under the old hooks, which it does not guard by default) would match.
    if known is None and first is not None:
        call = first()
    else:
        call = torch.compile(_fresh_call(model) if known is not None else model.__call__, **settings)
    calls[key] = (guard, call)
    return call


_FRESH_CALLS = itertools.count()


def _fresh_call(model: torch.nn.Module) -> Callable:
    """`model.__call__` (`torch.nn.Module._wrapped_call_impl`) through a code object of its own, which no compiled
    code was cached for."""
    impl = torch.nn.Module._wrapped_call_impl
    code = impl.__code__.replace(co_name=f"{impl.__name__}_hf_specdec_{next(_FRESH_CALLS)}")
    function = types.FunctionType(code, impl.__globals__, code.co_name, impl.__defaults__, impl.__closure__)
    return types.MethodType(function, model)


def forget_compiled(model: torch.nn.Module) -> None:
    """Drop hf_specdec's compiled calls of `model` (the next static call compiles anew)."""
    model_slots.drop(model, _COMPILED_CALLS)


def num_compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (`torch._dynamo.utils.counters`)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def crop_cache(cache: DynamicCache, tokens_to_remove: int) -> None:
    """`DynamicCache.crop(-n)`, skipping layers not written yet: transformers 5.23 skips them itself (models that
    share KV across layers, MTP layers), 5.17 fails on them (`'NoneType' object is not subscriptable`)."""
    cache = getattr(cache, "self_attention_cache", cache)  # an encoder-decoder's: its cross-attention stays whole
    for layer in cache.layers:
        if hasattr(layer, "keys") and (layer.keys is None or not getattr(layer, "is_initialized", True)):
            continue  # an attention layer never written: nothing to crop
        if is_recurrent_layer(layer):
            continue  # recurrent states have no columns: `hf_specdec.recurrent` rolls them back
        layer.crop(tokens_to_remove)


def experts_implementation(model: torch.nn.Module) -> str | None:
    """How the model's mixture-of-experts layers compute (`config._experts_implementation`: "eager", "grouped_mm",
    "batched_mm", ...); None for a model without such layers — transformers sets the attribute on dense models too,
    so the layers are found by their forward, the one `integrations.moe.use_experts_implementation` installs."""
    for module in model.modules():
        forward = type(module).forward
        if hasattr(forward, "__wrapped__") and forward.__code__.co_filename.endswith(
            ("integrations/moe.py", "integrations\\moe.py")
        ):
            return getattr(getattr(module, "config", None), "_experts_implementation", None)
    return None


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def missing_recurrent_cache_api() -> list[str]:
    """What of transformers' recurrent cache API (`cache_utils.LinearAttentionLayer` with per-state
    `conv_states`/`recurrent_states`/`has_previous_state`, `Cache.get_conv_state`/`update_conv_state`) this
    transformers lacks; empty when `hf_specdec.recurrent` can roll hybrid models back."""
    from transformers import cache_utils

    needed = {
        "cache_utils.LinearAttentionLayer": getattr(cache_utils, "LinearAttentionLayer", None),
        "cache_utils.LinearAttentionCacheLayerMixin": getattr(cache_utils, "LinearAttentionCacheLayerMixin", None),
        "Cache.get_conv_state": getattr(cache_utils.Cache, "get_conv_state", None),
        "Cache.update_conv_state": getattr(cache_utils.Cache, "update_conv_state", None),
        "Cache.update_recurrent_state": getattr(cache_utils.Cache, "update_recurrent_state", None),
    }
    missing = [name for name, found in needed.items() if found is None]
    layer = needed["cache_utils.LinearAttentionLayer"]
    if layer is not None:
        try:
            fields = vars(layer(number_of_states=1))
        except TypeError:  # an older constructor
            fields = {}
        per_state = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized")
        if not all(isinstance(fields.get(name), dict) for name in per_state):
            missing.append("LinearAttentionLayer's per-state dicts " + "/".join(per_state))
    return missing


def is_recurrent_layer(layer: object) -> bool:
    """Whether a cache layer holds recurrent (conv/SSM) states: `cache_utils.LinearAttentionCacheLayerMixin`."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    return mixin is not None and isinstance(layer, mixin)


def gemma4_assistant_step(
    assistant: PreTrainedModel,
    inputs_embeds: torch.Tensor,  # [B, 1, 2 * H_target] the token's target embedding and the previous hidden state
    position_ids: torch.Tensor,  # [B, 1]
    masks: dict[str, torch.Tensor],  # layer type -> [B, 1, 1, W] explicit mask over the shared keys
    shared_kv_states: dict[str, tuple[torch.Tensor, torch.Tensor]],  # layer type -> keys, values [B, h, W, D]
) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, 1, V], next previous-hidden state [B, 1, H_target]
    """One draft step of a `Gemma4AssistantForCausalLM` (or its unified twin) with explicit masks.

    `Gemma4AssistantForCausalLM.forward` (transformers 5.17-5.23) builds its masks from a 2-D padding mask, taking a
    sliding layer's window as the last columns of the keys, which is wrong once the keys have holes; this is the
    same forward (pre-projection, the shared-KV decoder, post-projection, the head) with the masks given."""
    embeds = assistant.pre_projection(inputs_embeds)
    outputs = assistant.model(
        inputs_embeds=embeds,
        attention_mask=masks,
        position_ids=position_ids,
        shared_kv_states=shared_kv_states,
        use_cache=False,
    )
    hidden = outputs.last_hidden_state  # [B, 1, H_assistant]
    if assistant.config.use_ordered_embeddings:  # per row: the masked head fills with its input's minimum
        logits = torch.cat([assistant.masked_embedding(h[None], assistant.lm_head.weight) for h in hidden])
    else:
        logits = assistant.lm_head(hidden)
    return logits, assistant.post_projection(hidden)


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """Ranks the model's weights are split over by transformers' tensor parallelism (`tp_plan`): its private
    `_tp_size` (transformers 5.17-5.24); 1 for a model loaded without it."""
    return int(getattr(model, "_tp_size", None) or 1)


def tensor_parallel_group(model: torch.nn.Module) -> Any:
    """The `torch.distributed` process group of the model's tensor-parallel ranks (the "tp" dimension of its private
    `_device_mesh`: 1-D on transformers 5.17, ("pp", "fsdp", "tp") on 5.24), or None without tensor parallelism."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or tensor_parallel_size(model) <= 1:
        return None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh.ndim > 1 and "tp" in names:
        mesh = mesh["tp"]
    return mesh.get_group()


@functools.cache
def sequence_bias_groups_by_length() -> bool:
    """How `SequenceBiasLogitsProcessor` adds the biases of sequences longer than one token (float sums depend on the
    order). transformers 5.24 (its `multi_token_biases`): grouped by prefix length, in order of each length's first
    sequence, a sequence matched once the input holds its prefix. 5.17: one sequence at a time in dict order,
    matched only once the input holds the whole sequence's length."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    return "multi_token_biases" in vars(SequenceBiasLogitsProcessor([[[1, 2], 1.0]]))


@functools.cache
def exponential_penalty_skips_non_finite() -> bool:
    """Whether `ExponentialDecayLengthPenalty` leaves a non-finite EOS score as it is (transformers 5.24: the penalty
    is masked to 0 there) or adds |score| * (factor^n - 1) to it anyway (5.17: -inf becomes nan)."""
    from transformers.generation.logits_process import ExponentialDecayLengthPenalty

    processor = ExponentialDecayLengthPenalty((0, 2.0), 0, 0)
    scores = processor(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-float("inf"), 0.0]]))
    return not bool(scores.isnan().any())
