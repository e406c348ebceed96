"""Benchmark on two GPUs (issue 40): hf_specdec against plain `generate` on the same multi-device placement.

The models are `bench_gpu_e2e.py`'s: an 8B-shaped bf16 Llama target with random weights made decisive, saved once
with `save_pretrained` (`--model-dir`, reused when it holds a checkpoint: no hub), and a 124M-shaped `SyntheticDraft`
that is right with probability alpha (every method sees the same drafts).

- **device_map** (default): the target reloaded with `from_pretrained(device_map="auto", max_memory=...)` split
  evenly over cuda:0 and cuda:1, the draft on the target's first device. Baseline: plain eager `generate` on that
  placement. hf_specdec with no flags (the adaptive schedule; a spread target runs on the eager dynamic path, and
  says why once) and with a constant k.
- **--tp** (run under `torchrun --nproc_per_node 2`): the target loaded with `tp_plan="auto"`, the draft whole on
  every rank. Baselines: plain tensor-parallel eager `generate` and, where transformers can, its compiled static
  `generate` (`cache_implementation="static"`; an error is recorded instead if it fails). hf_specdec with no flags
  (captured steps on each rank's GPU). The first call of each is timed too (the goal: ours <= plain's + 15 s).

Each setting (batch B, alpha) runs one warm-up round, then `--rounds` rounds timing every method once, in turn
(interleaved, baselines in the same process). Reported per setting: tokens/s per round, the minimum and median of
each speedup over plain eager, acceptance and drafting share, and whether every greedy output equals plain eager's.
Results go to the JSON file `--out` (rank 0 writes it under --tp).

Run (2 GPUs, from the repository root):
  PYTHONPATH=. python benchmarks/bench_multi_gpu.py --model-dir /tmp/bench8b --out device_map.json
  PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/bench_multi_gpu.py --tp --model-dir /tmp/bench8b --out tp.json
`--dry-run` runs tiny shapes on the CPU (device_map: the target offloaded to the CPU and the disk; --tp: gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

import hf_specdec
from benchmarks import bench_gpu_e2e as e2e
from hf_specdec.placement import placement

K = 4
#: the GPUs this process waits for before reading the clock (the placement's, or this rank's)
SYNC_DEVICES: list[torch.device] = []


def sync() -> None:
    for device in SYNC_DEVICES:
        torch.cuda.synchronize(device)


def device_name() -> str:
    return torch.cuda.get_device_name(SYNC_DEVICES[0]) if SYNC_DEVICES else platform.processor() or "cpu"


def distributed() -> tuple[int, int]:
    """(rank, world size) of a torchrun launch; (0, 1) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def say(*args: object) -> None:
    if distributed()[0] == 0:
        print(*args, flush=True)


def save_target(model_dir: Path) -> None:
    """The 8B-shaped decisive target, saved once (bf16 safetensors); kept when `model_dir` already holds one."""
    if (model_dir / "config.json").exists():
        say(f"reusing the target checkpoint in {model_dir}")
        return
    start = time.perf_counter()
    target = e2e.build(e2e.TARGET_SHAPE, seed=0)
    e2e.make_decisive(target)
    target.save_pretrained(model_dir)
    del target
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    say(f"built and saved the target in {time.perf_counter() - start:.0f} s")


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def load_device_map(model_dir: Path, dry_run: bool) -> torch.nn.Module:
    """The target spread by accelerate: evenly over cuda:0 and cuda:1 (max_memory), or on a dry run over the CPU
    and the disk (every other layer offloaded)."""
    if dry_run:
        layers = e2e.TARGET_SHAPE["num_hidden_layers"]
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                      **{f"model.layers.{i}": ("cpu", "disk")[i % 2] for i in range(layers)}}  # fmt: skip
        extra = dict(device_map=device_map, offload_folder=str(model_dir / "offload"))
    else:
        half = checkpoint_bytes(model_dir) / 2 / 2**30
        # cuda:0 takes half the weights, cuda:1 the rest (with room for what "auto" rounds over)
        extra = dict(device_map="auto", max_memory={0: f"{half * 1.02:.1f}GiB", 1: f"{half * 1.5:.1f}GiB"})
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", **extra)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    return target.eval()


def load_tensor_parallel(model_dir: Path) -> torch.nn.Module:
    kwargs: dict = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    try:  # a DistributedConfig (5.17 and 5.24; the tp_plan argument is deprecated), tp_plan= where it is missing
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    except ImportError:
        kwargs["tp_plan"] = "auto"
    target = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    return target.eval()


