"""`hf_specdec.install()` / `uninstall()`: routing of `generate`'s speculative kwargs and a clean undo.

After `install()`, `spec_decoder=`, `assistant_model=` (batch > 1 too, which stock HF refuses) and
`prompt_lookup_num_tokens=` run through hf_specdec and equal plain greedy `generate`; `uninstall()`
puts the identical original `GenerationMixin.generate` back, with stock behaviour; `install()` is
idempotent. The `installed` fixture uninstalls even when a test fails.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts
from transformers import GenerationMixin

import hf_specdec

MAX_NEW = 16
ORIGINAL_GENERATE = GenerationMixin.generate


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return make_noisy_copy(target, 0.01)


@pytest.fixture
def installed():
    assert not hf_specdec.is_installed()
    hf_specdec.install()
    try:
        yield
    finally:
        hf_specdec.uninstall()
    assert GenerationMixin.generate is ORIGINAL_GENERATE


def plain_greedy(target, inputs) -> torch.Tensor:
    return ORIGINAL_GENERATE(target, **inputs, do_sample=False, max_new_tokens=MAX_NEW)


def stock_refuses_batched_assisted_decoding(target, inputs, **speculation) -> bool:
    try:
        target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, **speculation)
    except ValueError as error:
        return "batch" in str(error).lower()
    return False


@pytest.mark.parametrize("batch_size", [1, 3])
def test_spec_decoder_kwarg_is_routed(target, draft, installed, batch_size):
    inputs = make_prompts(batch_size, seed=3)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
    out = target.generate(**inputs, spec_decoder=spec, do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(out, plain_greedy(target, inputs))
    assert spec.last_stats is not None and spec.last_stats.num_draft_tokens > 0  # it ran through hf_specdec


def test_explicit_custom_generate_still_works_when_installed(target, draft, installed):
    """`custom_generate=hf_specdec.generate, spec_decoder=spec` keeps working with the hook in place."""
    inputs = make_prompts(2, seed=4)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    out = target.generate(
        **inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, do_sample=False, max_new_tokens=MAX_NEW
    )
    assert torch.equal(out, plain_greedy(target, inputs))
    assert spec.last_stats is not None and spec.last_stats.num_steps > 0


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize(
    "speculation",
    [{"assistant_model": "draft"}, {"prompt_lookup_num_tokens": 4}],
    ids=["assistant_model", "prompt_lookup"],
)
def test_hf_speculation_kwargs_are_routed(target, draft, batch_size, speculation):
    speculation = {k: draft if v == "draft" else v for k, v in speculation.items()}
    inputs = make_prompts(batch_size, seed=3)
    expected = plain_greedy(target, inputs)
    if batch_size > 1:  # stock HF refuses this call: success below proves the routing
        assert stock_refuses_batched_assisted_decoding(target, inputs, **speculation)
    hf_specdec.install()
    try:
        out = target.generate(
            **inputs, do_sample=False, max_new_tokens=MAX_NEW, return_dict_in_generate=True, **speculation
        )
    finally:
        hf_specdec.uninstall()
    assert isinstance(out, hf_specdec.SpecDecodeOutput) and out.spec_stats.num_steps > 0  # hf_specdec ran it
    assert torch.equal(out.sequences, expected)
    if batch_size > 1:  # and stock behaviour is back after uninstall()
        assert stock_refuses_batched_assisted_decoding(target, inputs, **speculation)


def test_uninstall_restores_the_identical_original():
    assert GenerationMixin.generate is ORIGINAL_GENERATE
    hf_specdec.install()
    try:
        assert hf_specdec.is_installed()
        wrapper = GenerationMixin.generate
        assert wrapper is not ORIGINAL_GENERATE and wrapper.__wrapped__ is ORIGINAL_GENERATE
        hf_specdec.install()  # idempotent: no second layer of wrapping
        assert GenerationMixin.generate is wrapper
    finally:
        hf_specdec.uninstall()
    assert not hf_specdec.is_installed()
    assert GenerationMixin.generate is ORIGINAL_GENERATE
    hf_specdec.uninstall()  # a second uninstall is a no-op
    assert GenerationMixin.generate is ORIGINAL_GENERATE


def test_plain_calls_are_untouched_when_installed(target, installed):
    inputs = make_prompts(3, seed=3)
    out = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(out, plain_greedy(target, inputs))


@pytest.mark.parametrize("value", [0, -2])
def test_prompt_lookup_num_tokens_below_one_is_refused_as_stock_does(llama, value):
    """Stock transformers raises for prompt_lookup_num_tokens=0; after install() it must not silently run plain."""
    inputs = make_prompts(1)
    with pytest.raises(ValueError, match="Invalid max_matching_ngram_size or num_output_tokens"):
        llama.generate(**inputs, max_new_tokens=4, prompt_lookup_num_tokens=value)
    hf_specdec.install()
    try:
        with pytest.raises(ValueError, match=f"prompt_lookup_num_tokens={value} is invalid"):
            llama.generate(**inputs, max_new_tokens=4, prompt_lookup_num_tokens=value)
    finally:
        hf_specdec.uninstall()
