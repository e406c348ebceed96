"""Benchmark: n-gram prompt lookup, hf_specdec's numba kernel vs transformers' PromptLookupCandidateGenerator.

For batch x context x max_n it times one proposal step (min_n=1, k=8) on synthetic token streams (vocab 49152,
random spans interleaved with spans copied from earlier in the context, so matches exist): `ngram_search` on
the whole batch (default serial/parallel policy, and forced parallel), `NgramProposer.propose` on CPU tensors,
and HF's `get_candidates` called one row at a time. Medians of several repeats, same process.

Run: `PYTHONPATH=. python benchmarks/bench_ngram.py --out ngram.json`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import numba
import numpy as np
import torch
import transformers
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.ngram import NgramProposer
from hf_specdec.proposers.ngram_search import PARALLEL_MIN_TOKENS, ngram_search

VOCAB = 49152


def make_stream(rng: np.random.Generator, length: int, copy_prob: float = 0.5) -> np.ndarray:
    """A [length] int64 token stream: random spans of 16-128 tokens and spans copied from earlier."""
    out = np.empty(length, dtype=np.int64)  # [L]
    pos = 0
    while pos < length:
        span = min(int(rng.integers(16, 129)), length - pos)
        if pos >= 256 and rng.random() < copy_prob:
            src = int(rng.integers(0, pos - span)) if pos > span else 0
            out[pos : pos + span] = out[src : src + span]
        else:
            out[pos : pos + span] = rng.integers(0, VOCAB, span)
        pos += span
    return out


def time_median(fn: Callable[[], object], repeats: int, min_time: float = 2e-3) -> float:
    """Median seconds per call of `fn` over `repeats` timed blocks (calls per block sized to >= min_time)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    number = max(1, int(min_time / max(once, 1e-9)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return float(np.median(samples))


def bench_combo(
    tokens: np.ndarray, max_n: int, k: int, repeats: int, hf_repeats: int, hf_budget_s: float
) -> dict[str, object]:
    batch_size, length = tokens.shape  # [B, L]
    starts = np.zeros(batch_size, dtype=np.int64)  # [B]
    ends = np.full(batch_size, length, dtype=np.int64)  # [B]
    num_tokens = np.full(batch_size, k, dtype=np.int64)  # [B]
    _, counts, _ = ngram_search(tokens, starts, ends, num_tokens, 1, max_n, k)
    ours = time_median(lambda: ngram_search(tokens, starts, ends, num_tokens, 1, max_n, k), repeats)

    token_tensor = torch.from_numpy(tokens)  # [B, L]
    batch = RaggedBatch(
        token_ids=token_tensor,
        lengths=torch.from_numpy(ends),
        pad_lengths=torch.from_numpy(starts),
        row_ids=torch.arange(batch_size),
        prompt_width=length,
    )
    proposer = NgramProposer(k, prompt_lookup_min=1, prompt_lookup_max=max_n)
    budget = torch.from_numpy(num_tokens)
    proposer_s = time_median(lambda: proposer.propose(batch, budget, None), repeats)

    record: dict[str, object] = {
        "batch": batch_size,
        "context": length,
        "max_n": max_n,
        "ours_us": ours * 1e6,
        "ours_parallel_us": None,
        "proposer_us": proposer_s * 1e6,
        "ours_match_rate": float((counts > 0).mean()),
        "hf_us": None,
        "hf_repeats": 0,
        "hf_match_rate": None,
        "ratio_hf_over_ours": None,
    }
    generator = PromptLookupCandidateGenerator(
        eos_token_id=None, num_output_tokens=k, max_matching_ngram_size=max_n, max_length=length + 64
    )
    rows = [token_tensor[i : i + 1] for i in range(batch_size)]  # B x [1, L]
    t0 = time.perf_counter()
    generator.get_candidates(rows[0])
    estimate = (time.perf_counter() - t0) * batch_size  # seconds per step
    reps = min(hf_repeats, int(hf_budget_s / max(estimate, 1e-9)) - 1)
    if reps < 3:
        record["hf_skipped"] = f"estimated {estimate:.1f} s per step: over the {hf_budget_s:.0f} s budget"
    else:
        matched = [generator.get_candidates(row)[0].shape[1] > length for row in rows]

        def hf_step() -> None:
            for row in rows:
                generator.get_candidates(row)

        hf = time_median(hf_step, reps, min_time=0.0)
        record.update(
            hf_us=hf * 1e6, hf_repeats=reps, hf_match_rate=float(np.mean(matched)), ratio_hf_over_ours=hf / ours
        )
    # Last: numba's OpenMP workers spin for a while after a parallel region, which would slow what follows.
    par = time_median(lambda: ngram_search(tokens, starts, ends, num_tokens, 1, max_n, k, parallel=True), repeats)
    record["ours_parallel_us"] = par * 1e6
    return record


def machine_info() -> dict[str, object]:
    model = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15min": os.getloadavg(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parallel_min_tokens": PARALLEL_MIN_TOKENS,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def _fmt(value: object, spec: str) -> str:
    return "skipped" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--max-n", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=21, help="timed blocks for hf_specdec (median)")
    parser.add_argument("--hf-repeats", type=int, default=5, help="timed steps for HF (median)")
    parser.add_argument("--hf-budget", type=float, default=20.0, help="max seconds of HF timing per combination")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for HF (1: per-core comparison with our serial path, and no OpenMP stalls "
        "when other processes share the cores; 0: leave torch's default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default=None, help="write results as JSON here")
    args = parser.parse_args()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    info = machine_info()
    print(
        f"# {info['cpu']}, {info['cpu_count']} cores, numba threads {info['numba_threads']}, torch threads "
        f"{info['torch_threads']}, load {info['load_average_1_5_15min']}"
    )
    header = (
        f"{'batch':>5} {'context':>7} {'max_n':>5} | {'ours us':>9} {'parallel':>9} {'proposer':>9} | "
        f"{'HF us':>11} {'HF/ours':>8} | {'match ours/HF':>13}"
    )
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(args.seed)
    results = []
    start = time.perf_counter()
    for length in args.context:
        streams = np.stack([make_stream(rng, length) for _ in range(max(args.batch))])  # [B_max, L]
        for batch_size in args.batch:
            tokens = np.ascontiguousarray(streams[:batch_size])  # [B, L]
            for max_n in args.max_n:
                r = bench_combo(tokens, max_n, args.k, args.repeats, args.hf_repeats, args.hf_budget)
                results.append(r)
                hf_match = _fmt(r["hf_match_rate"], ".2f")
                ratio = "skipped" if r["ratio_hf_over_ours"] is None else f"{r['ratio_hf_over_ours']:.0f}x"
                print(
                    f"{batch_size:>5} {length:>7} {max_n:>5} | {r['ours_us']:>9.1f} {r['ours_parallel_us']:>9.1f} "
                    f"{r['proposer_us']:>9.1f} | {_fmt(r['hf_us'], '11.0f'):>11} "
                    f"{ratio:>8} | {r['ours_match_rate']:.2f}/{hf_match}",
                    flush=True,
                )
    info["total_seconds"] = time.perf_counter() - start
    info["load_average_after"] = os.getloadavg()
    print(f"# total {info['total_seconds']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