def timed_call(fn) -> tuple[float, object]:  # noqa: ANN001
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def run_setting(target, draft, inputs, alpha: float, n_new: int, rounds: int, baselines: dict) -> dict:  # noqa: ANN001
    """Interleaved rounds of the baselines and hf_specdec at one (batch, alpha); fresh SpecDecoders each round."""
    # A Python attribute the draft's forward reads: hf_specdec sees the change (no kept graph of the old alpha is
    # replayed, and the draft's acceptance is learned anew), as for any user's model; no library state is reset.
    draft.alpha = alpha
    batch = inputs["input_ids"].shape[0]
    gen = dict(max_new_tokens=n_new, do_sample=False)
    specs: dict[str, hf_specdec.SpecDecoder] = {}

    def ours(name: str, schedule: str):  # noqa: ANN202
        def call() -> torch.Tensor:
            spec = specs[name] = hf_specdec.SpecDecoder(
                draft_model=draft, num_speculative_tokens=K, num_speculative_tokens_schedule=schedule
            )
            return target.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)

        return call

    fns = {name: (lambda fn=fn: fn(inputs, gen)) for name, fn in baselines.items()}
    fns.update(ours_default=ours("ours_default", "adaptive"), ours_constant_k=ours("ours_constant_k", "constant"))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    errors: dict[str, str] = {}
    with torch.no_grad():
        reference = {}
        for name, fn in list(fns.items()):  # warm-up round (compiles what compiles, captures what captures)
            try:
                reference[name] = fn()
            except Exception as error:  # noqa: BLE001 - a baseline transformers cannot run here is recorded
                errors[name] = f"{type(error).__name__}: {error}"[:500]
                del fns[name]
        identical = {name: bool(torch.equal(out, reference["plain_eager"])) for name, out in reference.items()}
        for _ in range(rounds):
            for name, fn in fns.items():
                seconds, out = timed_call(fn)
                samples[name].append(seconds)
                identical[name] = identical[name] and bool(torch.equal(out, reference["plain_eager"]))
    tps = {name: [batch * n_new / s for s in ts] for name, ts in samples.items() if ts}
    speedup = {
        name: {"min": min(ratios), "median": statistics.median(ratios)}
        for name in tps
        if name != "plain_eager"
        for ratios in [[p / s for p, s in zip(samples["plain_eager"], samples[name])]]
    }
    stats = {name: dict(acceptance=s.last_stats.acceptance_rate, steps=s.last_stats.num_steps,
                        drafting_share=s.last_stats.num_drafting_row_steps / max(1, s.last_stats.num_row_steps),
                        graph_replays=s.last_stats.num_graph_replays)
             for name, s in specs.items()}  # fmt: skip
    row = dict(batch=batch, alpha=alpha, k=K, new_tokens=n_new, tokens_per_s=tps, speedup_vs_plain_eager=speedup,
               identical_to_plain_eager=identical, stats=stats, errors=errors)  # fmt: skip
    say(f"B={batch} alpha={alpha}: " + ", ".join(
        f"{name} {statistics.median(t):.1f} tok/s" + (f" ({speedup[name]['median']:.2f}x, min {speedup[name]['min']:.2f}x)"
                                                      if name in speedup else "")
        for name, t in tps.items()) + f"; identical {identical}" + (f"; errors {errors}" if errors else ""))  # fmt: skip
    return row


