"""The Triton draws (`random_kernels.draws_triton`) equal the torch draws of `random.py` bit for bit.

On the CPU the kernel runs in the Triton interpreter (tests/triton_interpreter.py: here, or in a fresh process where
this one imported triton first); on a GPU, compiled, and captured in a CUDA graph that reads the step counter from
the device.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import in_subprocess, interpreted, rerun_interpreted

from hf_specdec.sampling import random as rnd
from hf_specdec.sampling.random_kernels import BLOCK

SEEDS = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789012345], dtype=torch.int64)  # [6] edge words too


def draws_triton(seeds: torch.Tensor, step, stream: int, n: int, *, exponential: bool) -> torch.Tensor:  # noqa: ANN001
    return rnd._draws_triton(seeds, step, stream, n, exponential)


def assert_draws_equal(seeds: torch.Tensor, steps: list, streams: list[int], sizes: list[int]) -> None:
    for step in steps:
        for stream in streams:
            for n in sizes:
                for exponential, reference in ((False, rnd.torch_uniform), (True, rnd.torch_exponential)):
                    got = draws_triton(seeds, step, stream, n, exponential=exponential)  # [B, n]
                    want = reference(seeds, step, stream, n)  # [B, n]
                    where = f"step={step!r} stream={stream} n={n} exponential={exponential}"
                    assert got.dtype == torch.float32 and torch.equal(got, want), where


@interpreted
def test_interpreted_draws_equal_torch_draws() -> None:
    """Host steps (0, large, negative), a device step, several streams, sizes around the kernel's block."""
    steps = [0, 7, 2**64 + 3, -5, torch.tensor(7)]
    assert_draws_equal(SEEDS, steps, [0, 1, 2, 5], [1, 3, BLOCK + 5])


@interpreted
def test_a_device_step_gives_the_draws_of_the_int_it_holds_and_no_rows_gives_nothing() -> None:
    for step in (0, 11):
        for exponential in (False, True):
            as_int = draws_triton(SEEDS, step, 2, 9, exponential=exponential)
            assert torch.equal(draws_triton(SEEDS, torch.tensor(step), 2, 9, exponential=exponential), as_int)
    assert draws_triton(SEEDS[:0], 0, 0, 5, exponential=True).shape == (0, 5)


@in_subprocess
def test_draws_in_subprocess() -> None:
    rerun_interpreted(__file__, timeout=600)


@pytest.mark.requires_cuda
def test_cuda_draws_use_the_kernel_and_equal_torch_draws() -> None:
    """On a GPU `uniform`/`exponential` launch the compiled kernel; its values are the torch path's, at a real
    vocabulary size too."""
    seeds = SEEDS.cuda()
    assert_draws_equal(seeds, [0, 3, torch.tensor(3, device="cuda")], [0, 1, 6], [4, 128_256])
    assert torch.equal(rnd.exponential(seeds, 5, 1, 1000), draws_triton(seeds, 5, 1, 1000, exponential=True))


@pytest.mark.requires_cuda
def test_a_captured_draw_replays_each_steps_own_values() -> None:
    """In a CUDA graph the kernel reads the device step counter at replay: each replay draws its step's values."""
    seeds, step = SEEDS.cuda(), torch.zeros((), dtype=torch.int64, device="cuda")
    out = torch.empty(SEEDS.shape[0], 4096, device="cuda")
    rnd.exponential(seeds, step, 1, 4096)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(rnd.exponential(seeds, step, 1, 4096))
        step.add_(1)
    for expected_step in range(3):
        graph.replay()
        assert torch.equal(out, rnd.torch_exponential(seeds, expected_step, 1, 4096)), expected_step
