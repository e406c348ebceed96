"""Grid benchmark on one GPU (issue 38): hf_specdec with no flags against plain and compiled plain `generate`, over
targets, drafts, prompt and answer lengths, batch sizes, acceptance and sampling, each axis covered, not the cross
product.

The grid (`GRID`, 28 points in 16 groups): targets shaped like Llama 3.x 1B / 3B (the 4B class) / 8B (vocabulary
128 256) and Qwen3 1.7B / 4B / 8B (151 936, explicit head_dim); drafts of 2, 4, 16 and 28 layers; prompts of 128,
1 024 and 4 096 tokens; answers of 64, 256 and 1 024; batches 1, 4, 16, 64 (ragged prompts); alpha 0, 0.5, 0.7,
0.8; greedy and sampling (T = 0.8, top-p 0.9). Each axis moves away from the tuned set-up (8B Llama, 4-layer
124M-shaped draft, 128-token prompt, 64-token answer, B = 1) alone; the shortest answer wherever the answer is not
the axis. `grid_models.py` builds the models (random weights on the GPU, a target with a clear greedy rule and a
synthetic draft right with probability alpha).

A group is one target and one shape (batch, prompt, answer, sampling); its points are the arms run on it. Per group,
in one process: a warm-up round (every arm's first call at these shapes, timed: plain eager's is the reference
output; compiled plain runs twice, its second call compiles again), then `--rounds` rounds (3), each timing compiled
plain and then every arm once; ratios are per round against that round's compiled plain, reported as min and
median, with each timed call's garbage-collector pauses (`gc_pause_ms`: one collection once paused a 312 ms call
for 312 ms; another, a 0.85 s call for 1.5 s, so the warm-up's garbage is collected before the timed rounds).
Plain eager is timed once (its first call at the shapes) unless `--eager-rounds` asks for more (it is the costliest
arm: 30 ms a token at 8B). Arms: hf_specdec with no flags through `custom_generate` with a fresh
`SpecDecoder(draft_model=draft)` per call; at a few points the same through `hf_specdec.install()` and
`assistant_model=draft` (no other flag); at one a fresh draft object every call. Library state is never reset
between rounds or groups (what users get); each alpha is its own draft object. S* per point comes from forward costs
measured on the same machine (`grid_models.forward_seconds`: replayed CUDA graphs of a 1-wide and a (k + 1)-wide
target forward and of the draft's forwards, at the group's mid-answer context).

Compiled plain compiles each group's shape anew (`torch._dynamo.reset()` first), as a process that runs only that
shape would: in one process across shapes, transformers' compile config (`dynamic=None`) lets dynamo make a
recompiled shape's dims dynamic, and later shapes then reuse that graph without compiling (the H200 grid's first
calls at B = 16 and 64 took 1.1 and 2.3 s). `--shared-compile` keeps the old behaviour. It runs with a static cache of
its own, reset per call (`compiled_plain.CompiledPlain`): `cache_implementation="static"` makes a new cache each
call, which, between our calls, lands at new addresses and makes torch re-record its CUDA graphs every call (6.2-6.8
s a call at B = 64 on an H200 against 1.1-1.2 s). `--flag-baseline` also times the flag's call, for comparison.

Run (one GPU, in three commands of under 10 minutes each: `--estimate` prints rough H100 seconds, and runs took 1.7
to 2.3 times as long):
    PYTHONPATH=. python benchmarks/bench_gpu_grid.py --part a grid_a.json   # 8B: alpha, depth, fresh, sampling, N
    PYTHONPATH=. python benchmarks/bench_gpu_grid.py --part c grid_c.json   # 8B: prompt length, batch; 1B, N 1 024
    PYTHONPATH=. python benchmarks/bench_gpu_grid.py --part b grid_b.json   # Qwen3-8B, 1.7B, 4B; Llama-3B
    python benchmarks/bench_gpu_grid.py --plot docs/grid_h100.png grid_a.json grid_c.json grid_b.json
    PYTHONPATH=. python benchmarks/bench_gpu_grid.py --profile 'q8-p1k-n256/d28@0.7' profile.json
`--unfused` adds to each group a twin of every `custom_generate` arm run with `HF_SPECDEC_FUSED=0` (the eager layers'
kernels in the captured steps, `hf_specdec.fused_layers`), interleaved; more than four draft settings on one target
overflow its kept graphs (`graph_reuse.MAX_ENTRIES`), so use it on groups with at most two arms.
`--dry-run` runs all of it on the CPU with tiny shapes (and, where tests/emulated_graphs.py is present, the captured
static path that a GPU takes, with CUDA graphs emulated).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_specdec
from benchmarks import grid_models as gm
from benchmarks.compiled_plain import CompiledPlain, flag_call
from hf_specdec import fused_layers, routing

K = 5  # SpecDecoder's default num_speculative_tokens: hf_specdec runs with no flag
SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=0)


@dataclass(frozen=True)
class Arm:
    """One hf_specdec arm of a group: a draft, its alpha and the route a user takes."""

    draft: str  # grid_models.DRAFTS key
    alpha: float
    route: str = "custom"  # custom_generate + SpecDecoder; "install": install() + assistant_model=; "fresh": a new
    #: draft object every call (nothing learned or kept for it), through custom_generate; "unfused": custom_generate
    #: with HF_SPECDEC_FUSED=0 (the eager layers' own kernels in the captured steps: `--unfused`)

    @property
    def name(self) -> str:
        return f"{self.draft}@{self.alpha:g}" + ("" if self.route == "custom" else f"+{self.route}")


@dataclass(frozen=True)
class Group:
    """A target and a shape; its arms are the grid's points there (they share the baselines' timings)."""

    name: str
    target: str  # grid_models.TARGETS key
    batch: int
    prompt: int
    answer: int
    arms: tuple[Arm, ...]
    sample: bool = False
    part: str = "a"  # which command runs it (each stays under the 10-minute limit of one command)
    axis: str = ""  # the axis it moves along, away from the tuned set-up


GRID = (
    Group("8b-tuned", "llama-8b", 1, 128, 64, (Arm("d4", 0.8), Arm("d4", 0.8, "install"), Arm("d4", 0.5),
          Arm("d4", 0.0), Arm("d4", 0.0, "install")), axis="alpha, install route"),
    Group("8b-depth", "llama-8b", 1, 128, 64, (Arm("d2", 0.8), Arm("d16", 0.8), Arm("d28", 0.8)), axis="draft depth"),
    Group("8b-fresh", "llama-8b", 1, 128, 64, (Arm("d4", 0.0, "fresh"),), axis="a new draft object every call"),
    Group("8b-sampling", "llama-8b", 1, 128, 64, (Arm("d4", 0.8),), sample=True, axis="sampling"),
    Group("8b-n256", "llama-8b", 1, 128, 256, (Arm("d4", 0.0), Arm("d4", 0.8)), axis="answer length"),
    Group("8b-p1k", "llama-8b", 1, 1024, 64, (Arm("d4", 0.8),), part="c", axis="prompt length"),
    Group("8b-p4k", "llama-8b", 1, 4096, 64, (Arm("d4", 0.0), Arm("d4", 0.8)), part="c", axis="prompt length"),
    Group("8b-b4", "llama-8b", 4, 128, 64, (Arm("d4", 0.8),), part="c", axis="batch"),
    Group("8b-b16", "llama-8b", 16, 128, 64, (Arm("d4", 0.8),), part="c", axis="batch"),
    Group("8b-b64", "llama-8b", 64, 128, 64, (Arm("d4", 0.0), Arm("d4", 0.8)), part="c", axis="batch"),
    Group("q8-p1k-n256", "qwen3-8b", 1, 1024, 256, (Arm("d28", 0.7), Arm("d28", 0.0)), part="b",
          axis="the held-out pair: Qwen3 layout, 28-layer draft, longer prompt and answer"),
    Group("q8-tuned", "qwen3-8b", 1, 128, 64, (Arm("d4", 0.8),), part="b", axis="target layout"),
    Group("1b-n1024", "llama-1b", 1, 128, 1024, (Arm("d2", 0.0), Arm("d2", 0.8)), part="c",
          axis="answer length, target size"),
    Group("q1.7b", "qwen3-1.7b", 1, 128, 64, (Arm("d2", 0.8),), part="b", axis="target size"),
    Group("q4b", "qwen3-4b", 1, 128, 64, (Arm("d4", 0.0), Arm("d4", 0.8)), part="b", axis="target size"),
    Group("3b", "llama-3b", 1, 128, 64, (Arm("d4", 0.8),), part="b", axis="target size"),
)  # fmt: skip

#: `--dry-run`: the grid's lengths and batches, shrunk for tiny CPU models (each distinct value stays distinct)
TINY_PROMPTS = {128: 16, 1024: 32, 4096: 64}
TINY_ANSWERS = {64: 8, 256: 16, 1024: 32}
TINY_BATCHES = {1: 1, 4: 2, 16: 3, 64: 4}


def point_id(group: Group, arm: Arm) -> str:
    return f"{group.name}/{arm.name}"


def shape(group: Group) -> tuple[int, int, int]:
    """(batch, prompt, answer) as run: the grid's, or their tiny stand-ins in a dry run."""
    if gm.Setup.tiny:
        return TINY_BATCHES[group.batch], TINY_PROMPTS[group.prompt], TINY_ANSWERS[group.answer]
    return group.batch, group.prompt, group.answer


