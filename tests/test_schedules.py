"""HF's assistant knobs: num_assistant_tokens, num_assistant_tokens_schedule and assistant_confidence_threshold,
both as `SpecDecoder` options and through `hf_specdec.install()` + `model.generate(assistant_model=...)`."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_noisy_copy, make_prompts, spec_generate
from transformers.generation import candidate_generator

import hf_specdec
from hf_specdec import schedules
from hf_specdec.routing import _spec_from_kwargs
from hf_specdec.schedules import ConfidenceThreshold, HeuristicSchedule, best_threshold

GREEDY = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def noisy_draft(llama):
    return make_noisy_copy(llama, noise=0.02)


@pytest.fixture
def installed():
    hf_specdec.install()
    yield
    hf_specdec.uninstall()


def _assistant(draft, k: int, schedule: str, threshold: float):
    draft = copy.deepcopy(draft)
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = schedule
    draft.generation_config.assistant_confidence_threshold = threshold
    return draft


def test_heuristic_schedule_grows_and_shrinks_per_row():
    schedule = HeuristicSchedule(initial_k=3, max_k=6)
    schedule.start(4, torch.device("cpu"))
    schedule.observe(torch.tensor([3, 3, 0, 3]), torch.tensor([3, 1, 0, 0]))
    assert schedule.k_rows.tolist() == [5, 2, 3, 2]
    schedule.observe(torch.tensor([5, 2, 3, 2]), torch.tensor([5, 0, 0, 0]))
    assert schedule.k_rows.tolist() == [6, 1, 2, 1]  # capped at max_k, floored at 1


def test_best_threshold_minimises_fpr_plus_three_fnr():
    probs = torch.tensor([0.9, 0.8, 0.5, 0.6, 0.3, 0.2])
    matches = torch.tensor([1, 1, 1, 0, 0, 0])
    # t = 0.5: fpr 1/3, fnr 0 (cost 1/3); t = 0.6: fpr 1/3, fnr 1/3 (cost 4/3): missed accepts cost 3x.
    assert best_threshold(probs, matches) == pytest.approx(0.5)
    assert best_threshold(torch.tensor([0.9, 0.7, 0.6, 0.2]), torch.tensor([1, 1, 0, 0])) == pytest.approx(0.7)
    threshold = ConfidenceThreshold(0.4)
    threshold.update(torch.tensor([[0.9, 0.8, 0.1], [0.95, -1.0, -1.0]]), torch.tensor([1, 1]))
    assert threshold.probs == pytest.approx([0.9, 0.8, 0.95]) and threshold.matches == [1, 0, 1]


def test_kwargs_and_configs_resolve_like_hf(llama, noisy_draft):
    draft = _assistant(noisy_draft, 7, "heuristic_transient", 0.25)
    spec = _spec_from_kwargs(llama, {"assistant_model": draft})
    assert (spec.num_speculative_tokens, spec.num_speculative_tokens_schedule) == (7, "heuristic_transient")
    assert spec.draft_confidence_threshold == 0.25
    kwargs = {"assistant_model": draft, "num_assistant_tokens": 2, "num_assistant_tokens_schedule": "constant",
              "assistant_confidence_threshold": 0.0}  # fmt: skip
    spec = _spec_from_kwargs(llama, kwargs)
    assert (spec.num_speculative_tokens, spec.num_speculative_tokens_schedule) == (2, "constant")
    assert spec.draft_confidence_threshold is None and kwargs == {}
    bare = copy.deepcopy(noisy_draft)
    spec = _spec_from_kwargs(llama, {"assistant_model": bare})  # no knob named: hf_specdec's adaptive default
    assert (spec.num_speculative_tokens, spec.num_speculative_tokens_schedule) == (5, "adaptive")
    assert spec.draft_confidence_threshold is None
    spec = _spec_from_kwargs(llama, {"assistant_model": bare, "num_assistant_tokens": 3})  # HF's defaults for the rest
    assert (spec.num_speculative_tokens, spec.num_speculative_tokens_schedule) == (3, "constant")
    assert spec.draft_confidence_threshold == 0.4


def test_heuristic_follows_hf_step_by_step(llama, noisy_draft, installed, monkeypatch):
    """Batch of one, greedy: every step drafts, accepts and moves k exactly like transformers' own loop."""
    inputs = make_prompts(1, seed=5)
    hf_steps, our_steps = [], []
    original_update = candidate_generator.AssistedCandidateGenerator.update_candidate_strategy

    def hf_observed(self, input_ids, scores, num_matches):
        before = int(self.num_assistant_tokens)
        original_update(self, input_ids, scores, num_matches)
        hf_steps.append((len(scores[0]) - 1, num_matches, before, int(self.num_assistant_tokens)))

    original_observe = HeuristicSchedule.observe

    def ours_observed(self, num_draft_tokens, num_accepted):
        before = int(self.k_rows[0])
        original_observe(self, num_draft_tokens, num_accepted)
        our_steps.append((int(num_draft_tokens[0]), int(num_accepted[0]), before, int(self.k_rows[0])))

    monkeypatch.setattr(candidate_generator.AssistedCandidateGenerator, "update_candidate_strategy", hf_observed)
    monkeypatch.setattr(schedules.HeuristicSchedule, "observe", ours_observed)
    hf_draft, our_draft = _assistant(noisy_draft, 3, "heuristic", 0.0), _assistant(noisy_draft, 3, "heuristic", 0.0)
    hf_specdec.uninstall()
    expected = llama.generate(**inputs, **GREEDY, assistant_model=hf_draft)
    hf_specdec.install()
    out = llama.generate(**inputs, **GREEDY, assistant_model=our_draft)
    assert torch.equal(out, expected)
    # HF's first step may draft fewer than k (its assistant warms up); compare accept counts and k after each step.
    drafting = [s for s in hf_steps if s[0] > 0]
    assert [s[1:] for s in drafting] == [s[1:] for s in our_steps if s[0] > 0]
    assert len(drafting) > 5 and len({s[3] for s in drafting}) > 2  # k really moved
    # "heuristic" persists the final k on the assistant's generation_config, like transformers.
    assert our_draft.generation_config.num_assistant_tokens == drafting[-1][3]