def first_calls(target, draft, inputs, n_new: int, baselines: dict) -> dict:  # noqa: ANN001
    """Seconds of each route's first call in this process (before any warm-up): kernels, calibration, capture,
    compile. Plain eager runs first (it pays the process's CUDA and NCCL start), then ours, then plain compiled.
    The draft knows no continuation yet (every draft is wrong): what is timed is the first call's overhead."""
    draft.next_token = torch.full((inputs["input_ids"].shape[1] + n_new + 16, e2e.VOCAB), -1, dtype=torch.int32,
                                  device=e2e.DEVICE)  # fmt: skip
    gen = dict(max_new_tokens=n_new, do_sample=False)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=K)
    fns = {"plain_eager": lambda: baselines["plain_eager"](inputs, gen)}
    fns["ours_default"] = lambda: target.generate(**inputs, **gen, custom_generate=hf_specdec.generate,
                                                  spec_decoder=spec)  # fmt: skip
    fns.update({name: (lambda fn=fn: fn(inputs, gen)) for name, fn in baselines.items() if name != "plain_eager"})
    seconds = {}
    with torch.no_grad():
        for name, fn in fns.items():
            try:
                seconds[name] = timed_call(fn)[0]
            except Exception as error:  # noqa: BLE001 - recorded, as in run_setting
                seconds[name] = f"{type(error).__name__}: {error}"[:500]
    say(
        "first calls (s): "
        + ", ".join(f"{n} {v:.1f}" if isinstance(v, float) else f"{n} {v}" for n, v in seconds.items())
    )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", action="store_true", help="tensor parallelism (run under torchrun, 2 processes)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.8, 0.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--model-dir", default=None, help="where the target checkpoint is saved (and reused)")
    parser.add_argument("--out", default=None, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: a dry run of the script")
    parser.add_argument("--no-compiled", action="store_true", help="--tp: skip the compiled static plain baseline")
    args = parser.parse_args()
    if args.dry_run:
        e2e.use_tiny_shapes()
    rank, world = distributed()
    if args.tp:
        import torch.distributed as dist

        if torch.cuda.is_available() and not args.dry_run:
            local = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local)
            e2e.DEVICE = f"cuda:{local}"
            SYNC_DEVICES.append(torch.device(e2e.DEVICE))
        dist.init_process_group(backend="gloo" if args.dry_run else "nccl")  # transformers then uses this group
    torch.backends.cuda.matmul.allow_tf32 = True
    temporary = tempfile.TemporaryDirectory() if args.model_dir is None and rank == 0 else None
    model_dir = [args.model_dir or (temporary.name if temporary is not None else None)]
    if args.tp:  # every rank loads rank 0's checkpoint
        dist.broadcast_object_list(model_dir, src=0)
    model_dir = Path(model_dir[0])
    if rank == 0:
        model_dir.mkdir(parents=True, exist_ok=True)
        save_target(model_dir)
    if args.tp:
        dist.barrier()
    start = time.perf_counter()
    target = load_tensor_parallel(model_dir) if args.tp else load_device_map(model_dir, args.dry_run)
    load_s = time.perf_counter() - start
    where = placement(target)
    say(f"target loaded in {load_s:.0f} s: {where.describe()}, tensor parallel x{where.tensor_parallel}; "
        f"device_map {getattr(target, 'hf_device_map', None)}")  # fmt: skip
    if not args.tp:
        e2e.DEVICE = str(where.input_device)  # the draft and the inputs go to the target's first device
        SYNC_DEVICES.extend(d for d in where.devices if d.type == "cuda")
    draft = e2e.build(e2e.DRAFT_SHAPE, seed=1, cls=e2e.SyntheticDraft)  # whole, on every rank under --tp

    def plain_eager(inputs: dict, gen: dict) -> torch.Tensor:
        return target.generate(**inputs, **gen)

    def plain_compiled(inputs: dict, gen: dict) -> torch.Tensor:
        return target.generate(**inputs, **gen, cache_implementation="static")

    baselines = {"plain_eager": plain_eager}
    if args.tp and not args.no_compiled:
        baselines["plain_tp_compiled"] = plain_compiled
    all_inputs = {b: e2e.prompts(b, args.prompt_len, ragged=b > 1) for b in args.batches}
    results: dict = {"meta": dict(
        mode="tensor_parallel" if args.tp else "device_map", world_size=world, gpus=device_name(),
        gpu_count=torch.cuda.device_count(), torch=torch.__version__, transformers=transformers.__version__,
        python=platform.python_version(), placement=where.describe(), load_s=load_s, dry_run=args.dry_run,
        new_tokens=args.new_tokens, prompt_len=args.prompt_len, rounds=args.rounds)}  # fmt: skip
    if args.tp:  # the first call of each route in this process
        results["first_call_s"] = first_calls(target, draft, all_inputs[min(args.batches)], args.new_tokens, baselines)
    with torch.no_grad():  # the draft learns the target's greedy continuations (plain eager calls)
        start = time.perf_counter()
        e2e.teach_synthetic_draft(target, draft, all_inputs.values(), args.new_tokens)
        results["meta"]["teach_s"] = time.perf_counter() - start
    rows = []
    for b in args.batches:
        for alpha in args.alphas:
            rows.append(run_setting(target, draft, all_inputs[b], alpha, args.new_tokens, args.rounds, baselines))
    results["settings"] = rows
    if args.out and rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
        say(f"wrote {args.out}")
    if args.tp:
        dist.barrier()
        dist.destroy_process_group()
    if temporary is not None:
        temporary.cleanup()


if __name__ == "__main__":
    main()
