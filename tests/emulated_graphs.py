"""CUDA-graph semantics on the CPU, for tests of captured steps (`hf_specdec.step_graph.GRAPHS = EmulatedGraphs`).

A capture records the aten ops the step runs, on the tensors they run on. Like a real capture it leaves no trace
in the tensors that existed before it (what it writes there is put back afterwards), and what it creates holds
garbage until the first replay (a real capture computes nothing). A replay re-runs the recorded ops on the same
tensors: no Python runs, so Python numbers, shapes and branches are those of the capture, as on a GPU. An op that
reads device data on the host (`.item()`, `.tolist()`, `nonzero`, boolean indexing, ...) fails the capture, as
CUDA refuses it ("operation not permitted when stream is capturing").

Like a real graph, a recorded op holds no tensor that existed before the capture: it holds the address (the
storage, with the tensor's offset, shape and stride) and rebuilds the tensor there at each replay. If the program
drops every tensor on such a storage, a GPU would hand its memory to the next allocation and the replay would read or
write whatever lives there then (how a replay faults with an illegal memory access); here the replay raises
`StaleGraphInput` instead, naming the op that reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

#: Ops that read a tensor's data on the host (or size their output by it): a capture cannot contain them.
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}


def _key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `func` writes (its schema's `Tensor(a!)` arguments)."""
    found = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        found += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return found


class StaleGraphInput(RuntimeError):
    """A replay reads memory that the program freed (on a GPU): no tensor outside the graph holds its storage."""


@dataclass(frozen=True)
class _Address:
    """Where a tensor that existed before the capture lives: what a real graph records instead of the tensor."""

    storage: torch.UntypedStorage  # the graph's one handle on it (not counted as the program's)
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    reader: str  # the first op that used it, for the error

    def tensor(self) -> torch.Tensor:
        if torch._C._storage_Use_Count(self.storage._cdata) <= 1:  # only this handle
            raise StaleGraphInput(
                f"a replayed graph reads a {self.dtype} tensor of shape {self.shape} (first used by {self.reader}) "
                "that the program no longer holds: on a GPU its memory was freed and may hold anything now"
            )
        out = torch.empty(0, dtype=self.dtype, device=self.storage.device)
        return out.set_(self.storage, self.offset, self.shape, self.stride)


class EmulatedGraph:
    """The ops of one captured step: tensors made during the capture, and the addresses of those made before."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor | None]]] = []
        self.storages: dict[int, torch.UntypedStorage] = {}  # data_ptr -> the one handle per external storage

    def address(self, tensor: torch.Tensor, reader: str) -> _Address:
        ptr = tensor.untyped_storage().data_ptr()
        storage = self.storages.setdefault(ptr, tensor.untyped_storage())
        return _Address(storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype,
                        reader)  # fmt: skip

    def replay(self) -> None:
        for func, args, kwargs, outputs in self.ops:
            args, kwargs = tree_map(lambda v: v.tensor() if isinstance(v, _Address) else v, (args, kwargs))
            results = tree_flatten(func(*args, **kwargs))[0]
            for out, new in zip(outputs, results):
                if out is not None and new is not out:
                    out.copy_(new)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph
        self.created: set[int] = set()  # storages made during the capture
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its data before the capture wrote it)
        self.saved_keys: set[tuple] = set()
        self.outputs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        indices = kwargs.get("indices", args[1] if len(args) > 1 else None)
        boolean_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or [])
        )
        if func in HOST_READS or boolean_index:
            raise RuntimeError(f"operation not permitted when stream is capturing (emulated: {func} reads the device)")
        for tensor in _written(func, args, kwargs):
            key = _key(tensor)
            if (
                tensor.numel()
                and tensor.untyped_storage().data_ptr() not in self.created
                and key not in self.saved_keys
            ):
                self.saved_keys.add(key)
                self.saved.append((tensor, tensor.clone()))
        if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):  # `torch.tensor(...)` during the capture:
            self.created.add(args[0].untyped_storage().data_ptr())  # made in the graph's own pool on a GPU
        result = func(*args, **kwargs)
        outputs: list[torch.Tensor | None] = []
        for value, returned in zip(tree_flatten(result)[0], _returns(func, result)):
            if not isinstance(value, torch.Tensor):
                outputs.append(None)
                continue
            aliases = returned is not None and returned.alias_info is not None
            if not aliases and value.numel():
                self.created.add(value.untyped_storage().data_ptr())
                self.outputs.append(value)
            outputs.append(None if aliases else value)  # a view re-made at replay would alias the same data

        def held(value: Any) -> Any:  # a tensor from before the capture: its address only, as a real graph holds
            if (
                isinstance(value, torch.Tensor)
                and value.numel()
                and value.untyped_storage().data_ptr() not in self.created
                and not value.is_sparse
            ):
                return self.graph.address(value, str(func))
            return value

        args, kwargs = tree_map(held, (args, kwargs))
        self.graph.ops.append((func, args, kwargs, outputs))
        return result

    def finish(self) -> None:
        """What a real capture leaves: the old tensors as they were, the new ones not computed yet."""
        with torch.no_grad():
            for tensor, before in reversed(self.saved):
                tensor.copy_(before)
            for tensor in self.outputs:
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
                elif tensor.dtype == torch.bool:
                    tensor.fill_(True)
                else:
                    tensor.fill_(-(2**30) if tensor.dtype in (torch.int32, torch.int64) else 0)


def _returns(func: Any, result: Any) -> list:
    flat = tree_flatten(result)[0]
    returns = list(func._schema.returns)
    if len(returns) == len(flat):
        return returns
    return [returns[0] if returns else None] * len(flat)  # a list return (Tensor[]): one schema entry


class EmulatedGraphs:
    """`hf_specdec.step_graph.GRAPHS` for CPU tests: captures and replays `EmulatedGraph`s."""

    device_type = "cpu"

    @staticmethod
    def new() -> EmulatedGraph:
        return EmulatedGraph()

    @staticmethod
    @contextlib.contextmanager
    def capture(graph: EmulatedGraph) -> Iterator[None]:
        recorder = _Recorder(graph)
        try:
            with recorder:
                yield
        finally:
            recorder.finish()
