"""Tests of the n-gram prompt-lookup kernel (`ngram_search`) against hand cases and its pure-Python reference.

Hand cases pin the contract (largest n wins, most recent occurrence wins, truncation, no match, left padding,
min_n too large, num_tokens 0, k small); a hypothesis property test compares the numba kernel with
`ngram_search_reference` on random small-alphabet batches (so matches are frequent), both serial and parallel;
and input validation raises clear errors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec.proposers.ngram_search import ngram_search, ngram_search_reference

BOTH = pytest.mark.parametrize("search", [ngram_search, ngram_search_reference], ids=["numba", "reference"])


def _one_with_length(
    search, context: list[int], min_n: int, max_n: int, k: int, num_tokens: int | None = None, pad: int = 0
) -> tuple[list[int], int]:
    """Run a single row (with `pad` left-padding tokens of value 7); return its drafts and the matched n."""
    tokens = np.array([[7] * pad + context], dtype=np.int64)  # [1, L]
    n = k if num_tokens is None else num_tokens
    drafts, counts, match_lengths = search(
        tokens, np.array([pad]), np.array([pad + len(context)]), np.array([n]), min_n, max_n, k
    )
    assert drafts.shape == (1, k) and counts.shape == (1,) and match_lengths.shape == (1,)
    assert (drafts[0, counts[0] :] == -1).all()
    assert (match_lengths[0] == 0) == (counts[0] == 0)
    return drafts[0, : counts[0]].tolist(), int(match_lengths[0])


def _one(search, context: list[int], min_n: int, max_n: int, k: int, num_tokens: int | None = None, pad: int = 0):
    """The drafts of `_one_with_length`."""
    return _one_with_length(search, context, min_n, max_n, k, num_tokens, pad)[0]


@BOTH
def test_longest_ngram_wins(search):
    # Suffix [1, 2, 3]: the 3-gram occurs at the start (followed by 4); the 1-gram [3] occurs more recently
    # (followed by 9) but the longer match wins.
    context = [1, 2, 3, 4, 5, 3, 9, 1, 2, 3]
    assert _one_with_length(search, context, 1, 3, 2) == ([4, 5], 3)
    # Capped at max_n = 1, the most recent 1-gram wins.
    assert _one_with_length(search, context, 1, 1, 2) == ([9, 1], 1)


@BOTH
def test_most_recent_occurrence_wins(search):
    context = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert _one(search, context, 1, 2, 1) == [3]
    assert _one(search, context, 2, 4, 3) == [3, 5, 6]


@BOTH
def test_truncation_at_end_of_context(search):
    # Only 2 tokens follow the most recent occurrence of [1, 2] (ending at index 3); the self-overlap is allowed.
    context = [1, 2, 1, 2, 1, 2]
    assert _one(search, context, 2, 2, 5) == [1, 2]
    assert _one(search, [4, 4], 1, 3, 5) == [4]


@BOTH
def test_no_match(search):
    assert _one(search, [1, 2, 3, 4, 5], 1, 4, 3) == []
    assert _one(search, [3], 1, 4, 3) == []
    assert _one(search, [], 1, 4, 3) == []


@BOTH
def test_left_padding_is_ignored(search):
    # The pad token 7 would match the suffix [7] if padding counted; the real context has no earlier 7.
    assert _one(search, [1, 2, 7], 1, 2, 3, pad=4) == []
    # With the padding, the suffix [7, 7] would match pad + context[0] (-> [3, 9]); inside the context only the
    # 1-gram [7] matches, most recently at index 3 (-> [7]).
    assert _one(search, [7, 3, 9, 7, 7], 1, 3, 2, pad=2) == [7]


@BOTH
def test_min_n_larger_than_context(search):
    assert _one(search, [1, 1, 1], 3, 5, 2) == []
    assert _one(search, [1, 1, 1, 1], 3, 5, 2) == [1]
    # The only match is a 1-gram, below min_n.
    assert _one(search, [1, 2, 3, 2], 2, 4, 2) == []


@BOTH
def test_num_tokens_zero_and_k_small(search):
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    assert _one(search, context, 1, 2, 4, num_tokens=0) == []
    assert _one(search, context, 1, 2, 4, num_tokens=2) == [3, 4]
    assert _one(search, context, 1, 2, 3, num_tokens=10) == [3, 4, 5]
    drafts, counts, match_lengths = search(np.array([context]), np.array([0]), np.array([8]), np.array([3]), 1, 2, 0)
    assert drafts.shape == (1, 0) and counts.tolist() == [0] and match_lengths.tolist() == [0]


@BOTH
def test_batch_with_different_starts_and_ends(search):
    tokens = np.array(
        [
            [0, 0, 1, 2, 3, 1, 2, 8, 8],  # context [1, 2, 3, 1, 2] (2 pads, 2 scratch) -> [3, 1, 2]
            [4, 5, 4, 5, 4, 9, 9, 9, 9],  # context [4, 5, 4, 5, 4] -> 3-gram [4, 5, 4] at 0..2 -> [5, 4]
            [1, 1, 1, 1, 1, 1, 1, 1, 1],  # empty context
            [3, 3, 3, 6, 3, 3, 3, 6, 3],  # context [6, 3, 3, 3, 6, 3] -> 2-gram [6, 3] at 0 -> [3, 3, 6]
        ]
    )
    starts = np.array([2, 0, 4, 3])
    ends = np.array([7, 5, 4, 9])
    num_tokens = np.array([4, 2, 4, 3])
    drafts, counts, match_lengths = search(tokens, starts, ends, num_tokens, 1, 3, 4)
    assert counts.tolist() == [3, 2, 0, 3]
    assert match_lengths.tolist() == [2, 3, 0, 2]
    assert drafts.tolist() == [[3, 1, 2, -1], [5, 4, -1, -1], [-1] * 4, [3, 3, 6, -1]]


def test_parallel_and_serial_agree():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 3, size=(16, 300))  # [16, 300]
    starts = rng.integers(0, 100, size=16)
    ends = rng.integers(150, 301, size=16)
    num_tokens = rng.integers(0, 6, size=16)
    expected = ngram_search_reference(tokens, starts, ends, num_tokens, 1, 5, 5)
    for parallel in (False, True):
        for got, want in zip(ngram_search(tokens, starts, ends, num_tokens, 1, 5, 5, parallel=parallel), expected):
            np.testing.assert_array_equal(got, want)


def test_parallel_call_keeps_torch_thread_count():
    # Launching numba's OpenMP pool resets the OpenMP thread count that torch reads; ngram_search undoes it.
    # A fresh process, since the pool launches once per process.
    code = (
        "import numpy as np, torch\n"
        "from hf_specdec.proposers.ngram_search import ngram_search\n"
        "torch.set_num_threads(1)\n"
        "t = np.zeros((4, 50), dtype=np.int64)\n"
        "ngram_search(t, np.zeros(4), np.full(4, 50), np.ones(4), 1, 2, 3, parallel=True)\n"
        "assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@st.composite
def _batches(draw):
    alphabet = draw(st.integers(2, 5))
    batch_size = draw(st.integers(1, 4))
    length = draw(st.integers(0, 40))
    tokens = draw(st.lists(st.integers(0, alphabet - 1), min_size=batch_size * length, max_size=batch_size * length))
    tokens = np.array(tokens, dtype=np.int64).reshape(batch_size, length)  # [B, L]
    starts, ends = [], []
    for _ in range(batch_size):
        a, b = sorted(draw(st.tuples(st.integers(0, length), st.integers(0, length))))
        starts.append(a)
        ends.append(b)
    num_tokens = draw(st.lists(st.integers(0, 6), min_size=batch_size, max_size=batch_size))
    min_n = draw(st.integers(1, 4))
    max_n = draw(st.integers(min_n, min_n + 6))
    k = draw(st.integers(0, 6))
    return tokens, np.array(starts), np.array(ends), np.array(num_tokens), min_n, max_n, k


@settings(max_examples=250, deadline=None)
@given(_batches(), st.booleans())
def test_matches_reference(args, parallel):
    drafts, counts, match_lengths = ngram_search(*args, parallel=parallel)
    ref_drafts, ref_counts, ref_match_lengths = ngram_search_reference(*args)
    np.testing.assert_array_equal(counts, ref_counts)
    np.testing.assert_array_equal(drafts, ref_drafts)
    np.testing.assert_array_equal(match_lengths, ref_match_lengths)


def test_long_periodic_context_matches_reference():
    # Periodic contexts exercise the Z-box (long runs of partial matches).
    for period in (1, 2, 3, 7):
        context = ([1, 2, 3, 4, 5, 6, 7][:period] * 200)[:-1] + [0]
        context = context + context[:50]
        args = (np.array([context]), np.array([0]), np.array([len(context)]), np.array([8]), 1, 9, 8)
        for got, want in zip(ngram_search(*args), ngram_search_reference(*args), strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_n": 0}, "min_n` must be >= 1, got 0"),
        ({"min_n": 3, "max_n": 2}, "max_n=2 and min_n=3"),
        ({"k": -1}, "must be >= 0, got -1"),
        ({"token_ids": np.zeros(5, dtype=np.int64)}, "must be 2-D"),
        ({"starts": np.zeros(3, dtype=np.int64)}, r"`starts` must have shape \(2,\)"),
        ({"ends": np.array([5, 9])}, "row 1 has starts=0, ends=9"),
        ({"starts": np.array([3, 0]), "ends": np.array([2, 5])}, "row 0 has starts=3, ends=2"),
        ({"num_tokens": np.array([1, -2])}, "num_tokens=-2"),
    ],
)
def test_validation_errors(kwargs, message):
    args = {
        "token_ids": np.zeros((2, 5), dtype=np.int64),
        "starts": np.zeros(2, dtype=np.int64),
        "ends": np.full(2, 5),
        "num_tokens": np.ones(2, dtype=np.int64),
        "min_n": 1,
        "max_n": 2,
        "k": 3,
    }
    args.update(kwargs)
    for search in (ngram_search, ngram_search_reference):
        with pytest.raises(ValueError, match=message):
            search(**args)
