"""Speculative decoding with a draft model: a small model proposes k tokens, the target verifies them in one pass.

A draft must be a smaller model that predicts the target well and shares its tokenizer: SmolLM2-135M drafting for
SmolLM2-1.7B, say. No such pair exists offline on this machine (the only real checkpoint is SmolLM2-135M, and a
truncation of it -- its first 10 of 30 layers -- accepts almost none of its drafts), so this example always runs on
tiny random models whose draft is built to agree with the target most of the time. With real models the code is the
same: load both with `AutoModelForCausalLM.from_pretrained` and pass the small one as `draft_model`. A draft that
turns out useless costs little: the default adaptive schedule stops drafting after a few rejected steps.

    python examples/draft_model.py            # tiny random models (see above)
"""

from __future__ import annotations

from _common import chat_inputs, parse_args

import hf_specdec
from hf_specdec.tools.model_loading import tiny_models


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])  # --tiny is accepted for uniformity: this example is always tiny
    model, draft, tokenizer = tiny_models()
    print("tiny random target and draft (no real draft model for SmolLM2 exists offline: see this file's docstring)")

    inputs = chat_inputs(tokenizer, ["explain why the sky is blue", "name three colors"])
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)  # method="draft" is implied
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                         custom_generate=hf_specdec.generate, spec_decoder=spec)  # fmt: skip
    for row in out:
        print(repr(tokenizer.decode(row[inputs["input_ids"].shape[1] :], skip_special_tokens=True)))

    stats = spec.last_stats
    print(f"\nacceptance rate {stats.acceptance_rate:.2f}, mean accepted length {stats.mean_accepted_length:.2f}, "
          f"per position {[round(p, 2) for p in stats.per_position_acceptance]}")  # fmt: skip

    plain = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print("identical to plain generate:", plain.tolist() == out.tolist())


if __name__ == "__main__":
    main()
