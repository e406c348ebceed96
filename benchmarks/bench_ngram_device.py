"""Benchmark: the device n-gram matcher (`ngram_search_device`) per call, against the numba kernel on the host.

For batch x context x max_n (min_n=1, k=8) on synthetic token streams (random spans and spans copied from earlier,
as in bench_ngram.py), with a static-cache-like buffer (capacity = context + 64: scratch past each row's end):
- on CUDA, CUDA events around the eager call and around a replay of the call captured as a CUDA graph (how the
  captured static step runs it), medians of several repeats;
- on the CPU, `time.perf_counter` around the eager call;
- `ngram_search` (numba, serial, on a host copy) for reference, plus the host copy the dynamic path makes.
Each combination first checks that both matchers return the same drafts. Prints a table and the JSON.

Run: `PYTHONPATH=. python benchmarks/bench_ngram_device.py [--device cuda] [--batch 64 --context 8192] [--out f.json]`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.bench_ngram import make_stream
from hf_specdec.proposers.ngram_device import ngram_search_device
from hf_specdec.proposers.ngram_search import ngram_search

SCRATCH = 64  # columns past the longest row, as a static batch holds (max_length + k + 1)


def host_median_us(fn: Callable[[], object], repeats: int) -> float:
    """Median microseconds of `fn` over `repeats` calls (after two warm-up calls), timed on the host."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def cuda_median_us(fn: Callable[[], object], repeats: int, calls: int = 20) -> float:
    """Median microseconds per call of `fn` over `repeats` blocks of `calls` calls, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def bench_combo(
    streams: np.ndarray, batch_size: int, max_n: int, k: int, device: torch.device, repeats: int
) -> dict[str, object]:
    length = streams.shape[1]
    rng = np.random.default_rng(batch_size * 1000 + max_n)
    tokens = np.zeros((batch_size, length + SCRATCH), dtype=np.int64)  # [B, C]
    tokens[:, :length] = streams[:batch_size]
    starts = rng.integers(0, 32, size=batch_size)  # [B] some left padding
    ends = np.full(batch_size, length, dtype=np.int64)  # [B]
    num_tokens = np.full(batch_size, k, dtype=np.int64)  # [B]
    args = [torch.from_numpy(a).to(device) for a in (tokens, starts, ends, num_tokens)]

    def call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ngram_search_device(*args, 1, max_n, k)

    expected = ngram_search(tokens, starts, ends, num_tokens, 1, max_n, k, parallel=False)
    for want, got in zip(expected, call(), strict=True):
        np.testing.assert_array_equal(got.cpu().numpy(), want)
    record: dict[str, object] = {
        "batch": batch_size,
        "context": length,
        "capacity": length + SCRATCH,
        "max_n": max_n,
        "k": k,
        "device": str(device),
        "match_rate": float((expected[1] > 0).mean()),
    }
    if device.type == "cuda":
        record["device_eager_us"] = cuda_median_us(call, repeats)
        graph = torch.cuda.CUDAGraph()
        call()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            call()
        record["device_graph_us"] = cuda_median_us(graph.replay, repeats)
        # What the dynamic path pays per step instead: the host copy of the buffer, then numba.
        record["host_copy_us"] = host_median_us(lambda: args[0][:, :length].cpu(), repeats)
    else:
        record["device_eager_us"] = host_median_us(call, repeats)
    record["numba_serial_us"] = host_median_us(
        lambda: ngram_search(tokens, starts, ends, num_tokens, 1, max_n, k, parallel=False), repeats
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--max-n", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (CPU timing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    info = {
        "device": name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15min": os.getloadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    print(f"# {info['device']}, torch threads {info['torch_threads']}, load {info['load_average_1_5_15min']}")
    header = f"{'batch':>5} {'context':>7} {'max_n':>5} | {'device us':>10} {'graph us':>10} | {'numba us':>10}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(args.seed)
    results = []
    for length in args.context:
        streams = np.stack([make_stream(rng, length) for _ in range(max(args.batch))])  # [B_max, L]
        for batch_size in args.batch:
            for max_n in args.max_n:
                r = bench_combo(streams, batch_size, max_n, args.k, device, args.repeats)
                results.append(r)
                graph = r.get("device_graph_us")
                print(
                    f"{batch_size:>5} {length:>7} {max_n:>5} | {r['device_eager_us']:>10.1f} "
                    f"{'-' if graph is None else format(graph, '.1f'):>10} | {r['numba_serial_us']:>10.1f}"
                )
    payload = {"machine": info, "results": results}
    print(json.dumps(payload, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
