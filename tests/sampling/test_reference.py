"""Tests of the torch reference rejection sampler (`rejection_sample_reference`).

Hand-computed cases pin the contract (greedy, ragged, invalid ids, k = 0, V = 1, q(d) = 0, p(d) = 0, ties, the
all-zero residual); a per-row Python oracle of the contract checks the vectorised code on random batches; and
deterministic statistical tests (chi-square and total variation on 100k+ rows, with a wrong sampler as negative
control) check that the emitted tokens follow the target distribution exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from hf_specdec.sampling.random import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, exponential, uniform
from hf_specdec.sampling.reference import num_accepted_from_output, rejection_sample_reference
from hf_specdec.sampling.rejection import rejection_sample

NEG_INF = float("-inf")


def _run(
    logits: list | torch.Tensor,
    drafts: list | torch.Tensor,
    num: list | torch.Tensor | None = None,
    *,
    q: list | torch.Tensor | None = None,
    greedy: bool | list = False,
    u: list | torch.Tensor | None = None,
    e: list | torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """Call the reference with small Python lists; defaults: all drafts counted, u = 0.5, e = 1."""
    logits = torch.as_tensor(logits, dtype=torch.float32)  # [B, k+1, V]
    B, k1, V = logits.shape
    drafts = torch.as_tensor(drafts, dtype=torch.int64).reshape(B, k1 - 1)  # [B, k]
    num = torch.full((B,), k1 - 1) if num is None else torch.as_tensor(num, dtype=torch.int64)  # [B]
    q = None if q is None else torch.as_tensor(q, dtype=torch.float32)  # [B, k, V]
    greedy_t = torch.as_tensor(greedy if isinstance(greedy, list) else [greedy] * B, dtype=torch.bool)  # [B]
    u = torch.full((B, k1 - 1), 0.5) if u is None else torch.as_tensor(u, dtype=torch.float32)  # [B, k]
    e = torch.ones(B, V) if e is None else torch.as_tensor(e, dtype=torch.float32)  # [B, V]
    return rejection_sample_reference(logits, drafts, num, q, greedy_t, u, e, temperature)


# ----------------------------------------------------------------------------------------------- hand cases
GREEDY_LOGITS = [[[0.0, 1.0, 5.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0, 9.0], [0.0, 3.0, 1.0, 1.0, 0.0]]]  # argmax 2, 4, 1


def test_greedy_all_accepted_first_rejected_second_rejected() -> None:
    assert _run(GREEDY_LOGITS, [2, 4], greedy=True).tolist() == [[2, 4, 1]]
    assert _run(GREEDY_LOGITS, [3, 4], greedy=True).tolist() == [[2, -1, -1]]
    assert _run(GREEDY_LOGITS, [2, 0], greedy=True).tolist() == [[2, 4, -1]]


def test_greedy_ragged_lengths_including_zero() -> None:
    logits = GREEDY_LOGITS * 4
    drafts = [[2, 4], [2, 4], [2, -1], [-1, -1]]
    out = _run(logits, drafts, [2, 1, 1, 0], greedy=True)
    assert out.tolist() == [[2, 4, 1], [2, 4, -1], [2, 4, -1], [2, -1, -1]]
    assert num_accepted_from_output(out).tolist() == [2, 1, 1, 0]


def test_invalid_draft_ids_are_rejected_never_indexed() -> None:
    logits = GREEDY_LOGITS * 3
    drafts = [[-1, 4], [2, 5], [2, 10**9]]  # -1 and >= V inside the row's drafts
    assert _run(logits, drafts, greedy=True).tolist() == [[2, -1, -1], [2, 4, -1], [2, 4, -1]]
    # Random rows, one-hot and with draft_probs: rejected even though u = 0 would accept anything with p > 0.
    u = torch.zeros(3, 2)
    assert _run(logits, drafts, u=u).tolist() == [[2, -1, -1], [2, 4, -1], [2, 4, -1]]
    q = torch.full((3, 2, 5), 0.2)
    out = _run(logits, drafts, q=q, u=u)
    assert out[:, 0].tolist() == [2, 2, 2] and out[0, 1:].tolist() == [-1, -1] and (out[1:, 2] == -1).all()


def test_k_zero_emits_only_the_bonus() -> None:
    logits = [[[0.0, 2.0, 1.0]], [[3.0, 3.0, 1.0]]]
    assert _run(logits, torch.zeros(2, 0), greedy=True).tolist() == [[1], [0]]  # tie -> lowest id
    # Random: argmax p / e. Row 0: p ~ [.09,.67,.24]; e makes id 2 win. Row 1: equal p, e=1 -> lowest id.
    out = _run(logits, torch.zeros(2, 0), e=[[1.0, 10.0, 1.0], [1.0, 1.0, 1.0]])
    assert out.tolist() == [[2], [0]]
    empty = _run(torch.zeros(0, 1, 4), torch.zeros(0, 0), torch.zeros(0), u=torch.zeros(0, 0), e=torch.ones(0, 4))
    assert empty.shape == (0, 1)  # B = 0


def test_vocabulary_of_one() -> None:
    logits = torch.zeros(3, 3, 1)  # [B, k+1, 1]
    drafts = [[0, 0], [0, -1], [0, 1]]
    expected = [[0, 0, 0], [0, 0, -1], [0, 0, -1]]
    assert _run(logits, drafts, [2, 1, 2], greedy=True).tolist() == expected
    assert _run(logits, drafts, [2, 1, 2], u=torch.full((3, 2), 1 - 2**-24)).tolist() == expected
    assert _run(logits, drafts, [2, 1, 2], q=torch.ones(3, 2, 1)).tolist() == expected


def test_random_accept_test_is_strict_and_needs_q_positive() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = p.log().expand(1, 3, 3)  # [1, 3, 3]
    q = torch.tensor([[[0.2, 0.1, 0.7], [1 / 3] * 3]])  # [1, 2, 3]
    # p(2)=.2 vs u*q(2): accepted for u*.7 < .2, rejected otherwise; recovered from r = max(p-q, 0) = [.3, .2, 0].
    assert _run(logits, [[2, 0]], q=q, u=[[0.28, 0.0]]).tolist()[0][0] == 2
    assert _run(logits, [[2, 0]], q=q, u=[[0.3, 0.0]]).tolist() == [[0, -1, -1]]
    assert _run(logits, [[2, 0]], q=q, u=[[0.3, 0.0]], e=[[10.0, 1.0, 1.0]]).tolist() == [[1, -1, -1]]
    # q(d) = 0: never accepted, even with u = 0 (p(d) > 0 * 0 would hold).
    q0 = torch.tensor([[[0.5, 0.5, 0.0], [1 / 3] * 3]])  # [1, 2, 3]
    assert _run(logits, [[2, 0]], q=q0, u=[[0.0, 0.0]])[0, 1].item() == -1
    # p(d) = 0: never accepted, even with u = 0, in both modes; the recovered token is never d.
    logits0 = torch.tensor([[[0.0, 0.0, NEG_INF], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])  # [1, 3, 3]
    for qq in (None, torch.tensor([[[0.0, 0.0, 1.0], [1 / 3] * 3]])):
        out = _run(logits0, [[2, 0]], q=qq, u=[[0.0, 0.0]], e=[[1.0, 1.0, 1e-30]])
        assert out[0, 1].item() == -1 and out[0, 0].item() in (0, 1)


def test_one_hot_residual_zeroes_the_draft() -> None:
    logits = torch.tensor([0.6, 0.3, 0.1]).log().expand(1, 3, 3)  # [1, 3, 3]
    # d = 0 rejected (u = .99 > .6): r = [0, .3, .1] -> argmax r / e with e = 1 is id 1, never the draft.
    assert _run(logits, [[0, 0]], u=[[0.99, 0.0]]).tolist() == [[1, -1, -1]]
    assert _run(logits, [[0, 0]], u=[[0.99, 0.0]], e=[[1e-6, 1.0, 0.1]]).tolist() == [[2, -1, -1]]
    # An invalid id is rejected and nothing is zeroed: r = p.
    assert _run(logits, [[7, 0]], u=[[0.0, 0.0]]).tolist() == [[0, -1, -1]]


def test_all_zero_residual_falls_back_to_p() -> None:
    logits = torch.tensor([[[0.0, 0.0, NEG_INF], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])  # [1, 3, 3] p_0 = [.5, .5, 0]
    q = torch.softmax(logits[:, :1], -1).expand(1, 2, 3).clone()  # [1, 2, 3] q_0 == p_0: r = max(p - q, 0) = 0
    out = _run(logits, [[2, 0]], q=q, u=[[0.0, 0.0]], e=[[1.0, 0.5, 1e-30]])  # d = 2 has q(d) = 0: rejected
    assert out.tolist() == [[1, -1, -1]]  # argmax p / e over the fallback p; id 2 (p = 0) never wins
    out = _run(logits, [[9, 0]], q=q, u=[[0.0, 0.0]], e=[[0.5, 1.0, 1e-30]])  # invalid id: same fallback
    assert out.tolist() == [[0, -1, -1]]


def test_ties_go_to_the_lowest_id() -> None:
    logits = torch.zeros(1, 3, 4)  # [1, 3, 4] uniform p, tied logits
    assert _run(logits, [[3, 0]], greedy=True).tolist() == [[0, -1, -1]]
    assert _run(logits, [[0, 0]], greedy=True).tolist() == [[0, 0, 0]]
    assert _run(logits, [[3, 3]], u=[[0.0, 0.99]]).tolist() == [[3, 0, -1]]  # recovered: r = [.25,.25,.25,0]
    assert _run(logits, [[3, 3]], u=[[0.0, 0.0]], e=[[2.0, 1.0, 1.0, 1.0]]).tolist() == [[3, 3, 1]]  # bonus


def test_greedy_rows_ignore_the_random_draws_and_mix_with_random_rows() -> None:
    logits = GREEDY_LOGITS * 2
    nan_u, nan_e = torch.full((2, 2), float("nan")), torch.full((2, 5), float("nan"))
    assert _run(logits, [[2, 4], [2, 3]], greedy=True, u=nan_u, e=nan_e).tolist() == [[2, 4, 1], [2, 4, -1]]
    mixed = _run(logits, [[2, 4], [0, 0]], greedy=[True, False], u=[[9.0, 9.0], [0.0, 0.0]], e=nan_e.nan_to_num(1.0))
    assert mixed.tolist() == [[2, 4, 1], [0, 0, 1]]


def test_output_layout_on_random_batches() -> None:
    g = torch.Generator().manual_seed(0)
    B, k, V = 500, 4, 7
    logits = torch.randn(B, k + 1, V, generator=g) * 2  # [B, k+1, V]
    drafts = torch.randint(-1, V + 1, (B, k), generator=g)  # [B, k] includes invalid ids
    num = torch.randint(0, k + 1, (B,), generator=g)  # [B]
    greedy = torch.rand(B, generator=g) < 0.3  # [B]
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)  # [B, k, V]
    u, e = torch.rand(B, k, generator=g), torch.rand(B, V, generator=g) + 1e-3  # [B, k], [B, V]
    for qq in (None, q):
        out = rejection_sample_reference(logits, drafts, num, qq, greedy, u, e)  # [B, k+1]
        acc = num_accepted_from_output(out)  # [B]
        assert out.dtype == torch.int64 and out.shape == (B, k + 1)
        assert (acc >= 0).all() and (acc <= num).all()
        for i in range(B):
            a = int(acc[i])
            assert out[i, :a].tolist() == drafts[i, :a].tolist()  # accepted drafts, in order
            assert 0 <= out[i, a] < V  # exactly one recovered or bonus token
            assert (out[i, a + 1 :] == -1).all()


# -------------------------------------------------------------------------------- per-row Python oracle
def _first_argmax(values: list[float]) -> int:
    best = 0
    for v in range(1, len(values)):
        if values[v] > values[best]:
            best = v
    return best


def _oracle(logits, drafts, num, q, greedy, u, e, temperature) -> torch.Tensor:  # noqa: ANN001
    """The contract of `rejection.py`, row by row, in plain Python (fp32 softmax from torch)."""
    B, k1, V = logits.shape
    scaled = logits.float() if temperature is None else logits.float() / temperature.float()[:, None, None]
    probs = torch.softmax(scaled, -1).tolist()  # [B, k+1, V]
    out = torch.full((B, k1), -1, dtype=torch.int64)
    for i in range(B):
        n, emitted = int(num[i]), []
        for j in range(n + 1):
            p = probs[i][j]
            if greedy[i]:
                t = _first_argmax(logits[i, j].float().tolist())
                if j < n and int(drafts[i, j]) == t:
                    emitted.append(t)
                    continue
                emitted.append(t)
                break
            if j == n:
                emitted.append(_first_argmax([p[v] / float(e[i, v]) for v in range(V)]))
                break
            d = int(drafts[i, j])
            ok = 0 <= d < V
            qj = [0.0] * V if q is None else q[i, j].float().tolist()
            if q is None and ok:
                qj[d] = 1.0
            if ok and qj[d] > 0 and np.float32(p[d]) > np.float32(u[i, j]) * np.float32(qj[d]):
                emitted.append(d)
                continue
            if q is None:
                r = [0.0 if v == d else p[v] for v in range(V)]
            else:
                r = [max(float(np.float32(p[v]) - np.float32(qj[v])), 0.0) for v in range(V)]
            if not any(x > 0 for x in r):
                r = p
            emitted.append(_first_argmax([float(np.float32(r[v]) / np.float32(e[i, v])) for v in range(V)]))
            break
        out[i, : len(emitted)] = torch.tensor(emitted)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_matches_per_row_oracle(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, k, V = 48, seed % 4, [1, 2, 5, 9][seed % 4]
    # Small integer logits and coarse q make ties and exact p == u*q boundaries common.
    logits = torch.randint(-3, 3, (B, k + 1, V), generator=g).float()  # [B, k+1, V]
    logits[torch.rand(B, k + 1, V, generator=g) < 0.2] = NEG_INF
    logits[..., 0] = logits[..., 0].clamp_min(-3.0)  # at least one finite logit per position
    drafts = torch.randint(-2, V + 2, (B, k), generator=g)  # [B, k]
    num = torch.randint(0, k + 1, (B,), generator=g)  # [B]
    greedy = torch.rand(B, generator=g) < 0.25  # [B]
    q = torch.randint(0, 3, (B, k, V), generator=g).float()  # [B, k, V]
    q = q / q.sum(-1, keepdim=True).clamp_min(1)  # [B, k, V] rows may be all zero
    u = torch.randint(0, 4, (B, k), generator=g).float() / 4  # [B, k]
    e = torch.randint(1, 4, (B, V), generator=g).float()  # [B, V]
    temperature = torch.rand(B, generator=g) + 0.5 if seed % 2 else None  # [B]
    for qq in (None, q):
        expected = _oracle(logits, drafts, num, qq, greedy, u, e, temperature)
        got = rejection_sample_reference(logits, drafts, num, qq, greedy, u, e, temperature)
        assert torch.equal(got, expected)
        assert torch.equal(rejection_sample(logits, drafts, num, qq, greedy, u, e, temperature), expected)


def test_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(7)
    B, k, V = 32, 3, 11
    args = [
        torch.randn(B, k + 1, V, generator=g),
        torch.randint(0, V, (B, k), generator=g),
        torch.randint(0, k + 1, (B,), generator=g),
        torch.softmax(torch.randn(B, k, V, generator=g), -1),
        torch.rand(B, generator=g) < 0.5,
        torch.rand(B, k, generator=g),
        torch.rand(B, V, generator=g) + 0.1,
    ]
    full = rejection_sample_reference(*args)  # [B, k+1]
    perm = torch.randperm(B, generator=g)
    assert torch.equal(rejection_sample_reference(*[a[perm] for a in args]), full[perm])
    for i in (0, 5, 31):
        assert torch.equal(rejection_sample_reference(*[a[i : i + 1] for a in args]), full[i : i + 1])


# ------------------------------------------------------------------------------ temperature and dtypes
def test_temperature_equals_scaled_logits() -> None:
    g = torch.Generator().manual_seed(3)
    B, k, V = 256, 2, 6
    logits = torch.randn(B, k + 1, V, generator=g) * 3  # [B, k+1, V]
    temperature = torch.rand(B, generator=g) * 2 + 0.1  # [B]
    greedy = torch.rand(B, generator=g) < 0.3  # [B]
    drafts, num = torch.randint(0, V, (B, k), generator=g), torch.randint(0, k + 1, (B,), generator=g)
    seeds = torch.arange(B, dtype=torch.int64)
    u, e = uniform(seeds, 0, STREAM_ACCEPT, k), exponential(seeds, 0, STREAM_RESIDUAL, V)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)  # [B, k, V]
    for qq in (None, q):
        with_t = rejection_sample_reference(logits, drafts, num, qq, greedy, u, e, temperature)
        scaled = rejection_sample_reference(logits / temperature[:, None, None], drafts, num, qq, greedy, u, e)
        assert torch.equal(with_t, scaled)
    # Greedy rows may carry temperature 0.
    zero_t = torch.where(greedy, 0.0, temperature)
    out = rejection_sample_reference(logits, drafts, num, None, greedy, u, e, zero_t)
    assert torch.equal(out[greedy], rejection_sample_reference(logits, drafts, num, None, greedy, u, e)[greedy])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_inputs_use_fp32_math(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    B, k, V = 128, 3, 9
    logits = torch.randn(B, k + 1, V, generator=g).to(dtype)  # [B, k+1, V]
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1).to(dtype)  # [B, k, V]
    drafts, num = torch.randint(0, V, (B, k), generator=g), torch.randint(0, k + 1, (B,), generator=g)
    greedy, u, e = torch.rand(B, generator=g) < 0.3, torch.rand(B, k, generator=g), torch.rand(B, V, generator=g) + 0.1
    got = rejection_sample_reference(logits, drafts, num, q, greedy, u, e)
    assert torch.equal(got, rejection_sample_reference(logits.float(), drafts, num, q.float(), greedy, u, e))


# ------------------------------------------------------------------------------------------ validation
def test_errors_name_the_input_and_the_shapes() -> None:
    B, k, V = 2, 3, 5
    ok = dict(
        target_logits=torch.zeros(B, k + 1, V),
        draft_token_ids=torch.zeros(B, k, dtype=torch.int64),
        num_draft_tokens=torch.zeros(B, dtype=torch.int64),
        draft_probs=None,
        is_greedy=torch.zeros(B, dtype=torch.bool),
        uniforms=torch.zeros(B, k),
        exponentials=torch.ones(B, V),
    )
    rejection_sample_reference(**ok)
    bad = {
        "target_logits": (torch.zeros(B, V), r"target_logits.*\[B, k\+1, V\].*\(2, 5\)"),
        "draft_token_ids": (torch.zeros(B, k, dtype=torch.int32), r"draft_token_ids.*int64.*\[2, 3\].*int32"),
        "num_draft_tokens": (torch.tensor([0, 4]), r"num_draft_tokens.*0\.\.3.*\[4\]"),
        "draft_probs": (torch.zeros(B, k, V + 1), r"draft_probs.*\[2, 3, 5\].*\(2, 3, 6\)"),
        "is_greedy": (torch.zeros(B), r"is_greedy.*bool"),
        "uniforms": (torch.zeros(B, k + 1), r"uniforms.*\[2, 3\].*\(2, 4\)"),
        "exponentials": (torch.ones(B, V - 1), r"exponentials.*\[2, 5\].*\(2, 4\)"),
    }
    for name, (value, pattern) in bad.items():
        with pytest.raises(ValueError, match=pattern):
            rejection_sample_reference(**{**ok, name: value})
    with pytest.raises(ValueError, match=r"temperature.*\[2\]"):
        rejection_sample_reference(**ok, temperature=torch.ones(3))
    with pytest.raises(ValueError, match="output_token_ids"):
        num_accepted_from_output(torch.zeros(3, dtype=torch.int64))


# ------------------------------------------------------------------------------------- statistical tests
N = 100_000
P0 = [0.30, 0.05, 0.15, 0.00, 0.20, 0.10, 0.12, 0.08]  # target at position 0 (V = 8); p(3) = 0
Q0 = [0.05, 0.30, 0.10, 0.25, 0.05, 0.15, 0.00, 0.10]  # draft at position 0: proposes 3 (p = 0), never 6
P1 = [0.10, 0.25, 0.05, 0.20, 0.00, 0.15, 0.05, 0.20]  # target at position 1
Q1 = [0.20, 0.20, 0.20, 0.00, 0.10, 0.10, 0.10, 0.10]  # draft at position 1
P2 = [0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.10, 0.10]  # target at position 2 (bonus after two drafts)
# Peaked pairs for the two-position test, so that enough rows accept their first draft (one-hot included).
P0_PEAKED = [0.60, 0.05, 0.10, 0.00, 0.10, 0.05, 0.06, 0.04]
Q0_PEAKED = [0.70, 0.10, 0.05, 0.05, 0.05, 0.05, 0.00, 0.00]
P1_PEAKED = [0.05, 0.65, 0.05, 0.10, 0.00, 0.05, 0.05, 0.05]
Q1_PEAKED = [0.00, 0.75, 0.05, 0.05, 0.05, 0.05, 0.05, 0.00]


def _setup(ps: list[list[float]], qs: list[list[float]], step: int, n: int = N):
    """B = n rows of the same target/draft distributions, drafts sampled from q, draws from distinct seeds."""
    logits = torch.tensor(ps).log()[None].expand(n, -1, -1)  # [B, k+1, V], -inf where p = 0
    q = torch.tensor(qs, dtype=torch.float32)[None].expand(n, -1, -1)  # [B, k, V]
    seeds = torch.arange(n, dtype=torch.int64) + 1_000_003 * step  # [B]
    k, V = len(qs), len(ps[0])
    cdf = torch.tensor(qs, dtype=torch.float32).cumsum(-1)  # [k, V]
    drafts = torch.stack(  # inverse-CDF sampling of d_j ~ q_j, one draft stream per position
        [torch.searchsorted(cdf[j], uniform(seeds, step, STREAM_DRAFT + j, 1)[:, 0], right=True) for j in range(k)],
        dim=1,
    ).clamp(max=V - 1)  # [B, k]
    u = uniform(seeds, step, STREAM_ACCEPT, k)  # [B, k]
    e = exponential(seeds, step, STREAM_RESIDUAL, V)  # [B, V]
    p_true = torch.softmax(logits[0].double(), -1).numpy()  # [k+1, V]
    return logits, drafts, q, u, e, p_true


def _fit(tokens: torch.Tensor, p: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value, total variation) of the empirical distribution of `tokens` against `p`."""
    counts = np.bincount(tokens.numpy(), minlength=len(p)).astype(np.float64)  # [V]
    total, support = counts.sum(), p > 0
    if counts[~support].sum() > 0:
        return 0.0, 1.0  # a token with p = 0 was emitted
    expected = p[support] / p[support].sum() * total
    pvalue = scipy.stats.chisquare(counts[support], expected).pvalue
    return float(pvalue), float(0.5 * np.abs(counts / total - p).sum())


