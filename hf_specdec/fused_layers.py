"""Fused kernels in place of transformers' RMSNorm and rotary embeddings while hf_specdec captures a step.

A captured step replays eager forwards: on an 8B Llama at batch 1, RMSNorm, rotary embeddings and the like ran as
about 280 small kernels a step, 2.5 ms of device time against compiled plain's 0.95 ms a token. While a step is
captured (and in the eager warm-up before it, which compiles the kernels), `fused(models)` swaps in the kernels of
`fused_kernels`, which compute what the eager code computes to the bit. So greedy outputs stay identical to plain
`generate`'s, and the captured graphs launch 3 kernels for an RMSNorm instead of 7 and 1 for a rotary embedding of q
or k instead of 5.

Only code that is exactly the chain the kernels replicate is replaced: a module class whose `forward`, or a modeling
module whose `apply_rotary_pos_emb` and `rotate_half`, has the same syntax tree as the reference source below
(Llama's, which Mistral, Qwen2, Qwen3 and others copy). Anything else (Gemma's `1 + weight`, partial rotary, a
subclass that changed `forward`) keeps its own code. A swapped function runs the original wherever the kernels do
not apply: tensors off the GPU, dtypes other than bf16 and fp16 (fp32 chains could be contracted differently),
other layouts, tensor subclasses, autograd, or inside `torch.compile`'s tracing. The swap is process-wide while any
call is inside `fused` (other threads' forwards then run the same bits through the kernels); `HF_SPECDEC_FUSED=0`
turns it off.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

FUSED_ENV = "HF_SPECDEC_FUSED"

#: What the RMSNorm kernels compute (transformers' `LlamaRMSNorm.forward`, type hints aside)
RMS_NORM_SOURCE = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""

#: What the rotary kernel computes (transformers' `apply_rotary_pos_emb` and `rotate_half` of modeling_llama.py)
ROTARY_SOURCE = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
ROTATE_HALF_SOURCE = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""

_DTYPES = (torch.bfloat16, torch.float16)


def _shape(source: str) -> str:
    """The syntax tree of one function's source, without its name, docstring, decorators and type hints."""
    function = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    function.name, function.decorator_list, function.returns = "f", [], None
    for arg in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]:
        arg.annotation = None
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        function.body = body[1:]  # the docstring
    return ast.dump(function, include_attributes=False)


_EXPECTED = {name: _shape(source) for name, source in
             (("rms_norm", RMS_NORM_SOURCE), ("rotary", ROTARY_SOURCE), ("rotate_half", ROTATE_HALF_SOURCE))}  # fmt: skip
_VERDICTS: dict[tuple[int, str], bool] = {}


def _is(function: object, name: str) -> bool:
    """Whether `function` is the reference code `name`, reading `torch` as torch (answers kept per function)."""
    key = (id(function), name)
    if key not in _VERDICTS:
        try:
            same = _shape(inspect.getsource(function)) == _EXPECTED[name]
            same = same and getattr(function, "__globals__", {}).get("torch") is torch
        except (OSError, TypeError, SyntaxError, AssertionError, IndexError):
            same = False
        _VERDICTS[key] = same
    return _VERDICTS[key]


def _runs_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply to these tensors here: plain tensors on a GPU (or in Triton's CPU interpreter, fp16
    only), bf16 or fp16, with autograd off (the kernels have no backward), and not while `torch.compile` traces (it
    fuses on its own)."""
    first = tensors[0]
    if first.dtype not in _DTYPES or torch.compiler.is_compiling() or torch.is_grad_enabled():
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):  # a DTensor, a quantised weight
        return False
    if first.device.type not in ("cuda", "cpu") or not _triton_runs_on(first.device.type):
        return False
    if first.device.type == "cpu" and first.dtype != torch.float16:  # the interpreter does not round bf16 as a GPU
        return False
    return all(t.dtype == first.dtype and t.device == first.device for t in tensors)


def _triton_runs_on(device_type: str) -> bool:
    """Whether Triton is installed and runs kernels on this kind of device (the CPU: only in its interpreter)."""
    try:
        from hf_specdec.sampling.kernels import triton_interprets
    except ImportError:  # triton is not a dependency
        return False
    return device_type == "cuda" or triton_interprets()


def _fused_rms_norm(original: Callable) -> Callable:
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not (
            isinstance(hidden_states, torch.Tensor) and _runs_kernels(hidden_states)
            and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and hidden_states.is_contiguous() and hidden_states.dim() >= 1 and hidden_states.numel() > 0
            and weight.device == hidden_states.device and weight.dtype in (*_DTYPES, torch.float32)
            and weight.dim() == 1 and weight.shape[0] == hidden_states.shape[-1] and weight.is_contiguous()
            and isinstance(self.variance_epsilon, float)
        ):  # fmt: skip
            return original(self, hidden_states)
        from hf_specdec.fused_kernels import rms_norm

        out_dtype = torch.promote_types(weight.dtype, hidden_states.dtype)
        return rms_norm(hidden_states, weight, self.variance_epsilon, out_dtype)

    forward._hf_specdec_original = original  # type: ignore[attr-defined]
    return forward


_STRIDES: dict[tuple, tuple[int, ...]] = {}


def _eager_stride(original: Callable, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, ...]:
    """The strides of the eager chain's result for `x`, from running it on meta tensors (kept per layout)."""
    key = (x.shape, x.stride(), cos.shape, cos.stride(), x.dtype)
    if key not in _STRIDES:

        def meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        q_embed, _ = original(meta(x), meta(x), meta(cos), meta(sin))
        _STRIDES[key] = tuple(q_embed.stride())
    return _STRIDES[key]


