"""A Gradio Space: plain `generate` and hf_specdec side by side on SmolLM2-135M-Instruct, offline.

Type a prompt (or pick an example: answers that copy from the prompt, where prompt lookup pays, and a chat answer,
where it cannot), press Generate: plain decoding streams into the left box, then hf_specdec into the right one,
each token coloured by how it came (a draft the target accepted, the target's token after a rejected draft, the
bonus token after all drafts were accepted, a plain decoding step). Below: tokens/s of each, the speedup,
acceptance, mean accepted length and whether the two outputs are identical. Within a request they run one after
the other; several requests run at once on the same model (`CONCURRENCY_LIMIT`, default 4), and when they overlap
the statistics say that their timings shared the machine.

    pip install -e ".[space]" && python spaces/hf_specdec_demo/app.py   # http://127.0.0.1:7860
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import torch  # noqa: E402
from transformers import TextIteratorStreamer  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec.metrics import StepRecord  # noqa: E402
from hf_specdec.tools.benchmarking import warm_up  # noqa: E402
from hf_specdec.tools.prompts import DEMO_PROMPTS, encode_batch  # noqa: E402
from hf_specdec.tools.smollm import load_smollm2  # noqa: E402
from hf_specdec.tools.threads import configure_threads  # noqa: E402

#: Requests served at once (Gradio's concurrency_limit of the Generate event); `CONCURRENCY_LIMIT` overrides it.
CONCURRENCY_LIMIT = int(os.environ.get("CONCURRENCY_LIMIT", "4"))

#: Colours of the four ways a speculative token comes (HighlightedText categories).
KIND_COLORS = {"accepted": "#7bd88f", "recovered": "#ff9e64", "bonus": "#7aa2f7", "plain": "#d0d0d0"}
LABELS = {"accepted": "accepted draft", "recovered": "recovered", "bonus": "bonus", "plain": "plain step"}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    print(configure_threads(None))
MODEL, TOKENIZER = load_smollm2(device=DEVICE)
# Pay the one-time costs before the first visitor does: torch's warm-up and the adaptive schedule's timing of the
# verify widths (a few short calls; see `hf_specdec.tools.benchmarking.warm_up`).
for _method in ("plain", "ngram-adaptive"):
    warm_up(MODEL, TOKENIZER, [DEMO_PROMPTS[0].text], _method, k=8)


# State shared by concurrent requests. The model and SpecDecoders are safe to share (docs/usage.md, "Concurrency");
# these are not:
# - a fast tokenizer's `__call__` sets its padding options on the Rust tokenizer, which raises "Already borrowed"
#   while another thread is encoding: encoding takes `_ENCODE_LOCK`;
# - plain sampling draws from torch's global generator, seeded per request: a sampled plain run holds
#   `_GLOBAL_RNG_LOCK` from its `manual_seed` to its last draw, and the hf_specdec runs always pass their own seed
#   (so they never touch the global generator);
# - `_active` counts the requests running now, so that overlapping timings are flagged.
_ENCODE_LOCK = threading.Lock()
_GLOBAL_RNG_LOCK = threading.Lock()
_ACTIVE_LOCK = threading.Lock()
_active = 0
#: Chips sit flush, so that the spaces and word pieces of the text read as text ("Dr. Alice Moreno", not
#: "Dr . Alice More no"); Gradio's default gives every highlighted token a margin.
CSS = "#spec_output .token.highlighted { margin: 0 !important; padding: 0 !important; border-radius: 0 !important; }"


class TokenChips:
    """The coloured chips of a stream of tokens, whose texts join into exactly the decoded text.

    Decoding each token alone loses what depends on its neighbours (a SentencePiece word's leading space, a
    character whose bytes span several tokens). Instead, as transformers' `TextStreamer` does, the output so far is
    decoded after each token and the token's chip gets the text it added. A token that ends inside a character
    adds nothing yet: the chip of the token that completes the character carries it, with that token's kind.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.spans: list[tuple[str, str | None]] = []

    def add(self, token: int, label: str) -> None:
        self.tokens.append(int(token))
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the token that completes it
            return
        piece, self.text = text[len(self.text) :], text
        if piece:
            self.spans.append((piece, label))


