"""Why the eager dynamic path's early calls were slow on a GPU: per call, seconds, allocator figures, and, for the
slow ones, where the host's time went (cProfile: Python and the CUDA calls it makes, Triton compiles included).

Models of `bench_gpu_default.py` (8B-shaped target, synthetic draft at alpha 0.8, B given). Per round, in the
benchmark's order: plain eager, compiled plain, hf_specdec's default (captured), then the dynamic path, profiled.
A diagnosis, not a benchmark: `--keep-cudnn` runs hf_specdec's calls with cuDNN's SDPA kernels on (as before
`hf_specdec.attention_backends`); `--dynamic-only` runs the dynamic path alone.
Run (GPU): `PYTHONPATH=. python benchmarks/profile_first_calls_gpu.py 32 [--keep-cudnn] [--dynamic-only]`.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import sys
import time

import torch

import hf_specdec
import hf_specdec.generation
from benchmarks import bench_gpu_e2e as e2e
from benchmarks.bench_gpu_default import K, setup


def main() -> None:
    batch = int(sys.argv[1])
    if "--keep-cudnn" in sys.argv:
        hf_specdec.generation.without_cudnn_attention = lambda device: contextlib.nullcontext()
    target, draft, all_inputs = setup([batch], 64, 128)
    inputs = all_inputs[batch]
    draft.alpha = 0.8
    gen = dict(max_new_tokens=64, do_sample=False)

    def ours(dynamic: bool) -> torch.Tensor:
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=K)
        extra = {"cache_implementation": "dynamic"} if dynamic else {}
        return target.generate(**inputs, **gen, **extra, custom_generate=hf_specdec.generate, spec_decoder=spec)

    others = {
        "plain_eager": lambda: target.generate(**inputs, **gen),
        "plain_compiled": lambda: target.generate(**inputs, **gen, cache_implementation="static"),
        "ours_default": lambda: ours(False),
    }
    if "--dynamic-only" in sys.argv:
        others = {}
    with torch.no_grad():
        for i in range(4):
            for name, fn in others.items():
                e2e.sync()
                t0 = time.perf_counter()
                fn()
                e2e.sync()
                print(f"round {i} {name}: {time.perf_counter() - t0:.2f} s", flush=True)
            before = torch.cuda.memory_stats()
            profiler = cProfile.Profile()
            e2e.sync()
            t0 = time.perf_counter()
            profiler.enable()
            ours(True)
            e2e.sync()
            profiler.disable()
            seconds = time.perf_counter() - t0
            after = torch.cuda.memory_stats()
            grown = {key: after.get(key, 0) - before.get(key, 0) for key in ("num_alloc_retries", "num_device_alloc",
                                                                                "num_device_free")}  # fmt: skip
            print(f"round {i} ours_dynamic: {seconds:.2f} s, allocator {grown}, reserved "
                  f"{after.get('reserved_bytes.all.current', 0) / 2**30:.1f} GiB", flush=True)  # fmt: skip
            if seconds > 2.5:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
                print("\n".join(line[:170] for line in text.getvalue().splitlines()[6:]), flush=True)


if __name__ == "__main__":
    main()
