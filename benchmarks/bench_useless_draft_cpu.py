"""A useless draft through `install()` on the CPU: SmolLM2's own first layers as an early-exit draft (not trained to
exit early, so almost nothing is accepted) at batch 4, against plain greedy `generate`, interleaved in one process.

The adaptive schedule (what `install()` uses when no HF assistant knob is given) must learn that drafting does not
pay and decode plainly through its loop: the goal is at least 0.9x plain. Rounds after a warm-up call; each round
times plain and hf_specdec once; the minimum and median of the per-round ratios are reported.

    PYTHONPATH=. python benchmarks/bench_useless_draft_cpu.py --threads 1 --out docs/results/useless_draft_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers

import hf_specdec
from hf_specdec.tools.prompts import DEMO_PROMPTS, encode_batch
from hf_specdec.tools.smollm import load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--exit-layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    tokenizer.padding_side = "left"
    texts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)].text for i in range(args.batch)]
    inputs = encode_batch(tokenizer, texts)
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    hf_specdec.install()
    plain_s, spec_s, ratios = [], [], []
    with torch.inference_mode():
        hf_specdec.uninstall()
        expected = model.generate(**inputs, **settings)
        hf_specdec.install()
        first = time.perf_counter()
        out = model.generate(**inputs, **settings, assistant_early_exit=args.exit_layers)
        first_s = time.perf_counter() - first
        identical = bool(torch.equal(out, expected))
        for _ in range(args.rounds):
            hf_specdec.uninstall()
            start = time.perf_counter()
            model.generate(**inputs, **settings)
            plain_s.append(time.perf_counter() - start)
            hf_specdec.install()
            start = time.perf_counter()
            out = model.generate(**inputs, **settings, assistant_early_exit=args.exit_layers)
            spec_s.append(time.perf_counter() - start)
            identical = identical and bool(torch.equal(out, expected))
            ratios.append(plain_s[-1] / spec_s[-1])
    hf_specdec.uninstall()
    result = {
        "meta": {
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": args.threads,
            "batch": args.batch,
            "exit_layers": args.exit_layers,
            "max_new_tokens": args.max_new_tokens,
        },  # fmt: skip
        "plain_s": plain_s,
        "spec_s": spec_s,
        "first_spec_call_s": first_s,
        "speedup_min": min(ratios),
        "speedup_median": statistics.median(ratios),
        "identical": identical,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
