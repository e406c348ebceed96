"""CPU cost per step of Gemma 4 assistants and DFlash drafters (random weights), with greedy identity checked.

Random weights accept (almost) nothing, so this measures costs only: milliseconds per speculative step (one
verify plus its drafting) next to plain decoding's milliseconds per token, and transformers' own route (batch 1
only) per token. Every speculative output is checked token for token against plain greedy `generate`.
Medians of 3 runs; on a shared CPU the numbers are noisy.
Run: `OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_issue16_drafters_cpu.py`
(writes docs/results/issue16_drafters_cpu.json).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_dflash_drafter, make_gemma4, make_gemma4_assistant, make_model  # noqa: E402

import hf_specdec  # noqa: E402

NEW = 48
VOCAB = 2048


def median_time(fn, repeats: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def prompts(batch: int, length: int = 64) -> dict:
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def measure(model, inputs, spec, stock_kwargs: dict | None) -> dict:
    """ms per speculative step and per token, plain ms per token, transformers' route ms per token (B=1)."""
    common = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    plain_s, plain = median_time(lambda: model.generate(**inputs, **common))
    spec_s, out = median_time(
        lambda: model.generate(**inputs, **common, custom_generate=hf_specdec.generate, spec_decoder=spec)
    )
    assert torch.equal(out, plain), "greedy output differs from plain generate"
    result = {
        "ms_per_step": 1000 * spec_s / spec.last_stats.num_steps,
        "ms_per_token": 1000 * spec_s / NEW,
        "plain_ms_per_token": 1000 * plain_s / NEW,
        "accepted_per_step": spec.last_stats.num_accepted_tokens / spec.last_stats.num_steps,
    }
    if stock_kwargs is not None:
        stock_s, stock = median_time(lambda: model.generate(**inputs, **common, **stock_kwargs))
        assert torch.equal(stock, plain)
        result["transformers_ms_per_token"] = 1000 * stock_s / NEW
    return result


def main() -> None:
    torch.set_num_threads(1)
    results = {}
    gemma = make_gemma4(vocab=VOCAB, initializer_range=0.02, layers=8, hidden=256, shared_layers=4)
    assistant = make_gemma4_assistant(gemma, echo=0.0)
    assistant.generation_config.num_assistant_tokens = 4
    for batch in (1, 4):
        spec = hf_specdec.SpecDecoder(
            draft_model=assistant, num_speculative_tokens=4, num_speculative_tokens_schedule="constant"
        )
        stock = {"assistant_model": assistant} if batch == 1 else None
        results[f"gemma4 assistant (2 layers, hidden 32), 8-layer gemma4 hidden 256 (4 KV-shared), k=4, B={batch}"] = (
            measure(gemma, prompts(batch), spec, stock)
        )

    llama = make_model("llama", seed=0, vocab=VOCAB, layers=8, hidden=256)
    drafter = make_dflash_drafter(llama, block_size=5, sliding_window=4096)
    for batch in (1, 4):
        spec = hf_specdec.SpecDecoder(
            method="dflash", draft_model=drafter, num_speculative_tokens=4, num_speculative_tokens_schedule="constant"
        )
        stock = {"assistant_model": drafter, "speculation_type": "dflash"} if batch == 1 else None
        results[f"dflash block 5 (k=4), 8-layer llama hidden 256, B={batch}"] = measure(
            llama, prompts(batch), spec, stock
        )

    out = Path(__file__).resolve().parents[1] / "docs" / "results" / "issue16_drafters_cpu.json"
    out.write_text(json.dumps(results, indent=2))
    for name, values in results.items():
        print(f"{name}: " + ", ".join(f"{k}={v:.2f}" for k, v in values.items()))


if __name__ == "__main__":
    main()
