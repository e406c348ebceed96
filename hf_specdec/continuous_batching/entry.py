"""The continuous-batching entry points `install()` routes: `generate_batch`, `init_continuous_batching`,
`continuous_batching_context_manager` (each taking `spec_decoder=`) and paged `generate`.

transformers' `generate_batch` drops keyword arguments it does not know, and its context manager calls
`init_continuous_batching` itself; so the spec_decoder of an outer call is handed to the inner
`init_continuous_batching` through a context variable (all three run on the caller's thread).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from hf_specdec.config import SpecDecoder
from hf_specdec.continuous_batching.compat import ContinuousMixin

#: A model attribute naming the SpecDecoder every continuous-batching manager of that model speculates with, when a
#: call names none (set by `set_default_spec`; how `hf-specdec serve` reaches transformers' serve app).
DEFAULT_SPEC_ATTRIBUTE = "_hf_specdec_cb_spec_decoder"

_PENDING_SPEC: contextvars.ContextVar[SpecDecoder | None] = contextvars.ContextVar("hf_specdec_cb_spec", default=None)
_ORIGINALS: dict[str, Callable] = {}


def _check_inputs(inputs: Any) -> None:
    if not isinstance(inputs, (list, tuple)) or not all(
        isinstance(row, (list, tuple)) and row and all(isinstance(t, int) for t in row) for row in inputs
    ):
        raise ValueError(
            "generate_batch(inputs=...) with spec_decoder takes a list of non-empty lists of token ids (ints), got "
            f"{type(inputs).__name__}: e.g. tokenizer(prompts)['input_ids']."
        )


def _init_continuous_batching(original: Callable) -> Callable:
    @functools.wraps(original)
    def init_continuous_batching(
        self,
        generation_config=None,
        continuous_batching_config=None,  # noqa: ANN001, ANN202
        workload_hints=None,
        spec_decoder: SpecDecoder | None = None,
    ):
        spec = spec_decoder if spec_decoder is not None else _PENDING_SPEC.get()
        if spec is None:
            spec = getattr(self, DEFAULT_SPEC_ATTRIBUTE, None)
        if spec is None:
            return original(self, generation_config, continuous_batching_config, workload_hints)
        from hf_specdec.continuous_batching.manager import init_spec_continuous_batching

        return init_spec_continuous_batching(
            self, generation_config, continuous_batching_config, workload_hints, spec_decoder=spec
        )

    return init_continuous_batching


def _context_manager(original: Callable) -> Callable:
    @functools.wraps(original)
    @contextmanager
    def continuous_batching_context_manager(
        self,
        *args: Any,
        spec_decoder: SpecDecoder | None = None,  # noqa: ANN001
        **kwargs: Any,
    ) -> Iterator[Any]:
        with ExitStack() as stack:
            token = _PENDING_SPEC.set(spec_decoder) if spec_decoder is not None else None
            try:
                manager = stack.enter_context(original(self, *args, **kwargs))
            finally:
                if token is not None:
                    _PENDING_SPEC.reset(token)
            yield manager

    return continuous_batching_context_manager


def _generate_batch(original: Callable) -> Callable:
    @functools.wraps(original)
    def generate_batch(self, inputs, *args: Any, spec_decoder: SpecDecoder | None = None, **kwargs: Any):  # noqa: ANN001, ANN202
        if spec_decoder is None:
            return original(self, inputs, *args, **kwargs)
        _check_inputs(inputs)
        token = _PENDING_SPEC.set(spec_decoder)
        try:
            return original(self, inputs, *args, **kwargs)
        finally:
            _PENDING_SPEC.reset(token)

    return generate_batch


def set_default_spec(model: torch.nn.Module, spec: SpecDecoder | None) -> None:
    """Make every continuous-batching manager of `model` that names no spec_decoder speculate with `spec` (None:
    stop). Used where the caller of `init_continuous_batching` is not ours, e.g. transformers' serve app."""
    if spec is None:
        if hasattr(model, DEFAULT_SPEC_ATTRIBUTE):
            delattr(model, DEFAULT_SPEC_ATTRIBUTE)
        return
    if not isinstance(spec, SpecDecoder):
        raise TypeError(f"spec must be a hf_specdec.SpecDecoder or None, got {type(spec).__name__}.")
    setattr(model, DEFAULT_SPEC_ATTRIBUTE, spec)


def install_cb() -> None:
    """Route `spec_decoder=` through transformers' continuous-batching entry points (idempotent)."""
    if _ORIGINALS:
        return
    for name, wrap in (
        ("init_continuous_batching", _init_continuous_batching),
        ("continuous_batching_context_manager", _context_manager),
        ("generate_batch", _generate_batch),
    ):
        original = ContinuousMixin.__dict__[name]
        _ORIGINALS[name] = original
        wrapped = wrap(original)
        wrapped.__hf_specdec__ = True
        setattr(ContinuousMixin, name, wrapped)


def uninstall_cb() -> None:
    """Undo `install_cb()`."""
    for name, original in _ORIGINALS.items():
        setattr(ContinuousMixin, name, original)
    _ORIGINALS.clear()


def paged_generate(
    model: torch.nn.Module, inputs: torch.Tensor | None, kwargs: dict[str, Any], spec: SpecDecoder
) -> torch.Tensor:
    """`generate(..., cache_implementation="paged", spec_decoder=spec)`: every row through speculative continuous
    batching. Unlike transformers' own paged route, left padding is removed with the attention mask (transformers
    feeds pad tokens as prompt). Returns transformers' paged shape `[1, B, L]` (prompt then generated tokens, rows
    right-padded with the pad token when their lengths differ)."""
    kwargs = dict(kwargs)
    kwargs.pop("cache_implementation")
    inputs = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if inputs is None or not isinstance(inputs, torch.Tensor) or inputs.dim() not in (1, 2):
        raise ValueError("Paged generate needs input_ids as a 1D or 2D tensor of token ids.")
    inputs = inputs[None] if inputs.dim() == 1 else inputs
    mask = kwargs.pop("attention_mask", None)
    for name in ("stopping_criteria", "prefix_allowed_tokens_fn", "streamer", "negative_prompt_ids"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name} is not supported by paged generate (continuous batching).")
    rows = []
    for i, row in enumerate(inputs.tolist()):
        keep = mask[i].bool().tolist() if mask is not None else [True] * len(row)
        rows.append([t for t, k in zip(row, keep) if k])
    cb_config = kwargs.pop("continuous_batching_config", None)
    generation_config, _ = model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    outputs = model.generate_batch(
        rows,
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        spec_decoder=spec,
        max_new_tokens=generation_config.max_new_tokens,
    )
    sequences = [outputs[f"req_{i}"].prompt_ids + outputs[f"req_{i}"].generated_tokens for i in range(len(rows))]
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
    width = max(len(s) for s in sequences)
    padded = [s + [pad] * (width - len(s)) for s in sequences]
    return torch.tensor(padded, dtype=torch.long, device=model.device).unsqueeze(0)
