"""Greedy speculative continuous batching returns plain `generate_batch`'s tokens, request by request."""

from __future__ import annotations

import pytest
import torch
from cb_helpers import (
    greedy_config,
    installed,  # noqa: F401 (the autouse fixture)
    plain_and_spec,
)
from conftest import make_model

import hf_specdec


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


def prompts(n: int, seed: int = 0, min_len: int = 3, max_len: int = 20) -> list[list[int]]:
    """Mixed-length repetitive prompts (so prompt lookup finds matches)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        motif = torch.randint(3, 96, (max(2, length // 3),), generator=g)
        rows.append(motif.repeat(length // len(motif) + 1)[:length].tolist())
    return rows


@pytest.mark.parametrize("num_requests", [1, 3, 8])
def test_prompt_lookup_equals_plain(target, num_requests):
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4)
    plain, spec_out = plain_and_spec(target, prompts(num_requests), spec, greedy_config())
    assert spec_out == plain
    assert spec.last_stats.num_draft_tokens > 0  # it did speculate


def test_target_as_its_own_draft_accepts_and_stops_mid_block(target):
    """A draft equal to the target accepts every draft, so blocks of k + 1 tokens are committed at once; EOS and
    max_new_tokens then fall inside a block."""
    inputs = prompts(6, seed=1)
    free = greedy_config(max_new_tokens=14, eos_token_id=-1)
    plain_free, _ = plain_and_spec(target, inputs, hf_specdec.SpecDecoder(method="ngram"), free)
    # An EOS id that request 0 emits at its 3rd token, not before: mid-block for k = 4 (blocks of 5 after the first)
    eos = plain_free["req_0"][3]
    assert eos not in plain_free["req_0"][:3]
    spec = hf_specdec.SpecDecoder(
        draft_model=target, num_speculative_tokens=4, num_speculative_tokens_schedule="constant"
    )
    plain, spec_out = plain_and_spec(target, inputs, spec, greedy_config(max_new_tokens=13, eos_token_id=eos))
    assert spec_out == plain
    stats = spec.last_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert plain["req_0"][-1] == eos and len(plain["req_0"]) == 4
    assert any(len(v) == 13 for v in plain.values())  # max_new_tokens = 13 is not a multiple of k + 1 = 5


def test_draft_model_equals_plain(target):
    """An eager draft reads its paged cache through paged|eager, and gets its implementation back at the end."""
    draft = make_model("llama", seed=1, layers=1, hidden=32)
    draft.set_attn_implementation("eager")
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    plain, spec_out = plain_and_spec(target, prompts(5, seed=2), spec, greedy_config())
    assert spec_out == plain
    assert spec.last_stats.num_draft_tokens > 0
    assert draft.config._attn_implementation == "eager"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_32_requests_with_small_token_budget_and_cache(target, method):
    """32 requests on a batch of 48 tokens and a cache of 24 (12) blocks: drafts shrink to fit, requests are
    soft-reset by transformers' offloading when the cache is full (the draft then drops their KV), outputs stay
    plain's."""
    draft = make_model("llama", seed=1, layers=1, hidden=32) if method == "draft" else None
    spec = hf_specdec.SpecDecoder(
        method=method, draft_model=draft, num_speculative_tokens=6, num_speculative_tokens_schedule="constant"
    )
    inputs = prompts(32, seed=3, max_len=24)
    blocks = 24 if method == "ngram" else 12
    plain, spec_out = plain_and_spec(
        target, inputs, spec, greedy_config(max_new_tokens=16), max_batch_tokens=48, num_blocks=blocks
    )
    assert spec_out == plain
    assert spec.last_stats.num_draft_tokens > 0


def test_long_prompts_prefill_in_chunks_and_the_draft_catches_up_in_chunks(target):
    """Prompts longer than the batch (32 tokens): the target prefills in chunks, the draft catches up in chunks."""
    draft = make_model("llama", seed=1, layers=1, hidden=32)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    inputs = prompts(3, seed=4, min_len=70, max_len=100)
    plain, spec_out = plain_and_spec(target, inputs, spec, greedy_config(max_new_tokens=12), max_batch_tokens=32)
    assert spec_out == plain
    assert spec.last_stats.num_draft_tokens > 0


def test_adaptive_schedule_stops_probes_and_resumes_with_plain_tokens(target):
    """A draft that is the target with a noisy head (about 40% of drafts accepted, unevenly over requests): under the
    adaptive schedule some requests stop drafting, probe on the shared clock and resume, and some steps have no
    drafts at all (the argmax path; about a dozen of each here). Every request's tokens stay plain's, and it drafts
    less than the constant k."""
    draft = make_model("llama", seed=0)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(4)) * 0.3 * head.std())
    inputs = prompts(12, seed=5)
    config = greedy_config(max_new_tokens=48, eos_token_id=-1)
    drafted = {}
    for mode in ("adaptive", "constant"):
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4, num_speculative_tokens_schedule=mode)
        plain, spec_out = plain_and_spec(target, inputs, spec, config)
        assert spec_out == plain
        drafted[mode] = spec.last_stats.num_draft_tokens
        assert 0 < spec.last_stats.num_accepted_tokens < drafted[mode]
    assert drafted["adaptive"] < drafted["constant"]
