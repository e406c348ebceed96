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

import contextlib
import gc
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch

from hf_specdec import fused_layers, graph_reuse
from hf_specdec.locks import CAPTURE_LOCK
from hf_specdec.model_guard import ModelGuard

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
        if getattr(value, "not_step_state", False):  # a StepGraph's records, what calls share (`not_step_state`)
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


class CudaGraphs:
    """How steps are captured and replayed: `torch.cuda.CUDAGraph` on the current CUDA stream. (The CPU tests put
    an emulation with the same semantics in `GRAPHS`: tests/emulated_graphs.py.)"""

    device_type = "cuda"

    @staticmethod
    def new() -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    @staticmethod
    @contextlib.contextmanager
    def capture(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
        """Capture into the graph's own memory pool, cuBLAS's workspace included.

        cuBLAS keeps one workspace per handle and stream, made at its first matmul. Left alone, every graph captured
        after the first would run its matmuls in a workspace held by whoever made it: the first graph's pool, or the
        caching allocator. Torch's compiled CUDA graphs (`mode="reduce-overhead"`, what compiled plain `generate`
        uses) drop those workspaces whenever they record, and the first graph goes when its kept entry is dropped:
        a later replay then ran its matmuls in freed memory (an H100 grid run faulted with "unspecified launch
        failure" once a model's kept entries overflowed). So the workspaces are dropped before the capture, the
        capture's first matmul makes one in this graph's private pool (which lives as long as the graph), and they
        are dropped again after it, so that nothing else ever runs in it (as torch's own graph trees do). cuBLAS's
        handles are made first: a handle cannot be created inside a capture (CUBLAS_STATUS_NOT_INITIALIZED)."""
        x = torch.ones(8, 8, device="cuda")
        torch.nn.functional.linear(x, x, x[0])  # this thread's cuBLAS (and cuBLASLt) handles, made now if first
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                yield
        finally:
            torch._C._cuda_clearCublasWorkspaces()


#: The graph implementation steps are captured with (its `device_type`: where the static route may capture).
GRAPHS: type = CudaGraphs


@contextlib.contextmanager
def no_garbage_collection() -> Iterator[None]:
    """The garbage collector off during a capture: a collection could destroy another call's graph mid-capture
    (`torch.cuda.graph` collects once before it begins)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class _Rebind:
    owner: object
    name: str
    home: torch.Tensor  # the tensor the graph reads: the step's new value is copied into it at the end of a replay


class UncapturableStep(RuntimeError):
    """The step changes state in a way a replayed graph cannot reproduce."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph  # or what `GRAPHS` makes
    host_deltas: list[tuple[object, str, int]]  # (owner, attribute, change per replay)
    delta_paths: list[tuple[str, str, int]]  # the same by owner path (`graph_reuse`: for a later call's owners)


class StepGraph:
    """Captures `step` (a function of no arguments doing one step's device work) once per key, then replays it.

    The key names the host decisions that shape a step's device work (e.g. whether it drafts): steps with the same
    key run the same kernels on the same addresses. `run(None, ...)` runs a step eagerly."""

    #: `state_owners` does not walk into a StepGraph (its records hold the homes of the state tensors, which would
    #: make every rebound tensor look shared with other state at the next capture). Objects that every call on a
    #: model shares (the adaptive schedule's memory) carry the same flag: the step never changes them, and other
    #: threads' calls do, also while this one captures.
    not_step_state = True

    def __init__(
        self,
        root: object,
        step: Callable[[], None],
        description: str,
        capture: bool = True,
        model: object = None,
        signature: Hashable | None = None,
        hint: Callable[[], str] | None = None,
        guard: ModelGuard | None = None,
        fused: list | None = None,
    ) -> None:
        self.root = root
        #: `fused_layers.swaps`: fused kernels in place of eager layer code while steps are captured (and warmed up)
        self.fused = fused or []
        self.hint = hint  # what the user can change when a capture is refused ("" when nothing)
        self.model = model  # graphs are kept across calls per model and `signature` (`hf_specdec.graph_reuse`)
        self.device = getattr(getattr(root, "batch", None), "device", torch.device("cuda"))
        self.signature = signature
        self.guard = guard  # the call's models as they were when it began: kept graphs must have seen the same
        self.entry: graph_reuse.Entry | None = None  # the kept graphs this call adopted
        self.reuse_tried = False
        #: ("adopted" | "captured" | "", why nothing was adopted) for `SpecDecodeStats.graph_reuse`
        self.reuse_outcome: tuple[str, str] = ("", "")
        self.capture = capture  # False (no GPU, or compiling switched off): every step runs eagerly
        self.step = step
        self.description = description  # what is captured, for the warning when it cannot be
        self.graphs: dict[Hashable, _Captured] = {}
        self.rebinds: list[_Rebind] = []  # every graph's: an attribute has one home, whichever graph found it
        self.eager_steps: dict[Hashable, int] = {}
        self.refused: set[Hashable] = set()
        self.capture_time_s = 0.0
        self.replays = 0
        #: whether the latest step took what such a step takes from now on: a replay, or an eager step where this
        #: key is never captured; not a warm-up or a capture
        self.steady = True

    def run(self, key: Hashable | None) -> None:
        """One step: replayed when its key's graph is captured, else eager. The caller has made room in every static
        cache for the step's forwards (`SpeculativeLoop._make_room`): a replay cannot compact one."""
        if not self.reuse_tried and key is not None and self.capture:
            self._reuse()
        if key is None or not self.capture or key in self.refused:
            self._eager(key)
            self.steady = True
            return
        captured = self.graphs.get(key)
        self.steady = captured is not None
        if captured is None and self.eager_steps.get(key, 0) < WARMUP_STEPS:
            self._eager(key)
            return
        # Host work since the last step (a catch-up forward) may have replaced a state tensor: put it home first,
        # also before a capture, which must read the homes that the graphs captured before it read and write.
        self._rehome()
        if captured is None:
            captured = self._capture(key)
            if captured is None:  # refused: steps with this key run eagerly
                self._eager(key)
                return
        captured.graph.replay()
        self.replays += 1
        for owner, name, delta in captured.host_deltas:
            setattr(owner, name, getattr(owner, name) + delta)

    def _reuse(self) -> None:
        """Adopt the graphs a finished call kept for this signature, if any is free (`hf_specdec.graph_reuse`)."""
        self.reuse_tried = True
        self.reuse_outcome = ("captured", "graph reuse is off for this call")
        if self.signature is None or self.model is None:
            return
        changed = self.guard.changed_since if self.guard is not None else None
        entry, why = graph_reuse.checkout(self.model, self.signature, changed)
        self.reuse_outcome = ("captured", why)
        if entry is None:
            return
        if not graph_reuse.adopt(entry, self.root):
            graph_reuse.keep(self.model, entry)  # frees it
            self.reuse_outcome = ("captured", "the kept graphs read state of other shapes")
            return
        self.entry = entry
        self.reuse_outcome = ("adopted", "")
        owners = graph_reuse.owners_by_path(self.root)
        for key, kept in entry.graphs.items():
            deltas = [(owners[path], name, delta) for path, name, delta in kept.delta_paths]
            self.graphs[key] = _Captured(kept.graph, deltas, kept.delta_paths)
        self.rebinds = [_Rebind(owners[path], name, getattr(owners[path], name)) for path, name in entry.rebind_paths]

    def finish(self) -> None:
        """The call ends: keep its graphs (and the state they read) for a later call with the same signature, or
        destroy them now (the loop and its StepGraph refer to each other: left to the garbage collector, the graphs
        would be destroyed at any later time, also while another thread captures, which CUDA refuses)."""
        # Graphs this call captured itself were captured from the models as they were then: keep them only if no
        # model changed during the call (graphs it adopted and only replayed stay under the entry's fingerprint).
        captured_here = self.entry is None or set(self.graphs) != set(self.entry.graphs)
        checked = self.guard is not None and self.graphs and captured_here
        changed = self.guard.changed_during_call() if checked else None
        if (
            not graph_reuse.enabled() or self.signature is None or self.model is None or not self.graphs
            or changed is not None
        ):  # fmt: skip
            if self.entry is not None:  # adopted, then a model changed mid-call: its graphs may replay either model
                graph_reuse.drop(self.model, self.entry)
            self.graphs.clear()
            self.rebinds.clear()
            return
        entry = self.entry or graph_reuse.Entry(self.signature, self.root, self.device)
        if self.guard is not None:
            entry.guard = self.guard.fingerprint
            entry.model_ids = frozenset(id(m) for m in self.guard.models)
        if self.entry is not None:  # this loop now owns every tensor the kept graphs and the new ones read
            entry.keepalive.append(entry.root)
            entry.root = self.root
        graph_reuse.snapshot(entry)
        paths = {id(owner): path for path, owner in graph_reuse.owners_by_path(self.root).items()}
        entry.graphs = dict(self.graphs)
        entry.rebind_paths = [(paths[id(r.owner)], r.name) for r in self.rebinds if id(r.owner) in paths]
        graph_reuse.keep(self.model, entry)

    def host_change(self, owner: object, name: str) -> int:
        """The most any captured step moves host counter `owner.name` (0 when none does)."""
        return max(
            (d for c in self.graphs.values() for o, n, d in c.host_deltas if o is owner and n == name), default=0
        )

    def _steps(self) -> contextlib.AbstractContextManager:
        """What a step runs under: the fused kernels (`fused_layers`) when the call may capture (it then passed them)."""
        return fused_layers.fused(self.fused) if self.fused else contextlib.nullcontext()

    def _eager(self, key: Hashable | None) -> None:
        with self._steps():
            self.step()
        self.eager_steps[key] = self.eager_steps.get(key, 0) + 1
        self._rehome()  # an eager step replaces tensors too

    def _rehome(self) -> None:
        """Put each replaced state tensor's value where the graphs read it, and point its attribute back there."""
        for rebind in self.rebinds:
            current = getattr(rebind.owner, rebind.name)
            if current is not rebind.home:
                rebind.home.copy_(current)
                setattr(rebind.owner, rebind.name, rebind.home)

    def _capture(self, key: Hashable) -> _Captured | None:
        start = time.perf_counter()
        owners = state_owners(self.root)
        tensors_before = [(o, n, t) for o, n, t in _attributes(owners, torch.Tensor)]
        hosts_before = {(id(o), n): (o, v) for o, n, v in _attributes(owners, (int, float, bool, type(None)))}
        graph = GRAPHS.new()
        try:
            # One capture at a time; other threads' work goes on meanwhile and stays out of the graph (`locks`).
            with CAPTURE_LOCK, no_garbage_collection(), self._steps(), GRAPHS.capture(graph):
                self.step()
                rebinds = self._copy_back(tensors_before)
            host_deltas = self._host_deltas(owners, hosts_before)
        except Exception as error:  # noqa: BLE001 - any refusal by CUDA graphs means: run these steps eagerly
            self._restore(tensors_before, hosts_before)
            self._refuse(key, f"{type(error).__name__}: {error}")
            return None
        # The capture ran the host code but no kernel: every attribute goes back to its value before the step.
        self._restore(tensors_before, hosts_before, keep=rebinds)
        known = {(id(r.owner), r.name) for r in self.rebinds}
        self.rebinds += [r for r in rebinds if (id(r.owner), r.name) not in known]
        paths = {id(owner): path for path, owner in graph_reuse.owners_by_path(self.root).items()}
        delta_paths = [(paths[id(o)], n, d) for o, n, d in host_deltas]
        captured = self.graphs[key] = _Captured(graph, host_deltas, delta_paths)
        self.capture_time_s += time.perf_counter() - start
        return captured

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
        """Point tensor attributes back at their tensors from before the capture (their values are unchanged: a
        capture runs no kernel) — with `keep`, only those rebound (a write-only output keeps the graph's tensor)
        — and host attributes back at their values."""
        rebound = {(id(r.owner), r.name) for r in keep} if keep is not None else None
        for owner, name, before in tensors_before:
            if rebound is None or (id(owner), name) in rebound:
                setattr(owner, name, before)
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

    def _refuse(self, key: Hashable, why: str) -> None:
        first = not self.refused
        self.refused.add(key)
        if not first:
            return
        hint = self.hint() if self.hint is not None else ""
        warnings.warn(
            f"hf_specdec could not capture {self.description} as one CUDA graph ({why}); such steps "
            f"run uncaptured, each forward compiled on its own (same output, slower).{hint}",
            RuntimeWarning,
            stacklevel=4,
        )