class _Overlap:
    """Counts this request among the running ones; `shared` tells whether another one ran at any time during it."""

    def __enter__(self) -> _Overlap:
        global _active
        with _ACTIVE_LOCK:
            _active += 1
            self.shared = _active > 1
        return self

    def check(self) -> None:
        with _ACTIVE_LOCK:
            self.shared = self.shared or _active > 1

    def __exit__(self, *exc: object) -> None:
        global _active
        with _ACTIVE_LOCK:
            _active -= 1


def _settings(max_new_tokens: int, sampling: bool, temperature: float) -> dict[str, Any]:
    if sampling:
        return {"max_new_tokens": int(max_new_tokens), "do_sample": True, "temperature": float(temperature),
                "top_p": None, "top_k": None}  # fmt: skip
    return {
        "max_new_tokens": int(max_new_tokens),
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }


def _run_in_thread(target: Any) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def compare(
    prompt: str, method: str, schedule: str, k: int, max_new_tokens: int, sampling: bool, temperature: float, seed: int
) -> Iterator[tuple[str, list[tuple[str, str | None]], str]]:
    """Stream plain generate, then hf_specdec; yield (plain text, coloured speculative text, stats markdown)."""
    if not prompt.strip():
        raise gr.Error("Type a prompt first (or pick an example below).")
    with _ENCODE_LOCK:
        inputs = encode_batch(TOKENIZER, [prompt], MODEL.device)
    settings = _settings(max_new_tokens, sampling, temperature)
    width = inputs["input_ids"].shape[1]
    with _Overlap() as overlap:
        yield from _compare(inputs, width, settings, method, schedule, k, sampling, seed, overlap)


def _compare(
    inputs: dict[str, Any],
    width: int,
    settings: dict[str, Any],
    method: str,
    schedule: str,
    k: int,
    sampling: bool,
    seed: int,
    overlap: _Overlap,
) -> Iterator[tuple[str, list[tuple[str, str | None]], str]]:
    """`compare`'s two runs, for one encoded prompt, counted among the running requests by `overlap`."""
    # 1. plain generate, streamed
    streamer = TextIteratorStreamer(TOKENIZER, skip_prompt=True, skip_special_tokens=True)
    plain: dict[str, Any] = {}

    def run_plain() -> None:
        with _GLOBAL_RNG_LOCK if sampling else contextlib.nullcontext():
            torch.manual_seed(int(seed))
            start = time.perf_counter()
            with torch.inference_mode():
                out = MODEL.generate(**inputs, **settings, streamer=streamer)
            plain.update(seconds=time.perf_counter() - start, tokens=out[0, width:].tolist())

    thread = _run_in_thread(run_plain)
    text = ""
    for piece in streamer:
        text += piece
        yield text, [], "plain generate running..."
    thread.join()
    plain_text = TOKENIZER.decode(plain["tokens"], skip_special_tokens=True)

    # 2. hf_specdec, streamed token by token with how each came
    records: list[StepRecord] = []
    spec_out: dict[str, Any] = {}
    spec = hf_specdec.SpecDecoder(
        method="ngram" if method.startswith("prompt lookup") else method,
        num_speculative_tokens=int(k),
        num_speculative_tokens_schedule=schedule,
        seed=int(seed) if sampling else 0,  # greedy draws nothing; a seed keeps it off torch's global generator
        on_step=records.append,
    )

    def run_spec() -> None:
        start = time.perf_counter()
        with torch.inference_mode():
            out = MODEL.generate(**inputs, **settings, custom_generate=hf_specdec.generate, spec_decoder=spec)
        spec_out.update(seconds=time.perf_counter() - start, tokens=out[0, width:].tolist())

    thread = _run_in_thread(run_spec)
    shown = 0
    chips = TokenChips(TOKENIZER)
    while thread.is_alive() or shown < len(records):
        while shown < len(records):
            record = records[shown]
            shown += 1
            for tokens, kinds in ((record.tokens[i], record.kinds(i)) for i in range(len(record.row_ids))):
                for token, kind in zip(tokens, kinds):
                    chips.add(token, LABELS[kind])
        overlap.check()
        yield plain_text, list(chips.spans), "hf_specdec running..."
        time.sleep(0.05)
    thread.join()
    overlap.check()
    yield plain_text, list(chips.spans), _stats_markdown(plain, spec_out, spec.last_stats, overlap.shared)


