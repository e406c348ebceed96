"""Whole speculative steps captured as one CUDA graph and replayed with one launch (static caches on a GPU).

After its first steps, a static-cache step with a fixed draft count has fixed shapes and reads nothing back to
the host until the loop's one read at its end, so its device work — the k draft forwards, the verify, the
rejection sampler, the commit and the rollback — can be captured once with `torch.cuda.CUDAGraph` and replayed.
That removes what a compiled forward per call cannot: hundreds of kernel launches, the guard checks and the
graph-tree bookkeeping of each compiled call, and the eager glue between them.

A captured step replays the kernels with the addresses they had at capture. Python code that replaces a state
tensor (`batch.lengths = batch.lengths + n`) would leave the next replay reading the old tensor, so `StepGraph`
finds every tensor attribute the step replaced (on the loop and every hf_specdec object reachable from it), copies
the new value back into the old tensor inside the graph, and rebinds the attribute to it. Host counters that the
step moves (the write-offset bounds of the static caches) move by the same amount every step: their change during
capture is replayed after each launch. Anything else the step changes on the host makes the step uncapturable; so
does any operation CUDA graphs refuse (a host read, an allocation of pinned memory): the call then goes on eagerly,
exact, with a one-time warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

#: Eager steps before a step is captured: the first step after the prefill compiles and moves the draft to its
#: steady state (so the captured step changes host counters by the same amount every step).
WARMUP_STEPS = 1


def state_owners(root: object) -> list[object]:
    """`root` and every hf_specdec object reachable from its attributes (lists and tuples followed), once each."""
    seen: dict[int, object] = {}

    def visit(value: object) -> None:
        if isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
            return
        if not type(value).__module__.startswith("hf_specdec") or id(value) in seen or not hasattr(value, "__dict__"):
            return
        seen[id(value)] = value
        for attribute in vars(value).values():
            visit(attribute)

    visit(root)
    return list(seen.values())


def _attributes(owners: list[object], kind: type | tuple[type, ...]) -> Iterator[tuple[object, str, object]]:
    for owner in owners:
        for name, value in vars(owner).items():
            if isinstance(value, kind):
                yield owner, name, value


@dataclass
class _Rebind:
    owner: object
    name: str
    home: torch.Tensor  # the tensor the graph reads: the step's new value is copied into it at the end of a replay


class UncapturableStep(RuntimeError):
    """The step changes state in a way a replayed graph cannot reproduce."""


class StepGraph:
    """Captures `step` (a function of no arguments doing one step's device work) once, then replays it."""

    def __init__(self, root: object, step: Callable[[], None], description: str) -> None:
        self.root = root
        self.step = step
        self.description = description  # what is captured, for the warning when it cannot be
        self.graph: torch.cuda.CUDAGraph | None = None
        self.rebinds: list[_Rebind] = []
        self.host_deltas: list[tuple[object, str, int]] = []  # (owner, attribute, change per step)
        self.eager_steps = 0
        self.failed = False
        self.capture_time_s = 0.0
        self.replays = 0

    def run(self, fits: bool) -> None:
        """One step: replayed when captured and `fits` (no cache needs compacting), else eagerly."""
        if self.failed or not fits:
            self._eager()
            return
        if self.graph is None:
            if self.eager_steps < WARMUP_STEPS:
                self._eager()
                return
            self._capture()
            if self.graph is None:  # refused: this step runs eagerly, as every later one
                self._eager()
                return
        self.graph.replay()
        self.replays += 1
        self._advance_host()

    def host_change(self, owner: object, name: str) -> int:
        """How much a captured step moves host counter `owner.name` (0 when it does not)."""
        return sum(delta for o, n, delta in self.host_deltas if o is owner and n == name)

    def _eager(self) -> None:
        self.step()
        self.eager_steps += 1
        for rebind in self.rebinds:  # an eager step replaces tensors too: put the values where the graph reads
            current = getattr(rebind.owner, rebind.name)
            if current is not rebind.home:
                rebind.home.copy_(current)
                setattr(rebind.owner, rebind.name, rebind.home)

    def _advance_host(self) -> None:
        for owner, name, delta in self.host_deltas:
            setattr(owner, name, getattr(owner, name) + delta)

    def _capture(self) -> None:
        import time

        start = time.perf_counter()
        owners = state_owners(self.root)
        tensors_before = [(o, n, t) for o, n, t in _attributes(owners, torch.Tensor)]
        hosts_before = {(id(o), n): (o, v) for o, n, v in _attributes(owners, (int, float, bool, type(None)))}
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph):
                self.step()
                rebinds = self._copy_back(tensors_before)
        except Exception as error:  # noqa: BLE001 - any refusal by CUDA graphs means: run this call eagerly
            self._restore(tensors_before, hosts_before)
            self._refuse(f"{type(error).__name__}: {error}")
            return
        self._restore(tensors_before, hosts_before, keep=rebinds)
        try:
            self.host_deltas = self._host_deltas(owners, hosts_before)
        except UncapturableStep as error:
            self._restore(tensors_before, hosts_before)
            self._refuse(str(error))
            return
        self._restore_host(hosts_before)  # the capture ran the host code but no kernel: undo its host changes
        self.graph, self.rebinds = graph, rebinds
        self.capture_time_s = time.perf_counter() - start

    def _copy_back(self, tensors_before: list[tuple[object, str, torch.Tensor]]) -> list[_Rebind]:
        """Inside the capture: copy each replaced state tensor's new value into the tensor the step started from."""
        uses: dict[int, int] = {}
        for _, _, tensor in tensors_before:
            uses[id(tensor)] = uses.get(id(tensor), 0) + 1
        rebinds = []
        for owner, name, before in tensors_before:
            after = getattr(owner, name)
            if after is before:
                continue
            if not isinstance(after, torch.Tensor):
                raise UncapturableStep(f"{type(owner).__name__}.{name} stops being a tensor")
            if after.shape != before.shape or after.dtype != before.dtype or after.device != before.device:
                continue  # written by the step, never read by the next one (its shape is the step's own)
            if uses[id(before)] > 1:
                raise UncapturableStep(f"{type(owner).__name__}.{name} shares its tensor with other state")
            before.copy_(after)
            rebinds.append(_Rebind(owner, name, before))
        return rebinds

    @staticmethod
    def _restore(tensors_before: list, hosts_before: dict, keep: list[_Rebind] | None = None) -> None:
        """Point every tensor attribute back at its tensor from before the capture (its value is unchanged: a
        capture runs no kernel); attributes replaced by a write-only output keep the graph's output tensor."""
        rebound = {(id(r.owner), r.name) for r in keep} if keep is not None else None
        for owner, name, before in tensors_before:
            if rebound is None or (id(owner), name) in rebound:
                setattr(owner, name, before)
        if keep is None:
            StepGraph._restore_host(hosts_before)

    @staticmethod
    def _restore_host(hosts_before: dict) -> None:
        for (_, name), (owner, value) in hosts_before.items():
            setattr(owner, name, value)

    @staticmethod
    def _host_deltas(owners: list[object], hosts_before: dict) -> list[tuple[object, str, int]]:
        deltas = []
        for owner in owners:
            for name, value in vars(owner).items():
                key = (id(owner), name)
                if key not in hosts_before:
                    if isinstance(value, (int, float, bool)):
                        raise UncapturableStep(f"the step sets a new host attribute {type(owner).__name__}.{name}")
                    continue
                old = hosts_before[key][1]
                if value == old:
                    continue
                if isinstance(value, int) and isinstance(old, int) and not isinstance(value, bool):
                    deltas.append((owner, name, value - old))
                else:
                    raise UncapturableStep(
                        f"the step changes host state {type(owner).__name__}.{name} ({old!r} -> {value!r})"
                    )
        return deltas

    def _refuse(self, why: str) -> None:
        self.failed = True
        warnings.warn(
            f"hf_specdec could not capture {self.description} as one CUDA graph ({why}); this call goes on with "
            "a compiled forward per model call instead (same output, slower).",
            RuntimeWarning,
            stacklevel=4,
        )
