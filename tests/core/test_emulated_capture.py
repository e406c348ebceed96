"""Captured static steps on the CPU, with CUDA-graph semantics emulated (tests/emulated_graphs.py): each step kind
is captured once and then replayed with no Python, and the output must still equal plain `generate`.

The emulation is what lets CI test the captured path at all (CI has no GPU): a step that reads a Python value the
replay would not update, or a tensor the capture created but a later call reads, gives wrong tokens here as on a
GPU. `test_static_cache.py` runs the same planned steps uncaptured."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate
from emulated_graphs import EmulatedGraph, EmulatedGraphs

import hf_specdec

GREEDY = dict(do_sample=False, eos_token_id=None, cache_implementation="static")


def test_the_emulation_replays_without_python_and_refuses_host_reads():
    x = torch.arange(4.0)
    graph = EmulatedGraph()
    with EmulatedGraphs.capture(graph):
        x.add_(1)  # written during the capture: put back after it
        y = x * 2  # created: garbage until the first replay
    assert x.tolist() == [0, 1, 2, 3] and torch.isnan(y).all()
    graph.replay()
    graph.replay()
    assert x.tolist() == [2, 3, 4, 5] and y.tolist() == [4, 6, 8, 10]  # each replay reads x as it is then
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        with EmulatedGraphs.capture(EmulatedGraph()):
            x.sum().item()
    assert x.tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_captured_steps_equal_plain(emulated_graphs, method, schedule, batch_size):
    target = make_model("llama", seed=0)
    drafting = (
        dict(draft_model=make_noisy_copy(target, noise=0.3, seed=4)) if method == "draft" else dict(method="ngram")
    )
    inputs = make_prompts(batch_size, seed=20 + batch_size)
    expected = target.generate(**inputs, max_new_tokens=32, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=3, num_speculative_tokens_schedule=schedule)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=32, **GREEDY), expected)
    assert spec.last_stats.num_graph_replays > 0


def test_seeded_sampling_is_the_same_captured(emulated_graphs, monkeypatch):
    """The draws are keyed by a device step counter: a captured call draws exactly what an uncaptured one does."""
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.3, seed=4)
    inputs = make_prompts(3, seed=7)
    gen = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.9, eos_token_id=None,
               cache_implementation="static")  # fmt: skip

    def run() -> tuple[torch.Tensor, int]:
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3, seed=11)
        return spec_generate(target, inputs, spec, **gen), spec.last_stats.num_graph_replays

    captured, replays = run()
    monkeypatch.setenv("HF_SPECDEC_CAPTURE_STEPS", "0")
    uncaptured, none = run()
    assert replays > 0 and none == 0
    assert torch.equal(captured, uncaptured)
