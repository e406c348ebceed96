"""What a model's forward can see, as a value that changes whenever the forward could compute something else.

Kept CUDA graphs (`graph_reuse`) and compiled forwards replay whatever Python ran when they were made: the parameter
objects and their addresses, the module tree, hooks, `training` and the Python numbers a forward reads. A
`Fingerprint` records all of that for a model and its submodules: every parameter, buffer and tensor attribute (the
object, its data pointer, dtype, shape and device), which module object sits at each path, forward and forward-pre
hooks on every module and torch's global ones, and the plain Python values in each module's `__dict__` and config
(bool, int, float, str, None, and tuples, lists or dicts of them; other objects by identity). Values written in place
(an optimizer step, `load_state_dict`, `merge_adapter`'s weights) keep the fingerprint: the graphs read the same
memory. Not seen: what a forward reads from a global or a closure variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from hf_specdec import compat, model_slots

_PLAIN = (bool, int, float, str, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)
#: `nn.Module` internals read separately (tensors, submodules, hooks) or never read by a forward
_SKIPPED = frozenset(
    {
        "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_hooks", "_backward_pre_hooks",
        "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks", "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_compiled_call", "_last_compile_config",
        "training", "_cache", "_previous_max_cache_length",
    }
)  # fmt: skip
# `_cache` and `_previous_max_cache_length` are plain `generate`'s own bookkeeping of its static cache (set on the
# model by a `cache_implementation="static"` call, 5.17 and 5.24): no forward reads them, so a compiled plain call
# between two of ours must not make our kept graphs look stale.
#: the entries `torch.nn.Module.__init__` puts first in every module's `__dict__`, in order
_INTERNAL = tuple(vars(torch.nn.Module()))
_NUM_INTERNAL = len(_INTERNAL)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
          "_forward_hooks_always_called")  # fmt: skip
#: what hf_specdec itself keeps in a model's `__dict__` (`model_slots`: kept graphs, compiled calls): not the model's
_OWN_SLOTS = "_hf_specdec_"
_PARTS = ("modules", "tensors", "hooks", "attributes")


def _plain(value: object, depth: int = 0) -> object:
    """`value` itself when it is plain data (scalars and containers of them), else the object's identity."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if depth < 3 and kind in (tuple, list):
        return (kind.__name__, tuple(_plain(v, depth + 1) for v in value))
    if depth < 3 and kind in (set, frozenset):
        return (kind.__name__, tuple(sorted((_plain(v, depth + 1) for v in value), key=repr)))
    if depth < 3 and kind is dict:
        return ("dict", tuple((repr(k), _plain(v, depth + 1)) for k, v in value.items()))
    return ("object", kind.__name__, id(value))


def _config_values(config: PretrainedConfig, out: list) -> None:
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            out.append((name, "config", id(value)))
            _config_values(value, out)
        elif type(value) in _PLAIN or type(value) in (tuple, list, dict):
            out.append((name, _plain(value)))


@dataclass(frozen=True)
class Fingerprint:
    """What the forwards of some models can see (`fingerprint`); equal fingerprints replay the same computation.

    Each part holds one entry per module, in the order of a depth-first walk of the models (`module_paths`)."""

    modules: tuple  # (module id, class, child names)
    tensors: tuple  # ((name, tensor id, data pointer, dtype, shape), ...): parameters, buffers, tensor attributes
    hooks: tuple  # ((kind, ((handle id, hook id), ...)), ...); the first entry holds torch's global hooks
    attributes: tuple  # ((name, plain value), ...): `training`, numbers, strings, configs' values, objects' ids

    def difference(self, other: Fingerprint, models: list[torch.nn.Module]) -> str | None:
        """The first thing that differs from `other` (an earlier fingerprint of `models`), in words; None if equal."""
        try:
            if self == other:
                return None
        except Exception:  # noqa: BLE001 - a value whose comparison fails (an array's `==`) differs
            pass
        paths = ["<torch global hooks>", *module_paths(models)]
        for part in _PARTS:
            mine, theirs = getattr(self, part), getattr(other, part)
            if _equal(mine, theirs):
                continue
            offset = 0 if part == "hooks" else 1  # the hooks' first entry is torch's global ones
            for index, (new, old) in enumerate(zip(mine, theirs)):
                if not _equal(new, old):
                    where = paths[index + offset] if index + offset < len(paths) else f"module {index}"
                    return f"{part} of {where or '<model>'}: {_first_change(new, old)}"
            return f"{part}: {len(theirs)} entries before, {len(mine)} now"
        return "changed"


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose comparison fails differs
        return False


