"""Captured steps under schedules that mix step kinds, with CUDA-graph semantics emulated on the CPU
(tests/emulated_graphs.py): plain and drafting steps in any order, a draft that catches up between them, and later
calls that adopt a finished call's graphs (`graph_reuse`) must all give plain `generate`'s tokens.

These found a bug an H100 run had shown only as a device-side index assert: a step kind captured after a catch-up
forward read the tensor the catch-up had made, not the one the graphs captured before it write."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec import graph_reuse, plan, step_graph
from hf_specdec.schedules import SpeculationSchedule

#: which steps draft (step numbers from 1), one pattern per call
PATTERNS = {
    "never": lambda n: False,
    "every third": lambda n: n % 3 == 0,
    "always": lambda n: True,
    "every other": lambda n: n % 2 == 0,
    "after five": lambda n: n > 5,
    "first three": lambda n: n < 4,
    "four in five": lambda n: n % 5 != 0,
}


class Pattern(SpeculationSchedule):
    """Plans each step on the host like the adaptive schedule, from a fixed pattern: all rows draft k, or none."""

    plans_on_host = True
    queue: list = []

    def start(self, batch_size: int, device: torch.device) -> None:
        self.drafts, self.step, self.batch_size = self.queue.pop(0), 0, batch_size

    def host_budgets(self, batch) -> torch.Tensor:  # noqa: ANN001
        self.step += 1
        return torch.full((self.batch_size,), self.max_k if self.drafts(self.step) else 0)


@pytest.fixture
def patterned(monkeypatch, emulated_graphs):
    from hf_specdec.decoding import SpeculativeLoop

    monkeypatch.setattr(plan, "build_schedule", lambda spec, *args, **kwargs: Pattern(spec.num_speculative_tokens))
    # A pattern says what each step does: one plain step per plan (blocks of plain steps: test_plain_blocks.py).
    monkeypatch.setattr(SpeculativeLoop, "plain_block", lambda self: 1)
    Pattern.queue = []
    return Pattern.queue


def _setup(method: str):
    target = make_model("llama", seed=0)
    drafting = (
        dict(draft_model=make_noisy_copy(target, noise=0.3, seed=4)) if method == "draft" else dict(method="ngram")
    )
    spec = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=3)
    inputs = {b: make_prompts(b, seed=b, min_len=8, max_len=8) for b in (1, 3)}  # one width: one signature per b
    return target, spec, inputs


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_one_call_with_mixed_step_kinds_equals_plain(patterned, method, pattern):
    target, spec, inputs = _setup(method)
    gen = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    for b, prompt in inputs.items():
        patterned.append(PATTERNS[pattern])
        out = spec_generate(target, prompt, spec, **gen, cache_implementation="static")
        assert torch.equal(out, target.generate(**prompt, **gen)), (pattern, b)
        assert spec.last_stats.num_graph_replays > 0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_calls_that_adopt_graphs_kept_from_other_calls_equal_plain(adopted, patterned, method):
    """Each call adopts the graphs the previous call of its batch size kept, with step kinds first captured by
    different calls (the run that failed on an H100 with the adaptive schedule)."""
    target, spec, inputs = _setup(method)
    gen = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    plain = {b: target.generate(**prompt, **gen) for b, prompt in inputs.items()}
    for name in ["never", "every third", "always", "every other", "after five", "first three", "four in five"] * 2:
        for b, prompt in inputs.items():
            patterned.append(PATTERNS[name])
            out = spec_generate(target, prompt, spec, **gen, cache_implementation="static")
            assert torch.equal(out, plain[b]), (name, b)
    assert adopted[:2] == [False, False] and all(adopted[2:])
    graph_reuse.clear(target)


@pytest.mark.parametrize("method", ["draft", "early_exit"])
def test_a_draft_behind_after_plain_steps_catches_up_in_few_forwards_and_one_graph(patterned, monkeypatch, method):
    """After m steps without drafts the draft is m + 2 tokens behind. It used to catch up 2 tokens per eager forward
    of the whole draft before the drafting step's graph (m / 2 forwards: 63 after the adaptive schedule's 128 plain
    steps between two re-measurements of a useless draft), and to land 1 or 2 behind: two keys of one drafting graph,
    so a second warm-up and capture. Now the backlog goes in the widest forwards first, and there is one key."""
    from hf_specdec.proposers.draft_model import DraftModelProposer, catch_up_widths

    target, spec, inputs = _setup("draft")
    if method == "early_exit":  # the target's first layer drafts (a DraftModelProposer with its own static view)
        spec = hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=1, num_speculative_tokens=3)
    widths: list[int] = []
    planning = []
    hook = (spec.draft_model if method == "draft" else target).register_forward_hook(
        lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]) if planning else None,
        with_kwargs=True,
    )
    plan_step = DraftModelProposer.plan_step

    def planned(self, batch):  # noqa: ANN001, ANN202
        planning.append(True)
        try:
            return plan_step(self, batch)
        finally:
            planning.pop()

    monkeypatch.setattr(DraftModelProposer, "plan_step", planned)
    keys = []
    finish = step_graph.StepGraph.finish
    monkeypatch.setattr(step_graph.StepGraph, "finish", lambda self: (keys.extend(self.graphs), finish(self)))
    patterned.append(lambda n: n < 3 or n > 31)  # draft, then 29 plain steps (the draft 31 behind), then draft
    gen = dict(max_new_tokens=64, do_sample=False, eos_token_id=None)
    try:
        out = spec_generate(target, inputs[1], spec, **gen, cache_implementation="static")
    finally:
        hook.remove()
    assert torch.equal(out, target.generate(**inputs[1], **gen))
    assert widths == catch_up_widths(30) == [16, 8, 4, 2]  # 30 of the 31 tokens, in 4 forwards (not 15)
    assert sorted(keys) == [("draft", 2), ("plain",)]
    graph_reuse.clear(target)
