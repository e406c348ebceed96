"""Bad input raises a clear error that names what is wrong, the value received and the fix.

One case per mistake: a draft with another vocabulary or on another device, k out of range, an
unknown method, beam search, use_cache=False, output_attentions, T5 (no decoder position ids) at batch 3, a
right-padded batch, and a `spec_decoder` of the wrong type.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_config, make_model, make_prompts, spec_generate
from transformers import AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

import hf_specdec


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


def call(model, inputs: dict, spec, **kwargs):
    """A short speculative generate call (max_new_tokens set, so generate warns about nothing else)."""
    return spec_generate(model, inputs, spec, max_new_tokens=4, **kwargs)


def right_padded(batch_size: int = 3) -> dict[str, torch.Tensor]:
    """make_prompts' left-padded batch with every row's padding moved to the right."""
    inputs = make_prompts(batch_size, seed=3)
    ids, mask = inputs["input_ids"].clone(), inputs["attention_mask"].clone()
    for i in range(batch_size):
        keep = mask[i].bool()
        n = int(keep.sum())
        ids[i] = torch.cat([ids[i][keep], ids[i][~keep]])
        mask[i] = torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(len(keep) - n, dtype=torch.long)])
    assert (mask[:, -1] == 0).any()
    return {"input_ids": ids, "attention_mask": mask}


def draft_with_vocab(vocab: int):
    return make_model("llama", seed=1, layers=1, hidden=32, vocab=vocab)


def draft_on_meta():
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(make_config("llama", layers=1, hidden=32))


def tiny_t5():
    config = T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0, pad_token_id=0
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).eval()


# (case id, what to run given the target, exception type, regexes the message must contain: value and fix)
CASES = [
    (
        "draft_vocab",
        lambda t: call(t, make_prompts(1), hf_specdec.SpecDecoder(draft_model=draft_with_vocab(128))),
        ValueError,
        [r"128", r"96", r"tokenizer|ngram"],
    ),
    (
        "k_zero",
        lambda t: hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=0),
        ValueError,
        [r"num_speculative_tokens", r"got 0", r"1\.\.32"],
    ),
    (
        "k_33",
        lambda t: hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=33),
        ValueError,
        [r"num_speculative_tokens", r"got 33", r"1\.\.32"],
    ),
    (
        "unknown_method",
        lambda t: hf_specdec.SpecDecoder(method="medusa"),
        ValueError,
        [r"'medusa'", r"draft", r"ngram"],
    ),
    (
        "num_beams",
        lambda t: call(t, make_prompts(1), hf_specdec.SpecDecoder(method="ngram"), num_beams=2),
        ValueError,
        [r"num_beams=2", r"num_beams=1"],
    ),
    (
        "use_cache_false",
        lambda t: call(t, make_prompts(1), hf_specdec.SpecDecoder(method="ngram"), use_cache=False),
        ValueError,
        [r"use_cache=False", r"pass use_cache=True"],
    ),
    (
        "output_attentions",
        lambda t: call(
            t,
            make_prompts(1),
            hf_specdec.SpecDecoder(method="ngram"),
            output_attentions=True,
            return_dict_in_generate=True,
        ),
        NotImplementedError,
        [r"output_attentions=True", r"drop"],
    ),
    (
        "encoder_decoder",
        lambda t: call(tiny_t5(), make_prompts(3), hf_specdec.SpecDecoder(method="ngram")),
        NotImplementedError,
        [r"T5ForConditionalGeneration", r"no position ids", r"batch 1 only \(got 3 rows\)"],
    ),
    (
        "right_padding",
        lambda t: call(t, right_padded(), hf_specdec.SpecDecoder(method="ngram")),
        ValueError,
        [r"left-padded", r"row \d", r"padding_side = 'left'"],
    ),
    (
        "spec_decoder_type",
        lambda t: call(t, make_prompts(1), {"method": "ngram"}),
        TypeError,
        [r"hf_specdec\.SpecDecoder", r"got dict", r"SpecDecoder\("],
    ),
    (
        "draft_device",
        lambda t: call(t, make_prompts(1), hf_specdec.SpecDecoder(draft_model=draft_on_meta())),
        ValueError,
        [r"on meta", r"on cpu", r"\.to\('cpu'\)"],
    ),
]


@pytest.mark.parametrize(("case", "run", "error", "patterns"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(target, case, run, error, patterns):
    with pytest.raises(error) as info:
        run(target)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{case}: {pattern!r} not in {message!r}"