def _first_change(new: object, old: object) -> str:
    """The name of the first entry that differs between two per-module tuples of (name, ...) entries."""
    if isinstance(new, tuple) and isinstance(old, tuple):
        for a, b in zip(new, old):
            if a != b:
                if isinstance(a, tuple) and a and isinstance(a[0], str):
                    return repr(a[0])  # a (name, ...) entry
                return _first_change(a, b)
        return "entries added" if len(new) > len(old) else "entries removed"
    return "changed"


def _modules_in_order(models: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """Every module of `models`, in the order `fingerprint` reads them, with its path ("[i]" is models[i])."""
    order: list[tuple[str, torch.nn.Module]] = []
    for index, model in enumerate(models):
        stack = [(f"[{index}]", model)]
        while stack:
            path, module = stack.pop()
            order.append((path, module))
            children = module.__dict__["_modules"]
            stack.extend((f"{path}.{name}", child) for name, child in reversed(children.items()) if child is not None)
    return order


def module_paths(models: list[torch.nn.Module]) -> list[str]:
    return [path for path, _ in _modules_in_order(models)]


#: types whose values stand in a fingerprint as themselves (compared by identity, then value): not a container, a
#: tensor or a config, which can change in place and are read apart
_AS_IS_TYPES: set[type] = set()
_READ_APART = (tuple, list, set, frozenset, dict, torch.Tensor, PretrainedConfig)


def _learn(kinds: set[type]) -> bool:
    """Whether every type in `kinds` stands as itself (remembering those that do)."""
    fine = {kind for kind in kinds if not issubclass(kind, _READ_APART)}
    _AS_IS_TYPES.update(fine)
    return len(fine) == len(kinds)


def _read(model: torch.nn.Module) -> tuple[list, list, list, list]:
    """One model's entries of the four parts, a module per entry, depth first (a module held twice is read once)."""
    modules: list[tuple] = []
    tensors: list[tuple] = []
    hooks: list[tuple] = []
    attributes: list[tuple] = []
    seen: set[int] = set()
    configs: set[int] = set()  # configs read already (every attention layer of a model holds the model's)
    skipped, plain, tensor_type = _SKIPPED, _PLAIN_TYPES, torch.Tensor
    stack = [model]
    while stack:
        module = stack.pop()
        state = module.__dict__
        children = state["_modules"]
        modules.append((id(module), type(module), tuple(children)))
        if children:
            stack.extend(child for child in reversed(children.values()) if child is not None)
        if id(module) in seen:
            tensors.append(())
            hooks.append(())
            attributes.append(())
            continue
        seen.add(id(module))
        own = [(k, id(v), v.data_ptr(), v.dtype, v.shape) if v is not None else (k,)
               for table in (state["_parameters"], state["_buffers"]) if table for k, v in table.items()]  # fmt: skip
        if state["_forward_hooks"] or state["_forward_pre_hooks"] or state.get("_forward_hooks_always_called"):
            hooks.append(tuple((kind, tuple((k, id(v)) for k, v in state[kind].items()))
                               for kind in _HOOKS if state.get(kind)))  # fmt: skip
        else:  # the with_kwargs tables only mark hooks that are in these two
            hooks.append(())
        # A module's `__dict__` starts with torch's own entries (`Module.__init__`); what follows are its own
        # attributes. When none of them is a container, a tensor or a config, their (name, value) pairs are taken
        # as they are (built in C; compared by identity, then value); otherwise each is read on its own.
        torch_first = tuple(itertools.islice(state, _NUM_INTERNAL)) == _INTERNAL
        if torch_first and "_compiled_call" not in state and not any(name in state for name in model_slots.NAMES):
            kinds = set(map(type, itertools.islice(state.values(), _NUM_INTERNAL, None)))
            if kinds <= _AS_IS_TYPES or _learn(kinds):
                tensors.append(tuple(own))
                items = tuple(itertools.islice(state.items(), _NUM_INTERNAL, None))
                attributes.append((("training", state["training"]), items))
                continue
        values: list[tuple] = [("training", state["training"])]
        for key, value in itertools.islice(state.items(), _NUM_INTERNAL, None) if torch_first else state.items():
            if key in skipped or key.startswith(_OWN_SLOTS) or key in model_slots.NAMES:  # hf_specdec's own slots
                continue
            if type(value) in plain:
                values.append((key, value))
            elif isinstance(value, tensor_type):
                own.append((key, id(value), value.data_ptr(), value.dtype, value.shape))
            elif isinstance(value, PretrainedConfig):
                values.append((key, "config", id(value)))
                if id(value) not in configs:
                    configs.add(id(value))
                    _config_values(value, values)
            else:
                values.append((key, _plain(value)))
        tensors.append(tuple(own))
        attributes.append(tuple(values))
    return modules, tensors, hooks, attributes


#: id(model) -> its parts, while `read_once` is in force (one reading per model while a call is set up)
_READINGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hf_specdec_model_readings", default=None)


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Within this block each model is read once: a call's setup checks the same models for several purposes (the
    draft's acceptance statistics, compiled forwards, kept graphs), at the same moment."""
    token = _READINGS.set({})
    try:
        yield
    finally:
        _READINGS.reset(token)


def fingerprint(models: list[torch.nn.Module]) -> Fingerprint:
    """The fingerprint of `models` together, with torch's global module hooks."""
    readings = _READINGS.get()
    parts: tuple[list, list, list, list] = ([], [], [compat.global_module_hooks()], [])
    for model in models:
        reading = readings.get(id(model)) if readings is not None else None
        if reading is None:
            reading = _read(model)
            if readings is not None:
                readings[id(model)] = reading
        for part, entries in zip(parts, reading):
            part.extend(entries)
    return Fingerprint(*(tuple(part) for part in parts))


class ModelGuard:
    """The models one call runs and their fingerprint when it began (the key its kept graphs are checked against)."""

    def __init__(self, models: list[torch.nn.Module]) -> None:
        self.models = models
        self.fingerprint = fingerprint(models)

    def changed_since(self, earlier: Fingerprint) -> str | None:
        """What differs between `earlier` (an entry's) and this call's models, in words; None if nothing does."""
        return self.fingerprint.difference(earlier, self.models)

    def changed_during_call(self) -> str | None:
        """What changed in the models since the call began (another thread's hook, say); None if nothing did."""
        return fingerprint(self.models).difference(self.fingerprint, self.models)


_SERIALS: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
_NEXT_SERIAL = itertools.count()
_VERSIONS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Fingerprint, int]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def model_serial(model: object) -> int:
    """A number that names `model` for as long as it lives and is never reused (`id()` is, once it is freed: a new
    draft would inherit a dead one's acceptance statistics)."""
    with _LOCK:
        if model not in _SERIALS:
            _SERIALS[model] = next(_NEXT_SERIAL)
        return _SERIALS[model]


def model_version(model: torch.nn.Module) -> str:
    """`model_serial`, and how often the model's fingerprint changed since it was first seen here ("12.0", "12.1",
    ...): what hf_specdec learns about a model's drafts (acceptance) is kept per version, so a draft whose forward
    changed (a hook, a replaced weight, a Python setting it reads) is judged anew."""
    now = fingerprint([model])
    serial = model_serial(model)
    with _LOCK:
        seen, version = _VERSIONS.get(model, (now, 0))
        if seen != now:
            version += 1
        _VERSIONS[model] = (now, version)
    return f"{serial}.{version}"
