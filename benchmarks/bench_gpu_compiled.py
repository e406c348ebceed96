"""Benchmark on one GPU: hf_specdec's compiled static-cache path against transformers' compiled plain decoding.

The models and the synthetic-alpha draft are those of `bench_gpu_e2e.py` (an 8B-shaped bf16 Llama target, a
124M-shaped draft whose proposals are right with probability alpha). Baseline: plain
`generate(cache_implementation="static")`, which transformers compiles (CUDA graphs). Each setting times, in turn
and in the same process (3 turns, medians, after a warm-up that also compiles): plain eager, plain compiled,
hf_specdec eager (dynamic cache), hf_specdec compiled (static cache) and, at batch 1, HF stock assisted decoding.
Also: compiled step costs and S* = E t_target / (k t_draft + t_verify) from them, compile seconds and time to first
token (from `last_stats`), peak GPU memory, and the Triton rejection sampler captured in a CUDA graph against its
HBM floor.

Run (GPU): `PYTHONPATH=. python benchmarks/bench_gpu_compiled.py --part batch1 --out b1.json`
(`--part batched` for B = 32 and 64; `--tiny` for a CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import transformers

import hf_specdec
from benchmarks import bench_gpu_e2e as e2e
from hf_specdec.batch import RaggedBatch
from hf_specdec.cache_route import CAPTURE_ENV
from hf_specdec.decoding import StaticPlan
from hf_specdec.static_cache import StaticCacheView

STATIC = dict(cache_implementation="static")


def compiled_step_ms(model, inputs, width: int, generation_config) -> float:  # noqa: ANN001
    """Milliseconds of one compiled forward of `width` slots per row on a static cache (the loop's own view)."""
    from hf_specdec import compat

    batch = RaggedBatch.from_prompts(inputs["input_ids"], inputs["attention_mask"], inputs["input_ids"].shape[1] + 64)
    plan = StaticPlan(k=width - 1, max_columns=batch.capacity + 64, compiled_call=lambda m: compat.compiled_call(
        m, generation_config))  # fmt: skip
    view = StaticCacheView(model, batch.batch_size, batch.pad_lengths, plan)
    with torch.no_grad():
        view.forward(batch.token_ids, batch.lengths - 1)  # prefill, eager
        num_new = torch.full_like(batch.lengths, width)

        def step() -> None:
            view.forward(batch.token_ids, num_new, width=width)
            view.rollback(batch.lengths - 1)

        return e2e.timed(step, repeats=20) * 1e3


def run_setting(name: str, target, draft, inputs, k: int, alpha: float, n_new: int, stock: bool,  # noqa: ANN001
                schedule: str = "constant", per_forward: bool = True) -> dict:  # fmt: skip
    """Time every method of one setting side by side (interleaved turns, medians). `per_forward=False` leaves out
    the per-forward-graphs column (it compiles the target a second time)."""
    draft.alpha = alpha
    batch = inputs["input_ids"].shape[0]
    gen = dict(max_new_tokens=n_new, do_sample=False)
    spec_eager = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=k,
                                        num_speculative_tokens_schedule=schedule)  # fmt: skip
    spec_static = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=k,
                                         num_speculative_tokens_schedule=schedule)  # fmt: skip
    fns = {
        "plain_eager": lambda: target.generate(**inputs, **gen),
        "plain_compiled": lambda: target.generate(**inputs, **gen, **STATIC),
        "ours_eager": lambda: target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec_eager,
                                              **gen),
        "ours_compiled": lambda: target.generate(**inputs, custom_generate=hf_specdec.generate,
                                                 spec_decoder=spec_static, **gen, **STATIC),
    }  # fmt: skip
    spec_uncaptured = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=k,
                                             num_speculative_tokens_schedule=schedule)  # fmt: skip

    def uncaptured() -> torch.Tensor:  # the path before whole-step graphs: each forward its own compiled graph
        os.environ[CAPTURE_ENV] = "0"
        try:
            return target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec_uncaptured,
                                   **gen, **STATIC)  # fmt: skip
        finally:
            del os.environ[CAPTURE_ENV]

    if per_forward:
        fns["ours_compiled_per_forward_graphs"] = uncaptured
    if stock:
        stock_kwargs = dict(assistant_model=draft, num_assistant_tokens=k, assistant_confidence_threshold=0.0,
                            num_assistant_tokens_schedule="constant", **gen)  # fmt: skip
        fns["hf_stock"] = lambda: target.generate(**inputs, **stock_kwargs)
    with torch.no_grad():
        t0 = time.perf_counter()
        expected = fns["plain_compiled"]()  # compiles plain
        plain_first_s = time.perf_counter() - t0
        reference = fns["plain_eager"]()
        ours = fns["ours_compiled"]()  # compiles ours
        first_stats = spec_static.last_stats
        ours_uncaptured = uncaptured() if per_forward else ours
        ours_eager = fns["ours_eager"]()
        torch.cuda.reset_peak_memory_stats() if e2e.DEVICE == "cuda" else None
        times = e2e.timed_together(fns)
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if e2e.DEVICE == "cuda" else 0.0
    tps = {key: batch * n_new / t for key, t in times.items()}
    row = dict(setting=name, batch=batch, alpha=alpha, k=k, schedule=schedule, tps=tps,
               speedup_vs_compiled_plain=times["plain_compiled"] / times["ours_compiled"],
               eager_speedup_vs_compiled_plain=times["plain_compiled"] / times["ours_eager"],
               acceptance=spec_static.last_stats.acceptance_rate,
               mean_accepted_length=spec_static.last_stats.mean_accepted_length,
               first_call_compile_s=first_stats.compile_time_s, first_call_ttft_s=first_stats.time_to_first_token_s,
               second_call_compile_s=spec_static.last_stats.compile_time_s,
               plain_compiled_first_call_s=plain_first_s, peak_gpu_gb=peak_gb,
               speedup_per_forward_graphs_vs_compiled_plain=(
                   times["plain_compiled"] / times["ours_compiled_per_forward_graphs"] if per_forward else None),
               graph_replays=spec_static.last_stats.num_graph_replays, steps=spec_static.last_stats.num_steps,
               rows_identical_compiled_vs_plain_compiled=(ours == expected).all(1).float().mean().item(),
               rows_identical_uncaptured_vs_plain_compiled=(ours_uncaptured == expected).all(1).float().mean().item(),
               rows_identical_eager_vs_plain_eager=(ours_eager == reference).all(1).float().mean().item(),
               plain_compiled_vs_plain_eager_rows_identical=(expected == reference).all(1).float().mean().item())  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def step_breakdown(target, draft, inputs, k: int, n_new: int) -> dict:  # noqa: ANN001
    """Where a compiled step's time goes: each loop phase timed with a sync around it (which adds its own cost),
    and the kernel launches per step from the profiler."""
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=k)
    run = lambda: target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec,  # noqa: E731
                                  max_new_tokens=n_new, do_sample=False, **STATIC)  # fmt: skip
    with torch.no_grad():
        run()
        with e2e.phase_timer() as phases:
            run()
        steps = spec.last_stats.num_steps
        out = {name: phases[name] / steps * 1e3 for name in e2e.PHASES}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cudaGraphLaunch", "cudaLaunchKernelExC"))  # fmt: skip
    out["kernel_launches_per_step"] = launches / spec.last_stats.num_steps
    out["top_cpu_ops"] = [(e.key, e.count, e.cpu_time_total / 1e3) for e in sorted(
        prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def sampler_in_graph(batch: int = 64, k: int = 4, vocab: int = e2e.VOCAB) -> dict:
    """The Triton rejection sampler (random accept with draft probs: the heaviest case), captured in a CUDA graph."""
    from hf_specdec.sampling.kernels import rejection_sample_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(batch, k + 1, vocab, device="cuda", generator=g)
    draft_ids = torch.randint(0, vocab, (batch, k), device="cuda", generator=g)
    num = torch.full((batch,), k, device="cuda")
    q = torch.softmax(torch.randn(batch, k, vocab, device="cuda", generator=g), -1)
    greedy = torch.zeros(batch, dtype=torch.bool, device="cuda")
    uniforms = torch.rand(batch, k, device="cuda", generator=g)
    expo = torch.empty(batch, vocab, device="cuda").exponential_(generator=g)
    args = (logits, draft_ids, num, q, greedy, uniforms, expo, None)
    out = rejection_sample_triton(*args)  # compile the kernels
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        rejection_sample_triton(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rejection_sample_triton(*args)
    eager_ms = e2e.timed(lambda: rejection_sample_triton(*args), repeats=50) * 1e3
    graph_ms = e2e.timed(graph.replay, repeats=200) * 1e3
    bytes_read = logits.numel() * 4 + q.numel() * 4 + expo.numel() * 4
    floor_ms = bytes_read / 3.35e12 * 1e3  # H100 SXM HBM3
    row = dict(batch=batch, k=k, vocab=vocab, eager_ms=eager_ms, graph_ms=graph_ms, hbm_floor_ms=floor_ms,
               graph_over_floor=graph_ms / floor_ms, output_shape=list(out.shape))  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["batch1", "adaptive", "batched"], default="batch1")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-step-costs", action="store_true", help="batch1: skip the compiled step costs")
    parser.add_argument("--no-per-forward", action="store_true", help="leave out the per-forward-graphs column")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a dry run of the script")
    args = parser.parse_args()
    if args.tiny:
        e2e.use_tiny_shapes()
    torch._dynamo.config.cache_size_limit = 64  # one graph per batch size and width, target and draft
    target = e2e.build(e2e.TARGET_SHAPE, seed=0)
    e2e.make_decisive(target)
    draft = e2e.build(e2e.DRAFT_SHAPE, seed=1, cls=e2e.SyntheticDraft)
    n_new = args.new_tokens
    batches = args.batches if args.part == "batched" else [1]
    all_inputs = {b: e2e.prompts(b, args.prompt_len, ragged=b > 1) for b in batches}
    e2e.teach_synthetic_draft(target, draft, all_inputs.values(), n_new)
    results: dict = {"meta": dict(gpu=e2e.device_name(), torch=torch.__version__,
                                  transformers=transformers.__version__, python=platform.python_version(),
                                  new_tokens=n_new, prompt_len=args.prompt_len, part=args.part)}  # fmt: skip
    rows = []
    if args.part == "batch1":
        inputs = all_inputs[1]
        config = target.generation_config
        k, alpha = 4, 0.8
        steps = {"ideal_speedup_alpha0.8_k4": float("nan")}
        if not args.no_step_costs:
            steps = dict(target=compiled_step_ms(target, inputs, 1, config), draft=compiled_step_ms(draft, inputs, 1, config),
                         draft_catch_up=compiled_step_ms(draft, inputs, 2, config),
                         verify=compiled_step_ms(target, inputs, k + 1, config))  # fmt: skip
            e = (1 - alpha ** (k + 1)) / (1 - alpha)
            steps["ideal_speedup_alpha0.8_k4"] = (
                e * steps["target"] / (steps["draft_catch_up"] + (k - 1) * steps["draft"] + steps["verify"])
            )
            results["compiled_step_ms"] = steps
            print(json.dumps(steps), flush=True)
        rows.append(run_setting("B=1 alpha=0.8 k=4", target, draft, inputs, k, alpha, n_new, stock=True))
        rows[-1]["efficiency_vs_ideal"] = rows[-1]["speedup_vs_compiled_plain"] / steps["ideal_speedup_alpha0.8_k4"]
        results["phases"] = step_breakdown(target, draft, inputs, k, n_new)
        if e2e.DEVICE == "cuda":
            results["sampler_graph"] = sampler_in_graph()
    elif args.part == "adaptive":
        for alpha in (0.0, 0.8):  # the library's default schedule: a useless draft, and a good one
            # The draft is one object whose alpha the benchmark changes: its acceptance is learned anew per alpha
            # (`model_guard.model_version`), as for any user whose draft changed.
            rows.append(run_setting(f"B=1 alpha={alpha} adaptive", target, draft, all_inputs[1], 4, alpha, n_new,
                                    stock=False, schedule="adaptive", per_forward=not args.no_per_forward))  # fmt: skip
    else:
        for b in batches:
            rows.append(run_setting(f"B={b} ragged alpha=0.8 k=4", target, draft, all_inputs[b], 4, 0.8, n_new,
                                    stock=False, per_forward=not args.no_per_forward))  # fmt: skip
            results["rows"] = rows
            if args.out:  # after each setting, so a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    results["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
