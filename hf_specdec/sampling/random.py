"""Counter-based random draws for the rejection sampler: one independent stream per (row seed, step, stream).

Every value is a pure function of (seed, step, stream, index) — a splitmix64 hash computed in torch int64
arithmetic on the seeds' device (on CUDA, the same arithmetic in one Triton launch: `random_kernels.py`) — so a
row's draws never depend on the batch it shares, its position in that batch, the batch size or the device. This
is what makes batched speculative decoding reproducible row by row: the same seed gives the same draws whether the
request runs alone or among others (and the same text, unless a draw is decided within the last bits that batching
moves in the logits: docs/usage.md, "Seeds and reproducibility").
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_RESIDUAL",
    "exponential",
    "random_bits",
    "random_seeds",
    "uniform",
]

# Streams: independent families of draws within one (seed, step). `uniform` and `exponential` of the same
# (seed, step, stream, index) are built from the same hash, hence dependent: give each use its own stream.
STREAM_ACCEPT: int = 0
"""Uniforms of the accept test `p(d) > u * q(d)`, one per draft position: `uniform(seeds, step, STREAM_ACCEPT, k)`."""
STREAM_RESIDUAL: int = 1
"""Exp(1) draws choosing the recovered or bonus token: `exponential(seeds, step, STREAM_RESIDUAL, V)`."""
STREAM_DRAFT: int = 2
"""Draft sampling: draft position j uses stream `STREAM_DRAFT + j` (so every stream >= 2 belongs to drafts)."""

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, the splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_STEP_KEY = 0xD6E8FEB86659FD93  # odd constants: x -> x * K is a bijection mod 2^64
_STREAM_KEY = 0xA0761D6478BD642F
_UNIFORM_BITS = 24  # float32 has a 24-bit significand: bits / 2^24 is exact and < 1
_EXPONENTIAL_BITS = 52  # (bits + 0.5) / 2^52 is exact in float64 and < 1; -log of it reaches ~36.7 in the tail


def _signed(x: int) -> int:
    """The two's complement int64 value of the Python int `x` taken mod 2^64."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def _shr_(x: torch.Tensor, s: int) -> torch.Tensor:
    """In place: logical right shift of int64 `x` by `s` bits (torch's `>>` on int64 is arithmetic)."""
    return x.bitwise_right_shift_(s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """In place: the splitmix64 finaliser, a bijection of 64-bit words (int64 multiplication wraps mod 2^64).

    In-place ops avoid a fresh allocation per step, which makes this about 4x faster on the CPU.
    """
    shifted = torch.empty_like(z)  # same shape as z
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=shifted)
        z.bitwise_xor_(shifted.bitwise_and_((1 << (64 - shift)) - 1))  # z ^= z >>> shift
        if multiplier is not None:
            z.mul_(_signed(multiplier))
    return z


