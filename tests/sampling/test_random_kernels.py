"""The Triton draws (`random_kernels.draws_triton`) equal the torch draws of `random.py` bit for bit.

On the CPU the kernel runs in the Triton interpreter (TRITON_INTERPRET=1 must precede the first import of triton:
as in test_kernels.py, a process that imported triton first re-runs this file in a subprocess); on a GPU, compiled,
and captured in a CUDA graph that reads the step counter from the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`
pytest.importorskip("triton")

from hf_specdec.sampling import random as rnd  # noqa: E402
from hf_specdec.sampling.kernels import triton_interprets  # noqa: E402
from hf_specdec.sampling.random_kernels import BLOCK  # noqa: E402

IN_PROCESS = triton_interprets()
interpreted = pytest.mark.skipif(not IN_PROCESS, reason="run by test_draws_in_subprocess (triton was imported first)")
REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.skipif(IN_PROCESS, reason="the interpreter is on in this process: the tests above ran here")
def test_draws_in_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]


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
