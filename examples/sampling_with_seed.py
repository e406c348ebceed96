"""Reproducible sampling with speculative decoding: `SpecDecoder(seed=...)` fixes every random draw.

Speculative sampling (rejection sampling against the draft) keeps the target's output distribution exactly.
Row i of a batch uses seed + i, so a row's draws depend only on its seed, not on the batch around it (its text too,
unless a draw falls within the last bits that batching moves in the logits: docs/usage.md).
That takes a fixed number of drafts per step: the default adaptive schedule picks draft lengths from step times
measured on this machine, which changes the draws from run to run (never their distribution).

    python examples/sampling_with_seed.py
    python examples/sampling_with_seed.py --tiny
"""

from __future__ import annotations

from _common import chat_inputs, load, parse_args

import hf_specdec


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_new_tokens=48)
    model, tokenizer = load(args.tiny)
    inputs = chat_inputs(tokenizer, ["Write a haiku about the sea.", "Name three colors."])
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.8, top_p=0.95)

    outs = []
    for _ in range(2):
        spec = hf_specdec.SpecDecoder(
            method="ngram", num_speculative_tokens=4, num_speculative_tokens_schedule="constant", seed=0
        )
        outs.append(model.generate(**inputs, **settings, custom_generate=hf_specdec.generate, spec_decoder=spec))
    for row in outs[0]:
        print(repr(tokenizer.decode(row[inputs["input_ids"].shape[1] :], skip_special_tokens=True)))
    print("same seed, same text:", outs[0].tolist() == outs[1].tolist())


if __name__ == "__main__":
    main()
