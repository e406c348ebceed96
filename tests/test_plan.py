"""The call plan: built once per call, before any model forward, frozen, with the route resolved."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_prompts, spec_generate

import hf_specdec
from hf_specdec import plan as plan_module
from hf_specdec.proposers.top1 import Top1Proposer


def test_plan_is_built_before_any_model_work(llama, monkeypatch):
    forwards = []
    built = []
    build = plan_module.CallPlan.build.__func__

    def recording_build(cls, *args, **kwargs):
        plan = build(cls, *args, **kwargs)
        built.append((plan, len(forwards)))
        return plan

    monkeypatch.setattr(plan_module.CallPlan, "build", classmethod(recording_build))
    handle = llama.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3)
        spec_generate(llama, make_prompts(2, seed=3), spec, max_new_tokens=4, do_sample=False)
    finally:
        handle.remove()
    assert len(built) == 1
    plan, forwards_before = built[0]
    assert forwards_before == 0 and forwards  # no forward while planning; the loop ran some
    assert plan.route == "dynamic" and plan.static is None and plan.exact is None
    assert isinstance(plan.proposer, Top1Proposer)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.route = "static"


def test_first_failing_check_in_plan_order_is_raised(llama):
    """generate's own settings are checked before the SpecDecoder's seeds (a later check in the plan's order)."""
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, seed=[1, 2, 3])  # 3 seeds for 2 rows
    with pytest.raises(ValueError, match="beam search"):
        spec_generate(llama, make_prompts(2), spec, max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="per-row seeds"):
        spec_generate(llama, make_prompts(2), spec, max_new_tokens=4)