def _stats_markdown(plain: dict[str, Any], spec_out: dict[str, Any], stats: Any, shared: bool = False) -> str:
    plain_tps = len(plain["tokens"]) / plain["seconds"]
    spec_tps = len(spec_out["tokens"]) / spec_out["seconds"]
    same = plain["tokens"] == spec_out["tokens"]
    return (
        f"**plain** {plain_tps:.1f} tok/s · **hf_specdec** {spec_tps:.1f} tok/s · "
        f"**speedup {plain['seconds'] / spec_out['seconds']:.2f}x** · acceptance {stats.acceptance_rate:.2f} · "
        f"mean accepted length {stats.mean_accepted_length:.2f} · "
        f"identical outputs: **{'yes' if same else 'no (sampling draws differ; the distribution is the same)'}**"
        + (" · timings shared the machine with another request" if shared else "")
    )


def build_app() -> gr.Blocks:
    with gr.Blocks(title="hf_specdec: exact speculative decoding") as app:
        gr.Markdown(
            "# hf_specdec: exact, batched speculative decoding in `model.generate`\n"
            f"SmolLM2-135M-Instruct on {DEVICE}. Plain decoding runs first, then hf_specdec (prompt lookup: drafts "
            "copied from the prompt). Greedy outputs are token-for-token identical; the colours show how each "
            "speculative token came. Below 1.00x is slower: the adaptive schedule drafts only where it pays."
        )
        prompt = gr.Textbox(label="Prompt", lines=6, elem_id="prompt")
        with gr.Row():
            method = gr.Dropdown(["prompt lookup (n-gram)"], value="prompt lookup (n-gram)", label="Method")
            schedule = gr.Dropdown(["adaptive", "constant", "heuristic"], value="adaptive", label="Schedule")
            k = gr.Slider(1, 16, value=8, step=1, label="k (most drafts per step)")
            max_new_tokens = gr.Slider(8, 256, value=96, step=8, label="Max new tokens", elem_id="max_new_tokens")
        with gr.Row():
            sampling = gr.Checkbox(label="Sample (else greedy)", value=False)
            temperature = gr.Slider(0.1, 1.5, value=0.7, step=0.1, label="Temperature")
            seed = gr.Number(value=0, precision=0, label="Seed")
        button = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Row():
            plain_box = gr.Textbox(label="plain generate", lines=12, elem_id="plain_output")
            spec_box = gr.HighlightedText(
                label="hf_specdec", color_map={LABELS[k_]: c for k_, c in KIND_COLORS.items()}, elem_id="spec_output",
                combine_adjacent=False, show_legend=True,
            )  # fmt: skip
        stats = gr.Markdown(elem_id="stats")
        gr.Examples([[p.text] for p in DEMO_PROMPTS], inputs=[prompt], label="Examples (four copy, the last chats)")
        button.click(
            compare,
            inputs=[prompt, method, schedule, k, max_new_tokens, sampling, temperature, seed],
            outputs=[plain_box, spec_box, stats],
            concurrency_limit=CONCURRENCY_LIMIT,
        )
    return app


if __name__ == "__main__":
    build_app().queue(default_concurrency_limit=CONCURRENCY_LIMIT).launch(
        server_name=os.environ.get("HOST", "127.0.0.1"), server_port=int(os.environ.get("PORT", 7860)), css=CSS
    )