def _fused_rotary(original: Callable) -> Callable:
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = (q, k, cos, sin)
        if not (
            all(isinstance(t, torch.Tensor) for t in tensors) and unsqueeze_dim == 1 and _runs_kernels(*tensors)
            and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and cos.stride() == sin.stride() and q.shape[-1] % 2 == 0
            and all(t.shape[-1] == q.shape[-1] and t.stride(-1) == 1 for t in tensors)
            and cos.shape[0] in (1, q.shape[0]) and cos.shape[0] in (1, k.shape[0]) and q.shape[0] == k.shape[0]
            and cos.shape[1] == q.shape[2] == k.shape[2] and q.numel() > 0 and k.numel() > 0
        ):  # fmt: skip
            return original(q, k, cos, sin, unsqueeze_dim)
        from hf_specdec.fused_kernels import rotary

        return (
            rotary(q, cos, sin, _eager_stride(original, q, cos, sin)),
            rotary(k, cos, sin, _eager_stride(original, k, cos, sin)),
        )

    apply_rotary_pos_emb._hf_specdec_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def swaps(models: list[torch.nn.Module]) -> list[tuple[Any, str, Callable]]:
    """(owner, attribute, fused replacement) for every RMSNorm class and modeling module in `models` whose code is
    the reference code: what `fused` swaps in."""
    found: dict[tuple[int, str], tuple[Any, str, Callable]] = {}
    classes = {type(module) for model in models for module in model.modules()}  # each class and its module once
    for cls in classes:
        forward = cls.__dict__.get("forward")
        forward = getattr(forward, "_hf_specdec_original", forward)  # swapped in by another call's block: its original
        if forward is not None and _is(forward, "rms_norm"):
            found[(id(cls), "forward")] = (cls, "forward", _fused_rms_norm(forward))
    for home in {sys.modules.get(cls.__module__) for cls in classes}:
        rope = getattr(home, "apply_rotary_pos_emb", None)
        rope = getattr(rope, "_hf_specdec_original", rope)
        if rope is not None and _is(rope, "rotary") and _is(getattr(home, "rotate_half", None), "rotate_half"):
            found[(id(home), "apply_rotary_pos_emb")] = (home, "apply_rotary_pos_emb", _fused_rotary(rope))
    return list(found.values())


def enabled() -> bool:
    return os.environ.get(FUSED_ENV, "1") != "0"


_LOCK = threading.Lock()
_ACTIVE: dict[tuple[int, str], list] = {}  # (id(owner), attribute) -> [owner, original, users]


@contextlib.contextmanager
def fused(replacements: list[tuple[Any, str, Callable]]) -> Iterator[None]:
    """The replacements in force inside the block (counted across threads: the originals come back when the last
    block that swapped them ends)."""
    taken = []
    with _LOCK:
        for owner, name, replacement in replacements:
            key = (id(owner), name)
            if key not in _ACTIVE:
                _ACTIVE[key] = [owner, replacement._hf_specdec_original, 0]
                setattr(owner, name, replacement)
            _ACTIVE[key][2] += 1
            taken.append(key)
    try:
        yield
    finally:
        with _LOCK:
            for key in taken:
                entry = _ACTIVE[key]
                entry[2] -= 1
                if entry[2] == 0:
                    setattr(entry[0], key[1], entry[1])
                    del _ACTIVE[key]
