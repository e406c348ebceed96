"""Suffix trees with counts for suffix decoding: one numba-compiled pool of nodes holding one or more trees.

A tree holds every suffix of each sequence put into it, cut at `max_depth` tokens (a suffix trie of depth D). The
node of a string s counts its occurrences (`COUNT`) and the occurrences some token follows (`TOTAL`, the sum of its
children's counts), so child x of s has probability COUNT(s·x) / TOTAL(s). Each node keeps its most frequent child
(`BEST`; ties go to the one seen last) and its suffix link (`LINK`: the node of s without its first token). Nodes are
rows of one int32 array [N, 8]; children are found through an open-addressing hash of (node, token). Removing a
sequence decrements the paths inserting it incremented and frees the nodes whose count reaches 0. `SuffixTree` owns
the arrays (growth, roots); the drafting kernel is in `hf_specdec.proposers.suffix_search`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["SuffixTree", "kernels"]

# Columns of the node array.
COUNT, TOTAL, TOKEN, FIRST, NEXT, PREV, BEST, LINK = range(8)
FIELDS = 8
# Entries of the meta array: nodes ever allocated (high-water mark), free-list size, hash entries, insertion clock.
USED, FREE_TOP, HASH_COUNT, CLOCK = range(4)
_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 (Fibonacci hashing) as an int64


def _slot(key: int, mask: int) -> int:
    h = key * _MULTIPLIER  # wraps modulo 2**64
    return (h ^ (h >> 29)) & mask


def _find(hkeys: np.ndarray, hvals: np.ndarray, node: int, token: int) -> int:
    """The child of `node` reached by `token`, or -1."""
    key = (np.int64(node) << 32) | np.int64(token)
    mask = len(hkeys) - 1
    i = _slot(key, mask)
    while True:
        found = hkeys[i]
        if found == key:
            return hvals[i]
        if found == -1:
            return -1
        i = (i + 1) & mask


def _hash_delete(hkeys: np.ndarray, hvals: np.ndarray, meta: np.ndarray, key: int) -> None:
    """Remove `key` (which must be present), shifting later entries of its probe run back (no tombstones)."""
    mask = len(hkeys) - 1
    i = _slot(key, mask)
    while hkeys[i] != key:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if hkeys[j] == -1:
            break
        home = _slot(hkeys[j], mask)
        stays = (i < home <= j) if i <= j else (home > i or home <= j)  # its home lies cyclically in (i, j]
        if not stays:
            hkeys[i] = hkeys[j]
            hvals[i] = hvals[j]
            i = j
    hkeys[i] = -1
    meta[HASH_COUNT] -= 1


def _alloc(nodes: np.ndarray, stamps: np.ndarray, free: np.ndarray, meta: np.ndarray) -> int:
    if meta[FREE_TOP] > 0:
        meta[FREE_TOP] -= 1
        n = free[meta[FREE_TOP]]
    else:
        n = meta[USED]
        meta[USED] += 1
    nodes[n, COUNT] = 0
    nodes[n, TOTAL] = 0
    nodes[n, TOKEN] = -1
    nodes[n, FIRST] = -1
    nodes[n, NEXT] = -1
    nodes[n, PREV] = -1
    nodes[n, BEST] = -1
    nodes[n, LINK] = -1  # -1 marks a root; every other node links somewhere
    stamps[n] = 0
    return n


def _child(
    nodes: np.ndarray,
    stamps: np.ndarray,
    hkeys: np.ndarray,
    hvals: np.ndarray,
    free: np.ndarray,
    meta: np.ndarray,
    parent: int,
    token: int,
    link: int,
) -> int:
    """The child of `parent` reached by `token`, created (with suffix link `link`) when missing."""
    child = _find(hkeys, hvals, parent, token)
    if child >= 0:
        return child
    child = _alloc(nodes, stamps, free, meta)
    nodes[child, TOKEN] = token
    nodes[child, LINK] = link
    head = nodes[parent, FIRST]
    nodes[child, NEXT] = head
    if head >= 0:
        nodes[head, PREV] = child
    nodes[parent, FIRST] = child
    key = (np.int64(parent) << 32) | np.int64(token)
    mask = len(hkeys) - 1
    i = _slot(key, mask)
    while hkeys[i] != -1:
        i = (i + 1) & mask
    hkeys[i] = key
    hvals[i] = child
    meta[HASH_COUNT] += 1
    return child


def _rescan_best(nodes: np.ndarray, stamps: np.ndarray, parent: int) -> None:
    """Recompute `parent`'s most frequent child (ties: the latest stamp) from its children."""
    best = -1
    child = nodes[parent, FIRST]
    while child >= 0:
        if (
            best < 0
            or nodes[child, COUNT] > nodes[best, COUNT]
            or (nodes[child, COUNT] == nodes[best, COUNT] and stamps[child] > stamps[best])
        ):
            best = child
        child = nodes[child, NEXT]
    nodes[parent, BEST] = best


