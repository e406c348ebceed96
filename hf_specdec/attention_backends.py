"""Which SDPA kernels hf_specdec's calls on a GPU may use: on the dynamic path every backend the user left on except
cuDNN's; on the static path, and in anything captured, the user's setting.

cuDNN's attention builds an execution plan for each new pair of query and key lengths, and the build runs on the
host. The dynamic path's forwards meet many such pairs: verify widths 1..k+1 against a cache that grows every step,
drafts and catch-ups of varying widths. Measured on an H100 (torch 2.11, an 8B-shaped bf16 Llama target with sdpa,
the eager dynamic path, B = 32, alpha 0.8, 64 new tokens, in a fresh process): with cuDNN, the first two calls took
20 s and 9.1 s, SDPA holding 88% of the host's time, and the next ones 1.5-1.6 s; without it the first call took
5.1 s and the next ones 1.7-1.8 s. Plain `generate` keeps cuDNN (its decode forwards have one query token).

The switch (`without_cudnn_attention`, entered by dynamic-path calls and the continuous-batching loop) is
process-wide (torch keeps SDPA's backend flags global), so it is counted: the first call in flight turns cuDNN's
attention off and the last one to end puts the user's setting back, whatever order threads end in. Another thread's
work that runs meanwhile (a plain `generate`, say) uses the other kernels too. A user who turned every other backend
off keeps cuDNN: then nothing changes. `HF_SPECDEC_CUDNN_ATTENTION=1` leaves the setting alone.

Static caches have one length, so a static-path call meets a few pairs per graph and keeps the user's setting. A
CUDA graph keeps the kernels its capture picked, so whatever is captured under the switch (continuous batching's
draft forwards) gets the user's setting back while it warms up and is captured (`cudnn_for_capture`). Measured on
an H100 (8B-shaped Llama, 4 096-token prompts, B = 1, the grid's `8b-p4k` group): without cuDNN the captured steps'
attention took 212 us per layer and step (the memory-efficient kernel) against cuDNN's 104 us, and the call ran at
0.64x compiled plain at alpha 0 and 1.20x at alpha 0.8, against 0.79x and 1.57x with cuDNN kept for the whole call.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

__all__ = ["KEEP_CUDNN_ENV", "cudnn_for_capture", "without_cudnn_attention"]

#: set to 1 to keep cuDNN's attention as the user set it during hf_specdec's calls
KEEP_CUDNN_ENV = "HF_SPECDEC_CUDNN_ATTENTION"

_LOCK = threading.Lock()
_HOLDERS = 0
_SAVED: bool | None = None  # the cuDNN flag as the first holder found it
_TURNED_OFF = False  # whether the holders turned it off (it was on, and another kernel was left)
_CAPTURING = 0  # captured steps warming up or being captured: the user's setting back meanwhile


def _others_enabled() -> bool:
    backends = torch.backends.cuda
    return backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled() or backends.math_sdp_enabled()


@contextlib.contextmanager
def without_cudnn_attention(device: torch.device) -> Iterator[None]:
    """cuDNN's SDPA kernels off while the block runs on a CUDA `device` (nothing happens on other devices)."""
    global _HOLDERS, _SAVED, _TURNED_OFF
    if device.type != "cuda" or os.environ.get(KEEP_CUDNN_ENV, "0") == "1":
        yield
        return
    with _LOCK:
        if _HOLDERS == 0:
            _SAVED = torch.backends.cuda.cudnn_sdp_enabled()
            _TURNED_OFF = _SAVED and _others_enabled()
            _apply()
        _HOLDERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _HOLDERS -= 1
            if _HOLDERS == 0:
                torch.backends.cuda.enable_cudnn_sdp(bool(_SAVED))
                _SAVED, _TURNED_OFF = None, False


@contextlib.contextmanager
def cudnn_for_capture() -> Iterator[None]:
    """cuDNN's attention as the user set it while the block runs (a captured step's warm-up and capture: the graph
    keeps the kernels picked then, for (query, key) lengths that never change). Nothing changes outside calls."""
    global _CAPTURING
    with _LOCK:
        _CAPTURING += 1
        _apply()
    try:
        yield
    finally:
        with _LOCK:
            _CAPTURING -= 1
            _apply()


def _apply() -> None:
    """Under `_LOCK`: cuDNN's flag for the current holders and captures (left alone unless the holders turned it
    off)."""
    if _TURNED_OFF:
        torch.backends.cuda.enable_cudnn_sdp(_CAPTURING > 0)