class Models:
    """The current target (one at a time: an 8B model is 16 GB) and its drafts, built on demand, freed on a switch."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.target: Any = None
        self.rule: torch.Tensor | None = None
        self.drafts: dict[str, Any] = {}
        self.by_alpha: dict[tuple[str, float], Any] = {}
        self.build_seconds: dict[str, float] = {}

    def use(self, name: str) -> None:
        if name == self.name:
            return
        self.release()
        start = time.perf_counter()
        layout, target_shape = gm.TARGETS[name]
        self.target = gm.build(layout, target_shape, seed=0)
        self.rule = gm.make_decisive(self.target)
        self.name = name
        gm.sync()
        self.build_seconds[name] = time.perf_counter() - start

    def release(self) -> None:
        """Drop the target and its drafts (their kept graphs and compiled calls go with them: the models hold them)."""
        self.name = self.target = self.rule = None
        self.drafts.clear()
        self.by_alpha.clear()
        gc.collect()
        if gm.Setup.device == "cuda":
            torch._dynamo.reset()  # compiled plain's graphs of the old target (the next target compiles its own)
            torch.cuda.empty_cache()

    def draft(self, arm: Arm) -> Any:
        """The arm's draft object: one per (draft, alpha), kept across rounds; a new one per call for "fresh"."""
        if arm.draft not in self.drafts:
            start = time.perf_counter()
            self.drafts[arm.draft] = gm.build_draft(gm.TARGETS[self.name][0], arm.draft, self.rule)
            self.build_seconds[f"{self.name}/{arm.draft}"] = time.perf_counter() - start
        base = self.drafts[arm.draft]
        if arm.route == "fresh":
            return gm.with_alpha(base, arm.alpha)
        key = (arm.draft, arm.alpha)
        if key not in self.by_alpha:
            self.by_alpha[key] = gm.with_alpha(base, arm.alpha)
        return self.by_alpha[key]


