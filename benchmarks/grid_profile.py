"""`bench_gpu_grid.py --profile POINT`: where one grid point's time goes, to find what to fix at the worst points.

After the point's warm-up (each of hf_specdec's arm and compiled plain called twice), it reports per step of one
hf_specdec call: the wall time; the host's share, split into the loop's parts (the step's plan: the schedule's
choice and a draft's catch-up; the graph launch or eager step; the wait for the step's one host read and the
retirement of rows; the schedule's bookkeeping after it), measured by wrapping those methods (no extra sync); the
device's busy time and top kernels under `torch.profiler`; and compiled plain's per-step time and top kernels
beside it (a captured eager step runs unfused kernels where compiled plain runs fused ones).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks import grid_models as gm
from benchmarks.compiled_plain import CompiledPlain
from benchmarks.profile_batched_gpu import kernel_class
from hf_specdec import decoding, draft_budgets, step_graph

#: the loop's parts timed on the host: (class, method, label)
PARTS = (
    (decoding.SpeculativeLoop, "plan_step", "plan (schedule choice, catch-up)"),
    (step_graph.StepGraph, "run", "launch (replay, or eager step)"),
    (decoding.SpeculativeLoop, "retire_finished", "wait for the step's host read, retire"),
    (draft_budgets.DraftBudgets, "after_step", "schedule bookkeeping"),
)


@contextlib.contextmanager
def host_parts() -> Iterator[dict[str, float]]:
    """Seconds spent in each of `PARTS` (outermost calls only) while the context is open."""
    totals: dict[str, float] = defaultdict(float)
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in PARTS]

    def wrap(fn, label: str):  # noqa: ANN001, ANN202
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start

        return timed

    for (cls, name, fn), (_, _, label) in zip(originals, PARTS):
        setattr(cls, name, wrap(fn, label))
    try:
        yield totals
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def kernels(fn) -> dict[str, Any]:  # noqa: ANN001
    """Device time (us) by kernel class, the top kernels, and the host's top operators of one call of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = gm.Setup.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        gm.sync()
    by_class: dict[str, float] = defaultdict(float)
    device_rows, host_rows = [], []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0) if cuda else 0.0
        if device_us > 0:
            by_class[kernel_class(event.key)] += device_us
            device_rows.append((device_us, event.count, event.key[:100]))
        if event.self_cpu_time_total > 0:
            host_rows.append((event.self_cpu_time_total, event.count, event.key[:100]))
    device_rows.sort(reverse=True)
    host_rows.sort(reverse=True)
    return dict(device_us=sum(by_class.values()), by_class_us=dict(by_class),
                top_kernels=[dict(us=u, count=c, name=n) for u, c, n in device_rows[:15]],
                top_host_ops=[dict(us=u, count=c, name=n) for u, c, n in host_rows[:15]])  # fmt: skip


