"""Benchmark on one GPU: speculative continuous batching vs plain continuous batching, in the same process.

Models without downloads (as `bench_gpu_e2e.py`): a Llama-3-8B-shaped target made decisive (next token = a fixed
permutation of the current one, with a wide margin, so bf16 verifies agree with single steps) and a ~150M-shaped
draft whose logits are replaced by the target's greedy token with probability alpha (decided by a seeded hash of
(position, token)): the real draft forward is paid, acceptance is controlled. Workloads, each at every concurrency:

- `draft`: the synthetic draft at `--alpha` (issue 41's goal: >= 1.5x plain CB at 16 requests, 1.2x at 64);
- `useless_draft`: the same draft at alpha 0 (goal: >= 0.95x);
- `ngram_copy`: prompt lookup on prompts that hold the answer (the permutation chain), goal >= 2x at 16.

Each setting runs interleaved rounds (plain, speculative, plain, ...) of `generate_batch` with `--concurrency`
requests of `--new-tokens` tokens; reported per side: medians of throughput (generated tokens / s), TTFT and
inter-token latency p50/p99 (from per-token timestamps; a verify's tokens share a stamp) and time per output token
after the first, per request (TPOT p50/p99), the speedup, and the share of requests whose tokens equal
plain CB's. JSON out. Plain CB keeps transformers' defaults (async batching, CUDA graphs where it picks them);
speculative CB turns those off (see docs/design.md, "Continuous batching"), so each setting also times plain CB
with them off (`plain_eager`), and plain CB on the attention kernels speculative CB runs (`plain_same_kernel`: cuDNN's
SDPA off, see `hf_specdec/attention_backends.py`): speedup over those is what speculation itself buys, speedup over
`plain` what a user gets.

Run (GPU, transformers >= 5.24): `PYTHONPATH=. python benchmarks/bench_cb_gpu.py --out cb.json`
Dry run (CPU, tiny shapes): `PYTHONPATH=. python benchmarks/bench_cb_gpu.py --dry-run`
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import hf_specdec
from hf_specdec.attention_backends import without_cudnn_attention

SHAPES = {
    "target": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "draft": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),  # fmt: skip
}
TINY = {
    "target": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "draft": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),  # fmt: skip
}


def build(shape: dict, vocab: int, device: str, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0, **shape)  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def make_decisive(model: LlamaForCausalLM, perm: torch.Tensor) -> None:
    """Next token = perm[current token] with a wide margin (see bench_gpu_e2e.make_decisive); every layer still runs."""
    model.model.embed_tokens.weight.mul_(50.0)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(1e-3)
        layer.mlp.down_proj.weight.mul_(1e-3)
    embed = model.model.embed_tokens.weight
    model.lm_head.weight.index_copy_(0, perm, embed / embed.norm(dim=1, keepdim=True).clamp_min(1e-3) * 4.0)


def make_synthetic(draft: LlamaForCausalLM, perm: torch.Tensor, alpha: float) -> None:
    """Replace the draft's logits (at the rows it keeps) by perm[token] with probability alpha, else a wrong token."""
    real_forward = draft.forward
    vocab = perm.numel()

    def forward(self, input_ids=None, position_ids=None, logits_to_keep=0, **kwargs):  # noqa: ANN001, ANN202
        out = real_forward(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
        rows = (
            logits_to_keep
            if isinstance(logits_to_keep, torch.Tensor)
            else torch.arange(input_ids.shape[1] - out.logits.shape[1], input_ids.shape[1], device=input_ids.device)
        )
        tok, pos = (
            input_ids[0, rows].long(),
            position_ids[0, rows].long(),
        )  # [R] (CB passes int32: widen before hashing)
        h = (pos * 1_000_003 + tok) * 2_654_435_761 % (2**31)
        right = h.double() / 2**31 < self.synthetic_alpha
        proposal = torch.where(right, perm[tok], (perm[tok] + 1) % vocab)  # [R]
        logits = torch.full_like(out.logits, -30.0)
        out.logits = logits.scatter_(-1, proposal[None, :, None], 30.0)
        return out

    draft.synthetic_alpha = alpha
    draft.forward = types.MethodType(forward, draft)


def make_prompts(n: int, length: int, vocab: int, perm: torch.Tensor, copy: bool, answer: int, seed: int):
    """Random prompts; `copy`: the prompt holds the chain its answer follows (so prompt lookup finds it)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        row = torch.randint(3, vocab, (length,), generator=g).tolist()
        if copy:
            start = int(torch.randint(3, vocab, (1,), generator=g))
            chain = [start]
            for _ in range(answer + 8):
                chain.append(int(perm[chain[-1]]))
            row = chain[1:] + row[: max(1, length - len(chain))] + [start]
        prompts.append(row)
    return prompts


def build_models(dry_run: bool, alpha: float) -> tuple[str, int, torch.Tensor, LlamaForCausalLM, LlamaForCausalLM]:
    """(device, vocabulary, permutation, decisive target, synthetic draft at `alpha`): tiny float32 models on the
    CPU for a dry run, else the 8B- and 124M-shaped bf16 pair on the GPU."""
    if dry_run:
        device, dtype, vocab, shapes = "cpu", torch.float32, 512, TINY
    else:
        device, dtype, vocab, shapes = "cuda", torch.bfloat16, 128_256, SHAPES
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).to(device)
    target = build(shapes["target"], vocab, device, dtype, seed=0)
    make_decisive(target, perm)
    draft = build(shapes["draft"], vocab, device, dtype, seed=1)
    make_synthetic(draft, perm, alpha)
    return device, vocab, perm, target, draft


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def eager(config: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
    """`config` with what speculative CB turns off turned off for plain CB too (async batching, CUDA graphs)."""
    config = ContinuousBatchingConfig() if config is None else config
    config.use_async_batching = False
    config.use_cuda_graph = False
    return config


def run_once(target, prompts, gen, cb_config, spec):  # noqa: ANN001, ANN201
    start = time.perf_counter()
    outputs = target.generate_batch(prompts, gen, continuous_batching_config=cb_config, record_timestamps=True,
                                    spec_decoder=spec) if spec is not None else target.generate_batch(
        prompts, gen, continuous_batching_config=cb_config, record_timestamps=True)  # fmt: skip
    wall = time.perf_counter() - start
    ttft, itl, tpot, total = [], [], [], 0
    for out in outputs.values():
        total += len(out.generated_tokens)
        stamps = out.timestamps or []
        if stamps:
            ttft.append(stamps[0] - out.created_time)
            itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
        if len(stamps) > 1:  # per request: a verify's tokens share one stamp, so ITL alone shows bursts
            tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    metrics = dict(tokens_per_s=total / wall, wall_s=wall, ttft_p50=percentile(ttft, 0.5), ttft_p99=percentile(ttft, 0.99),
                   itl_p50=percentile(itl, 0.5), itl_p99=percentile(itl, 0.99), tpot_p50=percentile(tpot, 0.5),
                   tpot_p99=percentile(tpot, 0.99))  # fmt: skip
    return metrics, {k: v.generated_tokens for k, v in outputs.items()}


#: Plain CB sides: transformers' defaults, with async batching and graphs off, on speculative CB's attention kernels
BASELINES = ("plain", "plain_eager", "plain_same_kernel")


def write(args: argparse.Namespace, device: str, results: list[dict]) -> None:
    meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, transformers=transformers.__version__, args=vars(args))  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, few requests and tokens")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (the per-request schedule's max)")
    parser.add_argument("--schedule", default="adaptive", help="num_speculative_tokens_schedule")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["draft", "useless_draft", "ngram_copy"])
    parser.add_argument(
        "--baselines",
        nargs="+",
        default=list(BASELINES),
        choices=BASELINES,
        help="the plain CB sides to time each round (the first gives the reference tokens)",
    )
    parser.add_argument("--out", default="bench_cb_gpu.json")
    args = parser.parse_args()

    if args.dry_run:
        args.concurrency, args.new_tokens, args.prompt_len, args.rounds = [2, 4], 16, 24, 1
        cb_config = lambda: ContinuousBatchingConfig(page_size=16, num_blocks=128, max_batch_tokens=256)  # noqa: E731
    else:
        cb_config = lambda: None  # noqa: E731 (transformers' defaults, resolved per manager)
    hf_specdec.install()
    device, vocab, perm, target, draft = build_models(args.dry_run, args.alpha)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)

    results = []
    for workload in args.workloads:
        for n in args.concurrency:
            copy = workload == "ngram_copy"
            prompts = make_prompts(n, args.prompt_len, vocab, perm.cpu(), copy, args.new_tokens, seed=n)
            if workload == "ngram_copy":
                spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=args.k,
                                              num_speculative_tokens_schedule=args.schedule)  # fmt: skip
            else:
                draft.synthetic_alpha = 0.0 if workload == "useless_draft" else args.alpha
                spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=args.k,
                                              num_speculative_tokens_schedule=args.schedule)  # fmt: skip
            run_once(target, prompts[:2], gen, cb_config(), None)  # warm up both sides
            run_once(target, prompts[:2], gen, cb_config(), spec)
            sides: dict[str, list[dict]] = {side: [] for side in (*args.baselines, "spec")}
            same = []
            for _ in range(args.rounds):
                plain_tokens = None
                for side in args.baselines:
                    if side == "plain_same_kernel":
                        with without_cudnn_attention(torch.device(device)):
                            metrics, tokens = run_once(target, prompts, gen, cb_config(), None)
                    else:
                        config = eager(cb_config()) if side == "plain_eager" else cb_config()
                        metrics, tokens = run_once(target, prompts, gen, config, None)
                    sides[side].append(metrics)
                    plain_tokens = plain_tokens or tokens
                spec_metrics, spec_tokens = run_once(target, prompts, gen, cb_config(), spec)
                sides["spec"].append(spec_metrics)
                same.append(sum(plain_tokens[r] == spec_tokens.get(r) for r in plain_tokens) / len(plain_tokens))
            med = {side: {m: statistics.median(r[m] for r in rows) for m in rows[0]} for side, rows in sides.items()}
            stats = spec.last_stats
            if stats is None:
                raise RuntimeError(
                    "spec_decoder was not applied (no speculation stats): an hf_specdec without continuous-batching "
                    "support was imported; run from the repository root with PYTHONPATH=."
                )
            row = dict(workload=workload, concurrency=n, **med, identical_share=min(same),
                       acceptance=stats.acceptance_rate)  # fmt: skip
            for side in args.baselines:  # median ratio, and the worst round's (speculative over the same round's)
                row[f"speedup_vs_{side}"] = med["spec"]["tokens_per_s"] / med[side]["tokens_per_s"]
                row[f"speedup_vs_{side}_min"] = min(
                    s["tokens_per_s"] / b["tokens_per_s"] for s, b in zip(sides["spec"], sides[side])
                )
            results.append(row)
            ratios = ", ".join(f"{row[f'speedup_vs_{side}']:.2f}x {side} (worst round {row[f'speedup_vs_{side}_min']:.2f}x)"
                               for side in args.baselines)  # fmt: skip
            print(f"{workload:14s} n={n:3d}: spec {med['spec']['tokens_per_s']:8.1f} tok/s: {ratios}; identical "
                  f"{row['identical_share']:.2f}, acceptance {row['acceptance']:.2f}, TTFT p50 "
                  f"{med['spec']['ttft_p50']:.3f}s", flush=True)  # fmt: skip
            write(args, device, results)  # after each setting: a run cut short keeps what it measured
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
