"""CUDA-graph semantics on the CPU, for tests of captured steps (`hf_specdec.step_graph.GRAPHS = EmulatedGraphs`).

A capture records the aten ops the step runs, on the tensors they run on. Like a real capture it leaves no trace
in the tensors that existed before it (what it writes there is put back afterwards), and what it creates holds
garbage until the first replay (a real capture computes nothing). A replay re-runs the recorded ops on the same
tensors: no Python runs, so Python numbers, shapes and branches are those of the capture, as on a GPU. An op that
reads device data on the host (`.item()`, `.tolist()`, `nonzero`, boolean indexing, ...) fails the capture, as
CUDA refuses it ("operation not permitted when stream is capturing").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


class EmulatedGraph:
    """The ops of one captured step, on fixed tensors."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor | None]]] = []

    def replay(self) -> None:
        for func, args, kwargs, outputs in self.ops:
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