def profile_point(models, group, arm, spy) -> dict[str, Any]:  # noqa: ANN001
    from benchmarks.bench_gpu_grid import SAMPLING, arm_call, call_stats, point_id, shape
    from benchmarks.grid_models import timed

    models.use(group.target)
    batch, prompt, answer = shape(group)
    inputs = gm.prompts(batch, prompt, gm.vocab_size(gm.TARGETS[group.target][0]))
    gen = dict(max_new_tokens=answer, do_sample=group.sample, **(SAMPLING if group.sample else {}))
    ours = arm_call(models, arm, inputs, gen, spy)
    compiled_plain = CompiledPlain(models.target)

    def compiled() -> torch.Tensor:
        return compiled_plain(**inputs, **gen)

    with torch.no_grad():
        for _ in range(2):
            ours()
            compiled()
        with host_parts() as parts:
            seconds, (_, spec) = timed(ours)
        stats = call_stats(spec)
        steps = max(1, stats.get("steps", 1))
        compiled_seconds, _ = timed(compiled)
        ours_kernels = kernels(ours)
        compiled_kernels = kernels(compiled)
    result = dict(
        point=point_id(group, arm), shape=dict(batch=batch, prompt=prompt, answer=answer), stats=stats,
        ours_ms_per_step=seconds / steps * 1e3, compiled_ms_per_token_step=compiled_seconds / answer * 1e3,
        host_ms_per_step={label: value / steps * 1e3 for label, value in parts.items()},
        ours_device_ms_per_step=ours_kernels["device_us"] / steps / 1e3,
        compiled_device_ms_per_step=compiled_kernels["device_us"] / answer / 1e3,
        ours_kernels=ours_kernels, compiled_kernels=compiled_kernels,
    )  # fmt: skip
    print(f"{result['point']}: hf_specdec {result['ours_ms_per_step']:.2f} ms/step over {steps} steps "
          f"(device busy {result['ours_device_ms_per_step']:.2f} ms/step), compiled plain "
          f"{result['compiled_ms_per_token_step']:.2f} ms/step (device {result['compiled_device_ms_per_step']:.2f})")  # fmt: skip
    print("host per step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in result["host_ms_per_step"].items()))
    print("stats:", {k: v for k, v in stats.items() if k != "spec"})
    for name, found in (("hf_specdec", ours_kernels), ("compiled plain", compiled_kernels)):
        print(f"{name}: device us by class { ({k: round(v) for k, v in found['by_class_us'].items()}) }")
        for row in found["top_kernels"][:10]:
            print(f"   {row['us']:10.0f} us  x{row['count']:<5d} {row['name']}")
        print(f"{name}: top host operators")
        for row in found["top_host_ops"][:8]:
            print(f"   {row['us']:10.0f} us  x{row['count']:<5d} {row['name']}")
    return result


@contextlib.contextmanager
def step_and_gc_times() -> Iterator[dict[str, Any]]:
    """Each loop step's wall time (ms, in order), when the first step began and the last ended (`perf_counter`
    seconds), and the garbage collector's pauses (ms) while the context is open. `on_first_step` (if set in the
    dict) is called as the first step begins."""
    found: dict[str, Any] = {"steps_ms": [], "first_start": None, "last_end": None, "on_first_step": None}
    step = decoding.SpeculativeLoop.step

    def timed_step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        start = time.perf_counter()
        if found["first_start"] is None:
            found["first_start"] = start
            if found["on_first_step"] is not None:
                found["on_first_step"]()
        try:
            return step(self, *args, **kwargs)
        finally:
            found["last_end"] = time.perf_counter()
            found["steps_ms"].append((found["last_end"] - start) * 1e3)

    decoding.SpeculativeLoop.step = timed_step
    try:
        with gm.GcPauses() as pauses:
            found["gc_ms"] = pauses.pauses_ms
            yield found
    finally:
        decoding.SpeculativeLoop.step = step


def spread_point(models, group, arm, spy, calls: int) -> dict[str, Any]:  # noqa: ANN001
    """Why one point's calls differ, and where a call's time goes outside its steps: `calls` fresh calls, each after
    a compiled plain call (as the grid interleaves them), with the call's seconds, its stats, the host parts, every
    step's wall time, the GC pauses, and the call cut into its setup (until the first step), its first step (the
    target's prefill), the later steps and what follows them; then the target's eager prefill alone (one logit row
    per prompt, as `generate` keeps) and a cProfile of one more call's setup on the host."""
    from benchmarks.bench_gpu_grid import SAMPLING, arm_call, call_stats, point_id, shape
    from benchmarks.grid_models import timed

    models.use(group.target)
    batch, prompt, answer = shape(group)
    inputs = gm.prompts(batch, prompt, gm.vocab_size(gm.TARGETS[group.target][0]))
    gen = dict(max_new_tokens=answer, do_sample=group.sample, **(SAMPLING if group.sample else {}))
    ours = arm_call(models, arm, inputs, gen, spy)
    compiled_plain = CompiledPlain(models.target)
    rows = []
    with torch.no_grad():
        for index in range(calls):
            compiled_seconds, _ = timed(lambda: compiled_plain(**inputs, **gen))
            with host_parts() as parts, step_and_gc_times() as steps:
                gm.sync()
                began = time.perf_counter()
                seconds, (_, spec) = timed(ours)
                ended = began + seconds
            stats = {k: v for k, v in call_stats(spec).items() if k != "spec"}
            ordered = sorted(steps["steps_ms"])
            row = dict(call=index, seconds=seconds, compiled_seconds=compiled_seconds, stats=stats,
                       host_ms={k: round(v * 1e3, 2) for k, v in parts.items()},
                       gc=dict(count=len(steps["gc_ms"]), total_ms=round(sum(steps["gc_ms"]), 2),
                               max_ms=max(steps["gc_ms"], default=0.0)),
                       step_ms_median=ordered[len(ordered) // 2] if ordered else None,
                       setup_ms=round((steps["first_start"] - began) * 1e3, 2),
                       first_step_ms=round(steps["steps_ms"][0], 2),
                       later_steps_ms=round(sum(steps["steps_ms"][1:]), 2),
                       after_steps_ms=round((ended - steps["last_end"]) * 1e3, 2),
                       slowest_steps_ms=[(i, round(t, 2)) for i, t in sorted(enumerate(steps["steps_ms"]),
                                                                              key=lambda x: -x[1])[:6]])  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
        prefill_seconds, _ = timed(lambda: models.target(**inputs, logits_to_keep=1))
        setup_profile = profile_setup(ours)
    print(f"plain eager prefill: {prefill_seconds * 1e3:.2f} ms")
    print(setup_profile)
    return dict(
        point=point_id(group, arm), calls=rows, plain_prefill_ms=prefill_seconds * 1e3, setup_profile=setup_profile
    )


def profile_setup(call) -> str:  # noqa: ANN001
    """cProfile of one call of `call` from its start to its first step (the call's setup on the host), as text."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    with step_and_gc_times() as steps:
        steps["on_first_step"] = profiler.disable
        profiler.enable()
        call()
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)
    return text.getvalue()
