"""Benchmark on one GPU: hf_specdec vs plain `generate` vs HF's stock assisted decoding, at controlled acceptance.

Models without downloads: a Llama-3-8B-shaped target and a ~150M-parameter-shaped draft (vocabulary 128 256),
bf16, random weights made on the GPU. Random weights make acceptance meaningless, so `SyntheticDraft` controls
it: it runs the real draft forward (for its real cost), then proposes the target's own greedy continuation
(precomputed by a plain greedy run) with probability alpha per position, decided by a seeded hash of (position,
previous token) — every method sees the very same drafts. (vLLM's `rejection_sample_method="synthetic"` idea, done
on the draft side so HF's stock path can run it too.)

Prints and writes (JSON): batch 1 tokens/s of plain, HF stock (`num_assistant_tokens_schedule="constant"`) and
hf_specdec for alpha x k; the measured draft step, 1-token target step and (k+1)-token verify; the ideal speedup
S* = E t_target / (k t_draft + t_verify), E = (1 - alpha^(k+1)) / (1 - alpha); efficiency = speedup / S*; batched
throughput against plain batched `generate`; and a per-phase time breakdown of hf_specdec's loop.

Run (GPU): `PYTHONPATH=. python benchmarks/bench_gpu_e2e.py --out e2e.json`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec import decoding

VOCAB = 128_256
TARGET_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, tie_word_embeddings=False)  # fmt: skip
DRAFT_SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
                   num_key_value_heads=4, tie_word_embeddings=True)  # fmt: skip
DEVICE = "cuda"
REPEATS = 3  # turns of each side-by-side timing (medians are reported)
PHASES = ("propose", "verify", "score", "accept", "commit", "rollback", "retire_finished")


def use_tiny_shapes() -> None:
    """`--tiny`: tiny models on the CPU, a dry run of a GPU benchmark script."""
    global DEVICE
    DEVICE = "cpu"
    TARGET_SHAPE.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)  # fmt: skip
    DRAFT_SHAPE.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2)  # fmt: skip


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu"


def build(shape: dict, seed: int, cls: type = LlamaForCausalLM) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=8192, rope_theta=500_000.0, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0, **shape)  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def make_decisive(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Give a random model a clear greedy choice: next token = perm(current token), with a wide logit margin.

    Random weights put the top two logits of a 128k vocabulary so close that bf16 rounding differences between a
    1-token step and a (k+1)-token verify flip the greedy choice, so no precomputed continuation would stay valid.
    Scaling the layers' output projections down keeps the residual stream near the token's embedding, and an output
    head made of permuted embeddings then has one clear winner. Every layer still runs: the costs stay real.
    """
    model.model.embed_tokens.weight.mul_(50.0)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(1e-3)
        layer.mlp.down_proj.weight.mul_(1e-3)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    embed = model.model.embed_tokens.weight
    model.lm_head.weight.index_copy_(0, perm, embed / embed.norm(dim=1, keepdim=True).clamp_min(1e-3) * 4.0)


class SyntheticDraft(LlamaForCausalLM):
    """A real draft forward whose logits are replaced by a one-hot proposal: right with probability alpha."""

    alpha: float = 0.8
    next_token: torch.Tensor | None = None  # [P, V] int32: the target's greedy token after (position, token), or -1

    def forward(self, input_ids=None, position_ids=None, cache_position=None, **kwargs):  # noqa: ANN001, ANN201
        positions = position_ids
        if positions is None and cache_position is not None:
            positions = cache_position[None].expand_as(input_ids)
        if positions is None:
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None else 0
            positions = (past + torch.arange(input_ids.shape[1], device=input_ids.device))[None].expand_as(input_ids)
        out = super().forward(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position, **kwargs)
        width = out.logits.shape[1]
        pos = positions[:, -width:].clamp(0, self.next_token.shape[0] - 1)  # [B, w]
        tok = input_ids[:, -width:]  # [B, w]
        truth = self.next_token[pos, tok].long()  # [B, w]
        h = (pos * 1_000_003 + tok) * 2_654_435_761 % (2**31)  # [B, w] seeded hash of (position, token)
        right = (h.double() / 2**31 < self.alpha) & (truth >= 0)
        proposal = torch.where(right, truth, (truth.clamp(min=0) + 1) % VOCAB)  # [B, w]
        logits = torch.full_like(out.logits, -30.0)
        out.logits = logits.scatter_(-1, proposal[..., None], 30.0)
        return out


