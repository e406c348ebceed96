"""Prompt-lookup n-gram search on the device: batched, fixed shapes, no host read (CUDA-graph capturable).

`ngram_search_device` returns exactly what the numba kernel `hf_specdec.proposers.ngram_search.ngram_search`
returns (largest n in [min_n, max_n] first, most recent occurrence, drafts cut where the context ends), but from
device tensors and in pure torch: every candidate end position of every row is compared at once, one shifted
window per n-gram offset, and one max-reduction picks the best (n, position) per row. Its cost is O(B * C * max_n)
elementwise work whatever the data, with no data-dependent shape, so a static-cache step that drafts with it can
be captured whole as one CUDA graph (`hf_specdec.step_graph`).
"""

from __future__ import annotations

import torch

from hf_specdec.proposers.ngram_search import check_sizes

__all__ = ["ngram_search_device"]


def ngram_search_device(
    token_ids: torch.Tensor,  # [B, C] int: the token buffer (padding, context, scratch)
    starts: torch.Tensor,  # [B] int: first context position of each row (its left padding)
    ends: torch.Tensor,  # [B] int: one past the last context position of each row
    num_tokens: torch.Tensor,  # [B] int: most drafts wanted per row (0 or less disables the row)
    min_n: int,
    max_n: int,
    k: int,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Prompt-lookup drafts for a batch of rows, on the tensors' device, without reading anything back to the host.

    Row i's context is `c = token_ids[i, starts[i]:ends[i]]`. The search finds the largest n in [min_n, max_n]
    such that the last n tokens `c[-n:]` also occur ending at an earlier index j < len(c) - 1, takes the most
    recent such occurrence (largest j), and proposes `c[j + 1 : j + 1 + min(num_tokens[i], k)]` (shorter when the
    context ends first). Same contract as [`ngram_search`], which the tests hold it to.

    Args:
        token_ids (`torch.Tensor` of shape `(B, C)`, integer):
            Token buffer; anything outside `[starts[i], ends[i])` (left padding, scratch) is ignored.
        starts (`torch.Tensor` of shape `(B,)`, integer): First context position of each row.
        ends (`torch.Tensor` of shape `(B,)`, integer): One past the last context position of each row.
        num_tokens (`torch.Tensor` of shape `(B,)`, integer): Most drafts wanted per row (0 disables the row).
        min_n (`int`): Smallest n-gram to match (>= 1).
        max_n (`int`): Largest n-gram to match (>= min_n).
        k (`int`): Width of the returned draft tensor (>= 0).
        validate (`bool`, *optional*, defaults to `False`):
            Also check `0 <= starts <= ends <= C` and `num_tokens >= 0` row by row, which reads the tensors on
            the host (a sync: never inside a captured step). Without it, rows out of those bounds give
            unspecified drafts but never an out-of-range index.

    Returns:
        `tuple[torch.Tensor, torch.Tensor, torch.Tensor]` on `token_ids.device`, int64: `drafts` of shape `(B, k)`
        padded with -1, `counts` of shape `(B,)` (valid drafts per row, 0 when nothing matched), and
        `match_lengths` of shape `(B,)` (the n of the matched n-gram, 0 for rows without drafts).
    """
    _check(token_ids, starts, ends, num_tokens, min_n, max_n, k, validate)
    batch_size, capacity = token_ids.shape
    device = token_ids.device
    drafts = torch.full((batch_size, k), -1, dtype=torch.long, device=device)  # [B, k]
    counts = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
    if batch_size == 0 or capacity == 0 or k == 0:
        return drafts, counts, counts.clone()
    starts, ends = starts.long().to(device), ends.long().to(device)  # [B]
    want = num_tokens.long().to(device).clamp(min=0, max=k)  # [B]
    positions = torch.arange(capacity, device=device)  # [C] q: where an earlier occurrence would end
    # Outside the context (padding, scratch) a token is -1 and a suffix token past the context's start -2: a
    # window that reaches out of the context never matches there.
    in_context = (positions >= starts[:, None]) & (positions < ends[:, None])  # [B, C]
    tokens = torch.where(in_context, token_ids.long(), -1)  # [B, C]
    offsets = torch.arange(max_n, device=device)  # [max_n]
    suffix = tokens.gather(1, (ends[:, None] - 1 - offsets).clamp(min=0, max=capacity - 1))  # [B, max_n] c[-1 - i]
    suffix = torch.where(offsets < (ends - starts)[:, None], suffix, -2)  # [B, max_n]

    # run[b, q] after offset i: the tokens ending at q repeat the suffix's last i + 1 tokens; run_length[b, q]
    # counts the offsets that did (the n of the longest n-gram ending at q, up to max_n). An occurrence must end
    # before the context's last token (at least one token follows it): q <= ends - 2.
    # Small integer types throughout (0/1 and 0..max_n): half to an eighth of the memory traffic of int64.
    small = torch.uint8 if max_n < 256 else torch.int32
    run = (in_context & (positions <= ends[:, None] - 2)).to(small)  # [B, C] 0/1
    run_length = torch.zeros(batch_size, capacity, dtype=small, device=device)  # [B, C]
    for i in range(min(max_n, capacity)):  # offsets past the buffer's width match nowhere
        if i:
            run[:, :i] = False  # q < i: the window would start before the buffer
        run[:, i:].bitwise_and_(tokens[:, : capacity - i] == suffix[:, i, None])  # token q - i vs c[-1 - i], q >= i
        run_length += run

    # One reduction for both choices: the largest n first, then the most recent q (n * C + q is monotone in both).
    key_dtype = torch.int32 if (max_n + 1) * capacity < 2**31 else torch.long
    key = run_length.to(key_dtype) * capacity + positions.to(key_dtype)  # [B, C]
    key = key.masked_fill_(run_length < min_n, -1)  # [B, C]
    best = key.max(dim=1).values.long()  # [B] -1 without a match
    found = (best >= 0) & (want > 0)  # [B]
    match_end = best.clamp(min=0) % capacity  # [B] q of the chosen occurrence
    counts = torch.where(found, torch.minimum(want, ends - 1 - match_end), 0)  # [B] the context may end first
    match_lengths = torch.where(found, best.clamp(min=0) // capacity, 0)  # [B]
    slots = torch.arange(k, device=device)  # [k]
    follow = token_ids.long().gather(1, (match_end[:, None] + 1 + slots).clamp(max=capacity - 1))  # [B, k]
    drafts = torch.where(slots < counts[:, None], follow, -1)  # [B, k]
    return drafts, counts, match_lengths


def _check(
    token_ids: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    num_tokens: torch.Tensor,
    min_n: int,
    max_n: int,
    k: int,
    validate: bool,
) -> None:
    """Argument checks that read shapes and dtypes only (no sync), plus the value checks of `validate=True`."""
    check_sizes(min_n, max_n, k)
    if token_ids.dim() != 2:
        raise ValueError(
            f"`token_ids` must be 2-D [batch, length], got shape {tuple(token_ids.shape)}; "
            "use token_ids[None] for a single sequence."
        )
    batch_size = token_ids.shape[0]
    for name, tensor in (("token_ids", token_ids), ("starts", starts), ("ends", ends), ("num_tokens", num_tokens)):
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise TypeError(f"`{name}` must hold integers (token ids, positions, counts), got {tensor.dtype}.")
        if name != "token_ids" and tuple(tensor.shape) != (batch_size,):
            raise ValueError(
                f"`{name}` must have shape ({batch_size},) to match token_ids {tuple(token_ids.shape)}, "
                f"got {tuple(tensor.shape)}."
            )
    if not validate:
        return
    length = token_ids.shape[1]
    bad = (starts < 0) | (ends < starts) | (ends > length) | (num_tokens < 0)  # [B]
    if bool(bad.any()):
        i = int(bad.long().argmax())
        raise ValueError(
            f"Need 0 <= starts[i] <= ends[i] <= {length} (token_ids width) and num_tokens[i] >= 0; row {i} has "
            f"starts={int(starts[i])}, ends={int(ends[i])}, num_tokens={int(num_tokens[i])}."
        )
