"""Suffix trees with counts for suffix decoding: one numba-compiled pool of nodes holding one or more trees.

A tree holds every suffix of each sequence put into it, cut at `max_depth` tokens (a suffix trie of depth D). The
node of a string s counts its occurrences (`COUNT`) and the occurrences some token follows (`TOTAL`, the sum of its
children's counts), so child x of s has probability COUNT(s·x) / TOTAL(s). Each node keeps its most frequent child
(`BEST`; ties go to the one seen last) and its suffix link (`LINK`: the node of s without its first token). Nodes are
rows of one int32 array [N, 8]; children are found through an open-addressing hash of (node, token), one [H, 2]
int64 array of (key, child) rows, so that a probe reads one cache line. Removing a sequence decrements the paths
inserting it incremented and frees the nodes whose count reaches 0. `SuffixTree` owns the arrays (growth, roots);
the drafting kernel is in `hf_specdec.proposers.suffix_search`.
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
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as an int64 (splitmix64's finalizer constants)
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _slot(key: int, mask: int) -> int:
    """The home slot of `key`: splitmix64's finalizer (every key bit moves the low bits), modulo the table size."""
    h = key
    h ^= (h >> 30) & 0x3FFFFFFFF  # logical shifts (the masks drop the sign bits an arithmetic shift brings in)
    h *= _MIX1  # wraps modulo 2**64
    h ^= (h >> 27) & 0x1FFFFFFFFF
    h *= _MIX2
    h ^= (h >> 31) & 0x1FFFFFFFF
    return h & mask


def _find(table: np.ndarray, node: int, token: int) -> int:
    """The child of `node` reached by `token`, or -1 (`table` [H, 2] int64: (key, child) rows, key -1 when empty)."""
    key = (np.int64(node) << 32) | np.int64(token)
    mask = table.shape[0] - 1
    i = _slot(key, mask)
    while True:
        found = table[i, 0]
        if found == key:
            return table[i, 1]
        if found == -1:
            return -1
        i = (i + 1) & mask


def _hash_delete(table: np.ndarray, meta: np.ndarray, key: int) -> None:
    """Remove `key` (which must be present), shifting later entries of its probe run back (no tombstones)."""
    mask = table.shape[0] - 1
    i = _slot(key, mask)
    while table[i, 0] != key:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if table[j, 0] == -1:
            break
        home = _slot(table[j, 0], mask)
        stays = (i < home <= j) if i <= j else (home > i or home <= j)  # its home lies cyclically in (i, j]
        if not stays:
            table[i, 0] = table[j, 0]
            table[i, 1] = table[j, 1]
            i = j
    table[i, 0] = -1
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
    table: np.ndarray,
    free: np.ndarray,
    meta: np.ndarray,
    parent: int,
    token: int,
    link: int,
) -> int:
    """The child of `parent` reached by `token`, created (with suffix link `link`) when missing."""
    child = _find(table, parent, token)
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
    mask = table.shape[0] - 1
    i = _slot(key, mask)
    while table[i, 0] != -1:
        i = (i + 1) & mask
    table[i, 0] = key
    table[i, 1] = child
    meta[HASH_COUNT] += 1
    return child


#: `_rescan_best` looks at this many children at most: a node with more (a frequent token's, near the root) keeps its
#: best child while it lives, or takes the best of its newest children, instead of a scan of thousands on eviction.
RESCAN_LIMIT = 64