def test_heuristic_transient_does_not_persist(llama, noisy_draft, installed):
    draft = _assistant(noisy_draft, 3, "heuristic_transient", 0.0)
    inputs = make_prompts(2, seed=6)
    out = llama.generate(**inputs, **GREEDY, assistant_model=draft)
    assert draft.generation_config.num_assistant_tokens == 3
    hf_specdec.uninstall()
    expected = llama.generate(**inputs, **GREEDY)
    assert torch.equal(out, expected)


def test_confidence_threshold_stops_low_confidence_rows(llama, noisy_draft):
    inputs = make_prompts(3, seed=7)
    expected = llama.generate(**inputs, **GREEDY)
    stats = {}
    for threshold in (None, 0.999):
        spec = hf_specdec.SpecDecoder(draft_model=noisy_draft, num_speculative_tokens=5,
                                      draft_confidence_threshold=threshold)  # fmt: skip
        draft_calls = []
        handle = noisy_draft.register_forward_pre_hook(lambda *_, calls=draft_calls: calls.append(1))
        try:
            assert torch.equal(spec_generate(llama, inputs, spec, **GREEDY), expected)
        finally:
            handle.remove()
        stats[threshold] = (spec.last_stats, len(draft_calls))
    loose, strict = stats[None][0], stats[0.999][0]
    assert loose.num_draft_tokens / loose.num_drafting_row_steps == pytest.approx(5, abs=0.6)
    # With a near-1 threshold almost every row stops after its first draft (the threshold re-fits as it goes).
    assert strict.num_draft_tokens / strict.num_drafting_row_steps < 4
    assert stats[0.999][1] / strict.num_steps < stats[None][1] / loose.num_steps  # fewer draft forwards per step


def test_confidence_threshold_options_are_checked():
    with pytest.raises(ValueError, match="only applies to method='draft'"):
        hf_specdec.SpecDecoder(method="ngram", draft_confidence_threshold=0.4)
    with pytest.raises(ValueError, match=r"\[0, 1\).*got 1.5"):
        hf_specdec.SpecDecoder(method="ngram", draft_confidence_threshold=1.5)
