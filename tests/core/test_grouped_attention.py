"""Grouped-query attention without the key-value copy (`grouped_attention`): the same attention as transformers'
SDPA function, used by hf_specdec's static-cache forwards and by no other caller."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

import hf_specdec
from hf_specdec import grouped_attention
from tests.conftest import make_model, make_prompts, spec_generate


def reference(query, key, value, mask, scale):  # noqa: ANN001, ANN201
    """Attention with the key-value heads copied (transformers' repeat_kv), [B, w, H, Dv]."""
    n_rep = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("n_rep", [2, 4])
@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "bool_batch1", "wider"])
def test_grouped_equals_copied_heads(n_rep, width, mask_kind):
    g = torch.Generator().manual_seed(n_rep * 10 + width)
    batch, kv_heads, length, dim = 3, 2, 17, 8
    query = torch.randn(batch, kv_heads * n_rep, width, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=g) for _ in range(2))
    query = query.transpose(1, 2).contiguous().transpose(1, 2)  # transformers' layout: [B, w, H, D] transposed
    mask = torch.rand(batch, 1, width, length, generator=g) > 0.4
    mask[..., 0] = True  # every query sees at least one key
    if mask_kind == "additive":
        mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    elif mask_kind == "bool_batch1":
        mask = mask[:1]
    expected = reference(query, key, value, mask, 0.3)
    if mask_kind == "wider":  # transformers' masks may cover more columns than the keys; extra columns are cut
        mask = torch.cat([mask, torch.ones(batch, 1, width, 4, dtype=torch.bool)], dim=-1)
    got = grouped_attention.grouped_sdpa(query, key, value, mask, 0.3)
    assert got.shape == (batch, width, kv_heads * n_rep, dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_only_hf_specdec_forwards_take_the_grouped_form(monkeypatch):
    """With the keyword a model's forward attends in grouped form, the same logits; without it (every other caller)
    transformers' own function runs."""
    model = make_model("llama")
    kwargs = grouped_attention.forward_kwargs(model)
    assert kwargs == {grouped_attention.KWARG: True}
    assert AttentionInterface()["sdpa"].hf_specdec_fallback is not None
    calls = []
    kept = grouped_attention.grouped_sdpa
    monkeypatch.setattr(grouped_attention, "grouped_sdpa", lambda *a: calls.append(1) or kept(*a))
    inputs = make_prompts(3, seed=4)
    width = inputs["input_ids"].shape[1]
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
    mask = (causal[None] & inputs["attention_mask"].bool()[:, None, :])[:, None]  # [B, 1, w, w]
    mask |= torch.eye(width, dtype=torch.bool)  # padding queries see themselves
    with torch.no_grad():
        plain = model(input_ids=inputs["input_ids"], attention_mask=mask).logits
        assert calls == []
        grouped = model(input_ids=inputs["input_ids"], attention_mask=mask, **kwargs).logits
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-5)


def test_install_wraps_once():
    grouped_attention.install()
    first = AttentionInterface()["sdpa"]
    grouped_attention.install()
    assert AttentionInterface()["sdpa"] is first
    assert not hasattr(first.hf_specdec_fallback, "hf_specdec_fallback")


@pytest.mark.parametrize(
    ("overrides", "why"),
    [({"num_key_value_heads": 4}, "no grouped heads"), ({"_attn_implementation": "eager"}, "eager attention")],
)
def test_models_that_gain_nothing_get_no_keyword(overrides, why):
    model = make_model("llama")
    for name, value in overrides.items():
        setattr(model.config, name, value)
    assert grouped_attention.forward_kwargs(model) == {}, why


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_static_calls_attend_grouped_and_equal_plain_generate(arch, monkeypatch):
    """The static path's forwards (target and draft) attend in grouped form; greedy output is plain's."""
    target, draft = make_model(arch, seed=0), make_model(arch, seed=1, layers=1, hidden=32)
    inputs = make_prompts(4, seed=9)
    gen = dict(max_new_tokens=20, do_sample=False)
    expected = target.generate(**inputs, **gen)
    calls = []
    kept = grouped_attention.grouped_sdpa
    monkeypatch.setattr(grouped_attention, "grouped_sdpa", lambda *a: calls.append(1) or kept(*a))
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
    assert torch.equal(out, expected)
    assert calls, "the static path's forwards did not take the grouped form"
