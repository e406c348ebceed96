"""Tests of the counter-based random draws: exact hash values, batch invariance, ranges and distributions.

A row's draws must be a pure function of (seed, step, stream, index): the same whatever else is in the batch and
whatever its position there. The values follow Exp(1) / U[0, 1), and distinct streams, steps and seeds are
uncorrelated.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from hf_specdec.sampling import random as specrand
from hf_specdec.sampling.random import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    exponential,
    random_bits,
    random_seeds,
    uniform,
)

MASK = (1 << 64) - 1


def _mix64_python(z: int) -> int:
    """splitmix64 finaliser on Python ints (unsigned 64-bit), the independent oracle."""
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _bits_python(seed: int, step: int, stream: int, index: int) -> int:
    key = _mix64_python(seed + 0x9E3779B97F4A7C15)
    key = _mix64_python(key ^ (((step + 1) * 0xD6E8FEB86659FD93) & MASK))
    key = _mix64_python(key ^ (((stream + 1) * 0xA0761D6478BD642F) & MASK))
    return _mix64_python(key + (index + 1) * 0x9E3779B97F4A7C15)


def test_stream_constants() -> None:
    assert (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_DRAFT) == (0, 1, 2)


def test_bits_match_python_oracle() -> None:
    # Extreme seeds exercise the wrap-around of int64 multiplication and the logical shifts.
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321]
    got = random_bits(torch.tensor(seeds, dtype=torch.int64), step=7, stream=3, n=5)  # [7, 5]
    for i, seed in enumerate(seeds):
        for j in range(5):
            assert int(got[i, j]) & MASK == _bits_python(seed & MASK, 7, 3, j)
    # Negative and large steps/streams are taken mod 2^64.
    got = random_bits(torch.tensor([5]), step=-3, stream=2**70 + 1, n=2)  # [1, 2]
    assert [int(v) & MASK for v in got[0]] == [_bits_python(5, -3, 2**70 + 1, j) for j in range(2)]


def test_uniform_and_exponential_are_functions_of_the_bits() -> None:
    seeds = torch.tensor([3, -4, 2**62], dtype=torch.int64)  # [3]
    bits = random_bits(seeds, 2, 1, 9)  # [3, 9]
    top24 = (bits >> 40) & ((1 << 24) - 1)  # [3, 9]
    assert torch.equal(uniform(seeds, 2, 1, 9), top24.float() / 2**24)
    top52 = (bits >> 12) & ((1 << 52) - 1)  # [3, 9]
    expected = (-torch.log((top52.double() + 0.5) / 2**52)).float()  # [3, 9]
    assert torch.equal(exponential(seeds, 2, 1, 9), expected)


def test_deterministic() -> None:
    seeds = torch.arange(100, dtype=torch.int64) * 7919 - 300  # [100]
    assert torch.equal(uniform(seeds, 3, 0, 11), uniform(seeds.clone(), 3, 0, 11))
    assert torch.equal(exponential(seeds, 3, 1, 11), exponential(seeds.clone(), 3, 1, 11))


def test_row_values_do_not_depend_on_the_batch() -> None:
    seeds = random_seeds(64, torch.Generator().manual_seed(0))  # [64]
    for draw in (uniform, exponential):
        full = draw(seeds, 5, STREAM_DRAFT + 1, 17)  # [64, 17]
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))  # [64]
        assert torch.equal(draw(seeds[perm], 5, STREAM_DRAFT + 1, 17), full[perm])  # reordered
        assert torch.equal(draw(seeds[10:13], 5, STREAM_DRAFT + 1, 17), full[10:13])  # rows removed
        assert torch.equal(draw(seeds[7:8], 5, STREAM_DRAFT + 1, 17), full[7:8])  # alone
        more = torch.cat([seeds, torch.tensor([1, 2, 3])])  # [67] rows added
        assert torch.equal(draw(more, 5, STREAM_DRAFT + 1, 17)[:64], full)
        # A longer draw extends the shorter one (index is a counter, not a shape-dependent offset).
        assert torch.equal(draw(seeds, 5, STREAM_DRAFT + 1, 40)[:, :17], full)


def test_ranges_and_shapes() -> None:
    seeds = torch.arange(2000, dtype=torch.int64)  # [2000]
    u = uniform(seeds, 0, STREAM_ACCEPT, 100)  # [2000, 100]
    e = exponential(seeds, 0, STREAM_RESIDUAL, 100)  # [2000, 100]
    assert u.shape == e.shape == (2000, 100) and u.dtype == e.dtype == torch.float32
    assert u.min() >= 0 and u.max() < 1
    assert torch.isfinite(e).all() and e.min() > 0
    assert uniform(seeds, 0, 0, 0).shape == (2000, 0)
    assert exponential(torch.zeros(0, dtype=torch.int64), 0, 0, 4).shape == (0, 4)


def test_extreme_bits_stay_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    # All-ones and all-zeros hashes are the edges: uniform < 1, exponential > 0 and finite.
    edges = torch.tensor([[-1, 0]], dtype=torch.int64)  # [1, 2]: bits 0xFFFF..., 0x0000...
    monkeypatch.setattr(specrand, "random_bits", lambda seeds, step, stream, n: edges.clone())
    u = specrand.uniform(torch.tensor([0]), 0, 0, 2)  # [1, 2]
    e = specrand.exponential(torch.tensor([0]), 0, 0, 2)  # [1, 2]
    assert u[0, 0] == 1 - 2**-24 and u[0, 1] == 0
    assert 0 < e[0, 0] < 1e-15 and 36 < e[0, 1] < 37


def test_distributions() -> None:
    seeds = torch.arange(100_000, dtype=torch.int64) + 10**12  # [100000] consecutive seeds
    u = uniform(seeds, 4, STREAM_ACCEPT, 1)[:, 0].numpy()  # [100000]
    e = exponential(seeds, 4, STREAM_RESIDUAL, 1)[:, 0].numpy().astype(np.float64)  # [100000]
    assert scipy.stats.kstest(u, "uniform").pvalue > 1e-3
    assert scipy.stats.kstest(e, "expon").pvalue > 1e-3
    assert abs(e.mean() - 1.0) < 0.01 and abs(u.mean() - 0.5) < 0.005
    # Many indices of one seed follow the same laws.
    e_row = exponential(torch.tensor([42]), 0, STREAM_RESIDUAL, 100_000)[0].numpy().astype(np.float64)  # [100000]
    assert scipy.stats.kstest(e_row, "expon").pvalue > 1e-3


def test_streams_steps_seeds_indices_uncorrelated() -> None:
    seeds = torch.arange(100_000, dtype=torch.int64)  # [100000]
    base = uniform(seeds, 0, STREAM_ACCEPT, 2)  # [100000, 2]
    others = {
        "stream": uniform(seeds, 0, STREAM_RESIDUAL, 1)[:, 0],
        "draft stream": uniform(seeds, 0, STREAM_DRAFT, 1)[:, 0],
        "step": uniform(seeds, 1, STREAM_ACCEPT, 1)[:, 0],
        "index": base[:, 1],
        "next seed": torch.roll(base[:, 0], 1),
        "exponential of another stream": exponential(seeds, 0, STREAM_RESIDUAL, 1)[:, 0],
    }
    x = base[:, 0].double().numpy()  # [100000]
    for name, other in others.items():
        corr = np.corrcoef(x, other.double().numpy())[0, 1]
        assert abs(corr) < 0.02, f"uniforms correlated across {name}: {corr}"


def test_random_seeds_reproducible() -> None:
    torch.manual_seed(1234)
    a = random_seeds(8)  # [8]
    torch.manual_seed(1234)
    b = random_seeds(8)  # [8]
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.shape == (8,)
    assert len(set(a.tolist())) == 8
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(random_seeds(4, g1), random_seeds(4, g2))
    assert random_seeds(0).shape == (0,)


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="1-D int64"):
        uniform(torch.zeros(3, dtype=torch.int32), 0, 0, 2)
    with pytest.raises(ValueError, match=r"\(3, 1\)"):
        exponential(torch.zeros(3, 1, dtype=torch.int64), 0, 0, 2)
    with pytest.raises(TypeError, match="`step` must be a Python int"):
        uniform(torch.zeros(3, dtype=torch.int64), 0.5, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`n` must be >= 0"):
        uniform(torch.zeros(3, dtype=torch.int64), 0, 0, -1)
    with pytest.raises(ValueError, match="non-negative"):
        random_seeds(-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_values_on_cuda() -> None:
    seeds = random_seeds(1000, torch.Generator().manual_seed(3))  # [1000]
    assert torch.equal(random_bits(seeds.cuda(), 2, 1, 33).cpu(), random_bits(seeds, 2, 1, 33))
    assert torch.equal(uniform(seeds.cuda(), 2, 1, 33).cpu(), uniform(seeds, 2, 1, 33))
    assert torch.allclose(exponential(seeds.cuda(), 2, 1, 33).cpu(), exponential(seeds, 2, 1, 33), rtol=1e-6, atol=0)
