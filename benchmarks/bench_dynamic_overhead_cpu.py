"""The eager dynamic-cache path's own overhead on the CPU: a small Llama whose forward is cheap, so the loop's host
work shows, against plain greedy `generate` in the same process.

Two settings where speculation cannot pay, so the adaptive schedule turns drafting off and every step is a plain
forward plus the loop's work: a useless draft model (another random model: nothing is accepted), and prompt lookup
on prompts without repeats. Each round times plain and hf_specdec once each, interleaved; per-token time is a
call's seconds over its generated positions (max_new_tokens); the minimum over rounds is reported, and its ratio to
plain's. The goal (issue 39): at most 1.03x plain.

    PYTHONPATH=. python benchmarks/bench_dynamic_overhead_cpu.py --threads 1 --batch 1 4
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec

VOCAB = 2048


def small_llama(seed: int, layers: int = 4, hidden: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 20..40 distinct tokens (nothing for prompt lookup to find in them)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 41, (batch,), generator=g).tolist()
    width = max(lengths)
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        input_ids[i, width - n :] = torch.randperm(VOCAB - 3, generator=g)[:n] + 3
        mask[i, width - n :] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = small_llama(0)
    settings = {
        "useless draft": dict(draft_model=small_llama(1, layers=2)),
        "prompt lookup": dict(method="ngram"),
    }
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None)
    results = []
    with torch.inference_mode():
        for batch in args.batch:
            inputs = prompts(batch)
            plain = target.generate(**inputs, **gen)
            specs = {name: hf_specdec.SpecDecoder(**kwargs) for name, kwargs in settings.items()}
            times: dict[str, list[float]] = {"plain": [], **{name: [] for name in specs}}
            for name, spec in specs.items():  # warm-up calls: the adaptive schedule calibrates and learns
                for _ in range(2):
                    out = target.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)
                    assert torch.equal(out, plain), f"{name}: not plain's tokens"
            for _ in range(args.rounds):
                start = time.perf_counter()
                target.generate(**inputs, **gen)
                times["plain"].append(time.perf_counter() - start)
                for name, spec in specs.items():
                    start = time.perf_counter()
                    out = target.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)
                    times[name].append(time.perf_counter() - start)
                    assert torch.equal(out, plain), f"{name}: not plain's tokens"
            per_token = {name: 1000 * min(t) / args.max_new_tokens for name, t in times.items()}
            for name, ms in per_token.items():
                ratio = ms / per_token["plain"]
                drafted = specs[name].last_stats.num_draft_tokens if name in specs else 0
                print(f"B={batch} {name:14s} {ms:7.3f} ms/token  {ratio:5.3f}x plain  (drafts in last call: {drafted})")
                results.append({"batch": batch, "setting": name, "ms_per_token": ms, "ratio_to_plain": ratio})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "max_new_tokens": args.max_new_tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
