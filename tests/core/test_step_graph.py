"""`hf_specdec.step_graph`: what a captured step may change on the host, found on real hf_specdec objects.

The capture itself needs a GPU (tests/core/test_static_cache.py's CUDA tests); these check, on the CPU, the rules
that decide whether a step can be replayed: which objects hold state, which host changes replay, which refuse."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.batch import RaggedBatch
from hf_specdec.metrics import SpecDecodeStats
from hf_specdec.step_graph import StepGraph, UncapturableStep, state_owners


class Owner:  # hf_specdec objects are found by module: this test module is not one
    pass


def test_state_owners_follow_hf_specdec_objects_through_lists_once():
    batch = RaggedBatch.from_prompts(torch.tensor([[5, 6, 7]]), None, 8)
    stats = SpecDecodeStats()
    stats.extra = [batch, batch]  # reached twice: listed once
    owners = state_owners(stats)
    assert owners[0] is stats and batch in owners and len(owners) == 2
    stranger = Owner()
    stranger.batch = batch
    assert state_owners(stranger) == []  # not an hf_specdec object: not walked


def test_host_counters_replay_their_change_and_other_host_changes_refuse():
    stats = SpecDecodeStats()
    owners = state_owners(stats)
    before = {(id(o), n): (o, v) for o in owners for n, v in vars(o).items() if not isinstance(v, torch.Tensor)}
    stats.num_steps += 3
    assert StepGraph._host_deltas(owners, before) == [(stats, "num_steps", 3)]
    stats.wall_time_s = 1.5  # a float that moves is not a counter a replay can advance
    with pytest.raises(UncapturableStep, match="wall_time_s"):
        StepGraph._host_deltas(owners, before)


def test_replaced_state_tensors_are_copied_home_and_shared_ones_refuse():
    batch = RaggedBatch.from_prompts(torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]]), 8)
    graph = StepGraph(batch, lambda: None, "a test step")
    before = [(batch, name, value) for name, value in vars(batch).items() if isinstance(value, torch.Tensor)]
    home = batch.lengths
    batch.lengths = batch.lengths + 2  # what a step does
    rebinds = graph._copy_back(before)
    assert [(r.name, r.home is home) for r in rebinds] == [("lengths", True)]
    assert home.tolist() == [5, 5]  # the new value, in the tensor the next replay reads
    batch.pad_lengths = batch.lengths  # two attributes on one tensor: a copy home would change both
    before = [(batch, name, value) for name, value in vars(batch).items() if isinstance(value, torch.Tensor)]
    batch.lengths = batch.lengths + 1
    with pytest.raises(UncapturableStep, match="shares its tensor"):
        graph._copy_back(before)


def test_the_step_graph_own_records_are_not_step_state():
    """A second key's capture must not see the homes of the first key's rebinds as state shared with a StepGraph
    (found on an H100: the plain step of the adaptive schedule was refused after the drafting step was captured)."""
    batch = RaggedBatch.from_prompts(torch.tensor([[5, 6, 7]]), None, 8)
    stats = SpecDecodeStats()
    stats.batch = batch
    graph = StepGraph(stats, lambda: None, "a test step")
    stats.graph = graph  # the loop holds its StepGraph, as SpeculativeLoop.step_graph does
    before = [(batch, name, value) for name, value in vars(batch).items() if isinstance(value, torch.Tensor)]
    batch.lengths = batch.lengths + 1
    graph.rebinds += graph._copy_back(before)  # the first capture's homes
    owners = state_owners(stats)
    assert graph not in owners and batch in owners
    tensors = [value for owner in owners for value in vars(owner).values() if isinstance(value, torch.Tensor)]
    assert len({id(t) for t in tensors}) == len(tensors)  # no tensor seen twice: the next capture is not refused


def test_what_calls_share_is_not_any_calls_step_state(monkeypatch):
    """Threads on one model share the adaptive schedule's memory and may share a SpecDecoder: a capture must not
    take their changes by another call for its own step's (an H100 run with 8 threads refused every capture on
    `StepCosts.draft_cost`), so the walk from a real call's loop never reaches them."""
    from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

    import hf_specdec
    from hf_specdec import adaptive

    roots = []
    init = StepGraph.__init__
    monkeypatch.setattr(StepGraph, "__init__", lambda self, root, *a, **k: (roots.append(root), init(self, root, *a, **k))[1])  # fmt: skip
    target = make_model("llama", seed=0)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target), num_speculative_tokens_schedule="adaptive")
    spec_generate(target, make_prompts(2, seed=1), spec, max_new_tokens=8, cache_implementation="static")
    assert roots, "the static call builds a StepGraph"
    shared = (hf_specdec.SpecDecoder, adaptive.ModelMemory, adaptive.StepCosts, adaptive.AcceptanceStats,
              adaptive.MeasuredSteps, StepGraph)  # fmt: skip
    owners = state_owners(roots[0])
    assert any(isinstance(o, adaptive.AdaptiveSchedule) for o in owners)  # the walk reaches the schedule...
    assert not [type(o).__name__ for o in owners if isinstance(o, shared)]  # ...and nothing calls share


@pytest.mark.requires_cuda
def test_a_kept_graph_runs_its_matmuls_in_its_own_workspace():
    """Each captured step owns cuBLAS's workspace of its capture (in its private pool). Before, every graph after
    the first ran its matmuls in the first one's: once that graph was dropped and torch's graph trees (compiled
    plain `generate`) dropped the workspaces, a replay wrote into memory the allocator had handed out again."""
    from hf_specdec.step_graph import CudaGraphs

    torch.manual_seed(0)
    a, b = torch.randn(512, 4096, device="cuda"), torch.randn(4096, 512, device="cuda")  # split-K: uses a workspace
    graphs, outs = [], []
    for _ in range(2):
        graph = CudaGraphs.new()
        with CudaGraphs.capture(graph):
            outs.append(a @ b)
        graphs.append(graph)
    del graphs[0], outs[0]  # the first graph goes (a kept entry dropped)
    torch._C._cuda_clearCublasWorkspaces()  # what torch's graph trees do whenever they record
    torch.cuda.empty_cache()
    fillers = [torch.full((2**22,), 7.0, device="cuda") for _ in range(64)]  # the freed memory, handed out again
    for _ in range(3):
        graphs[0].replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outs[0], a @ b)
    assert all(bool((f == 7.0).all()) for f in fillers)
