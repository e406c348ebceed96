"""Batched speculative decoding through a transformers `pipeline`: pass the hf_specdec arguments as call kwargs.

The pipeline forwards unknown keyword arguments to `model.generate`, so `custom_generate=hf_specdec.generate`
and `spec_decoder=spec` turn on speculation; `batch_size=` batches the prompts (rows of a batch may accept
different numbers of draft tokens; hf_specdec handles the ragged batch).

    python examples/batched_pipeline.py
    python examples/batched_pipeline.py --tiny
"""

from __future__ import annotations

from _common import load, parse_args
from transformers import pipeline

import hf_specdec

QUESTIONS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "List the days of the week.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of France?",
]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_new_tokens=48)
    model, tokenizer = load(args.tiny)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=5)

    if tokenizer.chat_template:  # chat models take a list of messages per prompt
        inputs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    else:
        inputs = QUESTIONS
    results = pipe(inputs, batch_size=4, max_new_tokens=args.max_new_tokens, do_sample=False,
                   return_full_text=False, custom_generate=hf_specdec.generate, spec_decoder=spec)  # fmt: skip
    for question, result in zip(QUESTIONS, results):
        print(f"Q: {question}\nA: {result[0]['generated_text']!r}\n")
    print(f"last batch: acceptance {spec.last_stats.acceptance_rate:.2f}, "
          f"mean accepted length {spec.last_stats.mean_accepted_length:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
