"""Triton kernels of the rejection sampler (the contract is the docstring of `rejection.py`).

Three launches; no [B, k+1, V] probability tensor is ever materialised:
  1. `_stats_kernel`    grid (B*(k+1), S1): per (row, position, vocab chunk) the running max and
     sum of exp of logits/temperature (random rows) or the max logit and its lowest id (greedy rows).
  2. `_race_kernel`     grid (B, S2): every program merges the chunk partials, runs the accept tests
     and finds the row's stop position (first rejection, else the bonus position); split 0 writes the
     accepted drafts and the -1 tail; random rows then race argmax r/e over one vocab chunk of it.
  3. `_finalize_kernel` grid (B,): merges the race partials and writes the recovered/bonus token.
`rejection_sample_triton` launches them; on CPU tensors it runs them in the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit(do_not_specialize=["B", "K1", "S1"])
def _stats_kernel(
    logits_ptr,  # [B, K+1, V] fp32/fp16/bf16, contiguous
    num_draft_ptr,  # [B] int64
    greedy_ptr,  # [B] bool
    temp_ptr,  # [B] fp32 (read only when HAS_TEMP)
    part_m_ptr,  # [B, K+1, S1] fp32: max of logits/T (random rows) or of logits (greedy rows)
    part_s_ptr,  # [B, K+1, S1] fp32: sum of exp(logits/T - max) (random rows)
    part_i_ptr,  # [B, K+1, S1] int32: lowest id of the max logit (greedy rows)
    B,
    V,
    K1,
    S1,
    CHUNK,
    HAS_TEMP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)  # row block * K1 + position
    sp = tl.program_id(1)  # vocab chunk
    pos = pid % K1
    rows = (pid // K1) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    in_b = rows < B
    n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + rows, mask=in_b, other=0).to(tl.int32), 0), K1 - 1)
    live = in_b & (pos <= n)  # positions past a row's bonus position are never read
    greedy = tl.load(greedy_ptr + rows, mask=in_b, other=0) != 0
    live_g = live & greedy
    live_r = live & (greedy == 0)
    base = (rows * K1 + pos).to(tl.int64)[:, None] * V  # [ROWS, 1]
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, V)
    out = (rows * K1 + pos) * S1 + sp  # [ROWS]
    lanes = tl.arange(0, BLOCK)
    if tl.max(live_g.to(tl.int32), 0) > 0:
        best = tl.full([ROWS], -float("inf"), tl.float32)
        best_i = tl.full([ROWS], 0, tl.int32) + start
        for off in range(start, end, BLOCK):
            offs = off + lanes  # [BLOCK]
            msk = live_g[:, None] & (offs < end)[None, :]
            x = tl.load(logits_ptr + base + offs[None, :], mask=msk, other=-float("inf")).to(tl.float32)
            t_max = tl.max(x, 1)
            t_idx = tl.min(tl.where(x == t_max[:, None], offs[None, :], 2147483647), 1)
            better = t_max > best  # strict: the earlier (lower) id keeps a tie
            best_i = tl.where(better, t_idx, best_i)
            best = tl.where(better, t_max, best)
        tl.store(part_m_ptr + out, best, mask=live_g)
        tl.store(part_i_ptr + out, best_i, mask=live_g)
    if tl.max(live_r.to(tl.int32), 0) > 0:
        if HAS_TEMP:
            temp = tl.load(temp_ptr + rows, mask=live_r, other=1.0)[:, None]
        m = tl.full([ROWS], -float("inf"), tl.float32)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            offs = off + lanes
            msk = live_r[:, None] & (offs < end)[None, :]
            x = tl.load(logits_ptr + base + offs[None, :], mask=msk, other=-float("inf")).to(tl.float32)
            if HAS_TEMP:
                x = x / temp
            m_new = tl.maximum(m, tl.max(x, 1))
            finite = m_new > -float("inf")  # all -inf so far: the sum stays 0 (no inf - inf)
            m_ref = tl.where(finite, m_new, 0.0)
            scale = tl.where(finite, tl.exp(m - m_ref), 0.0)
            acc = acc * scale[:, None] + tl.exp(x - m_ref[:, None])
            m = m_new
        tl.store(part_m_ptr + out, m, mask=live_r)
        tl.store(part_s_ptr + out, tl.sum(acc, 1), mask=live_r)


@triton.jit(do_not_specialize=["B", "K", "S1", "S2"])
def _race_kernel(
    logits_ptr,  # [B, K+1, V]
    draft_ids_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    draft_probs_ptr,  # [B, K, V] (read only when HAS_PROBS)
    greedy_ptr,  # [B] bool
    unif_ptr,  # [B, K] fp32
    expo_ptr,  # [B, V] fp32
    temp_ptr,  # [B] fp32 (read only when HAS_TEMP)
    part_m_ptr,  # [B, K+1, S1] fp32
    part_s_ptr,  # [B, K+1, S1] fp32
    part_i_ptr,  # [B, K+1, S1] int32
    race_ptr,  # [B, S2, 3] fp32: best r/e, best p/e, max r of the chunk
    race_i_ptr,  # [B, S2, 2] int32: ids of the two bests
    stop_ptr,  # [B] int32: the row's stop position (recovered or bonus)
    out_ptr,  # [B, K+1] int64
    B,
    V,
    K,
    S1,
    S2,
    CHUNK,
    HAS_PROBS: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    ROWS: tl.constexpr,
    KP: tl.constexpr,  # next power of 2 >= K+1
    SP1: tl.constexpr,  # next power of 2 >= S1
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    sp = tl.program_id(1)
    K1 = K + 1
    in_b = rows < B
    n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + rows, mask=in_b, other=0).to(tl.int32), 0), K)
    greedy = tl.load(greedy_ptr + rows, mask=in_b, other=0) != 0
    rnd = in_b & (greedy == 0)  # [ROWS] random rows
    j = tl.arange(0, KP)[None, :]  # [1, KP]
    sj = tl.arange(0, SP1)[None, None, :]  # [1, 1, SP1]
    live = in_b[:, None] & (j <= n[:, None])  # [ROWS, KP]
    pmask = live[:, :, None] & (sj < S1)
    poff = (rows[:, None] * K1 + j)[:, :, None] * S1 + sj  # [ROWS, KP, SP1]
    is_draft = in_b[:, None] & (j < n[:, None])
    d = tl.load(draft_ids_ptr + rows.to(tl.int64)[:, None] * K + j, mask=is_draft, other=-1)  # [ROWS, KP]
    valid = is_draft & (d >= 0) & (d < V)
    d_safe = tl.where(valid, d, 0)
    # greedy rows: the lowest argmax id; the lowest chunk holding the max holds the lowest id
    pm_g = tl.load(part_m_ptr + poff, mask=pmask & greedy[:, None, None], other=-float("inf"))
    pi = tl.load(part_i_ptr + poff, mask=pmask, other=0)
    mx = tl.max(pm_g, 2)
    win = tl.min(tl.where(pm_g == mx[:, :, None], sj, SP1), 2)
    tgt = tl.sum(tl.where(sj == win[:, :, None], pi, 0), 2).to(tl.int64)  # [ROWS, KP]
    # random rows: merge the chunks' online softmax, then accept iff q(d) > 0 and p(d) > u * q(d)
    pr_mask = pmask & rnd[:, None, None]
    pm = tl.load(part_m_ptr + poff, mask=pr_mask, other=-float("inf"))
    ps = tl.load(part_s_ptr + poff, mask=pr_mask, other=0.0)
    m = tl.max(pm, 2)  # [ROWS, KP]
    m_ref = tl.where(m > -float("inf"), m, 0.0)
    s = tl.sum(ps * tl.exp(pm - m_ref[:, :, None]), 2)  # a sum of exps, >= 1 for finite logits
    s = tl.where(s > 0.0, s, 1.0)
    if HAS_TEMP:
        temp = tl.load(temp_ptr + rows, mask=rnd, other=1.0)  # [ROWS]
    rv = valid & rnd[:, None]
    xd = tl.load(logits_ptr + (rows[:, None] * K1 + j).to(tl.int64) * V + d_safe, mask=rv, other=-float("inf"))
    xd = xd.to(tl.float32)
    if HAS_TEMP:
        xd = xd / temp[:, None]
    pd = tl.exp(xd - m_ref) / s
    if HAS_PROBS:
        qd = tl.load(draft_probs_ptr + (rows[:, None] * K + j).to(tl.int64) * V + d_safe, mask=rv, other=0.0)
        qd = qd.to(tl.float32)
    else:
        qd = tl.where(rv, 1.0, 0.0)
    u = tl.load(unif_ptr + rows.to(tl.int64)[:, None] * K + j, mask=is_draft & rnd[:, None], other=1.0)
    accept = tl.where(greedy[:, None], valid & (d == tgt), valid & (qd > 0.0) & (pd > u * qd))
    stop = tl.min(tl.where(is_draft & (accept == 0), j, n[:, None]), 1)  # [ROWS] first rejection, else n
    at = j == stop[:, None]  # [ROWS, KP]
    if sp == 0:
        val = tl.where(j < stop[:, None], d, -1)
        val = tl.where(at & greedy[:, None], tgt, val)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * K1 + j, val, mask=in_b[:, None] & (j < K1))
        tl.store(stop_ptr + rows, stop, mask=in_b)
    if tl.max(rnd.to(tl.int32), 0) > 0:  # exponential race at the stop position, over this vocab chunk
        m_c = tl.sum(tl.where(at, m_ref, 0.0), 1)[:, None]  # [ROWS, 1]
        s_c = tl.sum(tl.where(at, s, 0.0), 1)[:, None]
        s_c = tl.where(s_c > 0.0, s_c, 1.0)
        excl = (tl.sum(tl.where(at & valid, 1, 0), 1) > 0)[:, None]  # one-hot: r(d) = 0 where d was rejected
        d_c = tl.sum(tl.where(at & valid, d, 0), 1)[:, None]
        start = sp * CHUNK
        end = tl.minimum(start + CHUNK, V)
        q_end = tl.where(stop < n, end, 0)[:, None]  # a bonus position has q = 0: residual = p
        xrow = (rows * K1 + stop).to(tl.int64)[:, None] * V
        qrow = (rows * K + tl.minimum(stop, K - 1)).to(tl.int64)[:, None] * V
        erow = rows.to(tl.int64)[:, None] * V
        lanes = tl.arange(0, BLOCK)
        best_r = tl.full([ROWS], -float("inf"), tl.float32)
        best_p = tl.full([ROWS], -float("inf"), tl.float32)
        best_ri = tl.full([ROWS], 0, tl.int32) + start
        best_pi = tl.full([ROWS], 0, tl.int32) + start
        r_max = tl.zeros([ROWS], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            offs = (off + lanes)[None, :]  # [1, BLOCK]
            msk = rnd[:, None] & (offs < end)
            x = tl.load(logits_ptr + xrow + offs, mask=msk, other=-float("inf")).to(tl.float32)
            if HAS_TEMP:
                x = x / temp[:, None]
            p = tl.exp(x - m_c) / s_c
            if HAS_PROBS:
                q = tl.load(draft_probs_ptr + qrow + offs, mask=msk & (offs < q_end), other=0.0).to(tl.float32)
                r = tl.maximum(p - q, 0.0)
            else:
                r = tl.where(excl & (offs == d_c), 0.0, p)
            e = tl.load(expo_ptr + erow + offs, mask=msk, other=1.0)
            sc_p = tl.where(msk, p / e, -float("inf"))  # padded lanes can never win
            sc_r = tl.where(msk, r / e, -float("inf"))
            t_p = tl.max(sc_p, 1)
            t_pi = tl.min(tl.where(sc_p == t_p[:, None], offs, 2147483647), 1)
            t_r = tl.max(sc_r, 1)
            t_ri = tl.min(tl.where(sc_r == t_r[:, None], offs, 2147483647), 1)
            better = t_p > best_p  # strict: the earlier (lower) id keeps a tie
            best_pi = tl.where(better, t_pi, best_pi)
            best_p = tl.where(better, t_p, best_p)
            better = t_r > best_r
            best_ri = tl.where(better, t_ri, best_ri)
            best_r = tl.where(better, t_r, best_r)
            r_max = tl.maximum(r_max, tl.max(tl.where(msk, r, 0.0), 1))
        roff = (rows * S2 + sp) * 3
        tl.store(race_ptr + roff, best_r, mask=rnd)
        tl.store(race_ptr + roff + 1, best_p, mask=rnd)
        tl.store(race_ptr + roff + 2, r_max, mask=rnd)
        ioff = (rows * S2 + sp) * 2
        tl.store(race_i_ptr + ioff, best_ri, mask=rnd)
        tl.store(race_i_ptr + ioff + 1, best_pi, mask=rnd)


@triton.jit(do_not_specialize=["B", "K1", "S2"])
def _finalize_kernel(
    greedy_ptr,  # [B] bool
    race_ptr,  # [B, S2, 3] fp32
    race_i_ptr,  # [B, S2, 2] int32
    stop_ptr,  # [B] int32
    out_ptr,  # [B, K+1] int64
    B,
    K1,
    S2,
    ROWS: tl.constexpr,
    SP2: tl.constexpr,  # next power of 2 >= S2
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    in_b = rows < B
    rnd = in_b & (tl.load(greedy_ptr + rows, mask=in_b, other=1) == 0)
    sj = tl.arange(0, SP2)[None, :]  # [1, SP2]
    msk = rnd[:, None] & (sj < S2)
    base = (rows[:, None] * S2 + sj) * 3  # [ROWS, SP2]
    use_r = tl.max(tl.load(race_ptr + base + 2, mask=msk, other=0.0), 1) > 0.0  # all-zero residual: use p
    sc_r = tl.load(race_ptr + base, mask=msk, other=-float("inf"))
    sc_p = tl.load(race_ptr + base + 1, mask=msk, other=-float("inf"))
    ibase = (rows[:, None] * S2 + sj) * 2
    id_r = tl.load(race_i_ptr + ibase, mask=msk, other=0)
    id_p = tl.load(race_i_ptr + ibase + 1, mask=msk, other=0)
    sc = tl.where(use_r[:, None], sc_r, sc_p)
    ids = tl.where(use_r[:, None], id_r, id_p)
    best = tl.max(sc, 1)
    win = tl.min(tl.where(sc == best[:, None], sj, SP2), 1)  # the lowest chunk holds the lowest id
    tok = tl.sum(tl.where(sj == win[:, None], ids, 0), 1).to(tl.int64)
    stop = tl.load(stop_ptr + rows, mask=rnd, other=0)
    tl.store(out_ptr + rows.to(tl.int64) * K1 + stop, tok, mask=rnd)


_SM_COUNT: dict[int, int] = {}
_VARIANTS: dict[tuple, object] = {}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_interprets() -> bool:
    """Whether `triton.language` was imported under TRITON_INTERPRET=1 (kernels then run on CPU tensors).

    The interpreter is fixed when triton is first imported: set TRITON_INTERPRET=1 before any import of triton.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def _variant(kernel, interpret: bool):
    """The kernel as the process runs triton: interpreted (TRITON_INTERPRET=1 at import) or compiled."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction) == interpret:
        return kernel
    key = (kernel.fn, interpret)
    if key not in _VARIANTS:
        options = {"do_not_specialize": kernel.do_not_specialize} if hasattr(kernel, "do_not_specialize") else {}
        _VARIANTS[key] = InterpretedFunction(kernel.fn) if interpret else JITFunction(kernel.fn, **options)
    return _VARIANTS[key]


def _target_programs(device: torch.device) -> int:
    """Programs per launch that keep every SM busy (4 per SM); 1 in the interpreter (fewest loops)."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return 4 * _SM_COUNT[idx]


