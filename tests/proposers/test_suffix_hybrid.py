"""Tests of `SuffixHybridProposer` (`SpecDecoder(method="suffix", draft_model=...)`): each row takes the suffix
trees' draft or the draft model's, whichever is worth more.

Greedy outputs equal plain `generate` at batch 1 to 5 with left padding, with steps where some rows take the model's
drafts and others the trees'; a call that repeats earlier requests skips the model's forwards; sampling follows
the target's exact law (chi-square) with both kinds of drafts in one call; static caches are refused clearly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import EOS_ID, make_model, make_noisy_copy, make_prompts, spec_generate
from first_tokens_law import check_first_tokens, exact_joint_law

import hf_specdec
from hf_specdec.proposers import suffix_hybrid
from hf_specdec.proposers.draft_model import DraftModelProposer
from hf_specdec.proposers.suffix_hybrid import SuffixHybridProposer

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


@pytest.fixture
def choices(monkeypatch) -> list[np.ndarray]:
    """Each step's rows that took the model's drafts."""
    seen: list[np.ndarray] = []
    propose, plan_step = SuffixHybridProposer.propose, SuffixHybridProposer.plan_step

    def proposing(self, *args, **kwargs):  # noqa: ANN001, ANN202 - dynamic caches choose here
        proposal = propose(self, *args, **kwargs)
        if self.static is None:
            seen.append(self.model_rows.copy())
        return proposal

    def planning(self, *args, **kwargs):  # noqa: ANN001, ANN202 - static caches choose here, before the step
        key = plan_step(self, *args, **kwargs)
        seen.append(self.model_rows.copy())
        return key

    monkeypatch.setattr(SuffixHybridProposer, "propose", proposing)
    monkeypatch.setattr(SuffixHybridProposer, "plan_step", planning)
    return seen


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_greedy_equals_plain_with_both_kinds_of_drafts(target, choices, batch_size, schedule):
    inputs = make_prompts(batch_size, seed=30 + batch_size, min_len=3, max_len=20)
    expected = target.generate(**inputs, max_new_tokens=24, **GREEDY)
    draft = make_noisy_copy(target)
    spec = hf_specdec.SpecDecoder(
        method="suffix", draft_model=draft, num_speculative_tokens=6, num_speculative_tokens_schedule=schedule
    )
    out = spec_generate(target, inputs, spec, max_new_tokens=24, **GREEDY)
    assert torch.equal(out, expected)
    took_model = np.concatenate(choices)
    assert took_model.any(), "the model never drafted"
    # The same requests again: the trees hold their outputs, so most rows take the trees' drafts.
    choices.clear()
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=24, **GREEDY), expected)
    assert not np.concatenate(choices).all()
    assert spec.last_stats.acceptance_rate > 0.5


def test_rows_that_take_the_model_get_its_drafts(target, choices):
    """With an exact copy of the target as the draft, every model draft is right: a first call, where the trees
    know little, accepts most drafts."""
    inputs = make_prompts(3, seed=33, min_len=3, max_len=20)
    spec = hf_specdec.SpecDecoder(method="suffix", draft_model=make_noisy_copy(target, noise=0.0),
                                  num_speculative_tokens=6, num_speculative_tokens_schedule="constant")  # fmt: skip
    out = spec_generate(target, inputs, spec, max_new_tokens=24, **GREEDY)
    assert torch.equal(out, target.generate(**inputs, max_new_tokens=24, **GREEDY))
    assert np.concatenate(choices).mean() > 0.5 and spec.last_stats.acceptance_rate > 0.75


def test_a_repeated_request_skips_the_models_forwards(target, monkeypatch):
    inputs = make_prompts(2, seed=4, min_len=6, max_len=12)
    expected = target.generate(**inputs, max_new_tokens=32, **GREEDY)
    calls: list[int] = []
    propose = DraftModelProposer.propose
    monkeypatch.setattr(DraftModelProposer, "propose", lambda self, *a, **k: calls.append(1) or propose(self, *a, **k))
    spec = hf_specdec.SpecDecoder(method="suffix", draft_model=make_noisy_copy(target), num_speculative_tokens=8)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=32, **GREEDY), expected)
    first = len(calls)
    calls.clear()
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=32, **GREEDY), expected)
    assert len(calls) < first / 2, (len(calls), first)
    assert spec.last_stats.mean_accepted_length > 3


def test_rows_that_stop_early_equal_plain(target):
    inputs = make_prompts(5, seed=8)
    expected = target.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=EOS_ID)
    spec = hf_specdec.SpecDecoder(method="suffix", draft_model=make_noisy_copy(target), num_speculative_tokens=5)
    for _ in range(2):
        out = spec_generate(target, inputs, spec, max_new_tokens=40, do_sample=False, eos_token_id=EOS_ID)
        assert torch.equal(out, expected)


def test_a_useless_model_drafts_only_to_reprobe(target, choices):
    inputs = make_prompts(2, seed=9, min_len=4, max_len=10)
    useless = make_noisy_copy(target, noise=50.0)
    spec = hf_specdec.SpecDecoder(method="suffix", draft_model=useless, num_speculative_tokens=4,
                                  num_speculative_tokens_schedule="constant")  # fmt: skip
    expected = target.generate(**inputs, max_new_tokens=96, **GREEDY)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=96, **GREEDY), expected)
    steps_with_model = [i for i, rows in enumerate(choices) if rows.any()]
    late = [i for i in steps_with_model if i > len(choices) // 2]
    assert len(late) <= 2 + len(choices) // suffix_hybrid.REPROBE_EVERY, steps_with_model


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sampling_follows_the_target_law(request, choices, cache):
    """6000 rows of one seeded call; a first call fills the global tree, so some rows take the trees' drafts and
    the others the model's (sampled from its distribution), in the same steps; static: captured (emulated)."""
    if cache == "static":
        request.getfixturevalue("emulated_graphs")
    target = make_model("llama", seed=0, vocab=12)
    draft = make_noisy_copy(target, noise=0.5)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11, 5, 6]])
    samples = 6000
    inputs = {"input_ids": prompt.expand(samples, -1), "attention_mask": torch.ones(samples, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(method="suffix", draft_model=draft, num_speculative_tokens=2, seed=99,
                                  num_speculative_tokens_schedule="constant")  # fmt: skip
    sampling = dict(max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0, cache_implementation=cache)
    spec_generate(target, {k: v[:200] for k, v in inputs.items()}, spec, **sampling)
    choices.clear()
    out = spec_generate(target, inputs, spec, **sampling)
    mixed = [rows for rows in choices if 0 < rows.sum() < len(rows)]
    assert mixed, "no step mixed the trees' drafts with the model's"
    check_first_tokens(out, prompt, exact_joint_law(target, prompt, 3, 1.0), 3)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_static_steps_are_planned_and_captured(target, emulated_graphs, monkeypatch, batch_size):
    """On static caches (with emulated CUDA graphs) the trees draft in `plan_step`, which also picks the step's
    graph: with the model's forwards or without; outputs equal plain's, steps replay, a second call adopts the
    first's graphs, and the repeated requests run steps without the model."""
    from hf_specdec.decoding import SpeculativeLoop

    keys: list = []
    plan_step = SpeculativeLoop.plan_step
    monkeypatch.setattr(SpeculativeLoop, "plan_step", lambda self: keys.append(plan_step(self)) or keys[-1])
    inputs = make_prompts(batch_size, seed=40 + batch_size, min_len=3, max_len=16)
    expected = target.generate(**inputs, max_new_tokens=32, **GREEDY)
    spec = hf_specdec.SpecDecoder(method="suffix", draft_model=make_noisy_copy(target, noise=0.01),
                                  num_speculative_tokens=6, num_speculative_tokens_schedule="constant")  # fmt: skip
    for call in range(2):
        keys.clear()
        out = spec_generate(target, inputs, spec, max_new_tokens=32, cache_implementation="static", **GREEDY)
        assert torch.equal(out, expected)
        assert spec.last_stats.num_graph_replays > 0
        if call == 0:
            assert ("draft", ("model", 2)) in keys
            assert spec.last_stats.acceptance_rate > 0.3  # the model's drafts (the trees know little yet)
    assert spec.last_stats.graph_reuse == "adopted"
    assert ("draft", ("suffix",)) in keys and spec.last_stats.acceptance_rate > 0.7
    # An edit of an earlier request: the trees know its next 16 tokens (long accepted drafts from the first step
    # on, while the model waits), then the model drafts again (it must first catch up on all it missed).
    keys.clear()
    width = inputs["input_ids"].shape[1] + 16
    edited = {"input_ids": expected[:, :width], "attention_mask": torch.ones_like(expected[:, :width])}
    edited["attention_mask"][:, : inputs["attention_mask"].shape[1]] = inputs["attention_mask"]
    out = spec_generate(target, edited, spec, max_new_tokens=40, cache_implementation="static", **GREEDY)
    assert torch.equal(out, target.generate(**edited, max_new_tokens=40, **GREEDY))
    assert ("draft", ("suffix",)) in keys and any(key[1][0] == "model" for key in keys if key[0] == "draft")


def test_another_method_with_a_draft_model_is_refused(target):
    with pytest.raises(ValueError, match=r"method='suffix'"):
        hf_specdec.SpecDecoder(method="ngram", draft_model=make_noisy_copy(target))