class InstallSpy:
    """The SpecDecoder that `install()` built for the latest routed call (read-only: only to read its `last_stats`)."""

    def __init__(self) -> None:
        self.specs: list[hf_specdec.SpecDecoder] = []
        self._build = routing._spec_from_kwargs

        def spied(model, kwargs):  # noqa: ANN001, ANN202
            spec = self._build(model, kwargs)
            if spec is not None:
                self.specs[:] = [spec]
            return spec

        routing._spec_from_kwargs = spied


def call_stats(spec: hf_specdec.SpecDecoder | None) -> dict[str, Any]:
    """What one hf_specdec call did (from `last_stats`): acceptance, drafting share, graph replays and captures,
    calibration, whether it adopted kept graphs (and why not)."""
    s = spec.last_stats if spec is not None else None
    if s is None:
        return {}
    return dict(acceptance=round(s.acceptance_rate, 3), drafting_share=round(s.num_drafting_row_steps
                / max(1, s.num_row_steps), 3), steps=s.num_steps, replays=s.num_graph_replays,
                capture_s=round(s.compile_time_s, 3), calibration_s=round(s.calibration_time_s, 3),
                graph_reuse=s.graph_reuse, graph_reuse_reason=s.graph_reuse_reason, spec=spec.to_dict())  # fmt: skip


def arm_call(models: Models, arm: Arm, inputs: dict, gen: dict, spy: InstallSpy):  # noqa: ANN201
    """A function running one call of `arm`, returning (output, the SpecDecoder it ran with)."""

    def call() -> tuple[torch.Tensor, hf_specdec.SpecDecoder | None]:
        draft = models.draft(arm)
        if arm.route == "install":
            out = models.target.generate(**inputs, **gen, assistant_model=draft)
            return out, spy.specs[-1] if spy.specs else None
        spec = hf_specdec.SpecDecoder(draft_model=draft)
        with unfused(arm.route == "unfused"):
            out = models.target.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)
        return out, spec

    return call


