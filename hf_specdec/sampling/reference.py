"""The torch reference of `rejection_sample`: the executable form of the contract in `rejection.py`.

It owns the exact semantics (accept test, residual, tie-breaking, invalid drafts, output layout) that the Triton
kernels must match id for id given the same random draws. It is fully vectorised over rows and draft positions
(no Python loop), does its math in float32 whatever the input dtype, and works for any B, k = 0 and V = 1.
"""

from __future__ import annotations

import torch

__all__ = ["num_accepted_from_output", "rejection_sample_reference"]


def _describe(x: object) -> str:
    return f"shape {tuple(x.shape)} dtype {x.dtype}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def _validate(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    temperature: torch.Tensor | None,
    check_values: bool = True,
) -> None:
    """Raise a ValueError naming the first input whose type, shape, dtype or values break the contract."""
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3 or not target_logits.is_floating_point():
        raise ValueError(
            f"`target_logits` must be a float tensor [B, k+1, V], got {_describe(target_logits)}; "
            "pass the target's scores at the k drafted positions plus the bonus position."
        )
    B, k1, V = target_logits.shape
    k = k1 - 1
    if k < 0 or V < 1:
        raise ValueError(f"`target_logits` must have k+1 >= 1 positions and V >= 1 columns, got shape {(B, k1, V)}.")

    def check(name: str, x: object, shape: tuple[int, ...], kind: str, hint: str) -> None:
        ok_type = isinstance(x, torch.Tensor) and (
            (kind == "int64" and x.dtype == torch.int64)
            or (kind == "bool" and x.dtype == torch.bool)
            or (kind == "float" and x.is_floating_point())
        )
        if not ok_type or tuple(x.shape) != shape:
            raise ValueError(
                f"`{name}` must be a {kind} tensor of shape {list(shape)} ({hint}) to match target_logits of shape "
                f"{[B, k1, V]}, got {_describe(x)}."
            )
        if x.device != target_logits.device:
            raise ValueError(f"`{name}` is on {x.device} but `target_logits` is on {target_logits.device}.")

    check("draft_token_ids", draft_token_ids, (B, k), "int64", "[B, k], -1 past each row's drafts")
    check("num_draft_tokens", num_draft_tokens, (B,), "int64", "[B], values in 0..k")
    if draft_probs is not None:
        check("draft_probs", draft_probs, (B, k, V), "float", "[B, k, V], or None for one-hot drafts")
    check("is_greedy", is_greedy, (B,), "bool", "[B]")
    check("uniforms", uniforms, (B, k), "float", "[B, k], e.g. random.uniform(seeds, step, STREAM_ACCEPT, k)")
    check("exponentials", exponentials, (B, V), "float", "[B, V], e.g. random.exponential(seeds, step, 1, V)")
    if temperature is not None:
        check("temperature", temperature, (B,), "float", "[B], or None when already applied to the logits")
    if check_values and B > 0 and bool(((num_draft_tokens < 0) | (num_draft_tokens > k)).any()):
        bad = num_draft_tokens[(num_draft_tokens < 0) | (num_draft_tokens > k)]
        raise ValueError(f"`num_draft_tokens` values must be in 0..k = 0..{k}, got {bad.tolist()[:8]}.")


