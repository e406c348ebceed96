"""Logits processors under speculation: the allow-listed fast path, and the exact path for everything else.

Each allow-listed processor runs greedy-identical to plain `generate`, and the vectorised path equals per-position
calls on plain decoding's full batch (warpers do not move the argmax). Processors off the list (SynthID's
watermark, a user processor keyed by batch index) go through the exact path: greedy identical, sampling keeps
their hard constraints and SynthID's watermark as detectable as in plain samples.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, VOCAB, make_model, make_noisy_copy, make_prompts, spec_generate
from transformers import LogitsProcessor, LogitsProcessorList, SynthIDTextWatermarkingConfig
from transformers.generation import logits_process as lp

import hf_specdec
from hf_specdec.sampling.processors import PURE_PROCESSORS, StepSampling

WATERMARK = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443, 597, 160, 57], ngram_len=5)


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return make_noisy_copy(target, noise=0.05)


def specs(draft):
    return [
        hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1),
        hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4),
    ]


#: One instance of every allow-listed processor, with arguments that make it act within a few tokens.
ALLOW_LISTED = {
    "TemperatureLogitsWarper": lambda: lp.TemperatureLogitsWarper(0.7),
    "TopKLogitsWarper": lambda: lp.TopKLogitsWarper(5),
    "TopPLogitsWarper": lambda: lp.TopPLogitsWarper(0.8),
    "TopHLogitsWarper": lambda: lp.TopHLogitsWarper(0.5),
    "MinPLogitsWarper": lambda: lp.MinPLogitsWarper(0.1),
    "TypicalLogitsWarper": lambda: lp.TypicalLogitsWarper(0.9),
    "EpsilonLogitsWarper": lambda: lp.EpsilonLogitsWarper(0.01),
    "EtaLogitsWarper": lambda: lp.EtaLogitsWarper(0.01),
    "InfNanRemoveLogitsProcessor": lambda: lp.InfNanRemoveLogitsProcessor(),
    "LogitNormalization": lambda: lp.LogitNormalization(),
    "SuppressTokensLogitsProcessor": lambda: lp.SuppressTokensLogitsProcessor(list(range(3, 40))),
    "RepetitionPenaltyLogitsProcessor": lambda: lp.RepetitionPenaltyLogitsProcessor(1.8),
    "NoRepeatNGramLogitsProcessor": lambda: lp.NoRepeatNGramLogitsProcessor(2),
    "SequenceBiasLogitsProcessor": lambda: lp.SequenceBiasLogitsProcessor({(50,): 30.0, (50, 51): 40.0}),
    "NoBadWordsLogitsProcessor": lambda: lp.NoBadWordsLogitsProcessor([[40], [41, 42]], eos_token_id=EOS_ID),
    "MinLengthLogitsProcessor": lambda: lp.MinLengthLogitsProcessor(30, eos_token_id=EOS_ID),
    "MinNewTokensLengthLogitsProcessor": lambda: lp.MinNewTokensLengthLogitsProcessor(12, 8, eos_token_id=EOS_ID),
    "ForcedBOSTokenLogitsProcessor": lambda: lp.ForcedBOSTokenLogitsProcessor(7),
    "ForcedEOSTokenLogitsProcessor": lambda: lp.ForcedEOSTokenLogitsProcessor(28, eos_token_id=EOS_ID),
    "ExponentialDecayLengthPenalty": lambda: lp.ExponentialDecayLengthPenalty((2, 3.0), EOS_ID, 12),
    "SuppressTokensAtBeginLogitsProcessor": lambda: lp.SuppressTokensAtBeginLogitsProcessor(list(range(3, 60)), 12),
}


def test_every_allow_listed_processor_has_a_test() -> None:
    assert {cls.__name__ for cls in PURE_PROCESSORS} == set(ALLOW_LISTED)


@pytest.mark.parametrize("name", sorted(ALLOW_LISTED))
def test_allow_listed_processor_greedy_identical(target, draft, name) -> None:
    if not hasattr(lp, name):
        pytest.skip(f"{name} is not in this transformers version")
    inputs = make_prompts(3, seed=5, min_len=12, max_len=12)  # width 12: the length-keyed processors act
    plain = target.generate(
        **inputs, max_new_tokens=16, do_sample=False, logits_processor=LogitsProcessorList([ALLOW_LISTED[name]()])
    )
    for spec in specs(draft):
        out = spec_generate(
            target, inputs, spec, max_new_tokens=16, do_sample=False,
            logits_processor=LogitsProcessorList([ALLOW_LISTED[name]()]),
        )  # fmt: skip
        assert torch.equal(out, plain), (name, spec.method)
        assert spec.last_stats.num_draft_tokens > 0 or spec.method == "ngram"


@pytest.mark.parametrize("name", sorted(ALLOW_LISTED))
def test_allow_listed_processor_vectorised_equals_per_position_calls(name) -> None:
    """The fast path over ragged (row, prefix) pairs equals calling the processor as plain decoding does."""
    if not hasattr(lp, name):
        pytest.skip(f"{name} is not in this transformers version")
    g = torch.Generator().manual_seed(0)
    batch, width, capacity = 3, 4, 24
    token_ids = torch.randint(3, VOCAB, (batch, capacity), generator=g)  # [B, C]
    prefix_lengths = torch.tensor([[12, 13, 14, 15], [14, 15, 16, 17], [12, 13, 14, 15]])  # [B, w]
    valid = torch.ones(batch, width, dtype=torch.bool)
    logits = torch.randn(batch, width, VOCAB, generator=g) * 3  # [B, w, V]
    sampling = StepSampling(LogitsProcessorList([ALLOW_LISTED[name]()]), do_sample=True, seeds=torch.arange(batch))
    assert not sampling.exact
    fast = sampling.process(token_ids, prefix_lengths, valid, logits)
    reference = ALLOW_LISTED[name]()
    for i in range(batch):
        for j in range(width):
            expected = reference(token_ids[i : i + 1, : prefix_lengths[i, j]], logits[i : i + 1, j].clone())[0]
            torch.testing.assert_close(fast[i, j], expected, rtol=1e-5, atol=1e-5)


class RowBan(LogitsProcessor):
    """Row i may only emit tokens t with t % 3 == i % 3 (a per-row rule keyed by batch index); counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += 1
        rows = torch.arange(scores.shape[0])[:, None]
        allowed = torch.arange(scores.shape[1])[None, :] % 3 == rows % 3  # [B, V]
        return scores.masked_fill(~allowed, -float("inf"))


