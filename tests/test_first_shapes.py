"""`hf_specdec.first_shapes`: a step whose forwards ran a shape for the first time (a GPU's kernel loads; forced here
on the CPU) is left untimed, so the adaptive schedule never takes a first run for what a kind of step costs."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec import adaptive, first_shapes

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_shape_is_new_once_per_model_and_flagged_per_thread(monkeypatch):
    monkeypatch.setattr(first_shapes, "builds_plans_per_shape", lambda device: True)
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    cpu = torch.device("cpu")
    first_shapes.take_new()
    first_shapes.note(model, (1, 3), cpu)
    assert first_shapes.take_new() and not first_shapes.take_new()  # taking clears it
    first_shapes.note(model, (1, 3), cpu)
    assert not first_shapes.take_new()  # seen
    first_shapes.note(other, (1, 3), cpu)
    assert first_shapes.take_new()  # another model's first run
    elsewhere: list[bool] = []
    thread = threading.Thread(target=lambda: (first_shapes.note(model, (2, 5), cpu), first_shapes.take_new()))
    thread.start()
    thread.join()
    elsewhere.append(first_shapes.take_new())
    assert elsewhere == [False]  # another thread's first run is that thread's concern


def test_no_flag_where_shapes_cost_nothing_more_the_first_time():
    first_shapes.take_new()
    first_shapes.note(torch.nn.Linear(2, 2), (1, 7), torch.device("cpu"))
    assert not first_shapes.take_new()


@pytest.mark.parametrize("first_runs_cost", [True, False])
def test_steps_with_a_first_run_shape_are_not_timed(monkeypatch, first_runs_cost):
    """Where first runs cost more (a GPU), the steps that met new widths are left untimed; where they do not (the CPU)
    every steady step of the dynamic path is timed."""
    monkeypatch.setattr(first_shapes, "builds_plans_per_shape", lambda device: first_runs_cost)
    discarded = [0]
    discard = adaptive.AdaptiveSchedule.discard_timing

    def counting(self):  # noqa: ANN001, ANN202
        discarded[0] += 1
        discard(self)

    monkeypatch.setattr(adaptive.AdaptiveSchedule, "discard_timing", counting)
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.05)
    inputs = make_prompts(2, seed=3, min_len=5, max_len=11)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=3, num_speculative_tokens_schedule="adaptive"
    )
    out = spec_generate(target, inputs, spec, cache_implementation="dynamic", **gen)
    assert torch.equal(out, target.generate(**inputs, **gen))
    assert discarded[0] >= 2 if first_runs_cost else discarded[0] == 0, discarded


def test_a_models_first_dynamic_call_at_a_batch_size_is_not_timed(monkeypatch):
    """Where first runs cost more (a GPU), a model's first dynamic call at a batch size warms up (kernel compiles and
    loads no shape names): none of its steps is recorded as a cost; the next call's steps are."""
    monkeypatch.setattr(first_shapes, "builds_plans_per_shape", lambda device: True)
    recorded = [0]
    record = adaptive.StepCosts.record

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN202
        recorded[-1] += 1
        return record(self, *args, **kwargs)

    monkeypatch.setattr(adaptive.StepCosts, "record", counting)
    target = make_model("llama", seed=1)
    draft = make_noisy_copy(target, noise=0.05)
    inputs = make_prompts(2, seed=5, min_len=5, max_len=11)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    for _ in range(2):
        spec = hf_specdec.SpecDecoder(
            draft_model=draft, num_speculative_tokens=3, num_speculative_tokens_schedule="adaptive"
        )
        spec_generate(target, inputs, spec, cache_implementation="dynamic", **gen)
        recorded.append(0)
    assert recorded[0] == 0 and recorded[1] > 0, recorded
