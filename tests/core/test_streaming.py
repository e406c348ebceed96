"""Streamers get the same tokens, in the same order, as under plain `generate`, and `end()` once.

A recording `BaseStreamer` is compared put-by-put with its recording under plain greedy `generate`,
and `TextIteratorStreamer` text with plain's, through every way of passing a streamer:
`custom_generate=` + `spec_streamer=`, `SpecDecoder(streamer=)`, and `install()` + `streamer=`.
transformers' text streamers support batch size 1 only; the recording streamer (which plain
`generate` feeds one `[B]` column per step) is also checked at batch 3, pad fill included.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, make_tokenizer
from transformers import TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import hf_specdec

MAX_NEW = 20
FORMS = ("custom_generate", "spec_decoder_streamer", "install")


class RecordingStreamer(BaseStreamer):
    """Records every `put` (as a list of ids) and counts `end` calls."""

    def __init__(self) -> None:
        self.puts: list[list] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ends == 0, "put() after end()"
        self.puts.append(value.tolist())

    def end(self) -> None:
        self.ends += 1


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


@pytest.fixture(scope="module")
def spec_kwargs(target):
    return {
        "self": dict(draft_model=target, num_speculative_tokens=8),
        "noisy": dict(draft_model=make_noisy_copy(target, 0.01), num_speculative_tokens=5),
        "ngram": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3),
    }


def stream_speculatively(form: str, target, inputs: dict, spec_kwargs: dict, streamer, **kwargs) -> torch.Tensor:
    """model.generate with speculation, the streamer passed in one of the supported forms."""
    if form == "spec_decoder_streamer":
        spec = hf_specdec.SpecDecoder(**spec_kwargs, streamer=streamer)
        return target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **kwargs)
    spec = hf_specdec.SpecDecoder(**spec_kwargs)
    if form == "custom_generate":
        return target.generate(
            **inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, spec_streamer=streamer, **kwargs
        )
    hf_specdec.install()
    try:
        return target.generate(**inputs, spec_decoder=spec, streamer=streamer, **kwargs)
    finally:
        hf_specdec.uninstall()


@pytest.mark.parametrize(
    ("form", "kind"), [("custom_generate", "self"), ("custom_generate", "ngram")] + [(f, "noisy") for f in FORMS]
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_recording_streamer_matches_plain_generate(target, spec_kwargs, form, kind, batch_size):
    inputs = make_prompts(batch_size, seed=3)
    prompt_width = inputs["input_ids"].shape[1]
    plain_tokens = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
    eos = plain_tokens[0, prompt_width + 7].item()  # row 0 stops mid-way; other rows may pad after their stop
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos)
    plain = RecordingStreamer()
    expected = target.generate(**inputs, streamer=plain, **kwargs)
    spec = RecordingStreamer()
    out = stream_speculatively(form, target, inputs, spec_kwargs[kind], spec, **kwargs)
    assert torch.equal(out, expected)
    assert spec.ends == 1
    assert spec.puts[0] == inputs["input_ids"].tolist()  # the prompt first, like generate
    assert spec.puts == plain.puts  # one [B] column per token, in order
    assert len(spec.puts) - 1 == expected.shape[1] - prompt_width


@pytest.mark.parametrize("form", FORMS)
def test_text_iterator_streamer_matches_plain_generate(target, spec_kwargs, form):
    tokenizer = make_tokenizer()
    inputs = make_prompts(1, seed=5)
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW)

    plain = TextIteratorStreamer(tokenizer, skip_prompt=True)
    expected = target.generate(**inputs, streamer=plain, **kwargs)
    expected_text = "".join(plain)  # generate ran to completion, so the queue holds everything plus the end signal

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = stream_speculatively(form, target, inputs, spec_kwargs["self"], streamer, **kwargs)
    text = "".join(streamer)  # ends only if end() was called
    assert torch.equal(out, expected)
    assert text == expected_text == tokenizer.decode(expected[0, inputs["input_ids"].shape[1] :])
    assert len(text) > 0


def test_streamer_with_custom_generate_warns_once_naming_spec_streamer(target):
    """transformers streams the prompt into `streamer=` and keeps it from a custom_generate callable: say so, once."""
    inputs = make_prompts(2, seed=3)
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW)
    plain = RecordingStreamer()
    expected = target.generate(**inputs, streamer=plain, **kwargs)
    streamer = RecordingStreamer()
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4)
    with pytest.warns(UserWarning, match=r"spec_streamer=streamer") as caught:
        out = target.generate(
            **inputs, streamer=streamer, custom_generate=hf_specdec.generate, spec_decoder=spec, **kwargs
        )
    assert torch.equal(out, expected)
    assert sum("spec_streamer" in str(w.message) for w in caught) == 1  # once per call, not once per step
    assert streamer.puts == plain.puts[:1]  # only transformers' own put of the prompt
    assert len(plain.puts) == MAX_NEW + 1


@pytest.mark.parametrize("form", ["both_names", "install"])
def test_streamer_with_custom_generate_streams_when_named_or_installed(target, form, recwarn):
    """`streamer=s, spec_streamer=s` (the prompt is not put twice), and `install()` + `custom_generate=` +
    `streamer=`: the streamer gets exactly plain's puts and nothing warns."""
    inputs = make_prompts(2, seed=4)
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW)
    plain = RecordingStreamer()
    expected = target.generate(**inputs, streamer=plain, **kwargs)
    streamer = RecordingStreamer()
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4)
    call = dict(streamer=streamer, custom_generate=hf_specdec.generate, spec_decoder=spec, **kwargs)
    if form == "both_names":
        out = target.generate(**inputs, spec_streamer=streamer, **call)
    else:
        hf_specdec.install()
        try:
            out = target.generate(**inputs, **call)
        finally:
            hf_specdec.uninstall()
    assert torch.equal(out, expected)
    assert streamer.puts == plain.puts
    assert streamer.ends == 1
    assert not [w for w in recwarn if "spec_streamer" in str(w.message)]
