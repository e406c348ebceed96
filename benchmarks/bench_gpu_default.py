"""Benchmark on one GPU: hf_specdec with no flags (the captured static default) against what a user would run instead.

The models and the synthetic-alpha draft are `bench_gpu_e2e.py`'s (an 8B-shaped bf16 Llama target, a 124M-shaped
draft right with probability alpha). Baselines, timed in the same process and interleaved: plain eager `generate`
(no flags) and plain `generate(cache_implementation="static")` (transformers compiles it; in the interleaved rounds
with a static cache of its own, reset per call, as `compiled_plain.py` says why). hf_specdec runs with no
flags (`custom_generate=hf_specdec.generate, spec_decoder=SpecDecoder(draft_model=draft)`: the adaptive schedule
and, on CUDA, the captured static path) and with `cache_implementation="dynamic"` (the eager path).

Each setting runs `--rounds` rounds after one warm-up round; every round builds fresh `SpecDecoder`s and times each
method once, in turn (the adaptive schedule keeps what it learned per target model across calls, as in a process
that serves many calls). Reported: per-round tokens/s, the minimum and median of each ratio over the rounds, the
default's acceptance, drafting share and graph replays, and whether every output equals plain's. `--part first`
times each route's first call in a fresh process (`python -c`), after the models are built.

`--part eagle3` runs the same routes with an EAGLE-3 head (`synthetic_eagle3.SyntheticEagle3Head`: an 8B Llama head's
real layer, `fc` and 32k-token `lm_head`, proposing what the synthetic draft proposes at the same alpha) at B = 1 and
the `--batches`, plus `ours_uncaptured` (the same static steps, `HF_SPECDEC_CAPTURE_STEPS=0`) and `ours_draft` (the
synthetic draft model on the default path: the same drafts, a draft model's costs).

Run (GPU): `PYTHONPATH=. python benchmarks/bench_gpu_default.py --part batch1 --out b1.json`
(`--part batched` for B = 32, `--part sampling` for sampled rows at B = 1 and the `--batches`, `--part eagle3` for the
EAGLE-3 head, `--part first` for first calls; `--tiny` or `--dry-run` for a CPU dry run, which runs the EAGLE-3 head's
"default" routes on static caches: on the CPU the default is the dynamic path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers

import hf_specdec
from benchmarks import bench_gpu_e2e as e2e
from benchmarks.compiled_plain import CompiledPlain
from benchmarks.synthetic_eagle3 import build_synthetic_head
from hf_specdec import graph_reuse, model_guard
from hf_specdec.sampling.rejection import SAMPLER_ENV

K = 4


def sync() -> None:
    e2e.sync()


def setup(batches: list[int], n_new: int, prompt_len: int, head: bool = False) -> tuple:
    """The target, the synthetic draft (and with `head`, the synthetic EAGLE-3 head), and prompts per batch size."""
    target = e2e.build(e2e.TARGET_SHAPE, seed=0)
    e2e.make_decisive(target)
    draft = e2e.build(e2e.DRAFT_SHAPE, seed=1, cls=e2e.SyntheticDraft)
    all_inputs = {b: e2e.prompts(b, prompt_len, ragged=b > 1) for b in batches}
    e2e.teach_synthetic_draft(target, draft, all_inputs.values(), n_new)
    if head:
        return target, draft, all_inputs, build_synthetic_head(target, draft.next_token)
    return target, draft, all_inputs


def run_setting(name: str, target, draft, inputs, alpha: float, n_new: int, rounds: int,  # noqa: ANN001
                sample: bool = False, method: str = "draft", head=None) -> dict:  # noqa: ANN001  # fmt: skip
    """Interleaved rounds of every route at one setting (fresh SpecDecoders each round)."""
    # A Python attribute the draft's forward reads: hf_specdec sees the change (kept graphs of the old alpha are not
    # replayed, and the draft's acceptance is learned anew), as it would for a user's model; nothing is reset here.
    draft.alpha = alpha
    if head is not None:
        head.alpha = alpha
    batch = inputs["input_ids"].shape[0]
    gen = dict(max_new_tokens=n_new, do_sample=sample)
    if sample:
        gen.update(temperature=0.8, top_p=0.9, top_k=0)
    compiled = CompiledPlain(target)  # a cache of its own: see benchmarks/compiled_plain.py
    plain = {
        "plain_eager": lambda: target.generate(**inputs, **gen),
        "plain_compiled": lambda: compiled(**inputs, **gen),
    }
    specs: dict[str, hf_specdec.SpecDecoder] = {}

    def ours(route: str, seed: int):  # noqa: ANN202
        def call() -> torch.Tensor:
            kind = "draft" if route == "ours_draft" else method
            drafting = {"draft": dict(draft_model=draft), "ngram": dict(method="ngram"),
                        "eagle3": dict(draft_head=head)}[kind]  # fmt: skip
            spec = specs[route] = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=K,
                                                          seed=seed if sample else None)  # fmt: skip
            extra = {"cache_implementation": "dynamic"} if route == "ours_dynamic" else {}
            if kind == "eagle3" and e2e.DEVICE == "cpu" and route != "ours_dynamic":  # a dry run: the static path
                extra = {"cache_implementation": "static"}
            if route == "ours_uncaptured":  # the same static steps, each forward launched from the host
                os.environ["HF_SPECDEC_CAPTURE_STEPS"] = "0"
            if route == "ours_no_reuse":  # every call warms up and captures its own graphs
                os.environ[graph_reuse.REUSE_ENV] = "0"
            if route == "ours_torch_sampler":  # draws and rejection sampler in torch ops, not Triton
                os.environ[SAMPLER_ENV] = "torch"
            try:
                return target.generate(**inputs, **gen, **extra, custom_generate=hf_specdec.generate,
                                       spec_decoder=spec)  # fmt: skip
            finally:
                os.environ.pop(graph_reuse.REUSE_ENV, None)
                os.environ.pop(SAMPLER_ENV, None)
                os.environ.pop("HF_SPECDEC_CAPTURE_STEPS", None)

        return call

    fns = {**plain, "ours_default": ours("ours_default", 1), "ours_no_reuse": ours("ours_no_reuse", 3),
           "ours_dynamic": ours("ours_dynamic", 2)}  # fmt: skip
    if sample:  # the same sampled call with the sampler's draws and kernels in torch operations
        fns["ours_torch_sampler"] = ours("ours_torch_sampler", 1)
    if method == "eagle3":  # what capture gives the head, and a draft model proposing the same tokens
        fns["ours_uncaptured"] = ours("ours_uncaptured", 4)
        fns["ours_draft"] = ours("ours_draft", 1)
    samples: dict[str, list[float]] = {key: [] for key in fns}
    stats: list[dict] = []
    identical: dict[str, bool] = {}
    with torch.no_grad():
        reference = {key: fn() for key, fn in fns.items()}  # warm-up round (compiles plain static)
        fns["plain_compiled"]()  # its second call compiles again (10x slower in every H100 run)
        for key in [k for k in fns if k.startswith("ours")] + ["plain_compiled"]:
            identical[key] = bool((reference[key] == reference["plain_eager"]).all()) if not sample else None
        for _ in range(rounds):
            for key, fn in fns.items():
                sync()
                t0 = time.perf_counter()
                out = fn()
                sync()
                samples[key].append(time.perf_counter() - t0)
                if not sample and key.startswith("ours"):
                    identical[key] = identical[key] and bool((out == reference["plain_eager"]).all())
            s = specs["ours_default"].last_stats
            stats.append(dict(acceptance=s.acceptance_rate, mean_accepted_length=s.mean_accepted_length,
                              drafting_share=s.num_drafting_row_steps / max(1, s.num_row_steps), steps=s.num_steps,
                              replays=s.num_graph_replays, capture_s=s.compile_time_s, graph_reuse=s.graph_reuse,
                              graph_reuse_reason=s.graph_reuse_reason,
                              drafting_share_by_route={key: round(spec.last_stats.num_drafting_row_steps
                                                                  / max(1, spec.last_stats.num_row_steps), 3)
                                                       for key, spec in specs.items()}))  # fmt: skip
        guard_s = guard_seconds(fns["ours_default"])
    tps = {key: [batch * n_new / t for t in ts] for key, ts in samples.items()}
    ratios = {}
    for ours_key in [key for key in fns if key.startswith("ours")]:
        for base in ("plain_eager", "plain_compiled"):
            per_round = [b / o for b, o in zip(samples[base], samples[ours_key])]
            ratios[f"{ours_key}_vs_{base}"] = dict(min=min(per_round), median=statistics.median(per_round),
                                                   rounds=per_round)  # fmt: skip
    row = dict(setting=name, method=method, batch=batch, alpha=alpha, sample=sample, k=K, n_new=n_new,
               tps_median={k: statistics.median(v) for k, v in tps.items()}, tps=tps, ratios=ratios, stats=stats,
               identical_to_plain_eager=identical, guard_ms_per_call=1e3 * guard_s,
               guard_share_of_call=guard_s / statistics.median(samples["ours_default"]))  # fmt: skip
    print(json.dumps({"setting": name, "tps_median": row["tps_median"], "guard_ms": round(1e3 * guard_s, 3),
                      "guard_share": round(row["guard_share_of_call"], 5),
                      "ratios": {k: (round(v["min"], 3), round(v["median"], 3)) for k, v in ratios.items()},
                      "identical": identical, "stats_last": stats[-1]}), flush=True)  # fmt: skip
    return row


def guard_seconds(call) -> float:  # noqa: ANN001
    """Seconds one call spends checking its models (`model_guard.fingerprint`: kept graphs, draft versions)."""
    spent = [0.0]
    original = model_guard.fingerprint

    def timed(models):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        try:
            return original(models)
        finally:
            spent[0] += time.perf_counter() - start

    model_guard.fingerprint = timed
    try:
        call()
    finally:
        model_guard.fingerprint = original
    return spent[0]


FIRST_CALL = """
import time, torch, sys
sys.path.insert(0, '.')
import hf_specdec
from benchmarks import bench_gpu_default as b
from benchmarks import bench_gpu_e2e as e2e
from benchmarks.synthetic_eagle3 import build_synthetic_head
target, draft, all_inputs = b.setup([{batch}], {n_new}, {prompt_len})
inputs = all_inputs[{batch}]
torch.cuda.synchronize()
t0 = time.perf_counter()
with torch.no_grad():
    if '{route}' == 'plain_eager':
        target.generate(**inputs, max_new_tokens={n_new}, do_sample=False)
    elif '{route}' == 'plain_compiled':
        target.generate(**inputs, max_new_tokens={n_new}, do_sample=False, cache_implementation='static')
    else:
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens={k})
        extra = dict(cache_implementation='dynamic') if '{route}' == 'ours_dynamic' else dict()
        target.generate(**inputs, max_new_tokens={n_new}, do_sample=False, custom_generate=hf_specdec.generate,
                        spec_decoder=spec, **extra)