def _split(V: int, block: int, programs: int, target: int, num_splits: int | None) -> tuple[int, int]:
    """(number of vocab chunks, chunk length): a multiple of `block`, enough chunks to fill the GPU."""
    if num_splits is None:
        num_splits = triton.cdiv(target, max(programs, 1))
    num_splits = max(1, min(num_splits, triton.cdiv(V, block)))
    chunk = triton.cdiv(triton.cdiv(V, num_splits), block) * block
    return triton.cdiv(V, chunk), chunk


def launch_sizes(V: int, K1: int, block_stats: int, block_race: int) -> dict[str, int]:
    """The kernels' compile-time sizes: bounds that follow neither the batch nor the verify width. A new value of a
    compile-time constant (or of a specialised integer) compiles the kernels again, about a second each on a GPU;
    the dynamic path's batch (rows leave) and verify width (the adaptive schedule's budgets) change from step to
    step, so sizes that followed them compiled new variants all through a call (on an H100 at batch 32 its
    acceptance took 0.68 s a call against 0.01 s at a constant width). So the partial-result counts are bounded by
    the most vocabulary chunks (their actual counts are runtime arguments, masked), the draft positions by 8 (or
    the next power of two), and the batch, width and chunk counts are not specialised (`do_not_specialize`)."""
    return {
        "KP": max(8, triton.next_power_of_2(K1)),
        "SP1": triton.next_power_of_2(triton.cdiv(V, block_stats)),
        "SP2": triton.next_power_of_2(triton.cdiv(V, block_race)),
    }


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous, copied when it does not start on a 16-byte boundary. Triton compiles a kernel once
    per pattern of 16-byte-aligned pointer arguments, so views at offsets that follow the batch or the verify width
    (a workspace's parts, a caller's slices) compiled new variants through a call: on an H100, greedy calls on the
    dynamic path at batch 32 spent 3 s of their first 5-8 s compiling."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but the contract needs {shape}; fix the caller.")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but target_logits is on {device}; move it with .to({device}).")


