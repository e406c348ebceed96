"""Tests of `SuffixTree`: counts against brute force, exact removal (oldest first), growth, bounded rescans.

The node of every string up to depth D must count its occurrences in the sequences added (`COUNT`) and the
occurrences some token follows (`TOTAL`); removing the oldest sequences must leave the tree a fresh one built from
the rest would be (node for node, and the same drafts), also after freed nodes are reused; arrays and the hash
table grow from a tiny capacity; a node with more children than `RESCAN_LIMIT` keeps a living best child.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from hf_specdec.proposers.suffix_search import suffix_drafts, suffix_drafts_reference
from hf_specdec.proposers.suffix_tree import BEST, COUNT, RESCAN_LIMIT, SuffixTree, kernels


def brute_counts(sequences: list[list[int]], string: list[int], depth: int) -> tuple[int, int]:
    """(occurrences of `string`, occurrences followed by a token) when len(string) <= depth, else (0, 0)."""
    if len(string) > depth:
        return 0, 0
    n = len(string)
    starts = [(s, p) for s in sequences for p in range(len(s) - n + 1) if s[p : p + n] == string]
    followed = sum(1 for s, p in starts if p + n < len(s) and n < depth)
    return len(starts), followed


def tree_of(sequences: list[list[int]], depth: int) -> SuffixTree:
    tree = SuffixTree(depth, capacity=4)  # tiny: every add grows the arrays and the hash table
    for sequence in sequences:
        tree.add(np.array(sequence, np.int64))
    return tree


def own_drafts(context: list[int], tree: SuffixTree | None, depth: int, budget: int = 8) -> list[int]:
    local = SuffixTree(depth)
    active, state = local.start_rows(local.roots)
    row = np.array([context], np.int64)
    local.append_rows(active, state, row, np.array([len(context)]))
    out, _, _ = suffix_drafts(local, active, state, row, tree, np.array([budget]), 8, 1.0, 0.1)
    return out[0, : out[0, 8]].tolist()


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_counts_equal_brute_force(depth):
    rng = random.Random(depth)
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(0, 20))] for _ in range(4)]
    tree = tree_of(sequences, depth)
    for length in range(1, depth + 2):
        for string in itertools.product(range(3), repeat=length):
            assert tree.counts(list(string)) == brute_counts(sequences, list(string), depth), (string, sequences)
    assert tree.num_nodes == 1 + sum(1 for _ in _distinct_strings(sequences, depth))


def _distinct_strings(sequences: list[list[int]], depth: int) -> set[tuple[int, ...]]:
    return {tuple(s[p : p + n]) for s in sequences for p in range(len(s)) for n in range(1, min(depth, len(s) - p) + 1)}


@pytest.mark.parametrize("seed", range(6))
def test_removing_the_oldest_equals_a_fresh_tree(seed):
    """FIFO eviction is exact: counts, node count and drafts (ties included: the stamps of what is left keep their
    order) equal those of a tree built from the kept sequences, also after new sequences reuse freed nodes."""
    rng = random.Random(seed)
    depth, vocab = rng.choice([2, 3, 5]), rng.choice([2, 3])
    sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 25))] for _ in range(5)]
    tree = tree_of(sequences, depth)
    removed = rng.randrange(1, 5)
    for sequence in sequences[:removed]:
        tree.remove(np.array(sequence, np.int64))
    extra = [rng.randrange(vocab) for _ in range(12)]
    tree.add(np.array(extra, np.int64))
    kept = [*sequences[removed:], extra]
    fresh = tree_of(kept, depth)
    assert tree.num_nodes == fresh.num_nodes
    for length in range(1, depth + 1):
        for string in itertools.product(range(vocab), repeat=length):
            assert tree.counts(list(string)) == fresh.counts(list(string))
    for _ in range(5):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 15))]
        expected = suffix_drafts_reference(context, kept, 8, depth, 1.0, 0.1)
        assert own_drafts(context, tree, depth) == own_drafts(context, fresh, depth) == expected[0]


def test_removing_everything_frees_every_node():
    sequences = [[1, 2, 3, 1, 2], [2, 3, 3, 2]]
    tree = tree_of(sequences, 4)
    for sequence in sequences:
        tree.remove(np.array(sequence, np.int64))
    assert tree.num_nodes == 1  # the root
    assert tree.counts([2]) == (0, 0)
    tree.add(np.array([5, 6, 5, 6], np.int64))
    assert tree.counts([5, 6]) == (2, 1)


def test_a_huge_fanout_keeps_a_living_best_child():
    """A node with more children than `RESCAN_LIMIT` (a frequent token's) is not rescanned in full on eviction: its
    best child stays one of its living children, with a count."""
    fanout = RESCAN_LIMIT * 3
    sequences = [[7, 1000 + i] for i in range(fanout)] + [[7, 5]] * 3
    tree = tree_of(sequences, 3)
    node = kernels()["_find"](tree.table, int(tree.roots[0]), 7)
    best = int(tree.nodes[node, BEST])
    assert int(tree.nodes[best, COUNT]) == 3  # [7, 5], the most frequent
    for sequence in sequences[-3:]:
        tree.remove(np.array(sequence, np.int64))
    best = int(tree.nodes[node, BEST])
    assert best >= 0 and int(tree.nodes[best, COUNT]) == 1
    assert tree.counts([7]) == (fanout, fanout)


def test_invalid_depth_is_refused():
    with pytest.raises(ValueError, match="max_depth must be >= 1, got 0"):
        SuffixTree(0)
