"""`pipeline("text-generation")` with speculation passed as call kwargs (`custom_generate=`, `spec_decoder=`).

Pipelines forward generate kwargs, so greedy speculative text must equal the plain pipeline's, for
one prompt and for a batched call (left padding, batch_size=3, one batched `generate`); sampling
settings (do_sample=True, temperature=0.7) must run and return text.
"""

from __future__ import annotations

import pytest
from conftest import make_model, make_noisy_copy, make_tokenizer
from transformers import pipeline

import hf_specdec

PROMPTS = ["a b c d a b c", "hello world", "the cat sat on the mat the cat"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def pipe():
    target = make_model("llama", seed=0)
    return pipeline("text-generation", model=target, tokenizer=make_tokenizer(padding_side="left"))


@pytest.fixture(scope="module", params=["draft", "ngram"])
def spec(request, pipe):
    if request.param == "ngram":
        return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    return hf_specdec.SpecDecoder(draft_model=make_noisy_copy(pipe.model, 0.01), num_speculative_tokens=4)


def test_greedy_text_equals_plain_pipeline(pipe, spec):
    expected = pipe(PROMPTS[0], do_sample=False, max_new_tokens=MAX_NEW)
    spec.last_stats = None
    out = pipe(
        PROMPTS[0], do_sample=False, max_new_tokens=MAX_NEW, custom_generate=hf_specdec.generate, spec_decoder=spec
    )
    assert out == expected
    assert spec.last_stats is not None and spec.last_stats.num_generated_tokens > 0  # it really ran speculatively


def test_batched_greedy_text_equals_plain_pipeline(pipe, spec):
    assert pipe.tokenizer.padding_side == "left"
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW, batch_size=3)
    expected = pipe(PROMPTS, **kwargs)
    out = pipe(PROMPTS, custom_generate=hf_specdec.generate, spec_decoder=spec, **kwargs)
    assert out == expected
    assert spec.last_stats.num_generated_tokens > MAX_NEW  # one speculative generate call over several rows


def test_sampling_defaults_run_and_return_text(pipe, spec):
    out = pipe(
        PROMPTS,
        do_sample=True,
        temperature=0.7,
        max_new_tokens=MAX_NEW,
        batch_size=3,
        custom_generate=hf_specdec.generate,
        spec_decoder=spec,
    )
    assert len(out) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, out):
        text = result[0]["generated_text"]
        assert isinstance(text, str) and text.startswith(prompt) and len(text) > len(prompt)
