"""Captured step graphs kept across calls: a later call with the same shapes replays them, with no warm-up or capture.

A `StepGraph`'s graphs read fixed addresses: the loop's state tensors (the *homes*) and its static caches. When a call
ends, its graphs and its loop (which owns those tensors) are kept per target model under the call's *signature*:
everything a graph bakes in (batch size, k, the static caches' bucketed length, the models, dtypes, sampling and
stopping settings; `max_length` is a tensor the graphs read, so calls of other prompt and answer lengths in one
length bucket share graphs). A later call with the same signature copies its own state into the homes and points
its attributes at them (`adopt`), then replays. One call at a time uses an entry (a concurrent call with the same signature captures
its own); at most `MAX_ENTRIES` are kept per model, the oldest dropped; `clear(model)` drops a model's entries.
The model itself holds its entries (`hf_specdec.model_slots`): they go with it (a module-level table keyed weakly by
the model kept every such model alive, since an entry's loop refers back to it).

An entry also keeps the `model_guard.Fingerprint` of every model its graphs ran (the target and the models its
proposer drives), taken when the call that captured them began. A call adopts an entry only when its own models'
fingerprint is equal: a hook, a replaced parameter, a wrapped module, a changed Python attribute or `training` makes
it capture anew and drop the stale entry. A call during which a model changed keeps nothing.

Reuse is on by default (`HF_SPECDEC_REUSE_GRAPHS=0` turns it off): a call that adopts an entry skips the eager
warm-up step and the capture of each step kind, about a third of a 64-token call at batch 1 on an H100. What an entry
holds stays allocated on the GPU (the static caches, the state tensors and the graphs' memory pools), so entries are
kept only while the tensors they hold total at most `kept_budget` per model (2 GiB, or 5% of a larger GPU's memory):
small batches, whose calls pay the most for capturing, are kept; a batch of 128 rows at 8B scale (gigabytes of
static cache) is not. Its first H100 runs hit a device-side index assert in a replay (a step kind captured after a
catch-up forward without its state put home first); the CPU emulation of CUDA graphs (tests/emulated_graphs.py)
reproduced and fixed it (`step_graph.StepGraph.run`), and the H100 runs since replay every adopted graph exactly.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from hf_specdec import compat, model_slots
from hf_specdec.model_guard import Fingerprint, model_serial

REUSE_ENV = "HF_SPECDEC_REUSE_GRAPHS"
MAX_ENTRIES = 4
#: The most bytes of tensors and caches the kept entries of one model may hold (their graphs' pools come on top).
MAX_KEPT_BYTES = 2 * 2**30
#: ... or this share of the GPU's memory, where that is more (4 GB on an 80 GB H100). With 2 GiB, sampled calls at
#: batch 32 with an 8B target found no kept entry and captured anew, 0.08-0.12 s of a 0.93 s call on an H100 (by
#: our estimate their static caches, logits and draws pass 2 GiB; not verified on the GPU)
KEPT_SHARE = 0.05

Slot = tuple[object, str, Any]  # (owner, attribute, value)


@dataclass
class Entry:
    """A finished call's graphs, kept for the next call with the same signature."""

    signature: Hashable
    root: object  # the loop whose tensors and caches the graphs read (kept alive with them)
    device: torch.device  # where the graphs run: only state on it can be read by them
    #: the tensors and caches the graphs read, by (owner path, attribute), as they were when the call's last step
    #: ended (the loop may drop some afterwards, e.g. the statistics' device counters once they are read)
    slots: dict[tuple[str, str], Any] = field(default_factory=dict)
    graphs: dict = field(default_factory=dict)  # key -> captured step (host deltas by owner path)
    rebind_paths: list[tuple[str, str]] = field(default_factory=list)  # (owner path, attribute) replaced each step
    keepalive: list[object] = field(default_factory=list)  # earlier calls' loops (objects their graphs may read)
    in_use: bool = False
    #: what the models' forwards could see when the graphs were captured (`model_guard`); None: not checked
    guard: Fingerprint | None = None
    model_ids: frozenset[int] = frozenset()  # the models the graphs ran (`forget` drops entries of any of them)