def rejection_sample_triton(
    target_logits: torch.Tensor,  # [B, k+1, V]
    draft_token_ids: torch.Tensor,  # [B, k]
    num_draft_tokens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    is_greedy: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, k]
    exponentials: torch.Tensor,  # [B, V]
    temperature: torch.Tensor | None = None,  # [B]
    *,
    block_stats: int | None = None,
    block_race: int | None = None,
    num_splits: tuple[int | None, int | None] = (None, None),
    rows_per_program: int | None = None,
) -> torch.Tensor:  # [B, k+1] int64
    """The contract of `hf_specdec.sampling.rejection` on Triton; keyword knobs are for tests/tuning."""
    if target_logits.dim() != 3 or target_logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"target_logits must be a [B, k+1, V] fp32/fp16/bf16 tensor, got shape {tuple(target_logits.shape)} "
            f"dtype {target_logits.dtype}; pass the target's scores for the k+1 verified positions."
        )
    B, K1, V = target_logits.shape
    K, dev = K1 - 1, target_logits.device
    if V < 1 or K < 0:
        raise ValueError(f"target_logits shape {(B, K1, V)} needs k+1 >= 1 positions and V >= 1 tokens.")
    _check("draft_token_ids", draft_token_ids, (B, K), dev)
    _check("num_draft_tokens", num_draft_tokens, (B,), dev)
    _check("is_greedy", is_greedy, (B,), dev)
    _check("uniforms", uniforms, (B, K), dev)
    _check("exponentials", exponentials, (B, V), dev)
    if draft_probs is not None:
        _check("draft_probs", draft_probs, (B, K, V), dev)
        if draft_probs.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"draft_probs dtype {draft_probs.dtype} is not fp32/fp16/bf16; cast it with .float().")
    if temperature is not None:
        _check("temperature", temperature, (B,), dev)
    out = torch.empty((B, K1), dtype=torch.int64, device=dev)
    if B == 0:
        return out
    logits = aligned(target_logits)
    ids = aligned(draft_token_ids.to(torch.int64))
    nd = aligned(num_draft_tokens.to(torch.int64))
    greedy = aligned(is_greedy.to(torch.bool))
    unif = aligned(uniforms.to(torch.float32))
    expo = aligned(exponentials.to(torch.float32))
    probs = aligned(draft_probs) if draft_probs is not None else logits  # dummy pointer when absent
    temp = aligned(temperature.to(torch.float32)) if temperature is not None else unif

    interpret = triton_interprets()
    if dev.type != "cuda" and not interpret:
        raise RuntimeError(
            f"rejection_sample_triton got {dev} tensors but triton was imported without its interpreter; set "
            "TRITON_INTERPRET=1 before the first `import triton` (or use the torch reference on CPU)."
        )
    bs = block_stats or min(2048, triton.next_power_of_2(V))
    br = block_race or min(2048, triton.next_power_of_2(V))
    # rows per program: 1 for large V on a GPU; many in the interpreter, whose cost is per op, not per element
    budget = 1 << 16 if interpret else 2048
    rows = rows_per_program or max(1, min(triton.next_power_of_2(B), budget // max(bs, br)))
    nb = triton.cdiv(B, rows)
    target = _target_programs(dev)
    # The stats pass streams every position: many small vocab chunks keep enough loads in flight (measured on an
    # H100, B=64 k=4 V=128256: ~16x more programs than SMs x 4 cut the device time by 12-20%).
    s1, chunk1 = _split(V, bs, nb * K1, 16 * target, num_splits[0])
    s2, chunk2 = _split(V, br, nb, target, num_splits[1])
    # One 32-bit workspace for every partial result: a single allocation per call (host overhead matters at small B).
    # Each part starts on a 16-byte boundary (`aligned`).
    n1, n2 = B * K1 * s1, B * s2
    lengths = (n1, n1, n1, 3 * n2, 2 * n2, B)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + -(-length // 4) * 4)  # in int32 words: 4 of them are 16 bytes
    work = torch.empty(starts[-1], dtype=torch.int32, device=dev)
    part_m, part_s, part_i, race, race_i, stop = (work[a : a + n] for a, n in zip(starts, lengths))
    part_m, part_s = part_m.view(torch.float32).view(B, K1, s1), part_s.view(torch.float32).view(B, K1, s1)
    part_i = part_i.view(B, K1, s1)
    race, race_i = race.view(torch.float32).view(B, s2, 3), race_i.view(B, s2, 2)
    has_temp = temperature is not None
    sizes = launch_sizes(V, K1, bs, br)
    warps = {} if interpret else {"num_warps": 8}
    _variant(_stats_kernel, interpret)[(nb * K1, s1)](
        logits, nd, greedy, temp, part_m, part_s, part_i, B, V, K1, s1, chunk1,
        HAS_TEMP=has_temp, ROWS=rows, BLOCK=bs, **warps,
    )  # fmt: skip
    _variant(_race_kernel, interpret)[(nb, s2)](
        logits, ids, nd, probs, greedy, unif, expo, temp, part_m, part_s, part_i, race, race_i, stop, out,
        B, V, K, s1, s2, chunk2, HAS_PROBS=draft_probs is not None, HAS_TEMP=has_temp, ROWS=rows,
        KP=sizes["KP"], SP1=sizes["SP1"], BLOCK=br, **warps,
    )  # fmt: skip
    fin = {} if interpret else {"num_warps": 1}
    _variant(_finalize_kernel, interpret)[(nb,)](
        greedy, race, race_i, stop, out, B, K1, s2, ROWS=rows, SP2=sizes["SP2"], **fin
    )
    return out
