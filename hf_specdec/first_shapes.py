"""Which forward shapes each model has run in this process, so that a step paying a shape's first run is not timed.

On a GPU the first forward at a new shape loads kernels and builds their plans: measured on an H100 with an eager
8B-shaped target and its draft, a first forward of a new width took 50–1000 ms against 3–23 ms for the next ones.
The dynamic (eager) path's widths vary from step to step (verify widths 1..k+1, a draft's catch-up after plain
steps), so its first calls meet many widths. The adaptive schedule took those steps' times for what drafting costs,
and never drafted again. `SpeculativeLoop.step` now asks `take_new()` after each step and leaves such a step
untimed. A model's whole first dynamic call at a batch size is left untimed too: measured there, its drafting steps
took 4-20x what they took in later calls, shapes repeated or not (kernel compiles and loads that no shape names).
What was seen is kept per model (weakly) and flagged per thread (each `generate` call runs on one).
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["builds_plans_per_shape", "note", "take_new"]

_SEEN: weakref.WeakKeyDictionary[torch.nn.Module, set[tuple[object, ...]]] = weakref.WeakKeyDictionary()
_LOCAL = threading.local()


def builds_plans_per_shape(device: torch.device) -> bool:
    """Whether a forward's first run at a new shape costs far more than later ones (a GPU's kernel plans)."""
    return device.type == "cuda"


def note(model: torch.nn.Module, shape: tuple[object, ...], device: torch.device) -> bool:
    """A forward of `model` over inputs of `shape` ran on `device` (or, keyed alike, a call or a step): flag it and
    say so when that is its first at that shape."""
    if not builds_plans_per_shape(device):
        return False
    seen = _SEEN.setdefault(model, set())
    if shape in seen:
        return False
    seen.add(shape)
    _LOCAL.new = True
    return True


def take_new() -> bool:
    """Whether a forward on this thread ran a shape for the first time since the last call (and clear it)."""
    new = getattr(_LOCAL, "new", False)
    _LOCAL.new = False
    return new