def _assert_fits(tokens: torch.Tensor, p: np.ndarray, what: str) -> None:
    """Chi-square p-value > 1e-3 and total variation < 0.01 on 50k draws (a subset of m < 50k draws gets the
    same power: the TV bound grows as sqrt(50k / m); at least 20k draws are required)."""
    m = len(tokens)
    assert m >= 20_000, f"{what}: only {m} draws, too few for the test"
    pvalue, tv = _fit(tokens, p)
    tv_bound = 0.01 * np.sqrt(max(1.0, 50_000 / m))
    assert pvalue > 1e-3 and tv < tv_bound, f"{what} ({m} draws): chi-square p-value {pvalue:.2e}, TV {tv:.4f}"


def test_first_token_follows_target_with_draft_probs_and_ragged_rows() -> None:
    logits, drafts, q, u, e, p = _setup([P0, P1, P2], [Q0, Q1], step=1)
    num = torch.arange(N) % 3  # [B] n = 0, 1, 2
    out = rejection_sample_reference(logits, drafts, num, q, torch.zeros(N, dtype=torch.bool), u, e)
    _assert_fits(out[:, 0], p[0], "token 0, all rows")
    for n in (0, 1, 2):
        _assert_fits(out[num == n, 0], p[0], f"token 0, rows with {n} drafts")
    # Acceptance of the first draft has probability sum_v min(p, q).
    rate, theory = (num_accepted_from_output(out)[num > 0] > 0).double().mean().item(), np.minimum(p[0], Q0).sum()
    assert abs(rate - theory) < 4 * np.sqrt(theory * (1 - theory) / (N * 2 / 3))