def _rescan_best(nodes: np.ndarray, stamps: np.ndarray, parent: int, previous: int) -> None:
    """Recompute `parent`'s most frequent child (ties: the latest stamp) after `previous` (its best child) lost a
    count: exact for up to `RESCAN_LIMIT` children; past that, among the newest ones and `previous` if it lives."""
    best = previous if nodes[previous, COUNT] > 0 else -1
    child = nodes[parent, FIRST]
    seen = 0
    while child >= 0:
        if seen == RESCAN_LIMIT:
            break
        seen += 1
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
    table: np.ndarray,
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
            child = _child(nodes, stamps, table, free, meta, parent, token, previous)
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
    table: np.ndarray,
    free: np.ndarray,
    meta: np.ndarray,
    active: np.ndarray,  # [B, D + 1] int32: each row's suffix nodes
    state: np.ndarray,  # [B, 3] int64: (first token, tokens appended so far = end, set entries of `active`)
    tokens: np.ndarray,  # [B, L] int64
    ends: np.ndarray,  # [B] int64: row i appends tokens[i, state[i, 1]:ends[i]]
    depth: int,
    mirror: np.ndarray,  # [B, L'] int64: the appended tokens are also copied here, at the same indices
) -> None:
    """`_append` for every row of a batch (each row its own tree in the pool); advances `state`."""
    scratch = np.empty(depth, np.int32)
    for i in range(tokens.shape[0]):
        start = state[i, 1]
        if ends[i] > start:
            mirror[i, start : ends[i]] = tokens[i, start : ends[i]]
            state[i, 2] = _append(
                nodes, stamps, table, free, meta, active[i], state[i, 2], tokens[i], start, ends[i], depth, scratch
            )
            state[i, 1] = ends[i]