def test_subclass_of_an_allow_listed_processor_takes_the_exact_path() -> None:
    class Counting(lp.TopKLogitsWarper):
        pass

    sampling = StepSampling(LogitsProcessorList([Counting(5)]), do_sample=True, seeds=torch.arange(2))
    assert sampling.exact


@pytest.mark.parametrize("batch_size", [1, 4])
def test_synthid_greedy_identical(target, draft, batch_size) -> None:
    inputs = make_prompts(batch_size, seed=batch_size)
    plain = target.generate(**inputs, max_new_tokens=20, do_sample=False, watermarking_config=WATERMARK)
    for spec in specs(draft):
        out = spec_generate(target, inputs, spec, max_new_tokens=20, do_sample=False, watermarking_config=WATERMARK)
        assert torch.equal(out, plain), spec.method


def test_row_keyed_processor_greedy_identical_and_called_like_plain(target, draft) -> None:
    inputs = make_prompts(6, seed=3)
    reference = RowBan()
    plain = target.generate(**inputs, max_new_tokens=12, do_sample=False, logits_processor=[reference])
    for spec in specs(draft):
        processor = RowBan()
        out = spec_generate(target, inputs, spec, max_new_tokens=12, do_sample=False, logits_processor=[processor])
        assert torch.equal(out, plain), spec.method
        assert processor.calls == reference.calls  # once per position, never for a discarded one


def test_row_keyed_processor_sampling_holds_its_constraint(target, draft) -> None:
    inputs = make_prompts(6, seed=4)
    prompt_width = inputs["input_ids"].shape[1]
    for spec in specs(draft):
        spec.seed = 11
        out = spec_generate(
            target, inputs, spec, max_new_tokens=16, do_sample=True, logits_processor=[RowBan()], eos_token_id=None
        )  # no EOS: no pad after a finished row, every new token is a sampled one
        new = out[:, prompt_width:]
        rows = torch.arange(6)[:, None]
        assert bool((new % 3 == rows % 3).all()), new


def _mean_g_score(processor, sequences: torch.Tensor, prompt_width: int) -> torch.Tensor:  # [N]
    """SynthID's mean g-value of each row's generated tokens (the unweighted detector score; ~0.5 unwatermarked)."""
    generated = sequences[:, prompt_width:]
    g_values = processor.compute_g_values(generated)  # [N, T - (ngram_len - 1), depth]
    mask = processor.compute_context_repetition_mask(generated)  # [N, T - (ngram_len - 1)]
    weights = mask[..., None].float().expand_as(g_values)
    return (g_values * weights).sum((1, 2)) / weights.sum((1, 2)).clamp(min=1)


def test_synthid_sampling_watermark_detectable_like_plain(target, draft) -> None:
    """Batch 6, seeded: the watermark's mean g-value score on speculative samples matches plain samples'."""
    from scipy import stats

    torch.manual_seed(0)
    inputs = make_prompts(6, seed=9, repetitive=False)
    prompt_width = inputs["input_ids"].shape[1]
    processor = WATERMARK.construct_processor(VOCAB, torch.device("cpu"))
    plain_scores, spec_scores, unmarked = [], [], []
    for trial in range(6):
        torch.manual_seed(100 + trial)
        plain = target.generate(
            **inputs, max_new_tokens=24, do_sample=True, watermarking_config=WATERMARK, eos_token_id=None
        )
        plain_scores.append(_mean_g_score(processor, plain, prompt_width))
        for spec in specs(draft):
            spec.seed = 1000 * trial + 7
            out = spec_generate(
                target,
                inputs,
                spec,
                max_new_tokens=24,
                do_sample=True,
                watermarking_config=WATERMARK,
                eos_token_id=None,
            )
            spec_scores.append(_mean_g_score(processor, out, prompt_width))
        torch.manual_seed(200 + trial)
        free = target.generate(**inputs, max_new_tokens=24, do_sample=True, eos_token_id=None)
        unmarked.append(_mean_g_score(processor, free, prompt_width))
    plain_scores, spec_scores, unmarked = torch.cat(plain_scores), torch.cat(spec_scores), torch.cat(unmarked)
    # The watermark is there: both clearly above the unwatermarked samples ...
    assert stats.mannwhitneyu(spec_scores, unmarked, alternative="greater").pvalue < 1e-3
    assert stats.mannwhitneyu(plain_scores, unmarked, alternative="greater").pvalue < 1e-3
    # ... and speculative samples score like plain ones (no detectable difference; the test has power for ~0.05).
    assert stats.mannwhitneyu(spec_scores, plain_scores).pvalue > 1e-3
    assert abs(float(spec_scores.mean() - plain_scores.mean())) < 0.04, (spec_scores.mean(), plain_scores.mean())