@contextlib.contextmanager
def unfused(on: bool) -> Iterator[None]:
    """`HF_SPECDEC_FUSED=0` inside the block when `on` (read per call: its graphs are kept apart)."""
    if not on:
        yield
        return
    os.environ[fused_layers.FUSED_ENV] = "0"
    try:
        yield
    finally:
        del os.environ[fused_layers.FUSED_ENV]


def with_unfused_twins(groups: list[Group]) -> list[Group]:
    """Each group with an "unfused" twin of every custom_generate arm (`--unfused`)."""
    twins = lambda g: tuple(Arm(a.draft, a.alpha, "unfused") for a in g.arms if a.route == "custom")  # noqa: E731
    return [replace(g, arms=g.arms + twins(g)) for g in groups]


def forward_costs(models: Models, group: Group) -> dict[str, Any]:
    """Replayed forward costs at the group's batch and mid-answer context: the target 1 and k + 1 wide, each draft
    1 and 2 wide (seconds), and whether each was replayed as a graph."""
    batch, prompt, answer = shape(group)
    context = prompt + answer // 2
    costs: dict[str, Any] = {"context": context}
    for name, width in (("target_w1", 1), ("target_verify", K + 1)):
        costs[name], costs[f"{name}_graphed"] = gm.forward_seconds(models.target, batch, context, width)
    for draft in sorted({arm.draft for arm in group.arms}):
        model = models.draft(Arm(draft, 0.0))
        for width in (1, 2):
            costs[f"{draft}_w{width}"], costs[f"{draft}_w{width}_graphed"] = gm.forward_seconds(model, batch, context,
                                                                                               width)  # fmt: skip
    return costs


def rule_agreement(models: Models, reference: torch.Tensor, prompt: int) -> float:
    """Share of generated tokens that follow the target's rule (the synthetic drafts assume it)."""
    new = reference[:, prompt - 1 :]
    return float((models.rule[new[:, :-1]] == new[:, 1:]).float().mean())


