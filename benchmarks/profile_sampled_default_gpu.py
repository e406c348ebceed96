"""Why the sampled default drafts less in some rounds of `bench_gpu_default.py --part batch1` (a diagnosis).

Runs `bench_gpu_default.run_setting` as the benchmark does (α 0 greedy, then α 0.8 sampled, every route in turn) and
prints, for every hf_specdec call, its route, its stats (drafting share, acceptance, replays, capture seconds, graph
reuse and its reason) and the adaptive schedule's trace (`profile_dynamic_gpu.traced`: the cost table and survival
it chose from, the drafts chosen, the step times recorded, the steps left untimed). It wraps internals: a diagnosis,
not a benchmark.

Run (GPU): `PYTHONPATH=. python benchmarks/profile_sampled_default_gpu.py`; `--tiny` for a CPU dry run.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import hf_specdec
from benchmarks import bench_gpu_default as bench
from benchmarks import bench_gpu_e2e as e2e
from benchmarks import profile_dynamic_gpu as profile
from hf_specdec import graph_reuse
from hf_specdec.sampling.rejection import SAMPLER_ENV


def route_of(args: tuple, kwargs: dict) -> str:
    config = kwargs.get("generation_config", args[3] if len(args) > 3 else None)
    if "dynamic" in (kwargs.get("cache_implementation"), getattr(config, "cache_implementation", None)):
        return "ours_dynamic"
    if os.environ.get(graph_reuse.REUSE_ENV) == "0":
        return "ours_no_reuse"
    if os.environ.get(SAMPLER_ENV) == "torch":
        return "ours_torch_sampler"
    return "ours_default"


def main() -> None:
    if "--tiny" in sys.argv:
        e2e.use_tiny_shapes()
    profile.traced()
    original = hf_specdec.generate

    @functools.wraps(original)  # transformers reads the custom generate's signature
    def traced_generate(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        profile.trace.clear()
        out = original(model, *args, **kwargs)
        s = kwargs["spec_decoder"].last_stats
        route = route_of(args, kwargs)
        print(json.dumps(dict(route=route, steps=s.num_steps,
                              drafting=round(s.num_drafting_row_steps / max(1, s.num_row_steps), 3),
                              acceptance=round(s.acceptance_rate, 3), replays=s.num_graph_replays,
                              capture_s=round(s.compile_time_s, 3), reuse=s.graph_reuse, why=s.graph_reuse_reason,
                              wall_s=round(s.wall_time_s, 3), calibration_s=round(s.calibration_time_s, 3),
                              trace=profile.trace[:60] if route == "ours_default" else None)), flush=True)  # fmt: skip
        return out

    hf_specdec.generate = traced_generate
    target, draft, all_inputs = bench.setup([1], 64, 128)
    for alpha, sample in ((0.0, False), (0.8, True)):
        print(f"=== alpha {alpha} sample {sample}", flush=True)
        bench.run_setting(f"alpha={alpha} sample={sample}", target, draft, all_inputs[1], alpha, 64, 3, sample)


if __name__ == "__main__":
    main()
