"""The device forms of prefix-reading processors equal transformers' processors, position by position (bit for bit:
sequence bias adds its floats in transformers' order, the exponential length penalty takes its power as Python does)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import logits_process as lp

from hf_specdec.sampling.prefix_processors import device_form


def random_case(seed: int, vocab: int = 11, batch: int = 5, capacity: int = 14, width: int = 4, alphabet: int = 4):
    """A token buffer with left padding (id 0), a few ids past the output vocabulary, ragged prefixes, and scores
    of both signs. Tokens come from a small alphabet so that n-grams repeat."""
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, alphabet, (batch, capacity), generator=g)  # [B, C]
    token_ids[torch.rand(batch, capacity, generator=g) < 0.05] = vocab + 2  # an embedding wider than the head
    pad = torch.randint(0, 4, (batch,), generator=g)  # [B]
    token_ids[torch.arange(capacity)[None, :] < pad[:, None]] = 0
    prefix_lengths = torch.randint(1, capacity + 1, (batch, width), generator=g)  # [B, w]
    scores = torch.randn(batch, width, vocab, generator=g) * 3  # [B, w, V]
    return token_ids, prefix_lengths, scores


def per_position(processor, token_ids, prefix_lengths, scores) -> torch.Tensor:  # [B, w, V]
    out = torch.empty_like(scores)
    for i in range(scores.shape[0]):
        for j in range(scores.shape[1]):
            length = int(prefix_lengths[i, j])
            out[i, j] = processor(token_ids[i : i + 1, :length], scores[i, j][None].clone())[0]
    return out


def processors(row_ids: torch.Tensor, total_rows: int) -> list:
    ignore = torch.arange(total_rows) % 5  # one per caller row
    return [
        lp.RepetitionPenaltyLogitsProcessor(1.3),
        lp.RepetitionPenaltyLogitsProcessor(0.7, prompt_ignore_length=3),
        lp.NoRepeatNGramLogitsProcessor(1),
        lp.NoRepeatNGramLogitsProcessor(2),
        lp.NoRepeatNGramLogitsProcessor(3),
        lp.NoRepeatNGramLogitsProcessor(5),
        lp.MinLengthLogitsProcessor(9, eos_token_id=[2, 5]),
        lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=6, min_new_tokens=4, eos_token_id=3),
        lp.NoBadWordsLogitsProcessor([[4], [1, 2], [2, 1], [0, 3, 3], [3, 1, 2, 0], [5]], eos_token_id=5),
        lp.NoBadWordsLogitsProcessor([[1, 2, 3, 1, 2]]),
        lp.ForcedBOSTokenLogitsProcessor(bos_token_id=7),
        lp.ForcedEOSTokenLogitsProcessor(max_length=9, eos_token_id=[2, 6]),
        lp.SuppressTokensAtBeginLogitsProcessor([1, 8], begin_index=5),
        lp.SequenceBiasLogitsProcessor(
            {
                (1,): 0.1,
                (2, 1): 1.7,
                (0, 3, 1): -0.3,
                (3,): -2.5,
                (1, 2, 3, 1): 5.0,
                (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0): 9.0,
            }
        ),  # fmt: skip
        lp.SequenceBiasLogitsProcessor([[[3, 3], 1e-3], [[3, 3, 3], 1e8], [[1, 3], 1.0], [[3], 0.25]]),
        lp.ExponentialDecayLengthPenalty((2, 1.6), eos_token_id=[2, 5], input_ids_seq_length=3),
        lp.ExponentialDecayLengthPenalty((0, 0.7), eos_token_id=4, input_ids_seq_length=6),
    ] + [lp.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=ignore)]


@pytest.mark.parametrize("seed", range(6))
def test_device_forms_equal_the_processors_on_each_prefix(seed: int) -> None:
    token_ids, prefix_lengths, scores = random_case(seed)
    prefix_lengths[0, 0] = 1  # forced BOS fires at a prefix of one token
    total_rows = 8
    row_ids = torch.randperm(total_rows, generator=torch.Generator().manual_seed(seed))[: scores.shape[0]]  # [B]
    for processor in processors(row_ids, total_rows):
        form = device_form(processor, row_ids)
        assert form is not None, type(processor).__name__
        ignore = getattr(processor, "prompt_ignore_length", None)
        if isinstance(ignore, torch.Tensor):  # each row's entry: the same rule as that row alone with an int
            expected = torch.stack([
                per_position(lp.RepetitionPenaltyLogitsProcessor(processor.penalty, int(ignore[row])),
                             token_ids[i : i + 1], prefix_lengths[i : i + 1], scores[i : i + 1])[0]
                for i, row in enumerate(row_ids.tolist())
            ])  # fmt: skip
        else:
            expected = per_position(processor, token_ids, prefix_lengths, scores)
        assert torch.equal(form(token_ids, prefix_lengths, scores.clone()), expected), type(processor).__name__


def test_a_subclass_or_another_processor_has_no_device_form() -> None:
    class Custom(lp.RepetitionPenaltyLogitsProcessor):
        pass

    row_ids = torch.arange(2)
    assert device_form(Custom(1.2), row_ids) is None
    assert device_form(lp.TemperatureLogitsWarper(0.5), row_ids) is None  # prefix-free: runs as it is


def test_sequence_bias_adds_in_transformers_order() -> None:
    """Three biases of token 2 that all apply after "5 0 1": their float32 sum depends on the order. transformers
    5.24 adds them grouped by prefix length, in order of each length's first sequence (1.0, then -1e8, then 1e8:
    0); 5.17 one by one in dict order (-1e8, 1e8, 1.0: 1). The form adds them as the installed version does."""
    from hf_specdec import compat

    bias = {(7, 1, 2): 0.5, (5, 0, 1, 2): -1e8, (1, 2): 1e8, (0, 1, 2): 1.0}
    processor = lp.SequenceBiasLogitsProcessor(bias)
    token_ids = torch.tensor([[9, 5, 0, 1, 4]])  # [1, C]
    prefix_lengths = torch.tensor([[4]])  # the prefix "9 5 0 1"
    scores = torch.zeros(1, 1, 11)
    got = device_form(processor, torch.arange(1))(token_ids, prefix_lengths, scores)
    expected = processor(token_ids[:, :4], scores[:, 0])  # [1, V]
    assert torch.equal(got[:, 0], expected)
    assert float(expected[0, 2]) == (0.0 if compat.sequence_bias_groups_by_length() else 1.0)


def test_exponential_penalty_is_python_power_rounded_once() -> None:
    """factor^n - 1 in float32 arithmetic drifts from Python's double power rounded to float32: the form's table
    holds the latter, as transformers' scalar multiply rounds it."""
    processor = lp.ExponentialDecayLengthPenalty((0, 1.1), eos_token_id=1, input_ids_seq_length=0)
    scores = torch.full((1, 40, 3), 3.0)  # [1, w, V]
    prefix_lengths = torch.arange(1, 41)[None]  # [1, w]
    token_ids = torch.zeros(1, 41, dtype=torch.long)
    got = device_form(processor, torch.arange(1))(token_ids, prefix_lengths, scores)
    expected = per_position(processor, token_ids, prefix_lengths, scores)
    assert torch.equal(got, expected)
    in_float32 = 3.0 * (torch.tensor(1.1) ** prefix_lengths.float() - 1) + 3.0  # [1, w]
    assert not torch.equal(got[..., 1], in_float32)  # the check above can tell the two apart


