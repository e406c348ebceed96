"""The counter-based draws of `random.py` as one Triton kernel: the same bits, one launch instead of ~45.

`random.uniform` and `random.exponential` build their values from a splitmix64 hash in torch int64 arithmetic:
three mixes of the per-row key, one of every word, then the transform — some 45 elementwise launches, a quarter of
them over [B, V] int64 tensors. A sampled speculative step draws V exponentials per draft position and once more
for the recovered token, so on a GPU those launches cost more than the draws. This kernel computes the key chain,
the hash and the transform per element in registers and writes only the float32 result; it reads the step counter
from the device, so a captured graph replays each step's own draws. Same arithmetic, same values as the torch
path (`tests/sampling/test_random_kernels.py`, bit for bit on CUDA and in the CPU interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_specdec.sampling.kernels import _variant, aligned, triton_interprets

BLOCK = 1024


@triton.jit
def _mix(z):
    """splitmix64's finaliser on uint64 words (multiplication wraps mod 2^64)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit(do_not_specialize=["step_key", "stream_key", "N"])  # one compile per kind of draw, not per stream
def _draws_kernel(
    seeds_ptr,  # [B] int64
    step_ptr,  # [] int64 device counter (read when STEP_ON_DEVICE)
    step_key,  # int64: (step + 1) * STEP_KEY mod 2^64, when the step is a host int
    stream_key,  # int64: (stream + 1) * STREAM_KEY mod 2^64
    out_ptr,  # [B, N] float32
    N,
    STEP_ON_DEVICE: tl.constexpr,
    EXPONENTIAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    golden = 0x9E3779B97F4A7C15
    key = _mix(tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True) + golden)
    if STEP_ON_DEVICE:
        step = tl.load(step_ptr).to(tl.uint64, bitcast=True)
        key = _mix(key ^ ((step + 1) * 0xD6E8FEB86659FD93))
    else:
        key = _mix(key ^ step_key.to(tl.int64).to(tl.uint64, bitcast=True))
    key = _mix(key ^ stream_key.to(tl.int64).to(tl.uint64, bitcast=True))
    bits = _mix((offs + 1).to(tl.uint64) * golden + key)  # [BLOCK] the splitmix64 sequence at indices 1..N
    if EXPONENTIAL:  # -log((top 52 bits + 0.5) / 2^52), in float64: exact, in (0, 1)
        u = ((bits >> 12).to(tl.float64) + 0.5) * (2.0**-52)
        value = (-tl.log(u)).to(tl.float32)
    else:  # top 24 bits / 2^24: exact in float32, below 1
        value = (bits >> 40).to(tl.float32) * (2.0**-24)
    tl.store(out_ptr + row.to(tl.int64) * N + offs, value, mask=offs < N)


def draws_triton(
    seeds: torch.Tensor, step: int | torch.Tensor, stream_key: int, n: int, *, exponential: bool, step_key: int = 0
) -> torch.Tensor:  # [B, n] float32
    """The draws of `random.exponential` (or `random.uniform`) in one launch; CUDA tensors, or CPU tensors in the
    Triton interpreter. `random` computes the keys: `stream_key` = (stream + 1) * STREAM_KEY and, for a host int
    step, `step_key` = (step + 1) * STEP_KEY, both as signed int64 values; a tensor `step` is read on the device."""
    out = torch.empty(seeds.shape[0], n, dtype=torch.float32, device=seeds.device)  # [B, n]
    if out.numel() == 0:
        return out
    on_device = isinstance(step, torch.Tensor)
    seeds = aligned(seeds)  # one compiled variant (`kernels.aligned`)
    kernel = _variant(_draws_kernel, seeds.device.type != "cuda" or triton_interprets())
    grid = (seeds.shape[0], triton.cdiv(n, BLOCK))
    step_ptr = aligned(step.to(seeds.device)) if on_device else seeds  # (seeds: any pointer, never read)
    kernel[grid](seeds, step_ptr, step_key, stream_key, out, n, on_device, exponential, BLOCK=BLOCK)
    return out