@torch.no_grad()
def teach_synthetic_draft(target, draft: SyntheticDraft, all_inputs, n_new: int) -> None:  # noqa: ANN001
    """Give the draft the target's greedy continuation of every prompt (plus a margin for drafts past the end)."""
    tables = []
    for inputs in all_inputs:
        seq = target.generate(**inputs, max_new_tokens=n_new + 8, do_sample=False)
        tables.append(table_from(seq, inputs["attention_mask"]))
    width = max(t.shape[0] for t in tables)
    draft.next_token = torch.full((width, VOCAB), -1, dtype=torch.int32, device=DEVICE)
    for t in tables:
        draft.next_token[: t.shape[0]] = torch.where(t >= 0, t, draft.next_token[: t.shape[0]])


def table_from(sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # [P, V] int32
    """next_token[p, t]: the token that follows token t at position p in the greedy runs."""
    mask = torch.cat([attention_mask, torch.ones_like(sequences[:, attention_mask.shape[1] :])], 1)
    positions = mask.cumsum(1) - 1  # [B, L] the positions plain generate gives
    table = torch.full((int(positions.max()) + 2, VOCAB), -1, dtype=torch.int32, device=sequences.device)
    valid = mask[:, :-1].bool()
    table[positions[:, :-1][valid], sequences[:, :-1][valid]] = sequences[:, 1:][valid].int()
    return table


def timed(fn: Callable[[], object], repeats: int = 1) -> float:
    """Median wall seconds of fn (synchronised), after one warm-up."""
    return timed_together({"fn": fn}, repeats)["fn"]


def timed_together(fns: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, float]:
    """Median wall seconds of each fn (synchronised), after one warm-up each, the fns timed in turn `repeats` times.

    Taking turns puts a baseline and the methods it is compared with under the same machine: on a shared host the
    same batch-1 forward of a launch-bound 8B model varied from 26 to 42 ms within two minutes.
    """
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(times) for name, times in samples.items()}


def forward_time(model: torch.nn.Module, context: int, width: int, batch: int = 1) -> float:
    """Seconds of one forward of `width` new tokens over a cache of `context` tokens."""
    ids = torch.randint(3, VOCAB, (batch, context + width), device=DEVICE)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)

        def step() -> None:
            model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True)
            cache.crop(-width)

        return timed(step, repeats=20)


@contextlib.contextmanager
def phase_timer() -> Iterator[dict[str, float]]:
    """Time each step method of the loop (synchronising around it): where the time of a step goes."""
    totals: dict[str, float] = defaultdict(float)
    originals = {name: getattr(decoding.SpeculativeLoop, name) for name in PHASES}

    def wrap(name: str, fn: Callable) -> Callable:
        def timed_method(self, *args, **kwargs):  # noqa: ANN001, ANN202
            sync()
            t0 = time.perf_counter()
            result = fn(self, *args, **kwargs)
            sync()
            totals[name] += time.perf_counter() - t0
            return result

        return timed_method

    for name, fn in originals.items():
        setattr(decoding.SpeculativeLoop, name, wrap(name, fn))
    try:
        yield totals
    finally:
        for name, fn in originals.items():
            setattr(decoding.SpeculativeLoop, name, fn)


