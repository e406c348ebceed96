"""Greedy speculative output equals plain `generate`, token for token, across architectures and settings."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec

MAX_NEW = 16


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_matches_plain_generate(arch_models, batch_size):
    arch, target, small = arch_models
    inputs = make_prompts(batch_size, seed=batch_size)
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    for k in (1, 4, 8):
        for spec in (
            hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3),
            hf_specdec.SpecDecoder(draft_model=small, num_speculative_tokens=k),
        ):
            out = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False)
            assert torch.equal(out, expected), f"{arch} B={batch_size} k={k} {spec.method}: {out} != {expected}"


@pytest.mark.parametrize("arch", ARCHS)
def test_target_as_its_own_draft_accepts_everything(arch):
    target = make_model(arch, seed=0)
    inputs = make_prompts(3, seed=11)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=target, num_speculative_tokens=4)
    out = spec_generate(target, inputs, spec, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert torch.equal(out, expected)
    assert spec.last_stats.acceptance_rate >= 0.98
    assert spec.last_stats.mean_accepted_length > 4.0


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_ragged_acceptance_with_a_noisy_draft(arch):
    """A draft that is right most of the time: rows accept different numbers of tokens every step."""
    target = make_model(arch, seed=0)
    draft = make_noisy_copy(target, noise=0.01)
    inputs = make_prompts(8, seed=5, min_len=2, max_len=20)
    expected = target.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=6)
    out = spec_generate(target, inputs, spec, max_new_tokens=40, do_sample=False, eos_token_id=None)
    assert torch.equal(out, expected)
    stats = spec.last_stats
    assert 0.2 < stats.acceptance_rate < 0.98, stats  # genuinely ragged
    assert stats.num_steps < 40


def test_long_generation_compacts_holes_and_stays_exact():
    """Past the sliding window and past the compaction threshold, outputs still match."""
    target = make_model("mistral", seed=0)
    draft = make_noisy_copy(target, noise=0.5)
    inputs = make_prompts(4, seed=3, min_len=2, max_len=30)
    expected = target.generate(**inputs, max_new_tokens=120, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=8)
    out = spec_generate(target, inputs, spec, max_new_tokens=120, do_sample=False, eos_token_id=None)
    assert torch.equal(out, expected)
