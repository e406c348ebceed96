"""Where the eager dynamic path's time goes on one GPU, and what its adaptive schedule sees, step by step.

Models of `bench_gpu_default.py` (an 8B-shaped target, the synthetic draft at alpha 0.8 then 0). Per round, timed in
turn: plain eager `generate`, hf_specdec's default (static, captured), the dynamic path with the adaptive schedule
and with a constant k. Printed per round: each call's seconds and stats, and the adaptive call's trace: per step
the cost table it chose from (ms per verify width 1..k+1), the survival it expected, the drafts it chose, the step
time it recorded and the steps it left untimed ("discard"). After the rounds: one adaptive and one constant call
with each loop phase synchronised and timed, and the cost memory. Used for issue 39 (docs/benchmarks.md, "The
eager dynamic path"); it wraps internals, so it is a diagnosis, not a benchmark.

Run (GPU): `PYTHONPATH=. python benchmarks/profile_dynamic_gpu.py 1` (the batch size); `--tiny` for a CPU dry run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

import hf_specdec
from benchmarks import bench_gpu_e2e as e2e
from benchmarks.bench_gpu_default import K, setup
from hf_specdec import adaptive, decoding

PHASES = ("propose", "verify", "score", "accept", "commit", "read_step", "rollback", "retire_finished", "stream")
trace: list = []


def traced() -> None:
    """Record the schedule's choices, recorded step times and untimed steps into `trace`."""
    record, choose, discard = (
        adaptive.StepCosts.record,
        adaptive.AdaptiveSchedule._choose,
        adaptive.AdaptiveSchedule.discard_timing,
    )

    def recording(self, width, bucket, seconds, drafts_separately, clip=True):  # noqa: ANN001, ANN202
        record(self, width, bucket, seconds, drafts_separately, clip)
        trace.append(("rec", width, round(seconds * 1e3, 1)))

    def choosing(self, keys, num):  # noqa: ANN001, ANN202
        out = choose(self, keys, num)
        if self.pending is not None:
            table = self.pending.costs.table(self.max_k + 1, self.pending.bucket)
            survival = self.stats.survival(keys)[0]
            trace.append(("tab", [round(x * 1e3, 1) for x in table.tolist()], [round(x, 2) for x in survival.tolist()],
                          int(out.max())))  # fmt: skip
        return out

    def discarding(self):  # noqa: ANN001, ANN202
        trace.append("discard")
        discard(self)

    adaptive.StepCosts.record = recording
    adaptive.AdaptiveSchedule._choose = choosing
    adaptive.AdaptiveSchedule.discard_timing = discarding


def phase_times(call: Callable[[], object]) -> dict[str, float]:
    """Seconds per loop phase of one call, each phase synchronised (so the total is not the call's own time)."""
    totals: dict[str, float] = {}
    originals = {name: getattr(decoding.SpeculativeLoop, name) for name in PHASES}

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(self, *args, **kwargs):  # noqa: ANN001, ANN202
            e2e.sync()
            start = time.perf_counter()
            result = fn(self, *args, **kwargs)
            e2e.sync()
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
            return result

        return timed

    for name, fn in originals.items():
        setattr(decoding.SpeculativeLoop, name, wrap(name, fn))
    try:
        call()
    finally:
        for name, fn in originals.items():
            setattr(decoding.SpeculativeLoop, name, fn)
    return {name: round(seconds, 3) for name, seconds in totals.items()}


def main() -> None:
    if "--tiny" in sys.argv:
        e2e.use_tiny_shapes()
        sys.argv.remove("--tiny")
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    traced()
    target, draft, all_inputs = setup([batch], 64, 128)
    inputs = all_inputs[batch]
    gen = dict(max_new_tokens=64, do_sample=False)

    def ours(schedule: str = "adaptive", cache: str | None = "dynamic") -> hf_specdec.SpecDecoder:
        kwargs = {} if schedule == "default" else {"num_speculative_tokens_schedule": schedule}
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=K, **kwargs)
        extra = {"cache_implementation": cache} if cache else {}
        target.generate(**inputs, **gen, **extra, custom_generate=hf_specdec.generate, spec_decoder=spec)
        return spec

    calls = {"plain": lambda: target.generate(**inputs, **gen), "static": lambda: ours("default", None),
             "dyn": ours, "const": lambda: ours("constant")}  # fmt: skip
    with torch.no_grad():
        calls["plain"]()
        target.generate(**inputs, **gen, cache_implementation="static")
        for alpha in (0.8, 0.0):
            draft.alpha = alpha
            for round_ in range(3):
                row: dict = {"B": batch, "alpha": alpha, "round": round_}
                for name, call in calls.items():
                    trace.clear()
                    e2e.sync()
                    start = time.perf_counter()
                    spec = call()
                    e2e.sync()
                    row[name] = round(time.perf_counter() - start, 4)
                    if name in ("dyn", "const"):
                        s = spec.last_stats
                        row[f"{name}_stats"] = dict(steps=s.num_steps, mal=round(s.mean_accepted_length, 2),
                                                    drafting=s.num_drafting_row_steps,
                                                    calibration_s=round(s.calibration_time_s, 3))  # fmt: skip
                    if name == "dyn":
                        row["trace"] = trace[:80]
                print(json.dumps(row), flush=True)
            for name in ("dyn", "const"):
                print("PHASES", alpha, name, phase_times(calls[name]), flush=True)
            for key, costs in adaptive._MEMORY[target].costs.items():
                measured = {bucket: (round(m.ratio, 3), {w: round(s * 1e3, 2) for w, s in m.seconds.items()}, m.samples)
                            for bucket, m in costs.contexts.items()}  # fmt: skip
                print("COSTS", key, {w: round(v * 1e3, 2) for w, v in costs.forward.items()},
                      "draft_ms", round(costs.draft_cost * 1e3, 3), measured, flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