def rejection_sample_reference(
    target_logits: torch.Tensor,  # [B, k+1, V]
    draft_token_ids: torch.Tensor,  # [B, k]
    num_draft_tokens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    is_greedy: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, k]
    exponentials: torch.Tensor,  # [B, V]
    temperature: torch.Tensor | None = None,  # [B]
    check_values: bool = True,
    all_greedy: bool | None = None,
) -> torch.Tensor:  # [B, k+1]
    """
    Verifies a batch of drafts against the target and returns the emitted tokens (torch reference implementation).

    The semantics are the contract in the module docstring of `hf_specdec.sampling.rejection`: per row, the
    drafts are accepted left to right while `q(d) > 0 and p(d) > u * q(d)` (greedy: while `d == argmax logits`);
    the first rejected position emits a recovered token `argmax r / exponentials` with `r = max(p - q, 0)`
    (falling back to `p` when `r` is all zero), and a row whose drafts were all accepted emits a bonus token
    `argmax p / exponentials` at position `n`. Ties go to the lowest id. Greedy rows never read the random draws.

    Args:
        target_logits (`torch.Tensor` of shape `(B, k+1, V)`, float32/float16/bfloat16):
            The target's processed scores at each verified position (temperature applied unless `temperature`).
        draft_token_ids (`torch.Tensor` of shape `(B, k)`, int64):
            The drafts; entries at or past `num_draft_tokens[i]` are never read. Ids outside `[0, V)` are rejected.
        num_draft_tokens (`torch.Tensor` of shape `(B,)`, int64):
            Number of drafts of each row, in `0..k`.
        draft_probs (`torch.Tensor` of shape `(B, k, V)`, *optional*):
            The draft distributions `q`. `None` means one-hot drafts (`q(d) = 1`).
        is_greedy (`torch.Tensor` of shape `(B,)`, bool):
            Rows decoded greedily.
        uniforms (`torch.Tensor` of shape `(B, k)`, float32):
            Accept-test draws in [0, 1), see `hf_specdec.sampling.random.uniform`.
        exponentials (`torch.Tensor` of shape `(B, V)`, float32):
            Exp(1) draws (> 0) for the recovered or bonus token, see `hf_specdec.sampling.random.exponential`.
        temperature (`torch.Tensor` of shape `(B,)`, *optional*):
            When given, `p = softmax(target_logits / temperature)`; ignored by greedy rows.
        check_values (`bool`, *optional*, defaults to True):
            Also check that every `num_draft_tokens` is in 0..k (a host read of the device: the decoding loop, whose
            counts are in range by construction and whose steps may be captured as CUDA graphs, skips it).
        all_greedy (`bool`, *optional*):
            Whether every row is greedy, when the caller knows it on the host; None reads `is_greedy` (a host read).

    Returns:
        `torch.Tensor` of shape `(B, k+1)`, int64: the accepted drafts, then one recovered or bonus token, then -1.
    """
    _validate(
        target_logits,
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        is_greedy,
        uniforms,
        exponentials,
        temperature,
        check_values,
    )
    B, k1, V = target_logits.shape
    k = k1 - 1
    device = target_logits.device

    logits = target_logits.float()  # [B, k+1, V]
    target_argmax = logits.argmax(dim=-1)  # [B, k+1] greedy targets: first maximal id on ties
    if B > 0 and (bool(is_greedy.all()) if all_greedy is None else all_greedy):
        return _greedy_only(draft_token_ids, num_draft_tokens, target_argmax)
    if temperature is not None:
        # Greedy rows may carry temperature 0: divide them by 1 instead (their probabilities are never used).
        temp = torch.where(is_greedy, torch.ones_like(temperature), temperature).float()  # [B]
        logits = logits / temp[:, None, None]  # [B, k+1, V]
    probs = torch.softmax(logits, dim=-1)  # [B, k+1, V] p_j, fp32

    positions = torch.arange(k, device=device)  # [k]
    in_row = positions[None, :] < num_draft_tokens[:, None]  # [B, k] drafts of the row
    valid = in_row & (draft_token_ids >= 0) & (draft_token_ids < V)  # [B, k] drafts usable as an index
    safe_ids = draft_token_ids.clamp(0, V - 1)  # [B, k] never index with an invalid id; masked by `valid`

    # Accept test, at every draft position at once (only the prefix up to the first rejection matters).
    greedy_accept = valid & (draft_token_ids == target_argmax[:, :k])  # [B, k]
    p_draft = probs[:, :k].gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, k] p_j(d_j)
    q_probs = None if draft_probs is None else draft_probs.float()  # [B, k, V]
    if q_probs is None:
        q_draft = torch.ones_like(p_draft)  # [B, k] one-hot: q_j(d_j) = 1
    else:
        q_draft = q_probs.gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, k] q_j(d_j)
    random_accept = valid & (q_draft > 0) & (p_draft > uniforms.float() * q_draft)  # [B, k]
    accept = torch.where(is_greedy[:, None], greedy_accept, random_accept)  # [B, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix, in 0..n

    # One recovered-or-bonus token per row, at position j = num_accepted (j == n means every draft was accepted).
    rejected = num_accepted < num_draft_tokens  # [B] True: recovered at j, False: bonus at j = n
    gather_index = num_accepted[:, None, None].expand(B, 1, V)  # [B, 1, V]
    p_at = probs.gather(1, gather_index).squeeze(1)  # [B, V] p_j
    if q_probs is None:
        # One-hot residual: p_j with the rejected draft's entry zeroed (nothing to zero for an invalid id or a bonus).
        d_at = torch.zeros(B, dtype=torch.long, device=device)  # [B] the rejected draft (0 where there is none)
        zero_draft = torch.zeros(B, dtype=torch.bool, device=device)  # [B] whether to zero r(d_j)
        if k > 0:
            row_ids = torch.arange(B, device=device)  # [B]
            j_safe = num_accepted.clamp(max=k - 1)  # [B] a readable draft position (only used where rejected)
            d_at = safe_ids[row_ids, j_safe]  # [B]
            zero_draft = rejected & valid[row_ids, j_safe]  # [B]
        vocab = torch.arange(V, device=device)  # [V]
        residual = torch.where(zero_draft[:, None] & (vocab[None, :] == d_at[:, None]), 0.0, p_at)  # [B, V]
    else:
        q_padded = torch.nn.functional.pad(q_probs, (0, 0, 0, 1))  # [B, k+1, V] a zero row makes j = k readable
        q_at = q_padded.gather(1, gather_index).squeeze(1)  # [B, V] q_j
        q_at = torch.where(rejected[:, None], q_at, 0.0)  # [B, V] a bonus (j = n, maybe < k) has q = 0: r = p_n
        residual = (p_at - q_at).clamp_min(0.0)  # [B, V] max(p_j - q_j, 0)
    residual = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, p_at)  # [B, V] all-zero falls back
    sampled = (residual / exponentials.float()).argmax(dim=-1)  # [B] exponential race: first maximal id on ties
    greedy_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [B] t_j
    final_token = torch.where(is_greedy, greedy_token, sampled)  # [B]

    # Layout: accepted drafts, then the final token, then -1.
    out_positions = torch.arange(k1, device=device)  # [k+1]
    drafts_padded = torch.nn.functional.pad(safe_ids, (0, 1), value=-1)  # [B, k+1]
    output = torch.where(out_positions[None, :] < num_accepted[:, None], drafts_padded, -1)  # [B, k+1]
    output = torch.where(out_positions[None, :] == num_accepted[:, None], final_token[:, None], output)  # [B, k+1]
    return output


