"""`return_dict_in_generate` outputs: scores and logits per emitted token, stats, num_return_sequences.

Greedy `output_scores` / `output_logits` must hold one `[B, V]` entry per generated column, equal to
plain `generate`'s for every token a row really emitted (after a row's EOS plain `generate` keeps
scoring the pad it feeds, which speculation never computes, so those entries are not compared).
`spec_stats` rides on the output and `SpecDecoder.last_stats` is set with sane counters.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec

MAX_NEW = 20
K = 4


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


@pytest.fixture(scope="module")
def noisy(target):
    return make_noisy_copy(target, 0.01)


def emitted_mask(sequences: torch.Tensor, prompt_width: int, eos: int | None) -> torch.Tensor:  # [B, N]
    """True for the generated positions a row really emitted (up to and including its first EOS)."""
    new = sequences[:, prompt_width:]
    if eos is None:
        return torch.ones_like(new, dtype=torch.bool)
    is_eos = (new == eos).long()
    return (is_eos.cumsum(1) - is_eos) == 0


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("use_eos", [False, True], ids=["no_eos", "eos"])
@pytest.mark.parametrize("kind", ["noisy", "ngram"])
def test_scores_and_logits_match_plain_generate(target, noisy, batch_size, use_eos, kind):
    inputs = make_prompts(batch_size, seed=3)
    prompt_width = inputs["input_ids"].shape[1]
    # The penalty makes processed scores differ from raw logits and depend on each row's prefix and padding.
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW, repetition_penalty=1.3)
    eos = None
    if use_eos:
        plain = target.generate(**inputs, **kwargs, eos_token_id=None)
        eos = plain[0, prompt_width + 6].item()  # row 0 stops mid-way
    kwargs.update(eos_token_id=eos, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = target.generate(**inputs, **kwargs)
    spec = (
        hf_specdec.SpecDecoder(draft_model=noisy, num_speculative_tokens=K)
        if kind == "noisy"
        else hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=K, prompt_lookup_max=3)
    )
    out = spec_generate(target, inputs, spec, **kwargs)
    assert isinstance(out, hf_specdec.SpecDecodeOutput)
    assert torch.equal(out.sequences, expected.sequences)
    generated = expected.sequences.shape[1] - prompt_width
    assert len(out.scores) == len(out.logits) == len(expected.scores) == generated
    if use_eos:
        assert generated < MAX_NEW or batch_size > 1
    mask = emitted_mask(expected.sequences, prompt_width, eos)  # [B, N]
    for name in ("scores", "logits"):
        for j, (got, want) in enumerate(zip(getattr(out, name), getattr(expected, name))):
            assert got.shape == want.shape
            rows = mask[:, j]
            torch.testing.assert_close(got[rows], want[rows], atol=1e-4, rtol=1e-4, msg=f"{name}[{j}]")
    assert not torch.equal(out.scores[0], out.logits[0])  # the penalty was applied to scores only
    assert out.spec_stats is spec.last_stats


@pytest.mark.parametrize("batch_size", [1, 3])
def test_stats_are_set_and_sane(target, noisy, batch_size):
    inputs = make_prompts(batch_size, seed=3)
    spec = hf_specdec.SpecDecoder(draft_model=noisy, num_speculative_tokens=K)
    out = spec_generate(target, inputs, spec, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
    stats = spec.last_stats
    assert isinstance(stats, hf_specdec.SpecDecodeStats)
    assert 0 < stats.num_steps <= MAX_NEW
    assert stats.num_generated_tokens == batch_size * MAX_NEW == out[:, inputs["input_ids"].shape[1] :].numel()
    assert 0.0 <= stats.acceptance_rate <= 1.0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.mean_accepted_length >= 1.0
    assert len(stats.per_position_acceptance) == K
    assert all(0.0 <= a <= 1.0 for a in stats.per_position_acceptance)
    # Prefix acceptance: a draft is accepted only after every draft before it (the shares need not fall: rows near
    # max_length draft fewer, so later positions have fewer rows).
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    assert stats.drafted_per_position == sorted(stats.drafted_per_position, reverse=True)
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))
    assert stats.wall_time_s > 0
    # A new call replaces last_stats.
    spec_generate(target, inputs, spec, do_sample=False, max_new_tokens=3, eos_token_id=None)
    assert spec.last_stats is not stats and spec.last_stats.num_generated_tokens == 3 * batch_size


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_the_prefill_is_step_0s_verify(target, noisy, method):
    """Like plain `generate`, the first token costs no target forward of its own: one forward per step, all told
    (a constant k: the adaptive schedule's first calls also time the verify widths)."""
    forwards = []
    handle = target.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))
    try:
        inputs = make_prompts(3, seed=3)
        kwargs = {"draft_model": noisy} if method == "draft" else {"method": "ngram"}
        spec = hf_specdec.SpecDecoder(num_speculative_tokens=K, num_speculative_tokens_schedule="constant", **kwargs)
        expected = target.generate(**inputs, do_sample=False, max_new_tokens=1, eos_token_id=None)
        forwards.clear()
        out = spec_generate(target, inputs, spec, do_sample=False, max_new_tokens=1, eos_token_id=None)
        assert torch.equal(out, expected) and len(forwards) == spec.last_stats.num_steps == 1
        forwards.clear()
        spec_generate(target, inputs, spec, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
        assert len(forwards) == spec.last_stats.num_steps
    finally:
        handle.remove()


def test_sampling_with_num_return_sequences(target, noisy):
    inputs = make_prompts(2, seed=3)
    prompt_width = inputs["input_ids"].shape[1]
    kwargs = dict(do_sample=True, max_new_tokens=12, num_return_sequences=3, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=noisy, num_speculative_tokens=K, seed=123)
    out = spec_generate(target, inputs, spec, **kwargs)
    assert out.shape == (6, prompt_width + 12)
    expanded = inputs["input_ids"].repeat_interleave(3, dim=0)  # generate's layout: copies of a prompt adjacent
    assert torch.equal(out[:, :prompt_width], expanded)
    assert len({tuple(row) for row in out[:3, prompt_width:].tolist()}) > 1  # copies draw different samples
    again = spec_generate(
        target, inputs, hf_specdec.SpecDecoder(draft_model=noisy, num_speculative_tokens=K, seed=123), **kwargs
    )
    assert torch.equal(out, again)  # the seed makes it reproducible
    assert spec.last_stats.num_row_steps >= 6


def test_greedy_num_return_sequences_is_refused_like_plain_generate(target):
    """Plain generate refuses greedy num_return_sequences > 1 without beams; so does the speculative call."""
    inputs = make_prompts(1, seed=3)
    kwargs = dict(do_sample=False, max_new_tokens=4, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences") as plain_error:
        target.generate(**inputs, **kwargs)
    with pytest.raises(ValueError, match="num_return_sequences") as spec_error:
        spec_generate(target, inputs, hf_specdec.SpecDecoder(method="ngram"), **kwargs)
    assert str(spec_error.value) == str(plain_error.value)
