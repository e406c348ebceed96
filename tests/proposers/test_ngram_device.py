"""Tests of the device n-gram matcher (`ngram_search_device`) against the numba kernel (`ngram_search`).

A hypothesis property test and seeded loops compare the two on random small-alphabet batches (frequent matches),
with random lengths, left padding, scratch past each row's end and per-row budgets; hand cases pin the edges
(context shorter than n, matches near the end, padding that would match, empty rows). The matcher must never read
the device from the host: it runs on meta tensors (which hold no data, so any host read fails), and on CUDA
under `torch.cuda.set_sync_debug_mode("error")` and inside a captured CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec.proposers.ngram_device import ngram_search_device
from hf_specdec.proposers.ngram_search import ngram_search

pytestmark = pytest.mark.usefixtures("one_thread")


def _both(tokens, starts, ends, num_tokens, min_n: int, max_n: int, k: int, device: str = "cpu"):
    """(numba result, device result as numpy) for one batch; `num_tokens` may be negative (the device's rows off)."""
    tokens, starts, ends, num_tokens = (np.asarray(a, dtype=np.int64) for a in (tokens, starts, ends, num_tokens))
    expected = ngram_search(tokens, starts, ends, np.maximum(num_tokens, 0), min_n, max_n, k)
    got = ngram_search_device(
        *(torch.from_numpy(a).to(device) for a in (tokens, starts, ends, num_tokens)), min_n, max_n, k
    )
    assert [tuple(g.shape) for g in got] == [(len(tokens), k), (len(tokens),), (len(tokens),)]
    assert all(g.dtype == torch.long and g.device.type == torch.device(device).type for g in got)
    return expected, tuple(g.cpu().numpy() for g in got)


def _assert_same(expected, got) -> None:
    for name, want, have in zip(("drafts", "counts", "match_lengths"), expected, got, strict=True):
        np.testing.assert_array_equal(have, want, err_msg=name)


@st.composite
def _batches(draw):
    alphabet = draw(st.integers(1, 5))
    batch_size = draw(st.integers(1, 5))
    length = draw(st.integers(0, 40))
    tokens = draw(st.lists(st.integers(0, alphabet - 1), min_size=batch_size * length, max_size=batch_size * length))
    tokens = np.array(tokens, dtype=np.int64).reshape(batch_size, length)  # [B, L]
    bounds = [sorted(draw(st.tuples(st.integers(0, length), st.integers(0, length)))) for _ in range(batch_size)]
    num_tokens = draw(st.lists(st.integers(-1, 7), min_size=batch_size, max_size=batch_size))
    min_n = draw(st.integers(1, 4))
    max_n = draw(st.integers(min_n, min_n + 6))
    k = draw(st.integers(0, 7))
    starts, ends = (np.array(side, dtype=np.int64).reshape(batch_size) for side in zip(*bounds))
    return tokens, starts, ends, np.array(num_tokens), min_n, max_n, k


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_matches_numba_on_random_batches(args):
    _assert_same(*_both(*args))


@pytest.mark.parametrize("seed", range(4))
def test_matches_numba_on_long_ragged_left_padded_batches(seed):
    """Wide buffers as the loop holds them: left padding (pad id 0, which also occurs in the text), a context, then
    scratch (stale drafts) up to the capacity; repetitive rows and random ones, every budget from 0 to k."""
    rng = np.random.default_rng(seed)
    batch_size, capacity, k = 12, 300, 6
    tokens = rng.integers(0, 6, size=(batch_size, capacity))  # [B, C] scratch everywhere to start with
    starts = rng.integers(0, 60, size=batch_size)
    ends = np.minimum(starts + rng.integers(0, 240, size=batch_size), capacity)
    for i in range(batch_size):
        tokens[i, : starts[i]] = 0
        if i % 2:  # a repeated motif with a few edits: long matches and periodic runs
            motif = rng.integers(0, 50, size=int(rng.integers(1, 9)))
            row = np.resize(motif, ends[i] - starts[i])
            row[rng.random(len(row)) < 0.05] = 0
            tokens[i, starts[i] : ends[i]] = row
    num_tokens = rng.integers(0, k + 1, size=batch_size)
    for min_n, max_n in ((1, 1), (1, 4), (2, 3), (3, 8)):
        _assert_same(*_both(tokens, starts, ends, num_tokens, min_n, max_n, k))


def test_periodic_contexts_match_numba():
    for period in (1, 2, 3, 7):
        context = ([1, 2, 3, 4, 5, 6, 7][:period] * 200)[:-1] + [0]
        context = context + context[:50]
        _assert_same(*_both([context], [0], [len(context)], [8], 1, 9, 8))


@pytest.mark.parametrize(
    ("context", "min_n", "max_n", "k", "drafts", "n"),
    [
        ([1, 2, 3, 4, 5, 3, 9, 1, 2, 3], 1, 3, 2, [4, 5], 3),  # the longest n wins over a more recent shorter one
        ([1, 2, 3, 4, 5, 3, 9, 1, 2, 3], 1, 1, 2, [9, 1], 1),  # capped at max_n: the most recent 1-gram
        ([5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6], 2, 4, 3, [3, 5, 6], 2),  # the most recent occurrence
        ([1, 2, 1, 2, 1, 2], 2, 2, 5, [1, 2], 2),  # near the end: fewer than k drafts (overlap allowed)
        ([4, 4], 1, 3, 5, [4], 1),
        ([1, 1, 1], 3, 5, 2, [], 0),  # context shorter than n + 1
        ([1, 1, 1, 1], 3, 5, 2, [1], 3),
        ([1, 2, 3, 2], 2, 4, 2, [], 0),  # only a 1-gram, below min_n
        ([3], 1, 4, 3, [], 0),
        ([], 1, 4, 3, [], 0),
    ],
)
def test_hand_cases(context, min_n, max_n, k, drafts, n):
    tokens = [[9, 9] + context + [7, 7, 7]]  # padding and scratch around the context
    expected, got = _both(tokens, [2], [2 + len(context)], [k], min_n, max_n, k)
    _assert_same(expected, got)
    assert got[0][0, : got[1][0]].tolist() == drafts and int(got[2][0]) == n


def test_padding_never_matches():
    # With the padding, the suffix [7, 7] would match pad + context[0] (-> [3, 9]); inside the context only the
    # 1-gram [7] matches, most recently at index 3 (-> [7]). The sentinels for "outside the context" differ on the
    # buffer side and the suffix side, so a suffix running past a short row's start matches no padding either.
    _, got = _both([[7, 7, 7, 3, 9, 7, 7]], [2], [7], [2], 1, 3, 2)
    assert got[0].tolist() == [[7, -1]] and got[2].tolist() == [1]
    _, got = _both([[7, 7, 7, 7]], [3], [4], [2], 1, 3, 2)
    assert got[1].tolist() == [0]


def test_empty_shapes():
    for shape, k in (((0, 5), 3), ((2, 0), 3), ((2, 5), 0)):
        tokens = torch.zeros(shape, dtype=torch.long)
        starts = torch.zeros(shape[0], dtype=torch.long)
        drafts, counts, match_lengths = ngram_search_device(tokens, starts, starts, starts, 1, 2, k)
        assert drafts.shape == (shape[0], k) and counts.tolist() == match_lengths.tolist() == [0] * shape[0]


def test_reads_nothing_on_the_host():
    """Meta tensors hold no data: `.item()`, `.tolist()`, `bool()`, `.cpu()`, `nonzero()` all raise on them, so the
    matcher running there proves it needs no value on the host (a CUDA-graph capture would refuse any such read)."""
    batch_size, capacity = 4, 64
    meta = {"device": "meta", "dtype": torch.long}
    drafts, counts, match_lengths = ngram_search_device(
        torch.empty(batch_size, capacity, **meta),
        torch.empty(batch_size, **meta),
        torch.empty(batch_size, **meta),
        torch.empty(batch_size, **meta),
        1,
        4,
        5,
    )
    assert drafts.shape == (batch_size, 5) and counts.shape == match_lengths.shape == (batch_size,)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the check above can fail: a host read does
        torch.empty(2, **meta).sum().item()


def test_validate_raises_teaching_errors():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    zeros = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="row 1 has starts=0, ends=9"):
        ngram_search_device(tokens, zeros, torch.tensor([5, 9]), zeros, 1, 2, 3, validate=True)
    with pytest.raises(ValueError, match="min_n` must be >= 1"):
        ngram_search_device(tokens, zeros, zeros, zeros, 0, 2, 3)
    with pytest.raises(ValueError, match="max_n=1 and min_n=2"):
        ngram_search_device(tokens, zeros, zeros, zeros, 2, 1, 3)
    with pytest.raises(ValueError, match=r"`ends` must have shape \(2,\)"):
        ngram_search_device(tokens, zeros, torch.zeros(3, dtype=torch.long), zeros, 1, 2, 3)
    with pytest.raises(TypeError, match="must hold integers"):
        ngram_search_device(tokens.float(), zeros, zeros, zeros, 1, 2, 3)


