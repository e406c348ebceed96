"""Kinds of speculation transformers has and hf_specdec does not run yet (DFlash) fail with a clear error.

The error names what is supported and how to get transformers' own decoding, both through `install()` routing
and through `custom_generate`, before any model work.
"""

from __future__ import annotations

import pytest
from conftest import make_model, make_prompts, spec_generate

import hf_specdec


def test_dflash_is_refused_with_the_supported_kinds(llama, llama_draft):
    inputs = make_prompts(2)
    hf_specdec.install()
    try:
        with pytest.raises(NotImplementedError, match=r"speculation_type='dflash'.*Supported: a causal LM draft"):
            llama.generate(**inputs, assistant_model=llama_draft, speculation_type="dflash", max_new_tokens=4)
    finally:
        hf_specdec.uninstall()
    with pytest.raises(NotImplementedError, match="hf_specdec.uninstall()"):
        spec_generate(llama, inputs, hf_specdec.SpecDecoder(method="ngram"), speculation_type="dflash")


def test_plain_calls_stay_untouched_after_install():
    target = make_model("llama", seed=0)
    inputs = make_prompts(2)
    expected = target.generate(**inputs, max_new_tokens=4, do_sample=False)
    hf_specdec.install()
    try:
        assert (target.generate(**inputs, max_new_tokens=4, do_sample=False) == expected).all()
    finally:
        hf_specdec.uninstall()
