"""Profile of the batched speculative step on one GPU: where a step's time goes at B = 1, 32, 64 and 128.

The models are `bench_gpu_e2e.py`'s (an 8B-shaped bf16 Llama target, a 124M-shaped synthetic draft right with
probability alpha = 0.8), ragged prompts of 64-128 tokens, 64 new tokens. For each batch size:

- **forwards**: one target forward of width 1 (a plain step) and of width 1 + k (a verify), and one draft forward,
  over a 160-token cache (eager, synchronised, medians): whether the verify is still memory-bound;
- **calls**: plain eager `generate`, plain compiled `generate(cache_implementation="static")`, hf_specdec with no
  flags (the adaptive schedule, captured steps), the same without grouped attention (`grouped_attention`: the
  key-value heads copied as transformers does) and with a constant k = 4 (captured), timed in interleaved turns;
  tokens/s, identical outputs, peak GPU memory, and each method's first call (plain compiled: its compile);
- **phases**: the same constant-k call on static caches with steps *not* captured
  (`HF_SPECDEC_CAPTURE_STEPS=0`), each loop phase synchronised and timed (the sync adds its own cost);
- **kernels**: `torch.profiler` over the captured constant-k call: device time per kernel class (GEMMs,
  attention, the rest) and the top kernels.

Run (GPU): `PYTHONPATH=. python benchmarks/profile_batched_gpu.py --out profile.json` (`--tiny` for a CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import torch
import transformers

import hf_specdec
from benchmarks import bench_gpu_default as default
from benchmarks import bench_gpu_e2e as e2e
from hf_specdec import grouped_attention

K = 4


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk")):
        return "gemm"
    if any(s in low for s in ("flash", "fmha", "attention", "sdpa", "efficient")):
        return "attention"
    return "other"


def kernels(fn) -> dict:  # noqa: ANN001
    """Device time by kernel class and the top kernels of one call of `fn` (microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: a dry run
    with profile(activities=[activity]) as prof:
        fn()
        e2e.sync()
    by_class: dict[str, float] = defaultdict(float)
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0.0) if torch.cuda.is_available() else event.self_cpu_time_total
        if us <= 0:
            continue
        by_class[kernel_class(event.key)] += us
        rows.append((us, event.count, event.key[:90]))
    rows.sort(reverse=True)
    return dict(by_class_us=dict(by_class), top=[dict(us=u, count=c, name=n) for u, c, n in rows[:12]])


def ungrouped(call):  # noqa: ANN001, ANN201
    """`call` with hf_specdec's forwards copying grouped key-value heads, as transformers' SDPA attention does."""

    def run() -> torch.Tensor:
        kept = grouped_attention.forward_kwargs
        grouped_attention.forward_kwargs = lambda model: {}
        try:
            return call()
        finally:
            grouped_attention.forward_kwargs = kept
            run.stats = call.stats

    return run