@pytest.mark.requires_cuda
def test_cuda_matches_numba_without_a_sync_and_replays_in_a_graph():
    rng = np.random.default_rng(7)
    batch_size, capacity, k = 16, 512, 8
    tokens = rng.integers(0, 4, size=(batch_size, capacity))
    starts = rng.integers(0, 100, size=batch_size)
    ends = rng.integers(100, capacity + 1, size=batch_size)
    num_tokens = rng.integers(0, k + 1, size=batch_size)
    device_args = [torch.from_numpy(a).cuda() for a in (tokens, starts, ends, num_tokens)]
    ngram_search_device(*device_args, 1, 4, k)  # warm-up (allocator, kernels) outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ngram_search_device(*device_args, 1, 4, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_same(ngram_search(tokens, starts, ends, num_tokens, 1, 4, k), tuple(g.cpu().numpy() for g in got))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ngram_search_device(*device_args, 1, 4, k)
    new_ends = rng.integers(100, capacity + 1, size=batch_size)
    device_args[2].copy_(torch.from_numpy(new_ends))
    graph.replay()
    torch.cuda.synchronize()
    expected = ngram_search(tokens, starts, new_ends, num_tokens, 1, 4, k)
    _assert_same(expected, tuple(c.cpu().numpy() for c in captured))