def adaptive_row(target, draft, inputs, expected, alpha: float, k: int, gen: dict) -> dict:  # noqa: ANN001
    """hf_specdec with the adaptive schedule at one alpha: a new alpha changes the draft's fingerprint, so its
    acceptance is learned afresh (the cost tables are kept), as for any user whose draft changed."""
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=k, num_speculative_tokens_schedule="adaptive"
    )
    run = lambda: target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **gen)  # noqa: E731
    with torch.no_grad():
        ours = run()  # warm-up: calibrates the step costs on the first call, learns acceptance
        times = timed_together({"plain": lambda: target.generate(**inputs, **gen), "ours": run})
    t_plain, t_ours = times["plain"], times["ours"]
    stats = spec.last_stats
    row = dict(alpha=alpha, k="adaptive", max_k=k, tps_plain=gen["max_new_tokens"] / t_plain,
               tps_ours=gen["max_new_tokens"] / t_ours, speedup=t_plain / t_ours, acceptance=stats.acceptance_rate,
               drafts_per_step=stats.num_draft_tokens / max(stats.num_steps, 1),
               identical_to_plain=bool(torch.equal(ours, expected)))  # fmt: skip
    print(f"B=1 alpha={alpha} adaptive (k <= {k}): {row['tps_ours']:.1f} tok/s ({row['speedup']:.2f}x plain), "
          f"{row['drafts_per_step']:.2f} drafts/step, identical {row['identical_to_plain']}", flush=True)  # fmt: skip
    return row


