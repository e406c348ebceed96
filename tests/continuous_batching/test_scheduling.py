"""Requests arrive and leave while others decode: the speculative manager keeps each one equal to plain CB, and
cancelling or finishing a request frees all its blocks (draft slots and the draft model's KV included)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from cb_helpers import (
    cb_config,
    greedy_config,
    installed,  # noqa: F401 (the autouse fixture)
    next_output,
    processor_of,
    tokens,
    wait_for,
)
from conftest import make_model

import hf_specdec


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [3, 4] * 7, [40, 41, 42, 43, 44] * 3]


def free_sectors(cache) -> int:
    """Sectors free once the blocks kept for prefix sharing are evicted; asserts no request holds a block."""
    assert all(not allocator.block_table for allocator in cache.cache_allocators.values())
    cache.evict_cached_blocks()
    cache.pool.try_to_free_sectors()
    return cache.pool.num_free_sectors


@pytest.fixture(scope="module")
def mtp_target():
    """A tiny GLM-4.5 with MTP layers (tests/proposers/test_mtp.py)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "proposers"))
    from test_mtp import make_mtp_target

    return make_mtp_target("glm4_moe")


@pytest.mark.parametrize("method", ["ngram", "draft", "mtp"])
def test_requests_added_while_others_decode_and_cancel(target, mtp_target, method):
    target, mtp = mtp_target if method == "mtp" else (target, None)
    gen = greedy_config(max_new_tokens=40, eos_token_id=-1)
    plain = tokens(target.generate_batch(PROMPTS, gen, continuous_batching_config=cb_config()))
    draft = target if method == "draft" else None  # the target as its own draft: long accepted blocks
    spec = hf_specdec.SpecDecoder(method=method, draft_model=draft, mtp_model=mtp, num_speculative_tokens=3)
    manager = target.init_continuous_batching(gen, cb_config(), spec_decoder=spec)
    manager.start()
    try:
        first = manager.add_request(PROMPTS[0], request_id="req_0", streaming=True)
        # Wait until the first request decodes, then add the others while it runs
        deadline = time.monotonic() + 30
        while True:
            out = next_output(manager, first)
            if out is not None and len(out.generated_tokens) >= 2:
                break
            assert time.monotonic() < deadline, "the first request never started decoding"
        assert not out.is_finished()
        doomed = manager.add_request(PROMPTS[3], request_id="doomed", max_new_tokens=400, streaming=True)
        for i in (1, 2):
            manager.add_request(PROMPTS[i], request_id=f"req_{i}")
        while True:  # cancel the long request once it is decoding (speculating) among the others
            out = next_output(manager, doomed)
            if out is not None and len(out.generated_tokens) >= 3:
                break
            assert time.monotonic() < deadline + 30, "the long request never started decoding"
        manager.cancel_request(doomed)
        results = {rid: wait_for(manager, rid) for rid in ("req_0", "req_1", "req_2")}
        processor = processor_of(manager)
        deadline = time.monotonic() + 10
        while processor.scheduler.active_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processor.scheduler.active_requests and not processor.scheduler.waiting_requests
        # Every block went back: the target's (draft slots included) and the draft model's own
        assert free_sectors(processor.cache) == processor.cache.num_sectors
        if method != "ngram":
            assert not processor.proposer.requests
            assert free_sectors(processor.proposer.cache) == processor.proposer.cache.num_sectors
        if method == "mtp":
            assert not processor.proposer.stash  # the target's hidden states kept for the MTP layer went too
        stats = processor.spec_stats
    finally:
        manager.stop(block=True, timeout=10)
    assert {rid: r.generated_tokens for rid, r in results.items()} == {f"req_{i}": plain[f"req_{i}"] for i in range(3)}
    assert stats.accepted > 0


def run_two_waves(target, spec):
    """A request, then a second one whose prompt is the first's prompt and answer: it reuses the first's blocks
    (prefix sharing), including blocks completed while decoding. Returns both answers and the hashed block count."""
    gen = greedy_config(max_new_tokens=40, eos_token_id=-1)
    manager = target.init_continuous_batching(gen, cb_config(), spec_decoder=spec)
    manager.start()
    try:
        prompt = PROMPTS[3] * 3  # 45 tokens
        first = wait_for(manager, manager.add_request(prompt, request_id="first"))
        second_prompt = prompt + first.generated_tokens[:33]  # 78 tokens: 4 full pages, 2 of them decoded
        second = wait_for(manager, manager.add_request(second_prompt, request_id="second", max_new_tokens=12))
        allocator = manager.batch_processor.cache.cache_allocators["full_attention"]
        hashed = len(allocator.ledger.block_to_hash)
    finally:
        manager.stop(block=True, timeout=10)
    return first.generated_tokens, second.generated_tokens, hashed


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_prefix_sharing_of_blocks_completed_while_speculating(target, mtp_target, method):
    """Blocks completed while speculating (rejected drafts were written into them) are offered for prefix sharing
    as plain CB offers them, and a later request reusing them gets plain CB's tokens. With MTP the reused prompt
    tokens have no hidden states from the target (their MTP entries are fed zeros)."""
    if method == "mtp":
        target, mtp = mtp_target
        spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=5)
    else:
        spec = hf_specdec.SpecDecoder(
            draft_model=make_model("llama", seed=1, layers=1, hidden=32), num_speculative_tokens=5
        )
    plain = run_two_waves(target, None)
    speculative = run_two_waves(target, spec)
    assert speculative[:2] == plain[:2]
    assert speculative[2] == plain[2] >= 4  # decoded blocks were offered, as plain CB offers them
    assert spec.last_stats.num_draft_tokens > spec.last_stats.num_accepted_tokens  # some drafts were rejected
