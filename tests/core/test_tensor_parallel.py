"""Tensor-parallel targets (transformers' `tp_plan="auto"`): two ranks over gloo on the CPU, as torchrun runs them.

`tests/tensor_parallel_worker.py` runs on each rank: greedy calls with a draft model and with prompt lookup must equal
plain tensor-parallel `generate` (which equals the unsharded model); the adaptive schedule, given per-rank step costs
that disagree, must take the first rank's choices on every rank (else the ranks call the target with different
widths and their collectives hang or mix shapes); seeded-by-torch sampling must draw the same tokens on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_model

import hf_specdec

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

TESTS = Path(__file__).resolve().parents[1]
#: generous for two processes on a shared 2-core machine; a hang (ranks that disagree) fails instead of blocking
TIMEOUT_S = 240


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.requires_cuda,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
            ],
        ),
    ],
)
def test_tensor_parallel_ranks_agree_and_equal_plain(tmp_path: Path, device: str) -> None:
    """On GPUs (NCCL) the same checks run on the captured default path: the collectives inside each rank's graphs."""
    model_dir, out_dir = tmp_path / "model", tmp_path / "out"
    out_dir.mkdir()
    make_model("llama", seed=0).save_pretrained(model_dir)
    root = Path(hf_specdec.__file__).resolve().parents[1]  # this checkout's hf_specdec, on every rank
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(root), str(TESTS)])}
    if device == "cpu":  # transformers puts tensor parallelism on the GPUs when it sees any
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(TESTS / "tensor_parallel_worker.py"), str(model_dir), str(out_dir)]  # fmt: skip
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the tensor-parallel ranks did not finish in {TIMEOUT_S} s (a collective waiting?): {error}")
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(ranks):
        for check in ("plain_equals_unsharded", "draft_equals_plain", "ngram_equals_plain", "adaptive_equals_plain"):
            assert result[check] is True, f"rank {rank}: {check}"
        assert result["adaptive_drafted"] > 0, "the first rank's costs make drafting pay: every rank drafts"
        if device == "cuda":
            assert result["graph_replays"] > 0, "a tensor-parallel target takes the captured default path"
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert ranks[0]["plain"] == ranks[1]["plain"]
