"""Early-exit self-speculation (`assistant_early_exit=N`, LayerSkip): the target's first N layers draft.

Greedy output equals plain `generate` at batch 1, 3 and 8 with left padding (and HF's own early-exit assisted
decoding at batch 1); the draft really runs N layers (its cache holds N) and the target's config is restored;
bad settings are refused before any model work. The sampling law is in tests/core/test_sampling_distribution.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_prompts, spec_generate
from transformers import GenerationMixin

import hf_specdec
from hf_specdec.proposers.early_exit import EarlyExitProposer

MAX_NEW = 16
ORIGINAL_GENERATE = GenerationMixin.generate


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen3"])
def deep_target(request):
    return make_model(request.param, seed=0, layers=4)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_matches_plain_generate(deep_target, batch_size):
    inputs = make_prompts(batch_size, seed=batch_size)
    expected = deep_target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    for layers, k in ((1, 3), (3, 5)):
        spec = hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=layers, num_speculative_tokens=k)
        out = spec_generate(deep_target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(out, expected), f"N={layers} k={k} B={batch_size}"
        assert deep_target.config.num_hidden_layers == 4  # restored after every draft forward
    assert spec.last_stats.acceptance_rate > 0.1  # 3 of 4 layers agree with the whole model fairly often


def test_the_draft_runs_only_the_first_layers():
    target = make_model("llama", seed=0, layers=4)
    proposer = EarlyExitProposer(target, num_layers=2, num_speculative_tokens=3)
    batch = hf_specdec.batch.RaggedBatch.from_prompts(make_prompts(3)["input_ids"], None, 64)
    view = proposer.new_view(batch)
    view.forward(batch.token_ids, batch.lengths)
    assert len(view.cache.layers) == 2
    assert target.config.num_hidden_layers == 4


def test_installed_call_equals_hf_stock_early_exit_at_batch_1():
    target = make_model("llama", seed=0, layers=4)
    inputs = make_prompts(1, seed=2)
    settings = dict(max_new_tokens=MAX_NEW, do_sample=False, assistant_early_exit=2, num_assistant_tokens=4)
    stock = ORIGINAL_GENERATE(target, **inputs, **settings)
    plain = ORIGINAL_GENERATE(target, **inputs, max_new_tokens=MAX_NEW, do_sample=False)
    hf_specdec.install()
    try:
        routed = target.generate(**inputs, **settings)
        batched = make_prompts(3, seed=2)
        routed_batch = target.generate(**batched, **settings)
    finally:
        hf_specdec.uninstall()
    assert torch.equal(stock, plain)
    assert torch.equal(routed, plain)
    assert torch.equal(routed_batch, ORIGINAL_GENERATE(target, **batched, max_new_tokens=MAX_NEW, do_sample=False))


def test_bad_settings_are_refused_before_any_model_work():
    with pytest.raises(ValueError, match="needs early_exit_layers"):
        hf_specdec.SpecDecoder(method="early_exit")
    with pytest.raises(ValueError, match="only method='early_exit' uses"):
        hf_specdec.SpecDecoder(method="ngram", early_exit_layers=2)
    assert hf_specdec.SpecDecoder(early_exit_layers=2).method == "early_exit"
    target = make_model("llama", seed=0, layers=2)
    inputs = make_prompts(2)
    with pytest.raises(ValueError, match=r"assistant_early_exit=2 must be in 1\.\.1"):
        spec_generate(target, inputs, hf_specdec.SpecDecoder(early_exit_layers=2), max_new_tokens=4)
    gpt2 = make_model("gpt2", seed=0, layers=2)
    with pytest.raises(NotImplementedError, match="ignores config.num_hidden_layers"):
        spec_generate(gpt2, inputs, hf_specdec.SpecDecoder(early_exit_layers=1), max_new_tokens=4)