def _append(
    nodes: np.ndarray,
    stamps: np.ndarray,
    hkeys: np.ndarray,
    hvals: np.ndarray,
    free: np.ndarray,
    meta: np.ndarray,
    active: np.ndarray,  # [D + 1] int32: active[d] = node of the sequence's last d tokens (active[0]: its root)
    num_active: int,  # entries of `active` that are set (1 + min(D, tokens so far))
    tokens: np.ndarray,  # [n] int64
    start: int,
    end: int,
    depth: int,
    scratch: np.ndarray,  # [D] int32
) -> int:
    """Append tokens[start:end] to a sequence whose suffixes end at the `active` nodes; returns the new count of
    active entries. Each token extends every suffix shorter than D by one node (created with its suffix link)."""
    for q in range(start, end):
        token = tokens[q]
        clock = meta[CLOCK] + 1
        meta[CLOCK] = clock
        top = min(num_active, depth)
        previous = active[0]  # a depth-1 node links to the root
        for d in range(top):
            parent = active[d]
            child = _child(nodes, stamps, hkeys, hvals, free, meta, parent, token, previous)
            nodes[child, COUNT] += 1
            nodes[parent, TOTAL] += 1
            stamps[child] = clock
            if nodes[parent, LINK] >= 0:  # roots keep no best child (no draft starts at the empty string)
                best = nodes[parent, BEST]
                if best < 0 or nodes[child, COUNT] >= nodes[best, COUNT]:
                    nodes[parent, BEST] = child
            scratch[d] = child
            previous = child
        for d in range(top, 0, -1):
            active[d] = scratch[d - 1]
        num_active = min(num_active + 1, depth + 1)
    return num_active


def _append_rows(
    nodes: np.ndarray,
    stamps: np.ndarray,
    hkeys: np.ndarray,
    hvals: np.ndarray,
    free: np.ndarray,
    meta: np.ndarray,
    active: np.ndarray,  # [B, D + 1] int32
    num_active: np.ndarray,  # [B] int64
    tokens: np.ndarray,  # [B, L] int64
    starts: np.ndarray,  # [B] int64: row i appends tokens[i, starts[i]:ends[i]]
    ends: np.ndarray,  # [B] int64
    depth: int,
    mirror: np.ndarray,  # [B, L'] int64: the appended tokens are also copied here, at the same indices
) -> None:
    """`_append` for every row of a batch (each row its own tree in the pool)."""
    scratch = np.empty(depth, np.int32)
    for i in range(tokens.shape[0]):
        if ends[i] > starts[i]:
            mirror[i, starts[i] : ends[i]] = tokens[i, starts[i] : ends[i]]
            num_active[i] = _append(
                nodes, stamps, hkeys, hvals, free, meta, active[i], num_active[i], tokens[i], starts[i], ends[i],
                depth, scratch,
            )  # fmt: skip