def _greedy_only(
    draft_token_ids: torch.Tensor,  # [B, k]
    num_draft_tokens: torch.Tensor,  # [B]
    target_argmax: torch.Tensor,  # [B, k+1]
) -> torch.Tensor:  # [B, k+1]
    """The all-greedy batch without any softmax: accept while d_j == t_j, then emit t at the stop position."""
    k = draft_token_ids.shape[1]
    positions = torch.arange(k + 1, device=target_argmax.device)  # [k+1]
    in_row = positions[None, :k] < num_draft_tokens[:, None]  # [B, k]
    accept = in_row & (draft_token_ids == target_argmax[:, :k])  # [B, k] (an id outside [0, V) never matches)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    output = torch.where(positions[None, :] <= num_accepted[:, None], target_argmax, -1)  # [B, k+1]
    return output


def num_accepted_from_output(output_token_ids: torch.Tensor) -> torch.Tensor:  # [B]
    """
    Counts the accepted drafts of each row from the output of `rejection_sample`.

    Args:
        output_token_ids (`torch.Tensor` of shape `(B, k+1)`, int64):
            The accepted drafts, then one recovered or bonus token, then -1.

    Returns:
        `torch.Tensor` of shape `(B,)`, int64: `(output_token_ids >= 0).sum(-1) - 1`.
    """
    if not isinstance(output_token_ids, torch.Tensor) or output_token_ids.dim() != 2:
        raise ValueError(f"`output_token_ids` must be a [B, k+1] int64 tensor, got {_describe(output_token_ids)}.")
    return (output_token_ids >= 0).sum(dim=-1) - 1  # [B]
