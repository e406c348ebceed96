"""CPU cost per step of early exit, drafts with another tokenizer, cache continuation and Whisper (random weights).

Random weights give no real acceptance, so this measures costs only: milliseconds per speculative step (one
verify plus its drafting) next to plain decoding's milliseconds per token, and the host time of the text
translation and of handing a cache back. Medians of 3 runs; on a shared CPU the numbers are noisy.
Run: `OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_issue16_cpu.py` (writes docs/results/issue16_cpu.json).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_bpe_tokenizer, make_model, make_whisper  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec.proposers.cross_tokenizer import draft_text_to_target_ids  # noqa: E402

NEW = 48


def median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_step(model, inputs, spec) -> tuple[float, float]:
    """(ms per speculative step, ms per plain token) for one generate call."""
    plain = median_time(lambda: model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None))
    run = lambda: model.generate(  # noqa: E731
        **inputs,
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        custom_generate=hf_specdec.generate,
        spec_decoder=spec,
    )
    spec_s = median_time(run)
    return 1000 * spec_s / spec.last_stats.num_steps, 1000 * plain / NEW


def prompts(vocab: int, batch: int, length: int) -> dict:
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def main() -> None:
    torch.set_num_threads(1)
    results = {}
    target = make_model("llama", seed=0, vocab=2048, layers=8, hidden=256)
    for batch in (1, 4):
        inputs = prompts(2048, batch, 64)
        for layers in (2, 4):
            spec = hf_specdec.SpecDecoder(early_exit_layers=layers, num_speculative_tokens=4)
            step, token = per_step(target, inputs, spec)
            results[f"early_exit N={layers}/8 k=4 B={batch}"] = {"ms_per_step": step, "plain_ms_per_token": token}

    target_tok, draft_tok = make_bpe_tokenizer(80), make_bpe_tokenizer(160)
    rows = [torch.randint(3, 80, (256,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    texts = target_tok.batch_decode(rows, skip_special_tokens=True)
    known = draft_tok(texts)["input_ids"]
    drafted = [k[-4:] for k in known]

    def translate() -> None:
        draft_tok(target_tok.batch_decode(rows, skip_special_tokens=True))["input_ids"]
        draft_text_to_target_ids(target_tok, draft_tok, known, drafted)

    results["cross_tokenizer host translation, B=8 rows of 256 tokens"] = {"ms_per_step": 1000 * median_time(translate)}

    small = make_model("llama", seed=0, vocab=80, layers=4, hidden=128)
    draft = make_model("qwen3", seed=1, vocab=160, layers=1, hidden=64)
    inputs = dict(target_tok([" ".join(["the cat sat on the mat"] * 6)] * 4, return_tensors="pt"))
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, draft_tokenizer=draft_tok, tokenizer=target_tok, num_speculative_tokens=4
    )
    step, token = per_step(small, inputs, spec)
    results["cross_tokenizer draft k=4 B=4 (4-layer target)"] = {"ms_per_step": step, "plain_ms_per_token": token}

    inputs = prompts(2048, 4, 64)
    cache_spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4)

    def turn(with_cache: bool) -> None:
        extra = {"past_key_values": DynamicCache(config=target.config)} if with_cache else {}
        target.generate(
            **inputs,
            max_new_tokens=NEW,
            do_sample=False,
            custom_generate=hf_specdec.generate,
            spec_decoder=cache_spec,
            **extra,
        )

    results["cache handoff (fill caller's DynamicCache), B=4, 112 tokens"] = {
        "ms_with": 1000 * median_time(lambda: turn(True)),
        "ms_without": 1000 * median_time(lambda: turn(False)),
    }

    whisper = make_whisper(seed=0, decoder_layers=4, d_model=128)
    distil = make_whisper(seed=1, decoder_layers=1, causal=True, d_model=128)
    audio = {"input_features": torch.randn(4, 8, 32)}
    spec = hf_specdec.SpecDecoder(draft_model=distil, num_speculative_tokens=4)
    plain = median_time(lambda: whisper.generate(**audio, max_new_tokens=NEW, do_sample=False, eos_token_id=None))
    run = median_time(
        lambda: whisper.generate(
            **audio,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            custom_generate=hf_specdec.generate,
            spec_decoder=spec,
        )
    )
    results["whisper 4-layer decoder + WhisperForCausalLM 1-layer draft, k=4, B=4"] = {
        "ms_per_step": 1000 * run / spec.last_stats.num_steps,
        "plain_ms_per_token": 1000 * plain / NEW,
    }
    out = Path(__file__).resolve().parents[1] / "docs" / "results" / "issue16_cpu.json"
    out.write_text(json.dumps(results, indent=2))
    for name, values in results.items():
        print(f"{name}: " + ", ".join(f"{k}={v:.2f}" for k, v in values.items()))


if __name__ == "__main__":
    main()
