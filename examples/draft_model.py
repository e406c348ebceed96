"""Speculative decoding with a draft model: a small model proposes k tokens, the target verifies them in one pass.

The only real model offline is SmolLM2-135M, so the draft here is SmolLM2's own first 10 of 30 layers plus its
LM head (self-speculation, "early exit"); with a bigger target you would pass e.g. SmolLM2-135M as the draft of
SmolLM2-1.7B. Greedy output is token-for-token the same as plain `generate`.

    python examples/draft_model.py            # SmolLM2 (offline)
    python examples/draft_model.py --tiny     # tiny random models
"""

from __future__ import annotations

from _common import chat_inputs, parse_args
from transformers import AutoModelForCausalLM

import hf_specdec


def early_exit_draft(target, num_layers: int):
    """A draft that shares the target's first `num_layers` layers, embeddings, final norm and LM head (no copy)."""
    config = target.config.__class__.from_dict({**target.config.to_dict(), "num_hidden_layers": num_layers})
    draft = AutoModelForCausalLM.from_config(config)
    state = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    draft.load_state_dict(state, assign=True, strict=False)
    draft.tie_weights()
    return draft.eval()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if args.tiny:
        from hf_specdec.tools.model_loading import tiny_models

        model, draft, tokenizer = tiny_models()
    else:
        from hf_specdec.tools.smollm import load_smollm2

        model, tokenizer = load_smollm2()
        draft = early_exit_draft(model, num_layers=10)

    inputs = chat_inputs(tokenizer, ["Explain in three sentences why the sky is blue."])
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)  # method="draft" is implied
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                         custom_generate=hf_specdec.generate, spec_decoder=spec)  # fmt: skip
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))

    stats = spec.last_stats
    print(f"\nacceptance rate {stats.acceptance_rate:.2f}, mean accepted length {stats.mean_accepted_length:.2f}, "
          f"per position {[round(p, 2) for p in stats.per_position_acceptance]}")  # fmt: skip

    plain = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print("identical to plain generate:", plain.tolist() == out.tolist())


if __name__ == "__main__":
    main()
