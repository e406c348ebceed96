"""`speculation_type` values hf_specdec does not run, or runs only with a DFlash drafter, fail with a clear error.

The error names what is needed and how to get transformers' own decoding, both through `install()` routing
and through `custom_generate`, before any model work.
"""

from __future__ import annotations

import pytest
from conftest import make_model, make_prompts, spec_generate

import hf_specdec


def test_dflash_without_a_dflash_drafter_is_refused(llama, llama_draft):
    inputs = make_prompts(2)
    hf_specdec.install()
    try:
        with pytest.raises(TypeError, match=r"speculation_type='dflash' needs a DFlash drafter.*LlamaForCausalLM"):
            llama.generate(**inputs, assistant_model=llama_draft, speculation_type="dflash", max_new_tokens=4)
        with pytest.raises(ValueError, match="needs the DFlash drafter as assistant_model"):
            llama.generate(**inputs, speculation_type="dflash", max_new_tokens=4)
    finally:
        hf_specdec.uninstall()
    with pytest.raises(ValueError, match=r"speculation_type='dflash'.*method='ngram'"):
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