def run_group(
    models: Models,
    group: Group,
    rounds: int,
    eager_rounds: int,
    spy: InstallSpy,
    fresh_compile: bool = True,
    flag_baseline: bool = False,
) -> dict[str, Any]:
    """Warm-up round, then `rounds` interleaved rounds of compiled plain and every arm (see the module doc).
    `fresh_compile`: compiled plain compiles this group's shape anew, as in a process that runs only this shape.
    `flag_baseline`: each round also times compiled plain as `cache_implementation="static"` makes it (a new cache
    per call: benchmarks/compiled_plain.py), as `plain_compiled_flag`."""
    started = time.perf_counter()
    models.use(group.target)
    if fresh_compile and gm.Setup.device == "cuda":
        torch._dynamo.reset()  # compiled plain's graphs of earlier shapes (hf_specdec's default compiles nothing)
    batch, prompt, answer = shape(group)
    layout = gm.TARGETS[group.target][0]
    inputs = gm.prompts(batch, prompt, gm.vocab_size(layout))
    gen = dict(max_new_tokens=answer, do_sample=group.sample, **(SAMPLING if group.sample else {}))
    target = models.target
    compiled = CompiledPlain(target)
    baselines = {"plain_compiled": lambda: compiled(**inputs, **gen)}
    if flag_baseline:
        baselines["plain_compiled_flag"] = lambda: flag_call(target, **inputs, **gen)
    calls = {arm.name: arm_call(models, arm, inputs, gen, spy) for arm in group.arms}
    compiled_before = _compiled_graphs()
    first: dict[str, float] = {}
    gc_ms: dict[str, list[float]] = {**{name: [] for name in baselines}, **{name: [] for name in calls}}  # per round
    with torch.no_grad(), gm.GcPauses() as pauses:
        first["plain_eager"], reference = gm.timed(lambda: target.generate(**inputs, **gen))
        times: dict[str, list[float]] = {**{name: [] for name in baselines}, "plain_eager": []}
        stats: dict[str, list[dict]] = {name: [] for name in calls}
        identical: dict[str, list[bool]] = {name: [] for name in calls}
        for name, call in calls.items():
            print(f"[{group.name}] first call of {name}", flush=True)
            first[name], (out, spec) = gm.timed(call)
            stats[name].append(dict(call_stats(spec), warmup=True))
            identical[name].append(bool(torch.equal(out, reference)))
            times[name] = []
        for name, baseline in baselines.items():
            for i in (1, 2):  # its second call compiles again
                first[f"{name}_{i}"], _ = gm.timed(baseline)
        # The warm-up's garbage (above all, the compiled plain graphs that `torch._dynamo.reset()` dropped for earlier
        # groups) is collected here, untimed: on an H200 one collection inside a timed B = 64 call took 1.5 s.
        # Collections that the timed calls cause themselves still land in them (`gc_pause_ms`).
        first["gc_collect_after_warmup"], _ = gm.timed(gc.collect)
        for r in range(rounds):
            if r < eager_rounds:
                times["plain_eager"].append(gm.timed(lambda: target.generate(**inputs, **gen))[0])
            pauses.take()
            for name, baseline in baselines.items():
                times[name].append(gm.timed(baseline)[0])
                gc_ms[name].append(pauses.take())
            for name, call in calls.items():
                seconds, (out, spec) = gm.timed(call)
                gc_ms[name].append(pauses.take())
                times[name].append(seconds)
                stats[name].append(call_stats(spec))
                identical[name].append(bool(torch.equal(out, reference)))
        costs = forward_costs(models, group)
    eager = statistics.median(times["plain_eager"]) if times["plain_eager"] else first["plain_eager"]
    tokens = batch * answer
    points = []
    for arm in group.arms:
        per_round = [c / o for c, o in zip(times["plain_compiled"], times[arm.name])]
        if flag_baseline:
            flag_rounds = [c / o for c, o in zip(times["plain_compiled_flag"], times[arm.name])]
            flag = dict(vs_compiled_flag=dict(min=min(flag_rounds), median=statistics.median(flag_rounds)))
        else:
            flag = {}
        draft_costs = dict(costs, draft_w1=costs[f"{arm.draft}_w1"], draft_w2=costs[f"{arm.draft}_w2"])
        points.append(dict(
            id=point_id(group, arm), group=group.name, axis=group.axis, target=group.target, draft=arm.draft,
            alpha=arm.alpha, route=arm.route, batch=batch, prompt=prompt, answer=answer, sample=group.sample,
            vs_compiled=dict(min=min(per_round), median=statistics.median(per_round), rounds=per_round),
            vs_eager=eager / statistics.median(times[arm.name]),
            tokens_per_s=tokens / statistics.median(times[arm.name]), first_call_s=first[arm.name],
            identical=None if group.sample else all(identical[arm.name]), stats=stats[arm.name],
            **gm.ideal_speedup(arm.alpha, K, draft_costs), **flag,
        ))  # fmt: skip
        print(json.dumps({key: points[-1][key] for key in ("id", "s_star", "first_call_s", "identical")}
                         | {"vs_compiled": [round(points[-1]["vs_compiled"][q], 3) for q in ("min", "median")],
                            "acceptance": points[-1]["stats"][-1].get("acceptance"),
                            "drafting_share": points[-1]["stats"][-1].get("drafting_share")}), flush=True)  # fmt: skip
    return dict(
        group=asdict(group),
        shape=dict(batch=batch, prompt=prompt, answer=answer),
        first_call_s=first,
        seconds=times,
        gc_pause_ms=gc_ms,
        tokens_per_s=dict(
            plain_eager=tokens / eager, plain_compiled=tokens / statistics.median(times["plain_compiled"])
        ),  # fmt: skip
        forward_costs=costs,
        compiled_graphs=_compiled_graphs() - compiled_before,
        rule_agreement=rule_agreement(models, reference, prompt),
        points=points,
        group_seconds=time.perf_counter() - started,
    )


def _compiled_graphs() -> int:
    from hf_specdec import compat

    return compat.num_compiled_graphs()


def selected(part: str, names: list[str] | None) -> list[Group]:
    unknown = sorted(set(names or ()) - {g.name for g in GRID})
    if unknown:  # e.g. the output path after `--groups`, which takes every word that follows it
        raise SystemExit(
            f"--groups {unknown} names no group of GRID ({', '.join(g.name for g in GRID)}); put the output path "
            "before --groups (`bench_gpu_grid.py out.json --groups 8b-tuned ...`)."
        )
    groups = [g for g in GRID if part == "all" or g.part == part]
    return [g for g in groups if not names or g.name in names]


