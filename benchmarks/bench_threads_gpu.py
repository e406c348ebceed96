"""Benchmark on one GPU: 8 client threads sharing one model on the default (captured) path, against the same requests
made one at a time.

The models are `bench_gpu_e2e.py`'s (an 8B-shaped bf16 Llama target, a 124M-shaped synthetic draft right with
probability alpha). 8 clients each make 3 calls with varied batch sizes (1, 2 and 4 rows, ragged prompts), all
through one `SpecDecoder` with no flags. Turns alternate: the 24 requests one at a time on one thread, then the same
24 requests from 8 threads at once. Reported: wall time and tokens/s of each turn, errors, whether every output
equals the lone call's (and plain `generate`'s), the graphs kept per model afterwards, and peak GPU memory.

Run (GPU): `PYTHONPATH=. python benchmarks/bench_threads_gpu.py --out threads.json` (`--tiny` for a CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time

import torch
import transformers

import hf_specdec
from benchmarks import bench_gpu_default as default
from benchmarks import bench_gpu_e2e as e2e
from hf_specdec import graph_reuse

BATCHES = (1, 2, 4)
CLIENTS = 8
CALLS = 3


def requests() -> list[tuple[int, int]]:  # (client, batch size), in the order one thread would make them
    return [(i, BATCHES[(i + j) % len(BATCHES)]) for i in range(CLIENTS) for j in range(CALLS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a dry run of the script")
    args = parser.parse_args()
    if args.tiny:
        e2e.use_tiny_shapes()
    n_new = args.new_tokens
    target, draft, inputs = default.setup(list(BATCHES), n_new, args.prompt_len)
    draft.alpha = args.alpha
    spec = hf_specdec.SpecDecoder(draft_model=draft)  # one SpecDecoder, no flags, shared by every thread
    gen = dict(max_new_tokens=n_new, do_sample=False)

    def call(batch: int) -> torch.Tensor:
        return target.generate(**inputs[batch], **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)

    with torch.no_grad():
        plain = {b: target.generate(**inputs[b], **gen) for b in BATCHES}
        alone = {b: call(b) for b in BATCHES}  # also the warm-up: calibration, first captures
        alone_equals_plain = all(torch.equal(alone[b], plain[b]) for b in BATCHES)
        replays = spec.last_stats.num_graph_replays
        torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
        errors: list[str] = []
        wrong = 0
        turns: dict[str, list[float]] = {"one_at_a_time": [], "threads": []}

        def serve(batches: list[int]) -> None:
            nonlocal wrong
            for b in batches:
                try:
                    if not torch.equal(call(b), alone[b]):
                        wrong += 1
                except Exception as error:  # noqa: BLE001 - counted and reported
                    errors.append(repr(error))

        for _ in range(args.turns):
            e2e.sync()
            t0 = time.perf_counter()
            serve([b for _, b in requests()])
            e2e.sync()
            turns["one_at_a_time"].append(time.perf_counter() - t0)
            threads = [
                threading.Thread(target=serve, args=([b for c, b in requests() if c == i],)) for i in range(CLIENTS)
            ]
            e2e.sync()
            t0 = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            e2e.sync()
            turns["threads"].append(time.perf_counter() - t0)
    tokens = sum(b for _, b in requests()) * n_new
    kept = graph_reuse._ENTRIES.get(target, [])
    result = dict(
        meta=dict(
            gpu=e2e.device_name(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            command=" ".join(sys.argv),
            clients=CLIENTS,
            calls=CALLS,
            batches=BATCHES,
            new_tokens=n_new,
            alpha=args.alpha,
        ),  # fmt: skip
        alone_equals_plain=alone_equals_plain,
        alone_graph_replays=replays,
        calls=2 * args.turns * len(requests()),
        errors=errors,
        wrong_outputs=wrong,
        seconds=turns,
        tokens_per_s={key: [tokens / s for s in v] for key, v in turns.items()},
        threads_vs_one_at_a_time=dict(
            min=min(a / t for a, t in zip(turns["one_at_a_time"], turns["threads"])),
            median=statistics.median(a / t for a, t in zip(turns["one_at_a_time"], turns["threads"])),
        ),
        kept_entries=len(kept),
        kept_graphs=sum(len(entry.graphs) for entry in kept),
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    )
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
