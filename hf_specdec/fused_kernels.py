"""Triton kernels that do what a chain of eager elementwise kernels does, to the bit, in fewer launches.

A captured step replays the models' eager forwards, where an RMSNorm runs as 7 small kernels and a layer's rotary
embeddings as 10; compiled plain fuses them (and rounds differently). These kernels round exactly where the eager
chain rounds: each bf16/fp16 intermediate is rounded to nearest-even and read back, fp32 intermediates are kept, no
multiply-add is contracted (`enable_fp_fusion=False`), and a reduction is left to torch (its summation order is
its own): so their outputs equal the eager chain's bit for bit (`fused_layers` says which chains, and checks the
source it replaces).

- `rms_norm`: `weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)` as 3 launches: the
  squares (one kernel), their mean (torch's own reduction), and the scale (one kernel).
- `rotary`: `(x * cos) + (rotate_half(x) * sin)` for one of q or k as one launch, written with the strides the eager
  chain's result has.

On CPU tensors they run in the Triton interpreter (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_specdec.sampling.kernels import _variant, triton_interprets

#: Launch options that keep the arithmetic as written: no contraction of a multiply and an add into one rounding.
_EXACT = {"enable_fp_fusion": False}


@triton.jit(do_not_specialize=["N"])
def _square_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, x * x, mask=mask)


@triton.jit(do_not_specialize=["H"])
def _scale_kernel(x_ptr, var_ptr, w_ptr, out_ptr, eps, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    r = tl.math.rsqrt(tl.load(var_ptr + row) + eps)  # fp32, as torch.rsqrt(variance + eps)
    normed = (x.to(tl.float32) * r).to(x.dtype)  # rounded to the input's dtype, as `.to(input_dtype)`
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)  # `weight * ...` in fp32, rounded once to the result's dtype
    tl.store(out_ptr + row * H + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B", "H", "T", "xb", "xh", "xt", "cb", "ct", "ob", "oh", "ot"])
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    B, H, T,
    xb, xh, xt,  # x's strides (its last dimension is contiguous)
    cb, ct,  # cos's and sin's strides ([B or 1, T, D], last dimension contiguous; 0 for a broadcast batch)
    ob, oh, ot,  # the result's strides
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # one (b, h, t) row of D = 2 * HALF values
    t = pid % T
    h = (pid // T) % H
    b = pid // (T * H)
    d = tl.arange(0, BLOCK)
    mask = d < 2 * HALF
    first = d < HALF
    x_row = x_ptr + b * xb + h * xh + t * xt
    c_row = b * cb + t * ct
    x = tl.load(x_row + d, mask=mask, other=0.0)
    partner = tl.load(x_row + tl.where(first, d + HALF, d - HALF), mask=mask, other=0.0)
    rotated = tl.where(first, -partner, partner)  # rotate_half(x): cat(-x2, x1), exact
    cos = tl.load(cos_ptr + c_row + d, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + c_row + d, mask=mask, other=0.0)
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)  # x * cos, rounded
    b2 = (rotated.to(tl.float32) * sin.to(tl.float32)).to(x.dtype)  # rotate_half(x) * sin, rounded
    out = (a.to(tl.float32) + b2.to(tl.float32)).to(x.dtype)  # their sum, rounded
    tl.store(out_ptr + b * ob + h * oh + t * ot + d, out, mask=mask)


def _kernel(kernel):  # noqa: ANN001, ANN202 - the kernel as this process runs Triton (interpreted on the CPU)
    return _variant(kernel, triton_interprets())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """`x` [..., H] contiguous bf16/fp16, `weight` [H]: Llama's RMSNorm, bit for bit (`out_dtype`: the dtype of
    `weight * x`)."""
    H = x.shape[-1]
    squares = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [..., H], as `x.float().pow(2)`
    n = x.numel()
    block = 1024
    _kernel(_square_kernel)[(triton.cdiv(n, block),)](x, squares, n, BLOCK=block, **_EXACT)
    variance = squares.mean(-1, keepdim=True)  # [..., 1] torch's own reduction, as in the eager chain
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = n // H
    _kernel(_scale_kernel)[(rows,)](x, variance, weight, out, eps, H, BLOCK=triton.next_power_of_2(H), **_EXACT)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_stride: tuple[int, ...]) -> torch.Tensor:
    """`x` [B, H, T, D] (last dimension contiguous), `cos`, `sin` [B or 1, T, D] of x's dtype: `x * cos' +
    rotate_half(x) * sin'` (cos' = cos.unsqueeze(1)) bit for bit, written with strides `out_stride`."""
    B, H, T, D = x.shape
    out = torch.empty_strided(x.shape, out_stride, dtype=x.dtype, device=x.device)
    cb = cos.stride(0) if cos.shape[0] != 1 else 0
    _kernel(_rotary_kernel)[(B * H * T,)](
        x, cos, sin, out, B, H, T, x.stride(0), x.stride(1), x.stride(2), cb, cos.stride(1),
        out_stride[0], out_stride[1], out_stride[2], HALF=D // 2, BLOCK=triton.next_power_of_2(D), **_EXACT,
    )  # fmt: skip
    return out
