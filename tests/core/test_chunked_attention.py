"""Llama 4's chunked attention layers: masks built from the column map (a query sees its own chunk of positions).

A tiny `llama4_text` target with a chunk of 8 tokens, so that prompts and generations cross several chunks; left
padding puts every row's chunk borders at different columns, and rejected drafts leave holes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_noisy_copy, make_prompts, spec_generate
from transformers import Llama4ForCausalLM, Llama4TextConfig

import hf_specdec

NEW_TOKENS = 40


def make_llama4(seed: int = 0, chunk: int = 8) -> Llama4ForCausalLM:
    config = Llama4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=chunk, no_rope_layers=[1, 1, 1, 0],
        layer_types=["chunked_attention"] * 3 + ["full_attention"], max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    return Llama4ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama4():
    return make_llama4()


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 4])
def test_chunked_attention_greedy_matches_plain(llama4, batch_size, method, k):
    inputs = make_prompts(batch_size, seed=batch_size + k)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = llama4.generate(**inputs, **kwargs)
    spec_kwargs = {"draft_model": make_noisy_copy(llama4, 0.05)} if method == "draft" else {"method": "ngram"}
    spec = hf_specdec.SpecDecoder(num_speculative_tokens=k, **spec_kwargs)
    assert torch.equal(spec_generate(llama4, inputs, spec, **kwargs), expected)
    assert spec.last_stats.num_accepted_tokens < spec.last_stats.num_draft_tokens  # rejections: holes in the cache


def test_chunked_attention_on_the_static_cache_matches_plain(llama4):
    """The static path's full-length layers (`hf_specdec.static_cache`) take the same chunked mask."""
    inputs = make_prompts(3, seed=2)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = llama4.generate(**inputs, **kwargs)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(llama4, 0.05), num_speculative_tokens=4)
    out = spec_generate(llama4, inputs, spec, cache_implementation="static", **kwargs)
    assert torch.equal(out, expected) and spec.last_stats.num_accepted_tokens < spec.last_stats.num_draft_tokens


def test_the_chunk_mask_matters(llama4):
    """The same weights with one chunk as long as the sequence give other tokens: the chunked mask is exercised."""
    inputs = make_prompts(3, seed=5)
    wide = make_llama4(chunk=256)
    wide.load_state_dict(llama4.state_dict())
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    assert not torch.equal(llama4.generate(**inputs, **kwargs), wide.generate(**inputs, **kwargs))


def test_temperature_tuning_past_its_floor_is_refused(llama4):
    model = make_llama4()
    model.config.attn_temperature_tuning, model.config.floor_scale = True, 64
    spec = hf_specdec.SpecDecoder(method="ngram")
    with pytest.raises(NotImplementedError, match="attn_temperature_tuning"):
        spec_generate(model, make_prompts(1), spec, max_new_tokens=40, do_sample=False)
