"""The adaptive schedule's first-call overhead on SmolLM2 (CPU): what timing the verify widths costs a process.

In a fresh process: one plain `generate` (warms torch up), then hf_specdec calls with the library's defaults
(`SpecDecoder(method="ngram")`: the adaptive schedule, k <= 5) interleaved with plain ones, on the demo's chat
prompt (where speculation cannot pay, so any overhead shows) and its summary prompt. Reports, per prompt, the
first call's `calibration_time_s` and its excess over the later calls' median, as a share of a plain 96-token call.

    PYTHONPATH=. python benchmarks/bench_first_call.py --threads 1 --out docs/results/first_call_cpu.json
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
    parser.add_argument("--calls", type=int, default=5, help="hf_specdec calls per prompt (the first included)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    prompts = {p.category: p for p in DEMO_PROMPTS if p.category in ("chat", "summary")}
    results = {}
    with torch.inference_mode():
        model.generate(**encode_batch(tokenizer, [prompts["chat"].text]), **settings)  # warm torch up
        for name, prompt in prompts.items():
            inputs = encode_batch(tokenizer, [prompt.text])
            plain_s, spec_s, calibration = [], [], []
            for _ in range(args.calls):
                start = time.perf_counter()
                model.generate(**inputs, **settings)
                plain_s.append(time.perf_counter() - start)
                spec = hf_specdec.SpecDecoder(method="ngram")
                start = time.perf_counter()
                model.generate(**inputs, **settings, custom_generate=hf_specdec.generate, spec_decoder=spec)
                spec_s.append(time.perf_counter() - start)
                calibration.append(spec.last_stats.calibration_time_s)
            plain = statistics.median(plain_s)
            later = statistics.median(spec_s[3:]) if len(spec_s) > 3 else statistics.median(spec_s[1:])
            results[name] = {
                "plain_s": plain_s,
                "spec_s": spec_s,
                "calibration_s": calibration,
                "first_call_calibration_share_of_plain": calibration[0] / plain,
                "first_call_excess_share_of_plain": (spec_s[0] - later) / plain,
            }
            print(
                f"{name}: plain {plain:.2f} s; hf_specdec first call {spec_s[0]:.2f} s (timing {calibration[0]:.2f} s "
                f"= {100 * calibration[0] / plain:.1f}% of plain), later calls {later:.2f} s; calibration per call "
                f"{[round(c, 2) for c in calibration]}"
            )
    if args.out:
        meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "transformers": transformers.__version__, "threads": args.threads, "k": 5, "schedule": "adaptive"}  # fmt: skip
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