def profile_batch(target, draft, inputs, n_new: int, turns: int, phases: bool) -> dict:  # noqa: ANN001
    batch = inputs["input_ids"].shape[0]
    gen = dict(max_new_tokens=n_new, do_sample=False)
    forwards = {
        "target_w1_ms": e2e.forward_time(target, 160, 1, batch) * 1e3,
        f"target_w{K + 1}_ms": e2e.forward_time(target, 160, K + 1, batch) * 1e3,
        "draft_w1_ms": e2e.forward_time(draft, 160, 1, batch) * 1e3,
    }

    def ours(schedule: str):  # noqa: ANN202
        def call() -> torch.Tensor:
            spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=K,
                                          num_speculative_tokens_schedule=schedule)  # fmt: skip
            out = target.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)
            call.stats = spec.last_stats
            return out

        return call

    fns = {"plain_eager": lambda: target.generate(**inputs, **gen),
           "plain_compiled": lambda: target.generate(**inputs, **gen, cache_implementation="static"),
           "ours_default": ours("adaptive"), "ours_default_ungrouped": ungrouped(ours("adaptive")),
           "ours_k4": ours("constant")}  # fmt: skip
    times: dict[str, list[float]] = {key: [] for key in fns}
    memory: dict[str, float] = {}
    first_call_s: dict[str, float] = {}
    with torch.no_grad():
        reference = target.generate(**inputs, **gen)
        identical = {}
        for key, fn in fns.items():  # warm-up turn: peak memory of each, first captures or compile, calibration
            torch.cuda.reset_peak_memory_stats()
            e2e.sync()
            t0 = time.perf_counter()
            identical[key] = bool(torch.equal(fn(), reference))
            e2e.sync()
            first_call_s[key] = time.perf_counter() - t0
            memory[key] = torch.cuda.max_memory_allocated() / 2**30
        for _ in range(turns):
            for key, fn in fns.items():
                e2e.sync()
                t0 = time.perf_counter()
                fn()
                e2e.sync()
                times[key].append(time.perf_counter() - t0)
        default_stats = fns["ours_default"].stats
        k4_stats = fns["ours_k4"].stats
        phase_ms = {}
        if phases:
            os.environ["HF_SPECDEC_CAPTURE_STEPS"] = "0"
            with e2e.phase_timer() as timed:
                fns["ours_k4"]()
            os.environ.pop("HF_SPECDEC_CAPTURE_STEPS")
            steps = fns["ours_k4"].stats.num_steps
            phase_ms = {name: timed[name] / max(1, steps) * 1e3 for name in e2e.PHASES}
        kernel_view = kernels(fns["ours_k4"])
    tps = {key: batch * n_new / statistics.median(v) for key, v in times.items()}
    row = dict(
        batch=batch, forwards=forwards, verify_over_plain_forward=forwards[f"target_w{K + 1}_ms"]
        / forwards["target_w1_ms"], tps_median=tps, seconds=times, identical_to_plain=identical,
        peak_memory_gib=memory, first_call_s=first_call_s,
        default=dict(mean_accepted_length=default_stats.mean_accepted_length,
                     drafting_share=default_stats.num_drafting_row_steps / max(1, default_stats.num_row_steps),
                     steps=default_stats.num_steps, replays=default_stats.num_graph_replays),
        k4=dict(mean_accepted_length=k4_stats.mean_accepted_length, steps=k4_stats.num_steps,
                replays=k4_stats.num_graph_replays,
                step_ms=statistics.median(times["ours_k4"]) / max(1, k4_stats.num_steps) * 1e3),
        phases_ms_per_step=phase_ms,
        kernels=kernel_view,
    )  # fmt: skip
    print(json.dumps({key: row[key] for key in ("batch", "forwards", "tps_median", "identical_to_plain",
                                                "peak_memory_gib", "first_call_s", "default", "k4",
                                                "phases_ms_per_step")}),
          flush=True)  # fmt: skip
    print(json.dumps(kernel_view["by_class_us"]), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 64, 128])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-phases", action="store_true", help="skip the uncaptured, synchronised phase timing")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a dry run of the script")
    args = parser.parse_args()
    if args.tiny:
        e2e.use_tiny_shapes()
        torch.cuda.reset_peak_memory_stats = lambda: None
        torch.cuda.max_memory_allocated = lambda: 0
    target, draft, all_inputs = default.setup(args.batches, args.new_tokens, args.prompt_len)
    draft.alpha = 0.8
    results = dict(meta=dict(gpu=e2e.device_name(), torch=torch.__version__, transformers=transformers.__version__,
                             python=platform.python_version(), command=" ".join(sys.argv), k=K,
                             new_tokens=args.new_tokens, prompt_len=args.prompt_len, turns=args.turns),
                   rows=[])  # fmt: skip
    for batch in args.batches:
        results["rows"].append(
            profile_batch(target, draft, all_inputs[batch], args.new_tokens, args.turns, not args.no_phases)
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