def _remove(
    nodes: np.ndarray,
    stamps: np.ndarray,
    hkeys: np.ndarray,
    hvals: np.ndarray,
    free: np.ndarray,
    meta: np.ndarray,
    root: int,
    tokens: np.ndarray,  # [n] int64: a sequence appended to the tree of `root` before
    depth: int,
) -> None:
    """Undo appending `tokens`: decrement each suffix's path (deepest node first), free nodes whose count is 0."""
    n = len(tokens)
    path = np.empty(depth + 1, np.int32)
    for p in range(n):
        length = min(depth, n - p)
        path[0] = root
        for j in range(1, length + 1):
            path[j] = _find(hkeys, hvals, path[j - 1], tokens[p + j - 1])
        for j in range(length, 0, -1):
            child = path[j]
            parent = path[j - 1]
            nodes[child, COUNT] -= 1
            nodes[parent, TOTAL] -= 1
            if nodes[child, COUNT] == 0:
                before, after = nodes[child, PREV], nodes[child, NEXT]
                if before >= 0:
                    nodes[before, NEXT] = after
                else:
                    nodes[parent, FIRST] = after
                if after >= 0:
                    nodes[after, PREV] = before
                _hash_delete(hkeys, hvals, meta, (np.int64(parent) << 32) | np.int64(nodes[child, TOKEN]))
                free[meta[FREE_TOP]] = child
                meta[FREE_TOP] += 1
            if nodes[parent, BEST] == child and nodes[parent, LINK] >= 0:
                _rescan_best(nodes, stamps, parent)


