"""Gemma 4 assistants on static caches (`hf_specdec/proposers/gemma4_assistant_static.py`), with steps captured (CUDA
graphs emulated on the CPU: tests/emulated_graphs.py) and without.

Every draft of an uncaptured static call equals transformers' own assistant forward on the row's committed prefix
(test_gemma4_assistant.py's reference: the assistant reads the target's static cache through the verify's mask
row); captured calls at batch 3 (left-padded) give plain `generate`'s greedy tokens and the uncaptured static path's
acceptance, replaying their steps; seeded sampling draws the same captured and uncaptured, and keeps the target's
law; calls of equal shapes adopt the kept graphs and stay exact.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_gemma4, make_gemma4_assistant, make_prompts, record_proposals, spec_generate
from core.test_emulated_capture import assert_captured_drafts_equal_uncaptured, captured_and_uncaptured_stats
from first_tokens_law import check_first_tokens, exact_joint_law

import hf_specdec
from hf_specdec import graph_reuse

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not hasattr(transformers, "Gemma4AssistantForCausalLM"), reason="this transformers has no Gemma 4 assistants"
    ),
]
STATIC = dict(do_sample=False, cache_implementation="static")


@pytest.fixture(scope="module")
def gemma4():
    target = make_gemma4()
    return target, make_gemma4_assistant(target, echo=0.7)


def test_static_drafts_equal_transformers_assistant(gemma4, monkeypatch) -> None:
    from proposers.test_gemma4_assistant import reference_drafts

    from hf_specdec.proposers.gemma4_assistant_static import StaticGemma4AssistantProposer

    target, assistant = gemma4
    inputs = make_prompts(3, seed=3, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    steps = record_proposals(monkeypatch, StaticGemma4AssistantProposer)
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=3)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=16, **STATIC), expected)
    assert 0 < spec.last_stats.num_accepted_tokens < spec.last_stats.num_draft_tokens, spec.last_stats
    checked = 0
    for token_ids, lengths, pad_lengths, drafts in steps:
        for i in range(token_ids.shape[0]):
            num = int((drafts[i] >= 0).sum())
            if num:
                row = token_ids[i, pad_lengths[i] : lengths[i]]
                assert drafts[i, :num].tolist() == reference_drafts(target, assistant, row, num)
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
def test_captured_steps_equal_plain(emulated_graphs, gemma4, schedule) -> None:
    target, assistant = gemma4
    inputs = make_prompts(3, seed=5, repetitive=False)
    gen = dict(max_new_tokens=20, eos_token_id=None)
    expected = target.generate(**inputs, **gen, do_sample=False)
    spec = dict(draft_model=assistant, num_speculative_tokens=3, num_speculative_tokens_schedule=schedule)
    stats = captured_and_uncaptured_stats(target, inputs, spec, gen, expected)
    if schedule == "constant":
        assert 0 < stats[True].num_accepted_tokens < stats[True].num_draft_tokens, stats[True]
        assert stats[True].accepted_per_position == stats[False].accepted_per_position


def test_captured_sampling_draws_what_the_uncaptured_step_draws(emulated_graphs, gemma4, monkeypatch) -> None:
    target, assistant = gemma4
    gen = dict(max_new_tokens=20, do_sample=True, temperature=0.9, eos_token_id=None, cache_implementation="static")
    spec = dict(draft_model=assistant, num_speculative_tokens=3, seed=5)
    assert_captured_drafts_equal_uncaptured(target, make_prompts(3, seed=8), spec, gen, monkeypatch)


def test_sampling_on_static_caches_follows_the_target_law(monkeypatch) -> None:
    from hf_specdec import cache_route

    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)  # 6000 rows: keep the static caches short
    target = make_gemma4(seed=3, vocab=12, initializer_range=0.3)
    assistant = make_gemma4_assistant(target, seed=4, echo=0.5)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11, 5, 6]])
    samples = 6000
    inputs = {"input_ids": prompt.expand(samples, -1), "attention_mask": torch.ones(samples, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=2, seed=1234)
    out = spec_generate(target, inputs, spec, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0,
                        cache_implementation="static")  # fmt: skip
    assert 0.05 < spec.last_stats.acceptance_rate < 0.95, spec.last_stats
    check_first_tokens(out, prompt, exact_joint_law(target, prompt, 3, 1.0), 3)


def test_calls_that_adopt_kept_graphs_give_plain_output(adopted, emulated_graphs, gemma4) -> None:

    target, assistant = gemma4
    graph_reuse.clear(target)  # graphs an earlier test of this module kept would serve the first call
    for batch_size, seed, width, new in ((3, 1, 6, 16), (3, 2, 9, 11), (2, 4, 6, 16)):  # other lengths adopt too
        inputs = make_prompts(batch_size, seed=seed, min_len=width - 2, max_len=width, repetitive=False)
        gen = dict(max_new_tokens=new, do_sample=False, eos_token_id=None)
        spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=3)
        assert torch.equal(spec_generate(target, inputs, spec, **gen, cache_implementation="static"),
                           target.generate(**inputs, **gen)), seed  # fmt: skip
        assert spec.last_stats.num_graph_replays > 0
    assert adopted == [False, True, False]
    graph_reuse.clear(target)
