"""Suffix decoding's drafts: for each row, the best-scoring walk down its own tree and the global tree (numba).

For every match length m (the row's last m tokens found in a tree, m <= D), the walk starts at that string's node
and follows the most frequent child, multiplying the branch probability COUNT(child) / TOTAL(node), until it falls
below `min_token_prob`, for at most `min(budget, floor(m * max_spec_factor))` tokens. At depth D (a tree counts no
longer string) the walk slides to the node's suffix link and goes on: later drafts are then predicted from the last
D - 1 tokens. A walk's score is the sum of its branch probabilities (the drafts the tree expects accepted); the best
score over both trees and all m wins (the row's own tree on ties; longer matches first). `suffix_drafts` is the
batched kernel; `suffix_drafts_reference` the same contract from raw token lists, brute force, for tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from hf_specdec.proposers import suffix_tree
from hf_specdec.proposers.suffix_tree import BEST, COUNT, LINK, TOKEN, TOTAL, SuffixTree

__all__ = ["suffix_drafts", "suffix_drafts_reference"]


def _continues(nodes: np.ndarray, node: int, m: int, depth: int) -> bool:
    """Whether the string of `node` (length m) is followed by some token in the tree (at depth D: its link's)."""
    if m >= depth:
        node = nodes[node, LINK]
        if nodes[node, LINK] < 0:  # the link is a root: nothing to predict from (D = 1)
            return False
    return nodes[node, TOTAL] > 0


def _walk(
    nodes: np.ndarray,
    node: int,
    m: int,
    depth: int,
    limit: int,
    min_prob: float,
    out: np.ndarray,  # [k] int64: the walk's tokens
) -> tuple[int, float]:
    """Follow the most frequent children from `node` (a string of length m): (tokens written, score)."""
    prob = 1.0
    score = 0.0
    n = 0
    d = m
    while n < limit:
        if d >= depth:
            node = nodes[node, LINK]
            d -= 1
            if nodes[node, LINK] < 0:
                break
        total = nodes[node, TOTAL]
        if total <= 0:
            break
        child = nodes[node, BEST]
        prob *= nodes[child, COUNT] / total
        if prob < min_prob:
            break
        out[n] = nodes[child, TOKEN]
        n += 1
        score += prob
        node = child
        d += 1
    return n, score


def _longest_match(
    nodes: np.ndarray,
    table: np.ndarray,
    root: int,
    row: np.ndarray,  # [C] int64: the row's tokens
    start: int,  # its first real token (after left padding)
    end: int,  # one past its last token
    depth: int,
) -> tuple[int, int]:
    """(node, m) of the longest m <= min(D, end - start) such that row[end - m:end] is in the tree with a
    continuation; (root, 0) when none. Both properties only get rarer as m grows, so m is found by bisection."""
    low = 0
    high = min(depth, end - start)
    best = root
    while low < high:
        mid = (low + high + 1) // 2
        node = root
        for q in range(end - mid, end):
            node = _find(table, node, row[q])
            if node < 0:
                break
        if node >= 0 and _continues(nodes, node, mid, depth):
            low = mid
            best = node
        else:
            high = mid - 1
    return best, low


#: Columns of the kernel's output rows past the k drafts: drafts per row, match length, from the global tree (0/1),
#: and the draft's key for the adaptive schedule (the bucket of the match length, `key_of`).
COUNT_COLUMN, MATCH_COLUMN, GLOBAL_COLUMN, KEY_COLUMN = 0, 1, 2, 3
EXTRA_COLUMNS = 4
#: Upper ends of the match-length buckets that key the adaptive schedule's acceptance statistics (key = index + 1).
MATCH_BUCKETS = np.array([1, 2, 3, 5, 8, 12, 17], np.int64)


def key_of(match_length: int) -> int:
    """The adaptive schedule's key of a draft matched on `match_length` tokens: its bucket (0 without drafts)."""
    if match_length <= 0:
        return 0
    key = 1
    for upper in MATCH_BUCKETS:
        if match_length <= upper:
            return key
        key += 1
    return key


def _suffix_drafts(
    local_nodes: np.ndarray,
    active: np.ndarray,  # [B, D + 1] int32: node of each row's last d tokens in its own tree
    state: np.ndarray,  # [B, 3] int64: (first real token, end, set entries of `active`) per row
    tokens: np.ndarray,  # [B, C] int64: the rows' tokens
    global_nodes: np.ndarray,
    global_table: np.ndarray,
    global_root: int,  # -1: no global tree
    budgets: np.ndarray,  # [B] int64: most drafts per row
    depth: int,
    max_spec_factor: float,
    min_prob: float,
    out: np.ndarray,  # [B, k + 4] int64: drafts (-1 past the count), then count, match length, from_global, key
    scores: np.ndarray,  # [B] float64
) -> int:
    """Fills `out` and `scores`; returns the most drafts any row got."""
    k = out.shape[1] - EXTRA_COLUMNS
    scratch = np.empty(k, np.int64)
    widest = 0
    for i in range(out.shape[0]):
        out[i, :k] = -1
        out[i, k:] = 0
        scores[i] = 0.0
        want = min(budgets[i], k)
        if want <= 0:
            continue
        best_score = 0.0
        m = min(depth, state[i, 2] - 1)
        node = active[i, m] if m > 0 else -1
        for tree in range(2):
            if tree == 1:
                if global_root < 0:
                    break
                node, m = _longest_match(
                    global_nodes, global_table, global_root, tokens[i], state[i, 0], state[i, 1], depth
                )
            nodes = local_nodes if tree == 0 else global_nodes
            while m > 0:
                limit = min(want, int(m * max_spec_factor + 1e-9))
                if limit <= 0 or best_score >= limit:  # shorter matches draft no more: none can score higher
                    break
                if _continues(nodes, node, m, depth):
                    n, score = _walk(nodes, node, m, depth, limit, min_prob, scratch)
                    if score > best_score:
                        best_score = score
                        out[i, :n] = scratch[:n]
                        out[i, n:k] = -1
                        out[i, k + COUNT_COLUMN] = n
                        out[i, k + MATCH_COLUMN] = m
                        out[i, k + GLOBAL_COLUMN] = tree
                        out[i, k + KEY_COLUMN] = key_of(m)
                        scores[i] = score
                node = nodes[node, LINK]
                m -= 1
        widest = max(widest, out[i, k + COUNT_COLUMN])
    return widest


_compiled: Callable[..., None] | None = None
_compile_lock = threading.Lock()
_find: Callable[..., int] | None = None  # bound to the compiled `suffix_tree._find` by `_kernel`


def _kernel() -> Callable[..., None]:
    """The compiled batch kernel (thread-safe; the helpers are rebound in this module's globals first, where numba
    resolves the names the kernel calls)."""
    global _compiled, _find
    if _compiled is None:
        with _compile_lock:
            if _compiled is None:
                import numba

                _find = suffix_tree.kernels()["_find"]
                for name in ("key_of", "_continues", "_walk", "_longest_match"):
                    globals()[name] = numba.njit(nogil=True, cache=True)(globals()[name])
                _compiled = numba.njit(nogil=True, cache=True)(_suffix_drafts)
    return _compiled


def suffix_drafts(
    local: SuffixTree,
    active: np.ndarray,  # [B, D + 1] int32
    state: np.ndarray,  # [B, 3] int64
    tokens: np.ndarray,  # [B, C] int64: the rows' tokens (left padding, prompt, output)
    global_tree: SuffixTree | None,
    budgets: np.ndarray,  # [B] int64
    k: int,
    max_spec_factor: float,
    min_token_prob: float,
    out: np.ndarray | None = None,  # [B, k + 4] int64 to write into (reused across steps)
    scores: np.ndarray | None = None,  # [B] float64
) -> tuple[np.ndarray, np.ndarray, int]:
    """
    Drafts for a batch of rows from their own trees (in `local`, row i's suffix nodes `active[i]` and `state[i]`:
    first real token, end, set entries of `active`) and a global tree; the caller holds the global tree's lock.

    Returns `out` [B, k + 4] int64: each row's drafts (-1 padded), then (`COUNT_COLUMN`, ... after k) its draft count,
    the match length m of the winning walk (0 without drafts), 1 when it came from the global tree, and its key for
    the adaptive schedule (`key_of(m)`); `scores` [B] float64, the winning walk's sum of branch probabilities; and
    the most drafts any row got.
    """
    batch_size = active.shape[0]
    if out is None:
        out = np.empty((batch_size, k + EXTRA_COLUMNS), np.int64)
        scores = np.empty(batch_size, np.float64)
    if batch_size == 0 or k == 0:
        out[:, :k] = -1
        out[:, k:] = 0
        scores[:] = 0.0
        return out, scores, 0
    g = local if global_tree is None else global_tree
    widest = _kernel()(
        local.nodes, active, state, tokens, g.nodes, g.table, -1 if global_tree is None else int(g.roots[0]),
        budgets, local.max_depth, float(max_spec_factor), float(min_token_prob), out, scores,
    )  # fmt: skip
    return out, scores, int(widest)


def _reference_walk(
    sequences: list[list[int]], context: list[int], m: int, depth: int, limit: int, min_prob: float
) -> tuple[list[int], float]:
    """One walk from the last m tokens of `context`, brute force: counts by scanning `sequences`."""

    def occurrences(string: list[int]) -> list[tuple[int, int]]:  # (sequence, index after the string)
        n = len(string)
        return [
            (s, p + n) for s, seq in enumerate(sequences) for p in range(len(seq) - n + 1) if seq[p : p + n] == string
        ]

    key = list(context[len(context) - m :])
    if not occurrences(key):  # the match itself must be in the tree
        return [], 0.0
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < limit:
        if len(key) >= depth:
            key = key[1:]
            if not key:
                break
        follows: dict[int, list[int]] = {}  # next token -> its occurrences' insertion times
        for s, end in occurrences(key):
            if end < len(sequences[s]):
                follows.setdefault(sequences[s][end], []).append(_clock(sequences, s, end))
        total = sum(len(v) for v in follows.values())
        if total == 0:
            break
        token = max(follows, key=lambda t: (len(follows[t]), max(follows[t])))
        prob *= len(follows[token]) / total
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        key = key + [token]
    return out, score


def _clock(sequences: list[list[int]], s: int, index: int) -> int:
    """When token `index` of sequence s was appended, counting every token of the sequences before it."""
    return sum(len(seq) for seq in sequences[:s]) + index


def suffix_drafts_reference(
    context: list[int],
    corpus: list[list[int]],
    budget: int,
    depth: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> tuple[list[int], int, bool, float]:
    """
    The drafts of `suffix_drafts` for one row, from raw tokens: its `context` (its own tree) and the sequences of
    the global tree in insertion order (`corpus`, no removals). Returns (drafts, match length, from_global, score).
    """
    best: tuple[list[int], int, bool, float] = ([], 0, False, 0.0)
    for tree, sequences in ((0, [context]), (1, corpus)):
        if tree == 1 and not corpus:
            break
        longest = min(depth, len(context))
        for m in range(longest, 0, -1):
            limit = min(budget, int(m * max_spec_factor + 1e-9))
            if limit <= 0 or best[3] >= limit:
                break
            drafts, score = _reference_walk(sequences, context, m, depth, limit, min_token_prob)
            if drafts and score > best[3]:
                best = (drafts, m, tree == 1, score)
    return best