def prompts(batch: int, length: int, ragged: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g) if ragged else torch.full((batch,), length)
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, length - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, length - n :] = 1
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.5, 0.7, 0.8, 0.9])
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 4, 6])
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a dry run of the script")
    parser.add_argument("--adaptive", action="store_true",
                        help="also run num_speculative_tokens_schedule='adaptive' (k <= max(--ks)) at each alpha")  # fmt: skip
    args = parser.parse_args()
    if args.tiny:
        use_tiny_shapes()
    torch.backends.cuda.matmul.allow_tf32 = True
    n_new = args.new_tokens
    target = build(TARGET_SHAPE, seed=0)
    make_decisive(target)
    draft = build(DRAFT_SHAPE, seed=1, cls=SyntheticDraft)
    params = lambda m: sum(p.numel() for p in m.parameters()) / 1e9  # noqa: E731
    print(f"{device_name()}: target {params(target):.2f}B, draft {params(draft):.3f}B params", flush=True)
    results: dict = {"meta": dict(gpu=device_name(), torch=torch.__version__,
                                  transformers=transformers.__version__, python=platform.python_version(),
                                  new_tokens=n_new, prompt_len=args.prompt_len)}  # fmt: skip
    gen = dict(max_new_tokens=n_new, do_sample=False)

    # Greedy continuations of every prompt used below (plus a margin for drafts past the end) feed the draft.
    all_inputs = {b: prompts(b, args.prompt_len, ragged=b > 1) for b in [1, *args.batches]}
    teach_synthetic_draft(target, draft, all_inputs.values(), n_new)

    # Step costs at batch 1 with a cache of prompt + half the generation.
    context = args.prompt_len + n_new // 2
    t_target = forward_time(target, context, 1)
    t_draft = forward_time(draft, context, 1)
    t_verify = {k: forward_time(target, context, k + 1) for k in args.ks}
    results["step_ms"] = dict(
        target=t_target * 1e3, draft=t_draft * 1e3, verify={k: v * 1e3 for k, v in t_verify.items()}
    )
    print(f"step ms: target {t_target * 1e3:.2f}, draft {t_draft * 1e3:.2f}, verify "
          + ", ".join(f"k={k}: {v * 1e3:.2f}" for k, v in t_verify.items()), flush=True)  # fmt: skip

    inputs = all_inputs[1]
    with torch.no_grad():
        expected = target.generate(**inputs, **gen)
    rows = []
    for alpha in args.alphas:
        draft.alpha = alpha
        for k in args.ks:
            spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=k)
            with torch.no_grad():
                ours = target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **gen)
                stock_kwargs = dict(assistant_model=draft, num_assistant_tokens=k, assistant_confidence_threshold=0.0,
                                    num_assistant_tokens_schedule="constant", **gen)  # fmt: skip
                stock = target.generate(**inputs, **stock_kwargs)
                times = timed_together({
                    "plain": lambda: target.generate(**inputs, **gen),
                    "ours": lambda: target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec,
                                                    **gen),
                    "stock": lambda: target.generate(**inputs, **stock_kwargs),
                })  # fmt: skip
            t_plain, t_ours, t_stock = times["plain"], times["ours"], times["stock"]
            e = (1 - alpha ** (k + 1)) / (1 - alpha)
            ideal = e * t_target / (k * t_draft + t_verify[k])
            row = dict(alpha=alpha, k=k, tps_plain=n_new / t_plain, tps_hf_stock=n_new / t_stock, tps_ours=n_new / t_ours,
                       speedup=t_plain / t_ours, hf_stock_speedup=t_plain / t_stock, ideal_speedup=ideal,
                       efficiency=(t_plain / t_ours) / ideal, vs_hf_stock=t_stock / t_ours,
                       acceptance=spec.last_stats.acceptance_rate, mean_accepted_length=spec.last_stats.mean_accepted_length,
                       identical_to_plain=bool(torch.equal(ours, expected)), hf_stock_identical=bool(torch.equal(stock, expected)))  # fmt: skip
            rows.append(row)
            print(f"B=1 alpha={alpha} k={k}: plain {row['tps_plain']:.1f} tok/s, HF stock {row['tps_hf_stock']:.1f}, "
                  f"hf_specdec {row['tps_ours']:.1f} ({row['speedup']:.2f}x plain, {row['vs_hf_stock']:.2f}x HF stock), "
                  f"S* {ideal:.2f}, efficiency {row['efficiency']:.2f}, acc {row['acceptance']:.2f}, "
                  f"identical {row['identical_to_plain']}", flush=True)  # fmt: skip
        if args.adaptive:
            rows.append(adaptive_row(target, draft, inputs, expected, alpha, max(args.ks), gen))
    results["batch1"] = rows

    draft.alpha = 0.8
    with torch.no_grad(), phase_timer() as phases:
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
        t0 = time.perf_counter()
        target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **gen)
        total = time.perf_counter() - t0
    steps = spec.last_stats.num_steps
    results["phases_ms_per_step"] = {name: phases[name] / steps * 1e3 for name in PHASES}
    results["phases_ms_per_step"]["total"] = total / steps * 1e3
    print(
        "B=1 alpha=0.8 k=4 ms per step: " + ", ".join(f"{n} {v:.2f}" for n, v in results["phases_ms_per_step"].items())
    )

    batch_rows = []
    for b in args.batches:
        inputs = all_inputs[b]
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
        with torch.no_grad():
            expected = target.generate(**inputs, **gen)
            ours = target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **gen)
            times = timed_together({
                "plain": lambda: target.generate(**inputs, **gen),
                "ours": lambda: target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec,
                                                **gen),
            })  # fmt: skip
        t_plain, t_ours = times["plain"], times["ours"]
        same = (ours == expected).all(1).float().mean().item()
        row = dict(batch=b, alpha=0.8, k=4, tps_plain=b * n_new / t_plain, tps_ours=b * n_new / t_ours,
                   speedup=t_plain / t_ours, acceptance=spec.last_stats.acceptance_rate, rows_identical=same)  # fmt: skip
        batch_rows.append(row)
        print(f"B={b} alpha=0.8 k=4: plain {row['tps_plain']:.0f} tok/s, hf_specdec {row['tps_ours']:.0f} tok/s, "
              f"{row['speedup']:.2f}x, acc {row['acceptance']:.2f}, rows identical {same:.2f}", flush=True)  # fmt: skip
    results["batched"] = batch_rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