@pytest.mark.parametrize("kind", ["bad_words", "sequence_bias"])
def test_a_word_past_the_vocabulary_is_refused_as_transformers_refuses_it(kind: str) -> None:
    token_ids, prefix_lengths, scores = random_case(0)
    processor = (
        lp.NoBadWordsLogitsProcessor([[1, 40]])
        if kind == "bad_words"
        else lp.SequenceBiasLogitsProcessor([[[1, 40], -1.0]])
    )
    form = device_form(processor, torch.arange(scores.shape[0]))
    with pytest.raises(ValueError, match="vocabulary size is 11"):
        form(token_ids, prefix_lengths, scores)
    with pytest.raises(ValueError, match="vocabulary size is 11"):
        processor(token_ids[:, :3], scores[:, 0])


def test_selected_rows_keep_their_ignored_columns() -> None:
    processor = lp.RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([0, 3, 6]))
    form = device_form(processor, torch.tensor([2, 0, 1]))
    form.select_rows(torch.tensor([False, True, True]))
    assert form.ignore.tolist() == [0, 3]


def test_positions_past_the_buffer_are_scored_without_an_index_error() -> None:
    """A step scores positions it will not use (rows near the end of their buffer): their prefix lengths may pass
    the buffer; the forms must not index out of it (a device-side assert on a GPU)."""
    token_ids, prefix_lengths, scores = random_case(0)
    prefix_lengths[:, -1] = token_ids.shape[1] + 3
    for processor in (
        lp.NoRepeatNGramLogitsProcessor(3),
        lp.RepetitionPenaltyLogitsProcessor(1.2),
        lp.SequenceBiasLogitsProcessor({(1, 2): 0.5}),
        lp.ExponentialDecayLengthPenalty((1, 1.5), eos_token_id=2, input_ids_seq_length=2),
    ):
        form = device_form(processor, torch.arange(scores.shape[0]))
        assert form(token_ids, prefix_lengths, scores).shape == scores.shape
