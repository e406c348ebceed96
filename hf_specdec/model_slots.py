"""State that hf_specdec keeps per model and that must go when the model goes: held by the model itself.

A module-level `WeakKeyDictionary` frees its value with its key only if the value does not refer back to the key.
Kept step graphs (their loop holds the target and the draft) and compiled calls (a bound `model.__call__`) do, so
such a table kept every model that ever ran on the static path alive, with its kept static caches, for the life of
the process. A `ModelSlot` lives in the model's own `__dict__` instead: the model and what the slot holds form a
reference cycle that the garbage collector frees with the model. Deep copies and pickles of the model start without
it (they get an empty dict), and a shallow copy (`copy.copy`) does not see its original's slot.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_LOCK = threading.Lock()

#: the names models hold values under (`model_guard` leaves them out of a model's fingerprint: they are hf_specdec's
#: bookkeeping, which no forward reads, and made after the fingerprint that kept graphs are checked against)
NAMES: set[str] = set()


class ModelSlot:
    """One value hf_specdec keeps for one model (see the module doc)."""

    def __init__(self, owner: object, value: Any) -> None:
        self.owner = weakref.ref(owner)
        self.value = value

    def __deepcopy__(self, memo: dict) -> dict:
        return {}  # a copied model starts without the original's graphs or compiled calls

    def __reduce__(self) -> tuple:
        return (dict, ())  # nor does a pickled one (and unpickling needs no hf_specdec)


def held(model: object, name: str, factory: Callable[[], T] | None = None) -> T | None:
    """The value `model` holds under `name` (made by `factory` when there is none yet), or None without a factory."""
    with _LOCK:
        slot = getattr(model, "__dict__", {}).get(name)
        if isinstance(slot, ModelSlot) and slot.owner() is model:
            return slot.value
        if factory is None:
            return None
        NAMES.add(name)
        slot = ModelSlot(model, factory())
        object.__setattr__(model, name, slot)  # past `nn.Module.__setattr__`: neither a parameter nor a module
        return slot.value


def drop(model: object, name: str) -> None:
    """Forget what `model` holds under `name`."""
    with _LOCK:
        getattr(model, "__dict__", {}).pop(name, None)