@pytest.mark.parametrize("fixed_drafts", [False, True])
def test_first_token_follows_target_one_hot(fixed_drafts: bool) -> None:
    logits, drafts, _, u, e, p = _setup([P0, P1], [Q0], step=2)
    if fixed_drafts:
        drafts = (torch.arange(N) % 4 * 2)[:, None]  # [B, 1] ids 0, 2, 4, 6
    num, greedy = torch.ones(N, dtype=torch.int64), torch.zeros(N, dtype=torch.bool)  # [B], [B]
    out = rejection_sample_reference(logits, drafts, num, None, greedy, u, e)  # [B, 2]
    _assert_fits(out[:, 0], p[0], "one-hot token 0")


@pytest.mark.parametrize("one_hot", [False, True])
def test_second_token_follows_target_after_an_accepted_draft(one_hot: bool) -> None:
    B = 3 * N
    logits, drafts, q, u, e, p = _setup([P0_PEAKED, P1_PEAKED, P2], [Q0_PEAKED, Q1_PEAKED], step=3, n=B)
    num = 1 + torch.arange(B) % 2  # [B] n = 1 (token 1 is a bonus) or 2 (token 1 is accepted or recovered)
    greedy = torch.zeros(B, dtype=torch.bool)  # [B]
    out = rejection_sample_reference(logits, drafts, num, None if one_hot else q, greedy, u, e)  # [B, 3]
    accepted = num_accepted_from_output(out)  # [B]
    _assert_fits(out[:, 0], p[0], "token 0")
    for n in (1, 2):
        rows = (accepted >= 1) & (num == n)
        _assert_fits(out[rows, 1], p[1], f"token 1 after an accepted draft, rows with {n} drafts")
    rows = accepted == 2
    _assert_fits(out[rows, 2], p[2], "bonus token after two accepted drafts")


