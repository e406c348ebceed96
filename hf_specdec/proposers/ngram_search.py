"""Prompt-lookup n-gram search: a batched numba kernel (numpy in, numpy out) and a pure-Python reference.

For each row, the last n tokens of the context are looked up earlier in the same context (largest n in
[min_n, max_n] first, most recent occurrence first) and the tokens that followed that occurrence are
returned as drafts. The kernel runs a Z-function on the reversed context, capped at max_n, so each row
costs O(len(context)) in the worst case and usually much less (it stops at the first occurrence of the
full max_n-gram). Big batches run rows in parallel (`numba.prange`), small ones on the calling thread;
numba is imported and the kernels compiled (`cache=True`) on the first call.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ngram_search", "ngram_search_reference"]


def _search_row(
    row: np.ndarray,  # [L] int64: one row of the token buffer
    start: int,
    end: int,
    want: int,
    min_n: int,
    max_n: int,
    drafts_row: np.ndarray,  # [k] int64, -1 filled; the first `count` slots are written
    z: np.ndarray,  # [max_n] int64 scratch
) -> tuple[int, int]:
    """Search one row; returns (drafts written, length n of the matched n-gram, 0 without drafts). Numba-compiled.

    The context is read reversed: r[q] = row[end - 1 - q]. For p >= 1, the capped Z-value
    z(p) = min(LCP(r, r[p:]), M) with M = min(max_n, end - start - 1) is the length of the longest suffix
    of the context that also ends at context index j = len - 1 - p. The best match is the first p (most
    recent j) with the largest z(p); the scan stops once z(p) == M, which nothing can beat, or once the
    positions left are too short to beat the best so far. Linear time: the Z-box only moves right.
    """
    m = end - start
    if want <= 0 or m - 1 < min_n:
        return 0, 0
    cap_all = min(max_n, m - 1)  # M: no suffix longer than this can occur earlier
    last = end - 1
    best_len = 0
    best_p = -1
    box_l = 0  # Z-box [box_l, box_r): r[box_l:box_r] == r[0:box_r - box_l], box_r - box_l <= M
    box_r = 0
    for q in range(cap_all):
        z[q] = 0  # positions skipped by the fast scan below have z = 0
    first_token = row[last]  # r[0]
    p = 1
    while p < m:
        if m - p <= best_len:
            break  # older positions cannot give a longer match (best_len < M here)
        if p >= box_r:
            # Outside the Z-box, z(p) > 0 needs r[p] == r[0]: skip to the next such p, 8 at a time.
            p_end = m - best_len
            while p + 8 <= p_end:
                base = last - p
                if (
                    (row[base] == first_token)
                    | (row[base - 1] == first_token)
                    | (row[base - 2] == first_token)
                    | (row[base - 3] == first_token)
                    | (row[base - 4] == first_token)
                    | (row[base - 5] == first_token)
                    | (row[base - 6] == first_token)
                    | (row[base - 7] == first_token)
                ):
                    break
                p += 8
            while p < p_end and row[last - p] != first_token:
                p += 1
            if p >= p_end:
                break
        cap = min(cap_all, m - p)
        zl = 0
        extend = True
        if p < box_r:
            zq = z[p - box_l]  # p - box_l < M, computed earlier
            if zq < box_r - p:
                zl = zq
                extend = False
            else:
                zl = box_r - p
        if extend:
            while zl < cap and row[last - zl] == row[last - p - zl]:
                zl += 1
            if p + zl > box_r:
                box_l = p
                box_r = p + zl
        if p < cap_all:
            z[p] = zl
        if zl > best_len:
            best_len = zl
            best_p = p
            if zl >= cap_all:
                break
        p += 1
    if best_len < min_n:
        return 0, 0
    # The match ends at context index j = m - 1 - best_p; its continuation has best_p tokens.
    count = min(want, best_p)
    first = end - best_p  # = start + j + 1
    for t in range(count):
        drafts_row[t] = row[first + t]
    return count, best_len


def _search_batch_parallel(
    token_ids: np.ndarray,  # [B, L] int64
    starts: np.ndarray,  # [B] int64
    ends: np.ndarray,  # [B] int64
    num_tokens: np.ndarray,  # [B] int64
    min_n: int,
    max_n: int,
    k: int,
    drafts: np.ndarray,  # [B, k] int64, -1 filled
    counts: np.ndarray,  # [B] int64, zero filled
    match_lengths: np.ndarray,  # [B] int64, zero filled
    z_scratch: np.ndarray,  # [B, max_n] int64
) -> None:
    """All rows, one per `prange` iteration (compiled with parallel=True)."""
    for i in _prange(token_ids.shape[0]):
        want = min(num_tokens[i], k)
        counts[i], match_lengths[i] = _search_row(
            token_ids[i], starts[i], ends[i], want, min_n, max_n, drafts[i], z_scratch[i]
        )


def _search_batch_serial(
    token_ids: np.ndarray,  # [B, L] int64
    starts: np.ndarray,  # [B] int64
    ends: np.ndarray,  # [B] int64
    num_tokens: np.ndarray,  # [B] int64
    min_n: int,
    max_n: int,
    k: int,
    drafts: np.ndarray,  # [B, k] int64, -1 filled
    counts: np.ndarray,  # [B] int64, zero filled
    match_lengths: np.ndarray,  # [B] int64, zero filled
    z_scratch: np.ndarray,  # [B, max_n] int64
) -> None:
    """All rows in one thread: no thread-pool wake-up, for small batches."""
    for i in range(token_ids.shape[0]):
        want = min(num_tokens[i], k)
        counts[i], match_lengths[i] = _search_row(
            token_ids[i], starts[i], ends[i], want, min_n, max_n, drafts[i], z_scratch[i]
        )


# The kernels above are plain Python until `_get_kernels` jit-compiles them; it rebinds `_search_row` and
# `_prange` in this module's globals first, which is where numba resolves the names the batch kernels call.
_prange: Callable[..., Any] = range
_kernels: tuple[Callable[..., None], Callable[..., None]] | None = None
_compile_lock = threading.Lock()
_pool_started = False  # whether numba's thread pool was launched by a parallel call of ours
#: `parallel=None` runs batches with at least this many context tokens (and more than one row) on numba's
#: thread pool, smaller ones on the calling thread. The serial scan does ~0.3-0.5 ns/token (64 rows x 32k tokens
#: in well under 1 ms), while waking the pool costs tens of microseconds, and milliseconds when the cores are
#: oversubscribed (e.g. by torch's own threads), so only very large batches default to parallel.
PARALLEL_MIN_TOKENS = 1 << 22


def _get_kernels() -> tuple[Callable[..., None], Callable[..., None]]:
    """Import numba and wrap the kernels on first use (thread-safe); returns (serial, parallel)."""
    global _kernels, _prange, _search_row
    if _kernels is None:
        with _compile_lock:
            if _kernels is None:
                try:
                    import numba
                except ImportError as err:  # pragma: no cover - numba is a dependency
                    raise ImportError(
                        "hf_specdec's n-gram proposer needs numba for its search kernel; install it with "
                        "`pip install numba` (or use `ngram_search_reference`, which is pure Python and slow)."
                    ) from err
                _search_row = numba.njit(nogil=True, cache=True)(_search_row)
                _prange = numba.prange
                _kernels = (
                    numba.njit(nogil=True, cache=True)(_search_batch_serial),
                    numba.njit(parallel=True, nogil=True, cache=True)(_search_batch_parallel),
                )
    return _kernels


def check_sizes(min_n: int, max_n: int, k: int) -> None:
    """The n-gram sizes and the draft count every matcher takes (this numba one and `ngram_device`'s)."""
    if int(min_n) < 1:
        raise ValueError(f"`min_n` must be >= 1, got {min_n}; pass min_n=1 to allow single-token matches.")
    if int(max_n) < int(min_n):
        raise ValueError(
            f"`max_n` must be >= `min_n`, got max_n={max_n} and min_n={min_n}; raise max_n or lower min_n."
        )
    if int(k) < 0:
        raise ValueError(f"`k` (the number of draft slots) must be >= 0, got {k}.")


def _validate(
    token_ids: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    num_tokens: np.ndarray,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Check arguments and return contiguous int64 copies/views of the arrays."""
    check_sizes(min_n, max_n, k)
    token_ids = np.ascontiguousarray(token_ids, dtype=np.int64)
    if token_ids.ndim != 2:
        raise ValueError(
            f"`token_ids` must be 2-D [batch, length], got shape {token_ids.shape}; "
            "use token_ids[None] for a single sequence."
        )
    batch_size, length = token_ids.shape
    arrays = []
    for name, arr in (("starts", starts), ("ends", ends), ("num_tokens", num_tokens)):
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        if arr.shape != (batch_size,):
            raise ValueError(
                f"`{name}` must have shape ({batch_size},) to match token_ids {token_ids.shape}, got {arr.shape}."
            )
        arrays.append(arr)
    starts, ends, num_tokens = arrays
    bad = (starts < 0) | (ends < starts) | (ends > length) | (num_tokens < 0)  # [B]
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(
            f"Need 0 <= starts[i] <= ends[i] <= {length} (token_ids width) and num_tokens[i] >= 0; row {i} has "
            f"starts={int(starts[i])}, ends={int(ends[i])}, num_tokens={int(num_tokens[i])}."
        )
    return token_ids, starts, ends, num_tokens


def ngram_search(
    token_ids: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    num_tokens: np.ndarray,
    min_n: int,
    max_n: int,
    k: int,
    parallel: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """
    Prompt-lookup drafts for a batch of rows (numba kernel, rows in parallel for big batches).

    Row i's context is `c = token_ids[i, starts[i]:ends[i]]`. The kernel finds the largest n in
    [min_n, max_n] such that the last n tokens `c[-n:]` also occur ending at an earlier index
    j < len(c) - 1, takes the most recent such occurrence (largest j), and proposes
    `c[j + 1 : j + 1 + min(num_tokens[i], k)]` (shorter when the context ends first).

    Args:
        token_ids (`np.ndarray` of shape `(B, L)`, int64):
            Token buffer; anything outside `[starts[i], ends[i])` (e.g. left padding) is ignored.
        starts (`np.ndarray` of shape `(B,)`, int64):
            First context position of each row (its left padding length).
        ends (`np.ndarray` of shape `(B,)`, int64):
            One past the last context position of each row.
        num_tokens (`np.ndarray` of shape `(B,)`, int64):
            Maximum drafts wanted for each row (0 disables the row).
        min_n (`int`): Smallest n-gram to match (>= 1).
        max_n (`int`): Largest n-gram to match (>= min_n).
        k (`int`): Width of the returned draft array.
        parallel (`bool`, *optional*):
            Run rows on numba's thread pool (`True`) or on the calling thread (`False`). Defaults to parallel
            when the batch holds at least `PARALLEL_MIN_TOKENS` context tokens.

    Returns:
        `tuple[np.ndarray, np.ndarray, np.ndarray]`: `drafts` of shape `(B, k)` int64 padded with -1, `counts` of
        shape `(B,)` int64 (valid drafts per row, 0 when nothing matched), and `match_lengths` of shape `(B,)`
        int64 (the n of the n-gram that matched, 0 for rows without drafts): longer matches are accepted more
        often, which the adaptive schedule uses.
    """
    token_ids, starts, ends, num_tokens = _validate(token_ids, starts, ends, num_tokens, min_n, max_n, k)
    batch_size = token_ids.shape[0]
    drafts = np.full((batch_size, int(k)), -1, dtype=np.int64)  # [B, k]
    counts = np.zeros(batch_size, dtype=np.int64)  # [B]
    match_lengths = np.zeros(batch_size, dtype=np.int64)  # [B]
    if batch_size == 0 or k == 0:
        return drafts, counts, match_lengths
    z_scratch = np.empty((batch_size, int(max_n)), dtype=np.int64)  # [B, max_n]
    serial_kernel, parallel_kernel = _get_kernels()
    if parallel is None:
        parallel = batch_size > 1 and int((ends - starts).sum()) >= PARALLEL_MIN_TOKENS
    args = (
        token_ids,
        starts,
        ends,
        num_tokens,
        int(min_n),
        int(max_n),
        int(k),
        drafts,
        counts,
        match_lengths,
        z_scratch,
    )
    if not parallel:
        serial_kernel(*args)
    else:
        _run_parallel(parallel_kernel, args)
    return drafts, counts, match_lengths


def _run_parallel(kernel: Callable[..., None], args: tuple) -> None:
    """Run the parallel kernel; the first time, undo the side effect of launching numba's OpenMP pool.

    Launching the pool sets the OpenMP thread count of the calling thread, which torch shares when both use
    the same libgomp: `torch.get_num_threads()` would silently change to numba's thread count.
    """
    global _pool_started
    if _pool_started:
        kernel(*args)
        return
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    try:
        kernel(*args)
    finally:
        _pool_started = True
        if torch is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def ngram_search_reference(
    token_ids: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    num_tokens: np.ndarray,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """
    Pure-Python, obviously-correct version of [`ngram_search`] with identical semantics (for tests).

    Brute force: for n from the largest down, scan j from the most recent down; O(len * max_n * n) per row.
    """
    token_ids, starts, ends, num_tokens = _validate(token_ids, starts, ends, num_tokens, min_n, max_n, k)
    batch_size = token_ids.shape[0]
    drafts = np.full((batch_size, int(k)), -1, dtype=np.int64)  # [B, k]
    counts = np.zeros(batch_size, dtype=np.int64)  # [B]
    match_lengths = np.zeros(batch_size, dtype=np.int64)  # [B]
    for i in range(batch_size):
        c = token_ids[i, starts[i] : ends[i]].tolist()
        m = len(c)
        want = min(int(num_tokens[i]), int(k))
        if want <= 0:
            continue
        for n in range(min(max_n, m - 1), min_n - 1, -1):
            suffix = c[m - n :]
            match = next((j for j in range(m - 2, n - 2, -1) if c[j - n + 1 : j + 1] == suffix), None)
            if match is not None:
                cont = c[match + 1 : match + 1 + want]
                drafts[i, : len(cont)] = cont
                counts[i] = len(cont)
                match_lengths[i] = n if cont else 0
                break
    return drafts, counts, match_lengths
