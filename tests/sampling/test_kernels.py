"""Triton rejection-sampling kernels vs the torch reference (id for id) and vs the target law (chi-square).

The kernels run on CPU tensors in the Triton interpreter (tests/triton_interpreter.py): here if this process could
still turn it on, else `test_kernels_in_subprocess` re-runs this file in a fresh process that has it.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import in_subprocess, interpreted, rerun_interpreted

pytest.importorskip("scipy")

from scipy.stats import chisquare  # noqa: E402

from hf_specdec.sampling import random as rnd  # noqa: E402
from hf_specdec.sampling.kernels import rejection_sample_triton  # noqa: E402
from hf_specdec.sampling.reference import rejection_sample_reference  # noqa: E402
from hf_specdec.sampling.rejection import SAMPLER_ENV, rejection_sample  # noqa: E402

# Knobs that force the GPU code paths on tiny shapes: several vocab tiles and chunks per position.
TILED = dict(block_stats=16, block_race=16, num_splits=(2, 3), rows_per_program=4)
GPU_LAYOUT = dict(block_stats=16, block_race=8, num_splits=(3, 4), rows_per_program=1)  # one row per program


def make_inputs(
    B: int,
    k: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    probs: bool = True,
    temperature: bool = False,
    greedy_frac: float = 0.3,
    invalid_frac: float = 0.1,
    noise: float = 1.0,
    seed: int = 0,
) -> dict:
    """Random inputs of the contract: drafts drawn from q (close to p), ragged lengths, a few invalid ids."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, k + 1, V, generator=g) * 2.0  # [B, k+1, V]
    q_logits = logits[:, :k] + noise * torch.randn(B, k, V, generator=g)  # [B, k, V]
    q = torch.softmax(q_logits, dim=-1)  # [B, k, V]
    seeds = torch.arange(B, dtype=torch.int64) + 1000 * seed  # [B]
    if probs:  # d_j ~ q_j
        races = [(q[:, j] / rnd.exponential(seeds, 0, rnd.STREAM_DRAFT + j, V)).argmax(-1) for j in range(k)]
        ids = torch.stack(races, dim=1) if k else torch.empty(B, 0, dtype=torch.long)  # [B, k]
    else:  # one-hot drafts are argmax drafts, as a greedy draft model or a good n-gram match gives
        ids = q_logits.argmax(-1)  # [B, k]
    bad = torch.rand(B, k, generator=g) < invalid_frac
    ids = torch.where(bad, torch.tensor([-1, V, V + 7])[torch.randint(0, 3, (B, k), generator=g)], ids)
    n = torch.randint(0, k + 1, (B,), generator=g)  # [B]
    ids = torch.where(torch.arange(k)[None, :] < n[:, None], ids, -1)
    return dict(
        target_logits=logits.to(dtype),
        draft_token_ids=ids,
        num_draft_tokens=n,
        draft_probs=q.to(dtype) if probs else None,
        is_greedy=torch.rand(B, generator=g) < greedy_frac,
        uniforms=rnd.uniform(seeds, 0, rnd.STREAM_ACCEPT, k),
        exponentials=rnd.exponential(seeds, 0, rnd.STREAM_RESIDUAL, V),
        temperature=(0.5 + torch.rand(B, generator=g)) if temperature else None,
    )


def check(inputs: dict, **knobs) -> torch.Tensor:  # [B, k+1]
    """The kernel output, asserted equal to the reference and well formed."""
    out = rejection_sample_triton(**inputs, **knobs)
    ref = rejection_sample_reference(**inputs)
    assert torch.equal(out, ref), f"kernel != reference at rows {(out != ref).any(-1).nonzero().flatten().tolist()}"
    V = inputs["target_logits"].shape[-1]
    assert bool((out < V).all()), "an id >= V was emitted"
    emitted = (out >= 0).sum(-1)  # [B] accepted + 1
    assert bool((emitted >= 1).all()) and bool((emitted <= inputs["num_draft_tokens"] + 1).all())
    return out


