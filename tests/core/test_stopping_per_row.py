"""Stopping criteria keyed by batch index or with per-row state, and the smaller call-contract fixes.

Plain `generate` calls its criteria once per token on the caller's whole batch, in order; a criterion with a
per-row budget or per-row counters relies on it. Batch 8, rows finishing at different steps: identical to plain,
and the criteria called exactly as often. Also: a pad id inside a batch-1 prompt without attention_mask gets the
right error, and output_scores buffers grow with the tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PAD_ID, make_model, make_noisy_copy, make_prompts, spec_generate
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


def specs(target):
    return [
        hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1),
        hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, noise=0.05), num_speculative_tokens=4),
    ]


class RowBudget(StoppingCriteria):
    """Row i stops after budgets[i] new tokens (keyed by batch index; stateless)."""

    def __init__(self, prompt_width: int, budgets: list[int]) -> None:
        self.prompt_width, self.budgets = prompt_width, torch.tensor(budgets)
        self.calls = 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.calls += 1
        assert input_ids.shape[0] == len(self.budgets)
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.prompt_width) >= self.budgets


class RowCounter(StoppingCriteria):
    """Per-row state: counts, per row, the calls in which the row's newest token is odd; stops at a per-row quota."""

    def __init__(self, quotas: list[int]) -> None:
        self.quotas = torch.tensor(quotas)
        self.counts = torch.zeros(len(quotas), dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.counts += input_ids[:, -1] % 2  # [B]: fails on a batch that is not the caller's whole batch
        return self.counts >= self.quotas


BUDGETS = [3, 9, 5, 14, 1, 7, 11, 4]


@pytest.mark.parametrize("with_eos", [True, False])
def test_row_budget_criterion_identical(target, with_eos) -> None:
    inputs = make_prompts(8, seed=2)
    width = inputs["input_ids"].shape[1]
    eos = {} if with_eos else {"eos_token_id": None}
    reference = RowBudget(width, BUDGETS)
    plain = target.generate(**inputs, max_new_tokens=16, do_sample=False, stopping_criteria=[reference], **eos)
    for spec in specs(target):
        criterion = RowBudget(width, BUDGETS)
        out = spec_generate(
            target, inputs, spec, max_new_tokens=16, do_sample=False, stopping_criteria=[criterion], **eos
        )
        assert torch.equal(out, plain), spec.method
        assert criterion.calls == reference.calls, spec.method


def test_row_state_criterion_identical(target) -> None:
    inputs = make_prompts(8, seed=6)
    quotas = [1, 2, 3, 4, 5, 6, 2, 3]
    plain = target.generate(
        **inputs, max_new_tokens=16, do_sample=False, stopping_criteria=StoppingCriteriaList([RowCounter(quotas)])
    )
    lengths = (plain != PAD_ID).sum(1)
    assert len(set(lengths.tolist())) > 2  # rows really finish at different steps
    for spec in specs(target):
        criterion = RowCounter(quotas)
        out = spec_generate(target, inputs, spec, max_new_tokens=16, do_sample=False, stopping_criteria=[criterion])
        assert torch.equal(out, plain), spec.method


def test_row_state_criterion_sampling_runs(target) -> None:
    inputs = make_prompts(8, seed=6)
    for spec in specs(target):
        spec.seed = 3
        out = spec_generate(
            target, inputs, spec, max_new_tokens=12, do_sample=True, stopping_criteria=[RowCounter([2] * 8)]
        )
        assert out.shape[0] == 8


def test_pad_id_inside_batch1_prompt_without_mask_is_explained(target) -> None:
    input_ids = torch.tensor([[5, 6, PAD_ID, 7, 8]])
    plain = target.generate(input_ids=input_ids, max_new_tokens=4, do_sample=False)
    assert plain.shape[1] == 9  # plain generate infers a mask with a hole and runs
    with pytest.raises(ValueError, match=r"pad token id found inside the prompt.*attention_mask=torch.ones_like"):
        spec_generate(target, {"input_ids": input_ids}, hf_specdec.SpecDecoder(method="ngram"), max_new_tokens=4)
    # Marking those tokens real works and matches plain generate given the same mask.
    mask = torch.ones_like(input_ids)
    plain = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    out = spec_generate(
        target, {"input_ids": input_ids, "attention_mask": mask}, hf_specdec.SpecDecoder(method="ngram"),
        max_new_tokens=4, do_sample=False,
    )  # fmt: skip
    assert torch.equal(out, plain)


def test_use_cache_false_from_the_model_default_says_so(target) -> None:
    model = make_model("llama", seed=0)
    model.generation_config.use_cache = False
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's default .*pass use_cache=True"):
        spec_generate(model, make_prompts(1), hf_specdec.SpecDecoder(method="ngram"), max_new_tokens=4)


def test_output_scores_buffer_grows_with_the_tokens(target) -> None:
    from hf_specdec.decoding import _grown

    buffer = torch.zeros(2, 0, 5)
    buffer = _grown(buffer, 3, 1000)
    assert buffer.shape == (2, 3, 5)
    buffer = _grown(buffer, 4, 1000)
    assert buffer.shape == (2, 6, 5)  # doubled, not max_new_tokens wide
    assert _grown(buffer, 7, 8).shape == (2, 8, 5)
    inputs = make_prompts(2, seed=1)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3)
    out = spec_generate(
        target, inputs, spec, max_new_tokens=5, do_sample=False, eos_token_id=None,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    plain = target.generate(
        **inputs, max_new_tokens=5, do_sample=False, eos_token_id=None,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    assert len(out.scores) == len(plain.scores) == 5
    for a, b in zip(out.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
