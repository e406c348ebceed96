"""Early-exit self-speculation (`assistant_early_exit=N`, LayerSkip): the target's first N layers draft.

Greedy output equals plain `generate` at batch 1, 3 and 8 with left padding (and HF's own early-exit assisted
decoding at batch 1); the draft really runs N layers (its cache holds N) and the target's config is restored;
bad settings are refused before any model work. The sampling law is in tests/core/test_sampling_distribution.py.
"""

from __future__ import annotations

import warnings

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


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_captured_static_steps_equal_plain_generate(emulated_graphs, arch):
    """On static caches the draft keeps an N-layer static cache of its own and the whole step (catch-up, k truncated
    forwards, verify, commit) is captured (CUDA graphs emulated on the CPU): batch 3, left-padded, plain's tokens,
    and the acceptance of the same steps uncaptured."""
    target = make_model(arch, seed=0, layers=4)
    inputs = make_prompts(3, seed=3)
    gen = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    accepted = {}
    for captured in (True, False):
        spec = hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=3, num_speculative_tokens=3)
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
            warnings.simplefilter("error", RuntimeWarning)  # a refused capture would warn
            if not captured:
                patch.setenv("HF_SPECDEC_CAPTURE_STEPS", "0")
            out = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
        assert torch.equal(out, expected), captured
        assert (spec.last_stats.num_graph_replays > 0) == captured
        accepted[captured] = spec.last_stats.accepted_per_position
        assert target.config.num_hidden_layers == 4
    assert accepted[True] == accepted[False] and 0 < sum(accepted[True]) < spec.last_stats.num_draft_tokens


def test_the_static_draft_cache_holds_only_the_first_layers():
    from hf_specdec.static_cache import StaticPlan

    target = make_model("llama", seed=0, layers=4)
    proposer = EarlyExitProposer(target, num_layers=2, num_speculative_tokens=3)
    proposer.use_static(StaticPlan(k=3, max_columns=64, compiled_call=lambda model: None))
    batch = hf_specdec.batch.RaggedBatch.from_prompts(make_prompts(3)["input_ids"], None, 64)
    view = proposer.new_view(batch)
    view.forward(batch.token_ids, batch.lengths - 1)
    assert len(view.cache.layers) == 2 and all(layer.is_initialized for layer in view.cache.layers)
    assert target.config.num_hidden_layers == 4


def test_captured_sampling_draws_what_the_uncaptured_step_draws(emulated_graphs, monkeypatch):
    from core.test_emulated_capture import assert_captured_drafts_equal_uncaptured

    target = make_model("llama", seed=0, layers=4)
    gen = dict(max_new_tokens=MAX_NEW, do_sample=True, temperature=0.9, top_k=20, eos_token_id=None,
               cache_implementation="static")  # fmt: skip
    spec = dict(method="early_exit", early_exit_layers=2, num_speculative_tokens=3, seed=7)
    assert_captured_drafts_equal_uncaptured(target, make_prompts(3, seed=9), spec, gen, monkeypatch)