@interpreted
@pytest.mark.parametrize("temperature", [False, True])
@pytest.mark.parametrize("probs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(dtype: torch.dtype, probs: bool, temperature: bool) -> None:
    inputs = make_inputs(24, 4, 45, dtype=dtype, probs=probs, temperature=temperature, seed=1)
    out = check(inputs)
    assert torch.equal(out, check(inputs, **TILED))
    accepted = (out >= 0).sum(-1) - 1
    assert 0 < int(accepted.sum()) < int(inputs["num_draft_tokens"].sum()), "want both accepts and rejects"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_layout_one_row_per_program(dtype: torch.dtype) -> None:
    check(make_inputs(6, 3, 70, dtype=dtype, probs=True, temperature=True, seed=2), **GPU_LAYOUT)
    check(make_inputs(6, 3, 70, dtype=dtype, probs=False, seed=3), **GPU_LAYOUT)


@interpreted
@pytest.mark.parametrize("probs", [True, False])
def test_all_accepted(probs: bool) -> None:
    inputs = make_inputs(16, 5, 40, probs=probs, invalid_frac=0.0, greedy_frac=0.0, seed=4)
    inputs["num_draft_tokens"].fill_(5)
    inputs["draft_token_ids"] = inputs["target_logits"][:, :5].argmax(-1)
    inputs["uniforms"].zero_()  # accept iff q(d) > 0 and p(d) > 0
    if probs:
        inputs["draft_probs"] = torch.softmax(inputs["target_logits"][:, :5], dim=-1)
    out = check(inputs, **TILED)
    assert torch.equal(out[:, :5], inputs["draft_token_ids"]) and bool((out[:, 5] >= 0).all())


@interpreted
@pytest.mark.parametrize("probs", [True, False])
def test_first_token_rejected(probs: bool) -> None:
    inputs = make_inputs(16, 3, 40, probs=probs, invalid_frac=0.0, greedy_frac=0.25, seed=5)
    inputs["num_draft_tokens"].fill_(3)
    d0 = inputs["draft_token_ids"][:, 0] = torch.arange(16) % 40
    inputs["target_logits"][torch.arange(16), 0, d0] = -float("inf")  # p_0(d_0) = 0: never accepted
    out = check(inputs, **TILED)
    assert bool((out[:, 0] != d0).all()) and bool((out[:, 1:] == -1).all())


@interpreted
def test_ragged_lengths_single_token_and_k0() -> None:
    inputs = make_inputs(12, 5, 33, seed=6)
    inputs["num_draft_tokens"] = torch.arange(12) % 6  # 0..5, every length
    inputs["draft_token_ids"] = torch.where(torch.arange(5) < inputs["num_draft_tokens"][:, None], 3, -1)
    check(inputs, **TILED)
    check(make_inputs(1, 1, 29, seed=7))  # a single row with a single draft
    for probs in (True, False):
        check(make_inputs(5, 0, 29, probs=probs, seed=8), **TILED)  # k = 0: bonus only


@interpreted
@pytest.mark.parametrize("probs", [True, False])
def test_vocab_size_one(probs: bool) -> None:
    out = check(make_inputs(8, 3, 1, probs=probs, seed=9), **TILED)
    assert bool((out[:, 0] == 0).all())


@interpreted
def test_large_batch_and_long_drafts() -> None:
    check(make_inputs(256, 3, 24, dtype=torch.bfloat16, temperature=True, seed=10))
    check(make_inputs(256, 3, 24, probs=False, seed=11))
    for probs in (True, False):  # q close to p: long accepted runs
        check(make_inputs(8, 32, 40, probs=probs, noise=0.1, greedy_frac=0.5, seed=12), **TILED)


@interpreted
@pytest.mark.parametrize("probs", [True, False])
def test_invalid_draft_ids_are_rejected(probs: bool) -> None:
    inputs = make_inputs(12, 3, 30, probs=probs, invalid_frac=0.0, seed=13)
    inputs["num_draft_tokens"].fill_(3)
    inputs["draft_token_ids"][:, 0] = torch.tensor([-1, 30, 31, 2**40, -(2**40), 10**15] * 2)
    inputs["uniforms"].zero_()
    out = check(inputs, **TILED)
    assert bool((out[:, 1:] == -1).all()) and bool((out[:, 0] >= 0).all())


@interpreted
@pytest.mark.parametrize("probs", [True, False])
def test_last_tile_all_zero_never_emits_padding(probs: bool) -> None:
    """GHSA-8wr5-jm2h-8r4f: with every valid entry of the last (partial) tile 0, no padded lane may win."""
    inputs = make_inputs(16, 2, 40, probs=probs, invalid_frac=0.0, greedy_frac=0.0, seed=14)
    inputs["target_logits"][:, :, 32:] = -float("inf")  # p = 0 on ids 32..39, the valid part of the last tile
    inputs["exponentials"][:, 32:] = 1e-30  # would make any nonzero score there win
    out = check(inputs, block_stats=16, block_race=16, num_splits=(1, 1), rows_per_program=1)
    assert bool((out < 32).all())
    # residual all zero (q = 2p >= p everywhere): the fallback to p, over tiles whose scores all tie
    inputs = make_inputs(16, 2, 5, probs=True, invalid_frac=0.0, greedy_frac=0.0, seed=15)
    inputs["draft_probs"] = 2.0 * torch.softmax(inputs["target_logits"][:, :2], -1)
    inputs["uniforms"].fill_(0.9)  # p > 0.9 * 2p fails: every first draft is rejected
    inputs["num_draft_tokens"].fill_(2)
    out = check(inputs, block_stats=4, block_race=4, num_splits=(2, 2), rows_per_program=2)
    assert bool((out[:, 1:] == -1).all())


@interpreted
def test_ties_go_to_the_lowest_id() -> None:
    B, V = 6, 37
    inputs = make_inputs(B, 2, V, probs=False, invalid_frac=0.0, greedy_frac=0.5, seed=16)
    inputs["target_logits"].zero_()  # every logit equal: greedy argmax is 0, race scores all tie
    inputs["exponentials"].fill_(1.0)
    inputs["draft_token_ids"].fill_(0)
    inputs["num_draft_tokens"].fill_(2)
    inputs["uniforms"].fill_(0.99)  # p = 1/37 <= 0.99: random rows reject d = 0 and race over ids 1..36
    out = check(inputs, **GPU_LAYOUT)
    greedy = inputs["is_greedy"]
    assert bool((out[greedy, :3] == 0).all()) and bool((out[~greedy, 0] == 1).all())


def _law(logits: torch.Tensor, temperature: float | None) -> torch.Tensor:  # [V] float64
    p = torch.softmax(logits.double() / (temperature or 1.0), dim=-1)
    return p / p.sum()


@interpreted
@pytest.mark.parametrize("mode", ["draft_probs", "one_hot", "temperature"])
def test_output_distribution_matches_target(mode: str) -> None:
    """The first emitted token follows p_0 and the second (when d_0 was accepted) p_1: chi-square, 60k rows."""
    B, k, V = 60_000, 2, 6
    g = torch.Generator().manual_seed(17)
    target = torch.randn(k + 1, V, generator=g) * 1.2  # [k+1, V] the same target law on every row
    draft = torch.randn(k, V, generator=g) * 1.2  # [k, V] a different draft law
    q = torch.softmax(draft, dim=-1)
    seeds = torch.arange(B, dtype=torch.int64) + 12345
    ids = torch.stack([(q[j] / rnd.exponential(seeds, 3, rnd.STREAM_DRAFT + j, V)).argmax(-1) for j in range(k)], 1)
    temp = 0.7 if mode == "temperature" else None
    out = rejection_sample_triton(
        target[None].expand(B, k + 1, V).contiguous(),
        ids,
        torch.full((B,), k),
        q[None].expand(B, k, V).contiguous() if mode != "one_hot" else None,
        torch.zeros(B, dtype=torch.bool),
        rnd.uniform(seeds, 3, rnd.STREAM_ACCEPT, k),
        rnd.exponential(seeds, 3, rnd.STREAM_RESIDUAL, V),
        torch.full((B,), temp) if temp else None,
    )
    for j in range(2):
        tokens = out[:, j][out[:, j] >= 0] if j else out[:, 0]
        observed = torch.bincount(tokens, minlength=V).double()
        expected = _law(target[j], temp) * observed.sum()
        assert int(observed.sum()) > (50_000 if j == 0 else 5_000)
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3, (j, observed, expected)


@interpreted
def test_dispatch_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(8, 3, 20, seed=18)
    ref = rejection_sample_reference(**inputs)
    for choice in ("triton", "torch", " Torch "):
        monkeypatch.setenv(SAMPLER_ENV, choice)
        assert torch.equal(rejection_sample(**inputs), ref)
    monkeypatch.setenv(SAMPLER_ENV, "cuda")
    with pytest.raises(ValueError, match="triton, torch"):
        rejection_sample(**inputs)


@interpreted
def test_shape_errors_name_the_input() -> None:
    inputs = make_inputs(4, 3, 20, seed=19)
    inputs["exponentials"] = inputs["exponentials"][:, :10]
    with pytest.raises(ValueError, match="exponentials"):
        rejection_sample_triton(**inputs)


def test_compile_time_sizes_follow_neither_the_batch_nor_the_verify_width() -> None:
    """A new compile-time size compiles the kernels again (about a second on a GPU); the dynamic path's batch and
    verify width change from step to step. Each kernel's integer arguments for them are not specialised either."""
    from hf_specdec.sampling import kernels

    for V in (7, 1000, 32_000, 128_256):
        bs = min(2048, 1 << (V - 1).bit_length())
        assert len({tuple(kernels.launch_sizes(V, k1, bs, bs).items()) for k1 in range(1, 9)}) == 1
    not_specialised = {
        kernels._stats_kernel: {"B", "K1", "S1"},
        kernels._race_kernel: {"B", "K", "S1", "S2"},
        kernels._finalize_kernel: {"B", "K1", "S2"},
    }
    for kernel, names in not_specialised.items():
        assert set(getattr(kernel, "do_not_specialize", None) or names) == names  # the interpreter keeps no list


def test_aligned_copies_only_what_starts_off_a_16_byte_boundary() -> None:
    from hf_specdec.sampling.kernels import aligned

    words = torch.arange(12, dtype=torch.int32)
    assert aligned(words) is words
    view = words[1:]  # 4 bytes in
    copy = aligned(view)
    assert copy.data_ptr() % 16 == 0 and torch.equal(copy, view)


@pytest.mark.requires_cuda
def test_batches_widths_and_offsets_compile_no_new_variants() -> None:
    """Triton compiles a kernel once per pattern of 16-byte-aligned pointers: the dynamic path's batch sizes, verify
    widths and sliced inputs must reuse the first call's variants (each new one cost about a second on an H100)."""
    from hf_specdec.sampling import kernels

    def variants() -> int:
        return sum(len(next(iter(k.device_caches.values()))[0]) for k in (
            kernels._stats_kernel, kernels._race_kernel, kernels._finalize_kernel))  # fmt: skip

    def run(B: int, k: int, offset: int) -> None:
        inputs = make_inputs(B + offset, k, 4096, dtype=torch.bfloat16, seed=B * 10 + k)  # one row per program
        inputs = {name: t.cuda()[offset:] if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
        rejection_sample_triton(**inputs)

    run(32, 4, 0)
    first = variants()
    for B, k, offset in ((31, 3, 0), (25, 1, 1), (18, 2, 1), (7, 4, 0), (3, 1, 1), (1, 2, 0), (30, 4, 1)):
        run(B, k, offset)
    assert variants() == first


@in_subprocess
def test_kernels_in_subprocess() -> None:
    rerun_interpreted(__file__, timeout=900)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("probs", [True, False])
def test_compiled_kernels_on_cuda_match_reference(dtype: torch.dtype, probs: bool) -> None:
    """On a GPU the compiled kernels (not the interpreter) equal the reference, at real vocabulary sizes too."""
    for B, k, V, temperature in (
        (1, 1, 7, False),
        (37, 4, 1000, True),
        (64, 4, 128_256, False),
        (256, 8, 32_000, True),
    ):
        inputs = make_inputs(B, k, V, dtype=dtype, probs=probs, temperature=temperature, seed=B + k)
        inputs = {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
        out = rejection_sample_triton(**inputs)
        ref = rejection_sample_reference(**inputs)
        assert torch.equal(out, ref), f"B={B} k={k} V={V}: rows {(out != ref).any(-1).nonzero().flatten().tolist()}"
        assert torch.equal(rejection_sample(**inputs), out), "CUDA tensors must dispatch to the kernels"