def _remove(
    nodes: np.ndarray,
    stamps: np.ndarray,
    table: np.ndarray,
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
            path[j] = _find(table, path[j - 1], tokens[p + j - 1])
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
                _hash_delete(table, meta, (np.int64(parent) << 32) | np.int64(nodes[child, TOKEN]))
                free[meta[FREE_TOP]] = child
                meta[FREE_TOP] += 1
            if nodes[parent, BEST] == child and nodes[parent, LINK] >= 0:
                _rescan_best(nodes, stamps, parent, child)


def _rehash(old: np.ndarray, table: np.ndarray) -> None:
    mask = table.shape[0] - 1
    for i in range(old.shape[0]):
        key = old[i, 0]
        if key != -1:
            j = _slot(key, mask)
            while table[j, 0] != -1:
                j = (j + 1) & mask
            table[j, 0] = key
            table[j, 1] = old[i, 1]


_KERNEL_NAMES = ("_find", "_slot", "_alloc", "_child", "_rescan_best", "_hash_delete", "_append")
_ENTRY_NAMES = ("_append_rows", "_remove", "_rehash")
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


#: Most hash entries per slot before the table doubles (linear probing stays short below 0.6; a probe run of 4
#: (key, child) rows is one cache line).
MAX_LOAD = 0.6


def _table_size(entries: int) -> int:
    """The smallest power of two holding `entries` at a load of at most `MAX_LOAD`."""
    return 1 << max(4, (int(entries / MAX_LOAD) - 1).bit_length())


class SuffixTree:
    """
    A pool of suffix-trie nodes holding `num_roots` trees of depth `max_depth` (one per row of a call, or one
    global tree), with the arrays grown as sequences are appended.

    Per row, a sequence being appended has a suffix state: `active` [D + 1] int32 (the nodes of its last 0..D
    tokens) and a `state` row (first token, end, set entries of `active`); `start_rows` makes them.

    Args:
        max_depth (`int`): D, the longest string a tree counts (>= 1).
        num_roots (`int`, *optional*, defaults to 1): how many trees share the pool (`roots[i]` is tree i's root).
        capacity (`int`, *optional*, defaults to 1024): nodes allocated up front.
    """

    not_step_state = True  # host data only: a captured step never reads it (`step_graph.state_owners` skips it)

    def __init__(self, max_depth: int, num_roots: int = 1, capacity: int = 1024) -> None:
        kernels()  # compiled (or loaded from numba's cache) once per process
        if int(max_depth) < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}.")
        self.max_depth = int(max_depth)
        capacity = max(int(capacity), num_roots + 1)
        self.nodes = np.empty((capacity, FIELDS), np.int32)  # [N, 8]
        self.stamps = np.zeros(capacity, np.int64)  # [N] insertion clock of each node's latest count
        self.free = np.empty(capacity, np.int32)  # [N] freed node ids (a stack)
        self.meta = np.zeros(4, np.int64)
        self.table = np.full((_table_size(capacity), 2), -1, np.int64)  # [H, 2] ((parent << 32) | token, child)
        self.max_entries = int(MAX_LOAD * len(self.table))  # hash entries before the table doubles
        self.roots = np.array([_alloc(self.nodes, self.stamps, self.free, self.meta) for _ in range(num_roots)])

    @property
    def num_nodes(self) -> int:
        """Nodes in use (roots included)."""
        return int(self.meta[USED] - self.meta[FREE_TOP])

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold (what the tree costs in memory)."""
        return self.nodes.nbytes + self.stamps.nbytes + self.free.nbytes + self.table.nbytes

    def reserve(self, new_nodes: int) -> None:
        """Make room for `new_nodes` more nodes and their hash entries."""
        used, entries = self.meta[USED], self.meta[HASH_COUNT]
        if used + new_nodes <= len(self.nodes) and entries + new_nodes <= self.max_entries:
            return  # the common case, decided without a Python int conversion
        needed = int(used) + new_nodes
        if needed > len(self.nodes):
            size = max(needed, 2 * len(self.nodes))
            self.nodes = np.concatenate([self.nodes, np.empty((size - len(self.nodes), FIELDS), np.int32)])
            self.stamps = np.concatenate([self.stamps, np.zeros(size - len(self.stamps), np.int64)])
            self.free = np.concatenate([self.free, np.empty(size - len(self.free), np.int32)])
        entries = int(self.meta[HASH_COUNT]) + new_nodes
        if entries > MAX_LOAD * len(self.table):
            table = np.full((_table_size(max(entries, 2 * int(self.meta[HASH_COUNT]))), 2), -1, np.int64)
            _rehash(self.table, table)
            self.table = table
        self.max_entries = int(MAX_LOAD * len(self.table))

    def start_rows(
        self, roots: np.ndarray, starts: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:  # [B, D + 1] int32, [B, 3] int64
        """Empty suffix states of sequences about to be appended under `roots`, their first token at `starts`."""
        active = np.full((len(roots), self.max_depth + 1), -1, np.int32)
        active[:, 0] = roots
        state = np.zeros((len(roots), 3), np.int64)
        state[:, 2] = 1
        if starts is not None:
            state[:, 0] = state[:, 1] = starts
        return active, state

    def append_rows(
        self,
        active: np.ndarray,  # [B, D + 1] int32: the rows' suffix nodes (updated in place)
        state: np.ndarray,  # [B, 3] int64 (updated in place)
        tokens: np.ndarray,  # [B, L] int64
        ends: np.ndarray,  # [B] int64
        mirror: np.ndarray | None = None,  # [B, L'] int64: where the appended tokens are also copied
        max_new_tokens: int | None = None,  # a bound on sum(ends - state[:, 1]), when the caller knows one
    ) -> None:
        """Append tokens[i, state[i, 1]:ends[i]] to row i's sequence (its tree and suffix nodes `active[i]`), and
        copy them to the same indices of `mirror` when given."""
        if max_new_tokens is None:
            max_new_tokens = int(np.maximum(ends - state[:, 1], 0).sum())
        self.reserve(max_new_tokens * self.max_depth)
        mirror = tokens if mirror is None else mirror
        _append_rows(self.nodes, self.stamps, self.table, self.free, self.meta, active, state, tokens, ends,
                     self.max_depth, mirror)  # fmt: skip

    def add(self, tokens: np.ndarray, root_index: int = 0) -> None:
        """Append one whole sequence (`tokens` [n] int64) to tree `root_index`."""
        active, state = self.start_rows(self.roots[root_index : root_index + 1])
        row = np.ascontiguousarray(tokens, np.int64)[None]
        self.append_rows(active, state, row, np.array([row.shape[1]], np.int64), max_new_tokens=row.shape[1])

    def remove(self, tokens: np.ndarray, root_index: int = 0) -> None:
        """Take back a sequence added to tree `root_index` with `add` (the same tokens)."""
        tokens = np.ascontiguousarray(tokens, np.int64)
        _remove(self.nodes, self.stamps, self.table, self.free, self.meta, int(self.roots[root_index]), tokens,
                self.max_depth)  # fmt: skip

    def counts(self, string: list[int], root_index: int = 0) -> tuple[int, int]:
        """(COUNT, TOTAL) of the node of `string` in tree `root_index`, (0, 0) when it is not there (for tests)."""
        node = int(self.roots[root_index])
        for token in string:
            node = _find(self.table, node, int(token))
            if node < 0:
                return 0, 0
        return int(self.nodes[node, COUNT]), int(self.nodes[node, TOTAL])
