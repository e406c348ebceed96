"""Which SDPA kernels hf_specdec's calls on a GPU's dynamic path may use: every backend the user left on except
cuDNN's. Static-path calls (the default on a GPU) keep the user's setting.

cuDNN's attention builds an execution plan for each new pair of query and key lengths, and the build runs on the
host. The dynamic path's forwards meet many such pairs: verify widths 1..k+1 against a cache that grows every step,
drafts and catch-ups of varying widths. Measured on an H100 (torch 2.11, an 8B-shaped bf16 Llama target with sdpa,
the eager dynamic path, B = 32, alpha 0.8, 64 new tokens, in a fresh process): with cuDNN, the first two calls took
20 s and 9.1 s, SDPA holding 88% of the host's time, and the next ones 1.5-1.6 s; without it the first call took
5.1 s and the next ones 1.7-1.8 s. Plain `generate` keeps cuDNN (its decode forwards have one query token).

Static caches have one length, so a static-path call meets a few pairs per captured graph (and its prefill one, as
plain `generate`'s does), and at long contexts cuDNN's kernel is the fast one. Measured on an H100 (8B-shaped
Llama, 4 096-token prompts, B = 1, the grid's `8b-p4k` group): the captured steps' attention took 212 us per layer
and step on the memory-efficient kernel against cuDNN's 104 us, and the call ran at 0.64x compiled plain at alpha 0
and 1.20x at alpha 0.8 without cuDNN, 0.79x and 1.57x with it.

The switch is process-wide (torch keeps SDPA's backend flags global), so it is counted: the first call in flight
turns cuDNN's attention off and the last one to end puts the user's setting back, whatever order threads end in.
Another thread's work that runs meanwhile (a plain `generate` or a static-path call, say) uses the other kernels too.
A user who turned every other backend off keeps cuDNN: then nothing changes. `HF_SPECDEC_CUDNN_ATTENTION=1` leaves
the setting alone on the dynamic path too.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

__all__ = ["KEEP_CUDNN_ENV", "without_cudnn_attention"]

#: set to 1 to keep cuDNN's attention as the user set it during dynamic-path calls too
KEEP_CUDNN_ENV = "HF_SPECDEC_CUDNN_ATTENTION"

_LOCK = threading.Lock()
_HOLDERS = 0
_SAVED: bool | None = None  # the cuDNN flag as the first holder found it


def _others_enabled() -> bool:
    backends = torch.backends.cuda
    return backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled() or backends.math_sdp_enabled()


@contextlib.contextmanager
def without_cudnn_attention(device: torch.device) -> Iterator[None]:
    """cuDNN's SDPA kernels off while the block runs on a CUDA `device` (nothing happens on other devices)."""
    global _HOLDERS, _SAVED
    if device.type != "cuda" or os.environ.get(KEEP_CUDNN_ENV, "0") == "1":
        yield
        return
    with _LOCK:
        if _HOLDERS == 0:
            _SAVED = torch.backends.cuda.cudnn_sdp_enabled()
            if _others_enabled():
                torch.backends.cuda.enable_cudnn_sdp(False)
        _HOLDERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _HOLDERS -= 1
            if _HOLDERS == 0:
                torch.backends.cuda.enable_cudnn_sdp(bool(_SAVED))
                _SAVED = None