torch.cuda.synchronize()
print('FIRST', time.perf_counter() - t0)
"""


def lookup_prompts(target, inputs: dict, n_new: int) -> dict:  # noqa: ANN001
    """Prompts that contain the text the target will write: each prompt, then plain's continuation of it, then
    the prompt again (the decisive target's next token depends on the current token alone, so the continuation of
    the whole equals the continuation of the prompt, which prompt lookup finds in the middle)."""
    with torch.no_grad():
        seq = target.generate(**inputs, max_new_tokens=n_new + 8, do_sample=False)
    width = inputs["input_ids"].shape[1]
    ids = torch.cat([seq, inputs["input_ids"]], dim=1)  # left padding stays on the left
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(seq[:, width:]), inputs["attention_mask"]], dim=1)
    return {"input_ids": ids, "attention_mask": mask}


def first_calls(batch: int, n_new: int, prompt_len: int) -> dict:
    """Each route's first call in a fresh process (teaching the synthetic draft runs plain generate first, so
    CUDA and cuBLAS are already initialised for every route alike)."""
    out = {}
    for route in ("plain_eager", "plain_compiled", "ours_default", "ours_dynamic"):
        code = FIRST_CALL.format(batch=batch, n_new=n_new, prompt_len=prompt_len, route=route, k=K)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST")]
        out[route] = float(line[-1].split()[1]) if line else proc.stderr[-2000:]
        print(json.dumps({"first_call_s": {route: out[route]}}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["batch1", "batched", "ngram", "sampling", "eagle3", "first"],
                        default="batch1")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", nargs="+", type=int, default=[32])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", "--dry-run", action="store_true", dest="tiny",
                        help="tiny shapes on the CPU: a dry run of the script")  # fmt: skip
    args = parser.parse_args()
    if args.tiny:
        e2e.use_tiny_shapes()
    results: dict = {"meta": dict(gpu=e2e.device_name(), torch=torch.__version__,
                                  transformers=transformers.__version__, python=platform.python_version(),
                                  new_tokens=args.new_tokens, prompt_len=args.prompt_len, part=args.part,
                                  rounds=args.rounds, command=" ".join(sys.argv))}  # fmt: skip
    n_new = args.new_tokens
    if args.part == "first":
        results["first_call_s"] = first_calls(1, n_new, args.prompt_len)
    else:
        batches = [1] if args.part == "batch1" else args.batches
        if args.part in ("sampling", "eagle3"):
            batches = [1, *[b for b in args.batches if b != 1]]
        head = None
        if args.part == "eagle3":
            target, draft, all_inputs, head = setup(batches, n_new, args.prompt_len, head=True)
        else:
            target, draft, all_inputs = setup(batches, n_new, args.prompt_len)
        rows = []
        for b in batches:
            if args.part == "ngram":  # prompt lookup on prompts that hold the answer
                inputs = lookup_prompts(target, e2e.prompts(b, args.prompt_len, ragged=False), n_new)
                rows.append(run_setting(f"B={b} prompt lookup, answer in the prompt", target, draft, inputs, 0.0,
                                        n_new, args.rounds, method="ngram"))  # fmt: skip
                results["rows"] = rows
                continue
            settings = [(0.8, False), (0.0, False), (0.8, True)] if b == 1 else [(0.8, False), (0.0, False)]
            if args.part == "sampling":  # sampled rows only (T = 0.8, top-p 0.9), at B = 1 and the --batches
                settings = [(0.8, True)]
            method = "eagle3" if args.part == "eagle3" else "draft"
            for alpha, sample in settings:
                name = f"B={b} alpha={alpha}{' sampling T=0.8 top-p 0.9' if sample else ' greedy'}"
                name += " EAGLE-3 head" if head is not None else ""
                rows.append(run_setting(name, target, draft, all_inputs[b], alpha, n_new, args.rounds, sample,
                                        method=method, head=head))  # fmt: skip
                results["rows"] = rows
                if args.out:  # after each setting, so a run cut short keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