def _check_seeds(seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int) -> None:
    if not isinstance(seeds, torch.Tensor) or seeds.dtype != torch.int64 or seeds.dim() != 1:
        got = f"{tuple(seeds.shape)} {seeds.dtype}" if isinstance(seeds, torch.Tensor) else type(seeds).__name__
        raise ValueError(f"`seeds` must be a 1-D int64 tensor [B], got {got}; build it with `random_seeds(B)`.")
    if isinstance(step, torch.Tensor):
        if step.dtype != torch.int64 or step.dim() != 0:
            raise TypeError(f"a tensor `step` must be a 0-d int64 tensor, got {tuple(step.shape)} {step.dtype}.")
        step = 0  # checked: a device counter (a CUDA graph replays it), same draws as the int it holds
    for name, value in (("step", step), ("stream", stream), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be a Python int, got {value!r} ({type(value).__name__}).")
    if n < 0:
        raise ValueError(f"`n` must be >= 0 (number of draws per row), got {n}.")


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_kernel(seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int) -> bool:
    """Whether the draws run as one Triton launch (`random_kernels`): CUDA seeds and triton importable, unless
    HF_SPECDEC_SAMPLER=torch asks for the sampler in torch operations (`rejection.SAMPLER_ENV`)."""
    from hf_specdec.sampling.rejection import SAMPLER_ENV

    _check_seeds(seeds, step, stream, n)
    forced_torch = os.environ.get(SAMPLER_ENV, "").strip().lower() == "torch"
    return seeds.is_cuda and not forced_torch and _triton_importable()


def _draws_triton(
    seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int, exponential: bool
) -> torch.Tensor:
    """The same draws in one Triton launch (`random_kernels.py`), given this module's keys."""
    from hf_specdec.sampling.random_kernels import draws_triton

    step_key = 0 if isinstance(step, torch.Tensor) else _signed((step + 1) * _STEP_KEY)
    stream_key = _signed((stream + 1) * _STREAM_KEY)
    return draws_triton(seeds, step, stream_key, n, exponential=exponential, step_key=step_key)


def random_bits(seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """
    Returns 64 pseudo-random bits per (row, index), as int64 words, a pure function of (seed, step, stream, index).

    Args:
        seeds (`torch.Tensor` of shape `(batch_size,)`, int64):
            One seed per row (any int64 value, negative included).
        step (`int` or 0-d int64 `torch.Tensor`):
            The decoding step (any integer; taken mod 2^64). A tensor (a device counter, which a captured CUDA
            graph reads at replay) gives exactly the draws of the int it holds.
        stream (`int`):
            Which family of draws (`STREAM_ACCEPT`, `STREAM_RESIDUAL`, `STREAM_DRAFT + j`, ...).
        n (`int`):
            Number of words per row.

    Returns:
        `torch.Tensor` of shape `(batch_size, n)`, int64, on the seeds' device.
    """
    _check_seeds(seeds, step, stream, n)
    # Chain the bijective mixer over the key parts so that distinct (seed, step, stream) give distinct keys.
    key = _mix64_(seeds + _signed(_GOLDEN))  # [B]
    if isinstance(step, torch.Tensor):  # int64 products wrap mod 2^64, as _signed does for the int
        step_key = (step.to(seeds.device) + 1) * _signed(_STEP_KEY)  # [] int64
    else:
        step_key = _signed((step + 1) * _STEP_KEY)
    key = _mix64_(key.bitwise_xor_(step_key))  # [B]
    key = _mix64_(key.bitwise_xor_(_signed((stream + 1) * _STREAM_KEY)))  # [B]
    index = torch.arange(1, n + 1, dtype=torch.int64, device=seeds.device)  # [n]
    # splitmix64 sequence: the i-th output is mix(key + i * golden).
    return _mix64_(index.mul_(_signed(_GOLDEN))[None, :] + key[:, None])  # [B, n]


def uniform(seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """
    Draws `n` uniforms per row in [0, 1), each a pure function of (seed, step, stream, index).

    The top 24 bits of the hash are scaled by 2^-24, so every value is an exact float32 multiple of 2^-24 and
    strictly below 1.

    Args:
        seeds (`torch.Tensor` of shape `(batch_size,)`, int64):
            One seed per row.
        step (`int` or 0-d int64 `torch.Tensor`):
            The decoding step.
        stream (`int`):
            Which family of draws; the accept test uses `STREAM_ACCEPT`.
        n (`int`):
            Number of draws per row.

    Returns:
        `torch.Tensor` of shape `(batch_size, n)`, float32, in [0, 1), on the seeds' device.
    """
    if _use_kernel(seeds, step, stream, n):
        return _draws_triton(seeds, step, stream, n, exponential=False)
    return torch_uniform(seeds, step, stream, n)


def torch_uniform(seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int) -> torch.Tensor:  # [B, n]
    """`uniform` in torch operations (on any device; on CUDA `uniform` launches one Triton kernel instead)."""
    bits = _shr_(random_bits(seeds, step, stream, n), 64 - _UNIFORM_BITS)  # [B, n] in [0, 2^24)
    return bits.to(torch.float32).mul_(2.0**-_UNIFORM_BITS)  # [B, n]


def exponential(seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """
    Draws `n` Exp(1) values per row, each a pure function of (seed, step, stream, index).

    Computed as `-log((bits + 0.5) / 2^52)` in float64 from the top 52 bits of the hash (exact, in (0, 1)), then
    rounded to float32: every value is finite and strictly positive (smallest ~1.1e-16, largest ~36.7).

    Args:
        seeds (`torch.Tensor` of shape `(batch_size,)`, int64):
            One seed per row.
        step (`int` or 0-d int64 `torch.Tensor`):
            The decoding step.
        stream (`int`):
            Which family of draws; the recovered and bonus tokens use `STREAM_RESIDUAL`.
        n (`int`):
            Number of draws per row (the vocabulary size for the rejection sampler).

    Returns:
        `torch.Tensor` of shape `(batch_size, n)`, float32, finite and > 0, on the seeds' device.
    """
    if _use_kernel(seeds, step, stream, n):
        return _draws_triton(seeds, step, stream, n, exponential=True)
    return torch_exponential(seeds, step, stream, n)


def torch_exponential(seeds: torch.Tensor, step: int | torch.Tensor, stream: int, n: int) -> torch.Tensor:  # [B, n]
    """`exponential` in torch operations (on any device; on CUDA `exponential` launches one Triton kernel instead)."""
    bits = _shr_(random_bits(seeds, step, stream, n), 64 - _EXPONENTIAL_BITS)  # [B, n] in [0, 2^52)
    u = bits.to(torch.float64).add_(0.5).mul_(2.0**-_EXPONENTIAL_BITS)  # [B, n] in (0, 1), exact
    return u.log_().neg_().to(torch.float32)  # [B, n]


def random_seeds(
    n: int, generator: torch.Generator | None = None, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """
    Draws `n` base seeds (one per row) from torch's RNG.

    With `generator=None` the global CPU generator is used, so `torch.manual_seed(s)` makes unseeded runs
    reproducible.

    Args:
        n (`int`):
            Number of seeds.
        generator (`torch.Generator`, *optional*):
            A CPU generator to draw from instead of the global one.
        device (`torch.device` or `str`, *optional*):
            Where to put the returned seeds (they are always drawn on the CPU, so the values do not depend on it).

    Returns:
        `torch.Tensor` of shape `(n,)`, int64.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"`n` must be a non-negative Python int, got {n!r}.")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"`generator` must be a CPU torch.Generator, got one on {generator.device}.")
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=generator)  # [n]
    return seeds if device is None else seeds.to(device)
