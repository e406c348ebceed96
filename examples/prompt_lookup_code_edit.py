"""Prompt lookup (n-gram speculation) on a code edit: the answer copies long runs of the input, so drafts are free.

No draft model: the proposer looks up the last 1..4 tokens in the prompt and in what was generated so far and
proposes what followed them. Greedy output is token-for-token the same as plain `generate`.

    python examples/prompt_lookup_code_edit.py
    python examples/prompt_lookup_code_edit.py --tiny
"""

from __future__ import annotations

import time

from _common import chat_inputs, load, parse_args

import hf_specdec

CODE = """def total_price(items):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    return total
"""


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_new_tokens=96)
    model, tokenizer = load(args.tiny)
    inputs = chat_inputs(
        tokenizer, [f"Add type hints and a docstring to this function. Return the full code.\n\n{CODE}"]
    )
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=4)
    # Warm up both paths once: the first call pays one-time costs (kernel JIT, allocator) that would skew the timing.
    model.generate(**inputs, max_new_tokens=4, custom_generate=hf_specdec.generate, spec_decoder=spec)
    model.generate(**inputs, max_new_tokens=4)
    start = time.perf_counter()
    out = model.generate(**inputs, **settings, custom_generate=hf_specdec.generate, spec_decoder=spec)
    spec_s = time.perf_counter() - start
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))

    start = time.perf_counter()
    plain = model.generate(**inputs, **settings)
    plain_s = time.perf_counter() - start
    stats = spec.last_stats
    print(f"\nspeculative {spec_s:.2f}s vs plain {plain_s:.2f}s; acceptance {stats.acceptance_rate:.2f}, "
          f"mean accepted length {stats.mean_accepted_length:.2f}; identical: {plain.tolist() == out.tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
