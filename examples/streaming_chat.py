"""A multi-turn chat that streams speculative output token by token with `TextStreamer`.

With `custom_generate=`, transformers does not hand `streamer=` to the custom decoder, so pass it as
`spec_streamer=` (after `hf_specdec.install()`, plain `streamer=` works too). Accepted draft tokens arrive in
bursts: that is the speed-up you can see.

    python examples/streaming_chat.py            # scripted turns
    python examples/streaming_chat.py --tiny
"""

from __future__ import annotations

from _common import load, parse_args
from transformers import TextStreamer

import hf_specdec

TURNS = ["Give me a short recipe for pancakes.", "Now write the same recipe as a numbered list."]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_new_tokens=64)
    model, tokenizer = load(args.tiny)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=5)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    history: list[dict[str, str]] = []
    for user in TURNS:
        print(f"\n>>> {user}")
        history.append({"role": "user", "content": user})
        if tokenizer.chat_template:
            inputs = tokenizer.apply_chat_template(
                history, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        else:
            inputs = tokenizer("\n".join(m["content"] for m in history), return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             custom_generate=hf_specdec.generate, spec_decoder=spec, spec_streamer=streamer)  # fmt: skip
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        history.append({"role": "assistant", "content": answer})
        print(f"[mean accepted length {spec.last_stats.mean_accepted_length:.2f}]")


if __name__ == "__main__":
    main()
