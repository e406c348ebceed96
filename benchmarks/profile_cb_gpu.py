"""Where a continuous-batching step spends its time: plain CB against speculative CB, per phase (issue 41).

Wraps the phases of a CB step (batch preparation, proposing and its draft forwards, the verify forward, the sampler,
the commit) with timers that synchronise the device around each call, then runs one `generate_batch` of each side
(after a warm-up) on `bench_cb_gpu.py`'s models. Timers are inclusive (a phase's time contains the phases it
calls); the synchronisation removes the little overlap an eager CB step has.

Run (GPU, transformers >= 5.24): `PYTHONPATH=. python benchmarks/profile_cb_gpu.py --concurrency 16`
Dry run (CPU, tiny shapes): `PYTHONPATH=. python benchmarks/profile_cb_gpu.py --dry-run`
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import hf_specdec
from benchmarks.bench_cb_gpu import build_models, eager, make_prompts, run_once
from hf_specdec.attention_backends import without_cudnn_attention
from hf_specdec.continuous_batching import compat
from hf_specdec.continuous_batching.draft_model import DraftModelCBProposer
from hf_specdec.continuous_batching.processor import SpecBatchProcessor
from hf_specdec.continuous_batching.sampling import RowSampler

TOTALS: collections.Counter = collections.Counter()
COUNTS: collections.Counter = collections.Counter()


def sync() -> None:
    if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():  # a draft forward being captured
        torch.cuda.synchronize()


def timed(owner: object, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        sync()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            TOTALS[label] += time.perf_counter() - start
            COUNTS[label] += 1

    setattr(owner, name, wrapper)


def instrument(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    processor = compat.ContinuousBatchProcessor
    for owner in (processor, SpecBatchProcessor):
        tag = "spec." if owner is SpecBatchProcessor else ""
        for name in ("prepare_next_batch", "_generation_step", "update_batch"):
            if name in vars(owner):
                timed(owner, name, tag + name)
    timed(compat.ContinuousBatchingIOs, "prepare_batch_tensors", "ios.prepare_batch_tensors")
    timed(compat.ContinuousBatchingIOs, "get_model_kwargs", "ios.get_model_kwargs")
    timed(SpecBatchProcessor, "propose_drafts", "spec.propose_drafts")
    timed(DraftModelCBProposer, "_catch_up", "draft._catch_up")
    timed(DraftModelCBProposer, "_forward", "draft._forward")
    for name in ("scores", "draft_tokens", "verify", "request_args"):
        timed(RowSampler, name, f"sampler.{name}")
    timed(target, "forward", "target.forward")
    timed(draft, "forward", "draft.forward")


def report(title: str, wall: float, tokens: int) -> None:
    steps = COUNTS.get("_generation_step", 0) + COUNTS.get("spec._generation_step", 0)
    print(f"\n== {title}: {wall:.2f} s, {tokens} tokens, {tokens / wall:.1f} tok/s, {steps} steps, "
          f"{1000 * wall / max(1, steps):.1f} ms/step")  # fmt: skip
    for label, total in TOTALS.most_common():
        print(f"  {label:32s} {total:8.3f} s {100 * total / wall:5.1f}%  n={COUNTS[label]:6d}  "
              f"{1000 * total / COUNTS[label]:7.2f} ms/call")  # fmt: skip
    TOTALS.clear()
    COUNTS.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--schedule", default="adaptive")
    parser.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top operators")
    args = parser.parse_args()
    if args.dry_run:
        cb_config = lambda: ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=512)  # noqa: E731
    else:
        cb_config = lambda: None  # noqa: E731
    hf_specdec.install()
    device, vocab, perm, target, draft = build_models(args.dry_run, args.alpha)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = make_prompts(args.concurrency, args.prompt_len, vocab, perm.cpu(), False, args.new_tokens, seed=1)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=args.k,
                                  num_speculative_tokens_schedule=args.schedule)  # fmt: skip
    run_once(target, prompts, gen, eager(cb_config()), None)  # warm up both sides
    run_once(target, prompts, gen, cb_config(), spec)
    instrument(target, draft)
    sides = (("plain CB (no graphs, no async)", None, False), ("plain CB, cuDNN attention off", None, True),
             ("speculative CB", spec, False))  # fmt: skip
    for title, side, no_cudnn in sides:
        config = eager(cb_config()) if side is None else cb_config()
        TOTALS.clear()
        COUNTS.clear()
        with without_cudnn_attention(torch.device(device)) if no_cudnn else contextlib.nullcontext():
            metrics, tokens = run_once(target, prompts, gen, config, side)
        report(title, metrics["wall_s"], sum(len(t) for t in tokens.values()))
    if args.torch_profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        for title, side in (("plain CB (no graphs, no async)", None), ("speculative CB", spec)):
            config = eager(cb_config()) if side is None else cb_config()
            with torch.profiler.profile(activities=activities) as prof:
                run_once(target, prompts, gen, config, side)
            device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            print(f"\n== torch.profiler, {title}")
            print(prof.key_averages().table(sort_by=device_key, row_limit=25, max_name_column_width=60))
    stats = spec.last_stats
    print(f"\nacceptance {stats.acceptance_rate:.2f}, drafted {stats.num_draft_tokens}, verify steps {stats.num_steps}")


if __name__ == "__main__":
    main()
