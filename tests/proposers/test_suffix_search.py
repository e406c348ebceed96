"""Tests of suffix decoding's drafting kernel against its brute-force reference, and of each rule on small cases.

`suffix_drafts` (numba, on trees) must equal `suffix_drafts_reference` (counts by scanning raw token lists) on
random contexts and corpora for every depth, factor, probability floor and budget; the small cases pin down each
rule: the most frequent child (ties: the latest), the branch probability floor, the m * factor cap, sliding past
depth D, the global tree, the row's own tree winning ties, left padding, and a batch with rows of both kinds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from hf_specdec.proposers.suffix_search import (
    COUNT_COLUMN,
    GLOBAL_COLUMN,
    KEY_COLUMN,
    MATCH_COLUMN,
    key_of,
    suffix_drafts,
    suffix_drafts_reference,
)
from hf_specdec.proposers.suffix_tree import SuffixTree


def draft(
    context: list[int],
    corpus: list[list[int]] | None = None,
    depth: int = 8,
    budget: int = 8,
    factor: float = 1.0,
    min_prob: float = 0.1,
    k: int = 8,
) -> tuple[list[int], int, bool, float]:
    """(drafts, match length, from the global tree, score) of one row."""
    tree = None
    if corpus:
        tree = SuffixTree(depth)
        for sequence in corpus:
            tree.add(np.array(sequence, np.int64))
    local = SuffixTree(depth)
    active, state = local.start_rows(local.roots)
    row = np.array([context], np.int64)
    local.append_rows(active, state, row, np.array([len(context)]))
    out, scores, widest = suffix_drafts(local, active, state, row, tree, np.array([budget]), k, factor, min_prob)
    assert widest == out[0, k + COUNT_COLUMN]
    count = int(out[0, k + COUNT_COLUMN])
    return out[0, :count].tolist(), int(out[0, k + MATCH_COLUMN]), bool(out[0, k + GLOBAL_COLUMN]), float(scores[0])


@pytest.mark.parametrize("seed", range(4))
def test_equals_the_brute_force_reference(seed):
    rng = random.Random(seed)
    for _ in range(150):
        depth, vocab = rng.choice([1, 2, 3, 4, 6]), rng.choice([2, 3, 5])
        corpus = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(rng.randrange(0, 4))]
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        factor, min_prob, budget = rng.choice([0.5, 1.0, 2.5]), rng.choice([0.0, 0.1, 0.4]), rng.randrange(0, 9)
        got = draft(context, corpus, depth, budget, factor, min_prob)
        expected = suffix_drafts_reference(context, corpus, budget, depth, factor, min_prob)
        assert got[:3] == expected[:3], (context, corpus, depth, factor, min_prob, budget)
        assert got[3] == pytest.approx(expected[3])


def test_prompt_lookup_like_match_in_the_row_itself():
    drafts, match, from_global, score = draft([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert (drafts, match, from_global, score) == ([4, 5, 9], 3, False, 3.0)  # cap: m * 1.0 = 3


def test_most_frequent_child_and_latest_on_ties():
    # only [1] matches; after it: 2 twice, 3 once -> 2 with probability 2/3
    assert draft([1, 2, 5, 1, 3, 6, 1, 2, 7, 1]) == ([2], 1, False, pytest.approx(2 / 3))
    # after [1]: 2 once, 3 once -> the latest (3), probability 1/2
    assert draft([1, 2, 5, 1, 3, 6, 1])[0] == [3]


def test_probability_floor_and_budget():
    context = [5, 1, 2, 5, 1, 3, 5, 1, 4, 5, 1]  # after [5, 1]: 2, 3, 4 once each -> 1/3, then 5 for sure
    assert draft(context, min_prob=0.3)[::3] == ([4, 5], pytest.approx(2 / 3))
    assert draft(context, min_prob=0.34)[0] == []
    assert draft([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5], budget=2)[0] == [6, 1]
    assert draft([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5], budget=0)[0] == []


def test_drafts_slide_past_the_tree_depth():
    """With D = 3 a match of 3 keeps drafting: each later token is predicted from the last 2 tokens."""
    body = [10, 11, 12, 13, 14, 15, 16]
    drafts, match, _, _ = draft([*body, 99, 10, 11, 12], depth=3, factor=4.0)
    assert (drafts, match) == ([13, 14, 15, 16, 99, 10, 11, 12][:8], 3)


def test_the_global_tree_drafts_earlier_outputs():
    earlier = [7, 8, 9, 20, 21, 22, 23, 24, 25]
    drafts, match, from_global, _ = draft([1, 2, 7, 8, 9], corpus=[earlier], factor=2.0)
    assert (drafts, match, from_global) == ([20, 21, 22, 23, 24, 25], 3, True)
    # The row's own tree wins a tie: the same continuation in both.
    assert draft([7, 8, 9, 20, 21, 3, 7, 8, 9], corpus=[earlier], factor=1.0)[2] is False


def test_a_batch_with_left_padding_and_mixed_rows():
    depth, k = 6, 4
    rows = [[0, 0, 0, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 8, 8, 8], [0, 0, 9, 30, 31, 32, 9, 30]]
    starts = np.array([3, 0, 2])
    tree = SuffixTree(depth)
    tree.add(np.array([31, 32, 40, 41], np.int64))
    local = SuffixTree(depth, num_roots=3)
    active, state = local.start_rows(local.roots, starts)
    tokens = np.array(rows, np.int64)
    local.append_rows(active, state, tokens, np.array([8, 8, 8]))
    out, _, widest = suffix_drafts(local, active, state, tokens, tree, np.array([4, 4, 1]), k, 1.0, 0.1)
    assert widest == 2
    assert out[0, :2].tolist() == [7, 5] and out[0, k] == 2  # padding (token 0) is not context
    assert out[1, k] == 1 and out[1, 0] == 8  # [8, 8] -> 8 (the row's own)
    assert out[2, :1].tolist() == [31] and out[2, k] == 1  # budget 1


def test_draft_keys_bucket_the_match_length():
    lengths = [0, 1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 17, 18, 24]
    assert [key_of(m) for m in lengths] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8]
    tree = SuffixTree(24)
    local = SuffixTree(24)
    active, state = local.start_rows(local.roots)
    row = np.array([list(range(10, 30)) + [99] + list(range(10, 30))], np.int64)  # matches 20 tokens back
    local.append_rows(active, state, row, np.array([row.shape[1]]))
    out, _, _ = suffix_drafts(local, active, state, row, tree, np.array([8]), 8, 1.0, 0.1)
    assert out[0, 8 + MATCH_COLUMN] == 20 and out[0, 8 + KEY_COLUMN] == 8 and out[0, :1].tolist() == [99]
