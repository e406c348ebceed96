"""Threads on the captured static path (a GPU): several calls at once on one model, each identical to a lone call.

On CUDA a call with no cache flag captures its steps as CUDA graphs (`hf_specdec.cache_route`); a capture must not
fail because another thread launches work meanwhile, nor capture that work (`hf_specdec.locks`). The last test
runs the same on the CPU with CUDA graphs emulated (graph reuse across threads); CPU threads on the dynamic path
are tested in tests/core/test_concurrency.py."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec

BATCH_SIZES = (1, 3, 4)  # varied shapes: each call captures its own graphs


def _threads(target, work, num_threads: int, calls: int) -> tuple[list, list]:  # noqa: ANN001
    results, errors = [], []

    def client(i: int) -> None:
        try:
            for j in range(calls):
                results.append(work(i, j))
        except Exception as error:  # noqa: BLE001 - every error is a failure of the test, reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


@pytest.mark.requires_cuda
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_eight_threads_on_the_captured_path_give_lone_outputs(cache_implementation):
    """8 threads x 3 calls of varied batch sizes sharing one model and one SpecDecoder: no error, every output equal
    to the same call made alone (the default captured path; and the compiled static path, serialised per model)."""
    cpu_target = make_model("llama", seed=0)
    draft = make_noisy_copy(cpu_target).cuda()  # the noise is drawn on the CPU
    target = cpu_target.cuda()
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=3, num_speculative_tokens_schedule="constant"
    )
    gen = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    if cache_implementation:
        gen["cache_implementation"] = cache_implementation
    inputs = {b: {k: t.cuda() for k, t in make_prompts(b, seed=b).items()} for b in BATCH_SIZES}
    alone = {b: spec_generate(target, inputs[b], spec, **gen) for b in BATCH_SIZES}
    assert spec.last_stats.num_graph_replays > 0  # the path under test is the captured one
    plain = {b: target.generate(**inputs[b], **{k: v for k, v in gen.items() if k != "cache_implementation"})
             for b in BATCH_SIZES}  # fmt: skip
    assert all(torch.equal(alone[b], plain[b]) for b in BATCH_SIZES)

    def work(i: int, j: int) -> bool:
        b = BATCH_SIZES[(i + j) % len(BATCH_SIZES)]
        return torch.equal(spec_generate(target, inputs[b], spec, **gen), alone[b])

    results, errors = _threads(target, work, num_threads=8, calls=3)
    assert errors == [] and len(results) == 24 and all(results), (errors, results)


def test_eight_threads_on_emulated_captured_steps_give_lone_outputs(adopted, emulated_graphs):
    """The same on the CPU with CUDA graphs emulated (tests/emulated_graphs.py): 8 threads x 3 calls on the static
    path, serialised per model, each call adopting the graphs an earlier call of its shapes kept (graph reuse is on
    by default): no error, every output equal to the lone call's."""
    from hf_specdec import graph_reuse

    target = make_model("llama", seed=0)
    spec = hf_specdec.SpecDecoder(
        draft_model=make_noisy_copy(target), num_speculative_tokens=3, num_speculative_tokens_schedule="constant"
    )
    gen = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, cache_implementation="static")
    inputs = {b: make_prompts(b, seed=b, min_len=6, max_len=6) for b in BATCH_SIZES}  # one width: equal shapes
    alone = {b: spec_generate(target, inputs[b], spec, **gen) for b in BATCH_SIZES}
    assert spec.last_stats.num_graph_replays > 0
    assert len(graph_reuse.entries(target)) == len(BATCH_SIZES)  # one kept entry per shape
    adopted.clear()  # the threads' calls from here

    def work(i: int, j: int) -> bool:
        b = BATCH_SIZES[(i + j) % len(BATCH_SIZES)]
        return torch.equal(spec_generate(target, inputs[b], spec, **gen), alone[b])

    results, errors = _threads(target, work, num_threads=8, calls=3)
    assert errors == [] and len(results) == 24 and all(results), (errors, results)
    assert adopted == [True] * 24  # serialised per model: each call finds its shape's entry free
    graph_reuse.clear(target)