def test_negative_controls_fail_the_same_statistic() -> None:
    logits, drafts, q, u, e, p = _setup([P0, P1], [Q0], step=4)
    greedy = torch.zeros(N, dtype=torch.bool)
    num = torch.ones(N, dtype=torch.int64)
    out = rejection_sample_reference(logits, drafts, num, q, greedy, u, e)  # [B, 2]
    _assert_fits(out[:, 0], p[0], "reference")
    # Wrong sampler 1: same accept test, but the recovered token is sampled from p instead of the residual.
    probs = torch.softmax(logits[:, 0].float(), -1)  # [B, V]
    accepted = out[:, 1] >= 0  # [B] the reference's accept decisions
    wrong = torch.where(accepted, drafts[:, 0], (probs / e).argmax(-1))  # [B]
    pvalue, tv = _fit(wrong, p[0])
    assert pvalue < 1e-6 and tv > 0.02, (pvalue, tv)
    # Wrong sampler 2: the reference told the wrong draft distribution (q = p while drafts come from Q0).
    lied = rejection_sample_reference(logits, drafts, num, probs[:, None].clone(), greedy, u, e)
    pvalue, tv = _fit(lied[:, 0], p[0])
    assert pvalue < 1e-6 and tv > 0.02, (pvalue, tv)
