"""Tests of `NgramProposer` on hand-built ragged batches, and of its static-cache path end to end.

Checks the drafts per row (left padding and the scratch space past each row's length are ignored), the
per-row draft budget `max_draft_tokens`, the width trimming of `draft_token_ids` to the largest count, the
no-match and empty-batch cases, and argument validation. On static caches the proposer searches on the device
(fixed width k, capturable): the same drafts, and greedy `generate` with the constant schedule equals plain
decoding through planned steps (the ones a GPU captures as CUDA graphs).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_prompts, spec_generate

import hf_specdec
from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.proposers.ngram import NgramProposer

PAD = 0


def _batch(rows: list[list[int]], capacity: int = 16, scratch: int = 5) -> RaggedBatch:
    """Left-pad `rows` to a common prompt width and fill the space past each row with `scratch`."""
    width = max(len(r) for r in rows)
    token_ids = torch.full((len(rows), capacity), scratch, dtype=torch.long)  # [B, C]
    pads = []
    for i, row in enumerate(rows):
        pad = width - len(row)
        token_ids[i, :pad] = PAD
        token_ids[i, pad:width] = torch.tensor(row)
        pads.append(pad)
    return RaggedBatch(
        token_ids=token_ids,
        lengths=torch.full((len(rows),), width, dtype=torch.long),
        pad_lengths=torch.tensor(pads, dtype=torch.long),
        row_ids=torch.arange(len(rows)),
        prompt_width=width,
    )


def test_is_a_one_hot_proposer():
    proposer = NgramProposer(3)
    assert isinstance(proposer, Proposer)
    assert proposer.returns_probs is False


def test_drafts_per_row_with_padding_and_ragged_lengths():
    batch = _batch(
        [
            [1, 2, 3, 4, 1, 2],  # [1, 2] at 0..1 -> [3, 4, 1]
            [9, 0, 8, 6, 0],  # pad 1 is token 0 too, only the real 0 at 1 counts -> [8, 6, 0]
            [4, 5, 6],  # no repeat
        ]
    )
    # Row 2 grows by two accepted tokens: [4, 5, 6, 4, 5] -> [4, 5] at 0..1 -> [6, 4, 5]; row 1 keeps its length.
    batch.token_ids[2, 6:8] = torch.tensor([4, 5])
    batch.lengths[2] = 8
    proposal = NgramProposer(4, prompt_lookup_min=1, prompt_lookup_max=3).propose(
        batch, torch.tensor([3, 4, 4]), sampling=None
    )
    assert isinstance(proposal, Proposal)
    assert proposal.draft_probs is None
    assert proposal.num_draft_tokens.tolist() == [3, 3, 3]
    assert proposal.draft_token_ids.dtype == torch.long
    assert proposal.draft_token_ids.tolist() == [[3, 4, 1], [8, 6, 0], [6, 4, 5]]


def test_width_trimmed_to_largest_count():
    batch = _batch([[1, 2, 1], [3, 4, 5], [7, 7, 7, 7]])
    proposal = NgramProposer(8, prompt_lookup_max=2).propose(batch, torch.tensor([8, 8, 1]), sampling=None)
    assert proposal.num_draft_tokens.tolist() == [2, 0, 1]
    assert proposal.draft_token_ids.shape == (3, 2)
    assert proposal.draft_token_ids.tolist() == [[2, 1], [-1, -1], [7, -1]]


def test_width_capped_at_num_speculative_tokens():
    batch = _batch([[1, 2, 3, 4, 5, 6, 7, 1]])
    proposal = NgramProposer(2).propose(batch, torch.tensor([2]), sampling=None)
    assert proposal.draft_token_ids.tolist() == [[2, 3]]
    proposal = NgramProposer(2).propose(batch, torch.tensor([1]), sampling=None)
    assert proposal.draft_token_ids.tolist() == [[2]]


def test_no_match_and_zero_budget_give_empty_width():
    batch = _batch([[1, 2, 3], [4, 5, 6]])
    proposal = NgramProposer(4).propose(batch, torch.tensor([4, 4]), sampling=None)
    assert proposal.draft_token_ids.shape == (2, 0)
    assert proposal.num_draft_tokens.tolist() == [0, 0]
    batch = _batch([[1, 2, 1], [1, 1, 1]])
    proposal = NgramProposer(4).propose(batch, torch.tensor([0, 0]), sampling=None)
    assert proposal.draft_token_ids.shape == (2, 0)
    assert proposal.num_draft_tokens.tolist() == [0, 0]


def test_empty_batch():
    batch = RaggedBatch(
        token_ids=torch.empty(0, 4, dtype=torch.long),
        lengths=torch.empty(0, dtype=torch.long),
        pad_lengths=torch.empty(0, dtype=torch.long),
        row_ids=torch.empty(0, dtype=torch.long),
        prompt_width=2,
    )
    proposal = NgramProposer(4).propose(batch, torch.empty(0, dtype=torch.long), sampling=None)
    assert proposal.draft_token_ids.shape == (0, 0)


def test_stateless_hooks_are_no_ops():
    batch = _batch([[1, 2, 1]])
    proposer = NgramProposer(2)
    proposer.prefill(batch, None)
    proposer.commit(batch, torch.tensor([0]))
    proposer.select_rows(torch.tensor([0]))
    assert proposer.propose(batch, torch.tensor([2]), None).draft_token_ids.tolist() == [[2, 1]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0,), "num_speculative_tokens` must be >= 1, got 0"),
        ((4, 0), "prompt_lookup_min` must be >= 1, got 0"),
        ((4, 3, 2), "prompt_lookup_max=2 and prompt_lookup_min=3"),
    ],
)
def test_invalid_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)


def _static_plan(k: int):
    from hf_specdec.decoding import StaticPlan

    return StaticPlan(k=k, max_columns=64, compiled_call=lambda model: None)


def test_static_path_searches_on_the_device_at_width_k():
    batch = _batch([[1, 2, 3, 4, 1, 2], [9, 0, 8, 6, 0], [4, 5, 6]])
    budgets = torch.tensor([3, 4, 4])
    proposer = NgramProposer(4, prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.capturable is False  # dynamic caches: the numba search on a host copy
    dynamic = proposer.propose(batch, budgets, sampling=None)
    proposer.use_static(_static_plan(4))
    assert proposer.capturable is True
    static = proposer.propose(batch, budgets, sampling=None)
    assert static.draft_token_ids.shape == (3, 4)  # always k wide, -1 padded
    assert static.draft_token_ids.tolist() == [[3, 4, 1, -1], [8, 6, 0, -1], [-1] * 4]
    assert static.num_draft_tokens.tolist() == dynamic.num_draft_tokens.tolist() == [3, 3, 0]
    assert static.draft_keys.tolist() == dynamic.draft_keys.tolist()
    assert static.draft_token_ids[:, : dynamic.draft_token_ids.shape[1]].tolist() == dynamic.draft_token_ids.tolist()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_static_constant_schedule_matches_plain_generate_through_planned_steps(batch_size, monkeypatch):
    """Greedy prompt lookup on a static cache with the constant schedule: every step after the prefill is planned
    (`plan_step` names it, so a GPU replays it as one CUDA graph; here it runs the same device step uncaptured), and
    the output equals plain `generate` on left-padded prompts of different lengths, for k = 1 and 4."""
    from hf_specdec.decoding import SpeculativeLoop

    target = make_model("llama", seed=0)
    inputs = make_prompts(batch_size, seed=10 + batch_size, min_len=3, max_len=20)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None)
    keys: list = []
    plan_step = SpeculativeLoop.plan_step
    monkeypatch.setattr(SpeculativeLoop, "plan_step", lambda self: keys.append(plan_step(self)) or keys[-1])
    for k in (1, 4):
        keys.clear()
        spec = hf_specdec.SpecDecoder(
            method="ngram", num_speculative_tokens=k, num_speculative_tokens_schedule="constant"
        )
        out = spec_generate(
            target, inputs, spec, max_new_tokens=24, do_sample=False, eos_token_id=None, cache_implementation="static"
        )
        assert torch.equal(out, expected), f"B={batch_size} k={k}"
        assert keys and all(key == ("draft", ()) for key in keys)
        assert spec.last_stats.num_draft_tokens > 0