#: the attribute under which a model holds its kept entries (`model_slots`)
_SLOT = "_hf_specdec_kept_graphs"
#: the models holding entries (weakly: `clear` of a draft finds the targets whose entries ran it)
_HOLDERS: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()


def entries(model: object, create: bool = False) -> list[Entry]:
    """`model`'s kept entries, oldest first (an empty list, not kept, when it has none and `create` is False)."""
    found = model_slots.held(model, _SLOT, list if create else None)
    if create:
        _HOLDERS.add(model)
    return found if found is not None else []


def enabled() -> bool:
    return os.environ.get(REUSE_ENV, "1") != "0"


def owners_by_path(root: object) -> dict[str, object]:
    """`root` ("") and every hf_specdec object reachable from it, by attribute path (as `state_owners` walks)."""
    found: dict[str, object] = {}
    seen: set[int] = set()

    def visit(value: object, path: str) -> None:
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]")
            return
        if not type(value).__module__.startswith("hf_specdec") or id(value) in seen or not hasattr(value, "__dict__"):
            return
        if getattr(value, "not_step_state", False) or getattr(value, "host_only", False):
            return
        seen.add(id(value))
        found[path] = value
        for name, attribute in vars(value).items():
            visit(attribute, f"{path}.{name}")

    visit(root, "")
    return found


def state_slots(root: object, device: torch.device | None = None) -> dict[tuple[str, str], Slot]:
    """Every tensor or transformers `Cache` attribute of the objects reachable from `root`, by (owner path, name);
    with `device`, only tensors on that kind of device (a GPU's graphs never read the host's bookkeeping)."""
    return {
        (path, name): (owner, name, value)
        for path, owner in owners_by_path(root).items()
        for name, value in vars(owner).items()
        if isinstance(value, Cache)
        or (isinstance(value, torch.Tensor) and (device is None or value.device.type == device.type))
    }


def snapshot(entry: Entry) -> None:
    """Record the slots of the entry's loop now (its last step just ended)."""
    entry.slots = {key: value for key, (_, _, value) in state_slots(entry.root, entry.device).items()}


def checkout(
    model: object, signature: Hashable, changed: Callable[[Fingerprint], str | None] | None = None
) -> tuple[Entry | None, str]:
    """A free entry of `model` with this signature whose models are unchanged, now in use by the caller, or None and
    why none was taken. `changed(fingerprint)` says what differs between the entry's models and the caller's (None
    when nothing does); an entry whose models changed is dropped (its graphs replay what is gone)."""
    if not enabled():
        return None, f"{REUSE_ENV}=0"
    why = "no kept graphs of this model with these shapes and settings"
    with _LOCK:
        kept = entries(model)
        for entry in list(kept):
            if entry.signature != signature:
                continue
            if entry.in_use:
                why = "the kept graphs are in use by another call"
                continue
            difference = changed(entry.guard) if changed is not None and entry.guard is not None else None
            if difference is not None:
                kept.remove(entry)
                why = f"the model changed since its graphs were kept ({difference})"
                continue
            entry.in_use = True
            return entry, ""
    return None, why


def drop(model: object, entry: Entry) -> None:
    """Forget `entry` (its call saw a model change: its graphs may replay either model)."""
    with _LOCK:
        kept = entries(model)
        if entry in kept:
            kept.remove(entry)


def keep(model: object, entry: Entry) -> None:
    """Keep a call's entry for later calls (and free it); the oldest go past `MAX_ENTRIES` or `kept_budget`, a
    duplicate is dropped, and an entry larger than `kept_budget` is not kept."""
    if not enabled():
        return
    with _LOCK:
        entry.in_use = False
        kept = entries(model, create=True)
        if entry in kept:
            return
        budget = kept_budget(entry.device)
        if any(e.signature == entry.signature for e in kept) or entry_bytes(entry) > budget:
            return  # a concurrent call kept one for this signature first, or it holds too much memory
        kept.append(entry)
        del kept[:-MAX_ENTRIES]
        while sum(entry_bytes(e) for e in kept) > budget:
            del kept[0]