def _rehash(old_keys: np.ndarray, old_values: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    mask = len(keys) - 1
    for i in range(len(old_keys)):
        key = old_keys[i]
        if key != -1:
            j = _slot(key, mask)
            while keys[j] != -1:
                j = (j + 1) & mask
            keys[j] = key
            values[j] = old_values[i]


def _new_root(nodes: np.ndarray, stamps: np.ndarray, free: np.ndarray, meta: np.ndarray) -> int:
    return _alloc(nodes, stamps, free, meta)


_KERNEL_NAMES = ("_find", "_slot", "_alloc", "_child", "_rescan_best", "_hash_delete", "_append")
_ENTRY_NAMES = ("_append_rows", "_remove", "_rehash", "_new_root")
_kernels: dict[str, Callable[..., Any]] | None = None
_compile_lock = threading.Lock()


def kernels() -> dict[str, Callable[..., Any]]:
    """The jit-compiled kernels by name (numba is imported on first use; `cache=True` keeps them across runs).

    The helpers are rebound in this module's globals first: that is where numba resolves the names the entry
    kernels (and `hf_specdec.proposers.suffix_search`) call."""
    global _kernels
    if _kernels is None:
        with _compile_lock:
            if _kernels is None:
                try:
                    import numba
                except ImportError as err:  # pragma: no cover - numba is a dependency
                    raise ImportError(
                        "hf_specdec's suffix decoding needs numba for its tree kernels: `pip install numba`."
                    ) from err
                compiled = {}
                for name in (*_KERNEL_NAMES, *_ENTRY_NAMES):
                    compiled[name] = numba.njit(nogil=True, cache=True)(globals()[name])
                    globals()[name] = compiled[name]
                _kernels = compiled
    return _kernels


def _next_power_of_two(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())


class SuffixTree:
    """
    A pool of suffix-trie nodes holding `num_roots` trees of depth `max_depth` (one per row of a call, or one
    global tree), with the arrays grown as sequences are appended.

    Args:
        max_depth (`int`): D, the longest string a tree counts (>= 1).
        num_roots (`int`, *optional*, defaults to 1): how many trees share the pool (`roots[i]` is tree i's root).
        capacity (`int`, *optional*, defaults to 1024): nodes allocated up front.
    """

    not_step_state = True  # host data only: a captured step never reads it (`step_graph.state_owners` skips it)

    def __init__(self, max_depth: int, num_roots: int = 1, capacity: int = 1024) -> None:
        if int(max_depth) < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}.")
        self.max_depth = int(max_depth)
        capacity = max(int(capacity), num_roots + 1)
        self.nodes = np.empty((capacity, FIELDS), np.int32)  # [N, 8]
        self.stamps = np.zeros(capacity, np.int64)  # [N] insertion clock of each node's latest count
        self.free = np.empty(capacity, np.int32)  # [N] freed node ids (a stack)
        self.meta = np.zeros(4, np.int64)
        size = _next_power_of_two(2 * capacity)
        self.hkeys = np.full(size, -1, np.int64)  # [H] (parent << 32) | token, -1 when empty
        self.hvals = np.empty(size, np.int32)  # [H] the child
        new_root = kernels()["_new_root"]
        self.roots = np.array([new_root(self.nodes, self.stamps, self.free, self.meta) for _ in range(num_roots)])

    @property
    def num_nodes(self) -> int:
        """Nodes in use (roots included)."""
        return int(self.meta[USED] - self.meta[FREE_TOP])

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold (what the tree costs in memory)."""
        return sum(a.nbytes for a in (self.nodes, self.stamps, self.free, self.hkeys, self.hvals))

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(nodes, stamps, hkeys, hvals, free, meta): the arguments every kernel takes first."""
        return self.nodes, self.stamps, self.hkeys, self.hvals, self.free, self.meta

    def reserve(self, new_nodes: int) -> None:
        """Make room for `new_nodes` more nodes (and their hash entries, at a load of at most one half)."""
        needed = int(self.meta[USED]) + int(new_nodes)
        if needed > len(self.nodes):
            size = max(needed, 2 * len(self.nodes))
            self.nodes = np.concatenate([self.nodes, np.empty((size - len(self.nodes), FIELDS), np.int32)])
            self.stamps = np.concatenate([self.stamps, np.zeros(size - len(self.stamps), np.int64)])
            self.free = np.concatenate([self.free, np.empty(size - len(self.free), np.int32)])
        entries = int(self.meta[HASH_COUNT]) + int(new_nodes)
        if 2 * entries > len(self.hkeys):
            keys = np.full(_next_power_of_two(2 * entries), -1, np.int64)
            values = np.empty(len(keys), np.int32)
            kernels()["_rehash"](self.hkeys, self.hvals, keys, values)
            self.hkeys, self.hvals = keys, values

    def append_rows(
        self,
        active: np.ndarray,  # [B, D + 1] int32: the rows' suffix nodes (updated in place)
        num_active: np.ndarray,  # [B] int64 (updated in place)
        tokens: np.ndarray,  # [B, L] int64
        starts: np.ndarray,  # [B] int64
        ends: np.ndarray,  # [B] int64
        mirror: np.ndarray | None = None,  # [B, L'] int64: where the appended tokens are also copied
    ) -> None:
        """Append tokens[i, starts[i]:ends[i]] to the sequence of row i (its tree and suffix state `active[i]`), and
        copy them to the same indices of `mirror` when given."""
        self.reserve(int(np.maximum(ends - starts, 0).sum()) * self.max_depth)
        mirror = tokens if mirror is None else mirror
        kernels()["_append_rows"](*self.arrays(), active, num_active, tokens, starts, ends, self.max_depth, mirror)

    def start_rows(self, roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Empty suffix states ([B, D + 1] nodes, [B] counts) of sequences about to be appended under `roots`."""
        active = np.full((len(roots), self.max_depth + 1), -1, np.int32)
        active[:, 0] = roots
        return active, np.ones(len(roots), np.int64)

    def add(self, tokens: np.ndarray, root_index: int = 0) -> None:
        """Append one whole sequence (`tokens` [n] int64) to tree `root_index`."""
        active, num_active = self.start_rows(self.roots[root_index : root_index + 1])
        row = np.ascontiguousarray(tokens, np.int64)[None]
        self.append_rows(active, num_active, row, np.zeros(1, np.int64), np.array([row.shape[1]], np.int64))

    def remove(self, tokens: np.ndarray, root_index: int = 0) -> None:
        """Take back a sequence added to tree `root_index` with `add` (the same tokens)."""
        tokens = np.ascontiguousarray(tokens, np.int64)
        kernels()["_remove"](*self.arrays(), int(self.roots[root_index]), tokens, self.max_depth)

    def counts(self, string: list[int], root_index: int = 0) -> tuple[int, int]:
        """(COUNT, TOTAL) of the node of `string` in tree `root_index`, (0, 0) when it is not there (for tests)."""
        node = int(self.roots[root_index])
        find = kernels()["_find"]
        for token in string:
            node = find(self.hkeys, self.hvals, node, int(token))
            if node < 0:
                return 0, 0
        return int(self.nodes[node, COUNT]), int(self.nodes[node, TOTAL])
