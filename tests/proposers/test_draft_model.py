"""`hf_specdec.proposers.draft_model`: the draft's catch-up widths are warmed once per draft model where a forward's
first run at a new shape is costly (a GPU; forced here on the CPU), and the warm-up leaves no trace in the output."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec.proposers import draft_model
from hf_specdec.static_cache import StaticCacheView

pytestmark = pytest.mark.usefixtures("one_thread")


def test_catch_up_widths_are_warmed_once_and_change_nothing(monkeypatch, emulated_graphs):
    monkeypatch.setattr(draft_model, "builds_plans_per_shape", lambda device: True)
    widths: list[int] = []
    forward = StaticCacheView.forward

    def recording(self, token_ids, num_new, logits_to_keep=None, width=None, eager=False):  # noqa: ANN001, ANN202
        if eager:
            widths.append(width)
        return forward(self, token_ids, num_new, logits_to_keep, width, eager)

    monkeypatch.setattr(StaticCacheView, "forward", recording)
    warm_forwards: list[int] = []  # per call: the eager forwards its warm-up ran
    warm = draft_model.DraftModelProposer._warm_catch_up

    def counting(self, batch):  # noqa: ANN001, ANN202
        before = len(widths)
        warm(self, batch)
        warm_forwards.append(len(widths) - before)

    monkeypatch.setattr(draft_model.DraftModelProposer, "_warm_catch_up", counting)
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.05)
    inputs = make_prompts(3, seed=2, min_len=4, max_len=12)
    gen = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, cache_implementation="static", **gen)
    assert torch.equal(out, expected)
    warmed = draft_model._WARM_WIDTHS[draft]
    assert {32, 16, 8, 4, 2} <= warmed and set(widths) >= warmed
    assert torch.equal(spec_generate(target, inputs, spec, cache_implementation="static", **gen), expected)
    assert warm_forwards[0] >= 5 and warm_forwards[1] == 0  # the second call warms nothing