def kept_budget(device: torch.device) -> int:
    """The most bytes one model's kept entries may hold on `device` (`MAX_KEPT_BYTES`, or `KEPT_SHARE` of a GPU)."""
    if device.type != "cuda":
        return MAX_KEPT_BYTES
    return max(MAX_KEPT_BYTES, int(KEPT_SHARE * torch.cuda.get_device_properties(device).total_memory))


def entry_bytes(entry: Entry) -> int:
    """The bytes of the tensors and static caches an entry holds (each counted once)."""
    tensors = {}
    for value in entry.slots.values():
        for tensor in [t for pair in _layers(value) for t in pair] if isinstance(value, Cache) else [value]:
            tensors[id(tensor)] = tensor.nbytes
    return sum(tensors.values())


def clear(model: object) -> None:
    """Drop the kept graphs of `model` and of every target whose calls ran it (a draft), with the caches they hold."""
    with _LOCK:
        model_slots.drop(model, _SLOT)
        for holder in list(_HOLDERS):
            kept = entries(holder)
            kept[:] = [e for e in kept if id(model) not in e.model_ids or e.in_use]


def forget_graphs(model: torch.nn.Module) -> None:
    """Drop everything hf_specdec keeps to replay `model` fast: its kept CUDA graphs (and those of targets it
    drafted for) and its compiled forwards. Never needed for exactness (a changed model is detected: see the module
    doc); it frees the GPU memory the kept graphs and caches hold."""
    clear(model)
    compat.forget_compiled(model)


def driven_models(root: object, target: torch.nn.Module) -> list[torch.nn.Module]:
    """The target and every other model that the hf_specdec objects reachable from `root` hold (drafts, heads, MTP
    layers), each once, in an order that does not depend on how the objects were built."""
    found: dict[int, torch.nn.Module] = {}
    for owner in owners_by_path(root).values():
        for value in vars(owner).values():
            values = value if isinstance(value, (list, tuple)) else (value,)
            for item in values:
                if isinstance(item, torch.nn.Module) and item is not target:
                    found.setdefault(id(item), item)
    return [target, *sorted(found.values(), key=model_serial)]


def _layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None]


def _matches(old: Any, new: Any) -> bool:
    if isinstance(old, torch.Tensor):
        return (
            isinstance(new, torch.Tensor)
            and old.shape == new.shape
            and old.dtype == new.dtype
            and old.device == new.device
        )
    if isinstance(old, Cache):
        if type(new) is not type(old):
            return False
        old_layers, new_layers = _layers(old), _layers(new)
        return len(old_layers) == len(new_layers) and all(
            _matches(a, b) for pair, other in zip(old_layers, new_layers) for a, b in zip(pair, other)
        )
    return False


def adopt(entry: Entry, root: object) -> bool:
    """Move a new call's state into the entry's tensors and caches, so that the entry's graphs read it.

    Every slot of the entry's loop must be in the new loop with the same shape, dtype and device (or, for a tensor
    the step writes before reading, not set yet); otherwise nothing changes and False is returned."""
    old_slots, new_slots = entry.slots, state_slots(root, entry.device)
    new_owners = owners_by_path(root)
    if set(new_slots) - set(old_slots):
        return False
    for (path, name), old in old_slots.items():
        if (path, name) in new_slots:
            if not _matches(old, new_slots[(path, name)][2]):
                return False
        elif path not in new_owners or getattr(new_owners[path], name, 0) is not None:
            return False
    copied: set[int] = set()
    for (path, name), old in old_slots.items():
        slot = new_slots.get((path, name))
        if slot is not None and id(old) not in copied:
            copied.add(id(old))
            if isinstance(old, torch.Tensor):
                old.copy_(slot[2])
            else:  # a static cache: the prefill's keys and values
                for (old_k, old_v), (new_k, new_v) in zip(_layers(old), _layers(slot[2])):
                    old_k.copy_(new_k)
                    old_v.copy_(new_v)
        setattr(new_owners[path], name, old)
    return True