def meta(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.cuda.get_device_name() if gm.Setup.device == "cuda" else platform.processor() or "cpu"
    return dict(gpu=device, torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), command=" ".join(sys.argv), rounds=args.rounds,
                eager_rounds=args.eager_rounds, k=K, dry_run=args.dry_run,
                fresh_compile=not args.shared_compile, compiled_plain="kept StaticCache per shape, reset per call",
                flag_baseline=args.flag_baseline)  # fmt: skip


def limit_recompiles() -> None:
    """Compiled plain compiles one graph per target and shape (two, counting its second call), all under one code
    object: dynamo's default limit of 8 would silently drop the later ones back to eager forwards."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its older name
    setattr(config, limit, 256)
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = 4096


def emulate_graphs() -> bool:
    """Dry run: the captured static path a GPU takes, on the CPU (tests/emulated_graphs.py), if the tests are here."""
    tests = Path(__file__).resolve().parent.parent / "tests"
    if not (tests / "emulated_graphs.py").exists():
        return False
    sys.path.insert(0, str(tests))
    from emulated_graphs import EmulatedGraphs

    from hf_specdec import cache_route, plan, step_graph

    step_graph.GRAPHS = EmulatedGraphs
    choose = cache_route.choose_route

    def captured_default(model, spec, config, cache=None):  # noqa: ANN001, ANN202 - the CUDA default, on the CPU
        if config.cache_implementation is None and cache_route.default_blocker(model, spec, config, cache) is None:
            return cache_route.CacheRoute(static=True, compile=False, by_default=True)
        return choose(model, spec, config, cache)

    plan.choose_route = captured_default
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="*", help="JSON to write (a run or --profile), or the JSONs to read (--plot)")
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--groups", nargs="+", default=None, help="only these groups (names in GRID)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager-rounds", type=int, default=0, help="timed plain eager calls after its first")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: the whole grid's logic")
    parser.add_argument("--plot", metavar="PNG", default=None, help="plot the JSONs given as `out`")
    parser.add_argument("--profile", metavar="POINT", default=None, help="profile one point (an id printed by a run)")
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="also run each custom_generate arm with HF_SPECDEC_FUSED=0 (side by side)",
    )
    parser.add_argument("--spread", type=int, default=0, metavar="N", help="with --profile: N fresh calls, each timed")
    parser.add_argument("--estimate", action="store_true", help="print the estimated H100 seconds per group")
    parser.add_argument(
        "--shared-compile",
        action="store_true",
        help="compiled plain keeps its graphs across groups (dims of a recompiled shape turn dynamic)",
    )
    parser.add_argument(
        "--flag-baseline",
        action="store_true",
        help='also time compiled plain as cache_implementation="static" makes it (a new cache per call)',
    )
    args = parser.parse_args()
    selected(args.part, args.groups)  # a bad --groups fails before any model work
    if args.plot:
        from benchmarks.grid_report import plot

        plot([json.loads(Path(p).read_text()) for p in args.out], Path(args.plot))
        return
    if args.estimate:
        from benchmarks.grid_report import estimate

        estimate(selected(args.part, args.groups), args.rounds, args.eager_rounds, not args.shared_compile)
        return
    if args.dry_run:
        gm.Setup.use_tiny()
        emulated = emulate_graphs()
    torch.set_grad_enabled(False)
    limit_recompiles()
    hf_specdec.install()  # as a user who routes assistant_model= would; other calls pass through unchanged
    spy = InstallSpy()
    out = Path(args.out[0]) if args.out else None
    if args.profile:
        from benchmarks.grid_profile import profile_point, spread_point

        group, arm = next((g, a) for g in GRID for a in g.arms if point_id(g, a) == args.profile)
        if args.spread:
            result = spread_point(Models(), group, arm, spy, args.spread)
        else:
            result = profile_point(Models(), group, arm, spy)
    else:
        result = {"meta": meta(args) | ({"emulated_graphs": emulated} if args.dry_run else {}), "groups": []}
        models = Models()
        groups = selected(args.part, args.groups)
        for group in with_unfused_twins(groups) if args.unfused else groups:
            result["groups"].append(run_group(models, group, args.rounds, args.eager_rounds, spy,
                                              fresh_compile=not args.shared_compile,
                                              flag_baseline=args.flag_baseline))  # fmt: skip
            spy.specs.clear()  # it holds the last routed call's draft
            result["meta"]["build_seconds"] = models.build_seconds
            if out:  # after each group: a run cut short keeps what it measured
                out.write_text(json.dumps(result, indent=1))
        models.release()
    if out:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
