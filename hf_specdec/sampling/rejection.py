"""The rejection sampler: target logits + draft tokens → accepted, recovered and bonus tokens.

Glossary (these words are used in every name of this package):
    draft      — a token proposed by a proposer (draft model, n-gram, MTP head) for one step.
    target     — the model whose distribution we must reproduce exactly.
    accepted   — a draft token kept after verification against the target.
    recovered  — the token emitted at the first rejected position, sampled from the residual
                 max(p - q, 0) (greedy: the target argmax there).
    bonus      — the token emitted after the last draft when every draft of the row was accepted,
                 sampled from the target at that position.

Contract of `rejection_sample` (the torch reference in `reference.py` and the Triton kernels in
`kernels.py` implement exactly this; with the same random draws they return the same ids):

Inputs, for a batch of B rows, k = draft_token_ids.shape[1], V = vocabulary size:
    target_logits     [B, k+1, V] float (fp32/fp16/bf16): the target's scores at each verified
                      position, after the logits processors (temperature already applied when
                      `temperature` is None).
    draft_token_ids   [B, k] int64: row i's drafts are draft_token_ids[i, :num_draft_tokens[i]];
                      entries past that are -1 and are never read. A draft id < 0 or >= V inside
                      the row's drafts is treated as rejected (never used as an index).
    num_draft_tokens  [B] int64 in 0..k (ragged).
    draft_probs       [B, k, V] float or None. None means one-hot drafts (n-gram, argmax drafts):
                      q(d) = 1 for the drafted token and 0 elsewhere.
    is_greedy         [B] bool: greedy rows ignore the random draws.
    uniforms          [B, k] float32 in [0, 1): one draw per draft position.
    exponentials      [B, V] float32, > 0: Exp(1) draws, one vector per row (a row emits at most
                      one recovered-or-bonus token per step, so one vector suffices).
    temperature       [B] float32 or None: when given, p = softmax(target_logits / temperature).

Per row i with n = num_draft_tokens[i], p_j = softmax(target_logits[i, j]) in fp32, q_j the draft
distribution at j, d_j the draft:
    greedy rows: t_j = argmax_v target_logits[i, j] (lowest id on ties). For j = 0..n-1: if
        d_j == t_j, emit d_j (accepted) and go on; else emit t_j (recovered) and stop. If all n
        were accepted, emit t_n (bonus).
    random rows: for j = 0..n-1: accept d_j iff q_j(d_j) > 0 and p_j(d_j) > uniforms[i, j] * q_j(d_j)
        (so acceptance has probability min(1, p/q) and a token with p = 0 is never accepted).
        On the first rejection at j emit the recovered token
            argmax_v r(v) / exponentials[i, v],  r = max(p_j - q_j, 0)
        (one-hot mode: r = p_j with r(d_j) = 0), falling back to r = p_j when r is all zero; stop.
        If all n were accepted, emit the bonus token argmax_v p_n(v) / exponentials[i, v].
        Ties go to the lowest id.
Output: output_token_ids [B, k+1] int64: the accepted drafts, then exactly one recovered or bonus
token, then -1. The number of accepted drafts of row i is (output_token_ids[i] >= 0).sum() - 1.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from hf_specdec.sampling.reference import rejection_sample_reference

SAMPLER_ENV = "HF_SPECDEC_SAMPLER"
SAMPLERS = ("triton", "torch")


@functools.cache
def is_triton_available() -> bool:
    """Whether `triton` can be imported (the kernels in `kernels.py` need it)."""
    return importlib.util.find_spec("triton") is not None


def rejection_sample(
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
    """Run the rejection sampler on the best backend for these tensors (see the module docstring). The torch
    sampler reads the device on the host unless told: `check_values=False` skips its check of the draft counts,
    `all_greedy` says whether every row is greedy (the Triton sampler reads nothing)."""
    args = (target_logits, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, uniforms, exponentials)
    forced = os.environ.get(SAMPLER_ENV, "").strip().lower()
    if forced not in ("", *SAMPLERS):
        raise ValueError(
            f"{SAMPLER_ENV}={os.environ[SAMPLER_ENV]!r} is not a sampler; allowed values are {', '.join(SAMPLERS)} "
            "(or leave it unset: Triton for CUDA tensors when triton is importable, else torch)."
        )
    if forced == "triton" and not is_triton_available():
        raise RuntimeError(f"{SAMPLER_ENV}=triton but triton is not importable; install triton or unset {SAMPLER_ENV}.")
    use_triton = forced == "triton" or (forced == "" and target_logits.is_cuda and is_triton_available())
    if use_triton:
        from hf_specdec.sampling.kernels import rejection_sample_triton  # imports triton: only when used

        return rejection_sample_triton(*args, temperature)
    return rejection_sample_reference(*args, temperature, check_values=check_values, all_greedy=all_greedy)
