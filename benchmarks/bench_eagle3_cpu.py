"""The trained EAGLE-3 head for SmolLM2-135M-Instruct on the CPU: acceptance on held-out chat prompts, and speed
against plain greedy and prompt lookup on the README demo's prompts.

1. Acceptance: greedy, k = 5 every step (`"constant"`), batch 1, on the 16 held-out MT-bench prompts of the dev file
   (`train_eagle3_smollm.split_prompts`) and the demo's chat prompt: acceptance rate, mean accepted length
   (1 + accepted drafts per drafting step), per-position acceptance.
2. Speed: per demo prompt, plain `generate`, hf_specdec prompt lookup (`method="ngram"`, the demo's settings: k = 8,
   adaptive) and the head (k = 5, constant and adaptive), each warmed up, then `--repeats` interleaved timed runs
   (the order rotating); the median counts. Every output is checked against plain greedy.

Run: `OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_eagle3_cpu.py --head heads/eagle3-smollm2`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

METHODS = ("plain", "ngram", "eagle3-k5", "eagle3")


def run(model, tokenizer, head, text: str, method: str, max_new_tokens: int):  # noqa: ANN001, ANN201
    """(new token ids, seconds, stats or None) of one greedy call."""
    import hf_specdec
    from hf_specdec.tools.prompts import encode_batch

    enc = encode_batch(tokenizer, [text])
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    spec = None
    if method == "ngram":
        spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=8)
    elif method == "eagle3-k5":
        spec = hf_specdec.SpecDecoder(
            draft_head=head, num_speculative_tokens=5, num_speculative_tokens_schedule="constant"
        )
    elif method == "eagle3":
        spec = hf_specdec.SpecDecoder(draft_head=head, num_speculative_tokens=5)
    with torch.inference_mode():
        start = time.perf_counter()
        if spec is None:
            out = model.generate(**enc, **kwargs)
        else:
            out = model.generate(**enc, **kwargs, custom_generate=hf_specdec.generate, spec_decoder=spec)
        seconds = time.perf_counter() - start
    return out[0, enc["input_ids"].shape[1] :].tolist(), seconds, spec.last_stats if spec else None


def acceptance(model, tokenizer, head, texts: list[str], max_new_tokens: int) -> dict:  # noqa: ANN001
    drafted = accepted = steps = 0
    per_position = torch.zeros(2, 5)
    identical = True
    for text in texts:
        plain, _, _ = run(model, tokenizer, head, text, "plain", max_new_tokens)
        tokens, _, stats = run(model, tokenizer, head, text, "eagle3-k5", max_new_tokens)
        identical &= tokens == plain
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        steps += stats.num_drafting_row_steps
        per_position[0, : len(stats.drafted_per_position)] += torch.tensor(
            stats.drafted_per_position, dtype=torch.float
        )
        per_position[1, : len(stats.accepted_per_position)] += torch.tensor(
            stats.accepted_per_position, dtype=torch.float
        )
    return {
        "prompts": len(texts),
        "acceptance_rate": accepted / max(1, drafted),
        "mean_accepted_length": 1 + accepted / max(1, steps),
        "per_position_acceptance": (per_position[1] / per_position[0].clamp(min=1)).tolist(),
        "identical_to_plain": bool(identical),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default="heads/eagle3-smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", default=None)
    parser.add_argument("--seen", type=int, default=0, help="also measure acceptance on this many training prompts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers
    from train_eagle3_smollm import split_prompts

    import hf_specdec
    from hf_specdec.tools.prompts import DEMO_PROMPTS
    from hf_specdec.tools.smollm import load_smollm2

    model, tokenizer = load_smollm2()
    head = hf_specdec.load_draft_head(args.head)
    report: dict = {
        "machine": f"{platform.processor() or platform.machine()}, 1 thread, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        "max_new_tokens": args.max_new_tokens,
    }
    seen, held_out = split_prompts()
    if args.seen:  # prompts the head was trained on: does drafting read what the trainer fed?
        import random

        random.seed(0)
        report["seen_acceptance_k5"] = acceptance(
            model, tokenizer, head, random.sample(seen, args.seen), args.max_new_tokens
        )
        print(json.dumps(report["seen_acceptance_k5"], indent=1), flush=True)
    chat = [*held_out, next(p.text for p in DEMO_PROMPTS if p.category == "chat")]
    report["chat_acceptance_k5"] = acceptance(model, tokenizer, head, chat, args.max_new_tokens)
    print(json.dumps(report["chat_acceptance_k5"], indent=1), flush=True)
    for method in METHODS:  # warm-up: one-time costs, and the adaptive schedule's step-cost timing
        for _ in range(3):
            run(model, tokenizer, head, DEMO_PROMPTS[0].text, method, 16)
    rows = []
    for prompt in DEMO_PROMPTS:
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        outputs: dict[str, list[int]] = {}
        stats: dict[str, object] = {}
        for repeat in range(args.repeats):
            order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
            for method in order:
                tokens, seconds, st = run(model, tokenizer, head, prompt.text, method, args.max_new_tokens)
                times[method].append(seconds)
                outputs[method] = tokens
                stats[method] = st
        n = len(outputs["plain"])
        row = {"prompt": prompt.category, "new_tokens": n}
        for method in METHODS:
            median = statistics.median(times[method])
            row[f"{method}_tok_s"] = n / median
            row[f"{method}_speedup"] = statistics.median(times["plain"]) / median
            row[f"{method}_identical"] = outputs[method] == outputs["plain"]
            if stats[method] is not None:
                row[f"{method}_mean_accepted_length"] = stats[method].mean_accepted_length
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["demo"] = rows
    print("\nprompt          plain tok/s  ngram        eagle3-k5    eagle3 (adaptive)  MAL(k5)")
    for r in rows:
        print(
            f"{r['prompt']:<15} {r['plain_tok_s']:>7.1f}     "
            + "  ".join(f"{r[m + '_tok_s']:>5.1f} {r[m + '_speedup']:.2f}x" for m in METHODS[1:])
            + f"  {r.get('eagle3-k5_mean_accepted_length', 0):.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
