"""Speculative decoding stops exactly where plain greedy `generate` stops, token for token.

EOS (one id or a list) met inside an accepted block, max_new_tokens / max_length landing mid-block,
min_new_tokens, a user `StoppingCriteria`, stop strings, and batches whose rows stop at different
steps (pad fill included). Every stop token is taken from the plain run's own output, and each test
asserts that the stop really cut the output short, so none can pass vacuously.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, make_prompts, make_tokenizer, spec_generate
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec

MAX_NEW = 24
DRAFTS = ("self", "noisy", "ngram")
FAST_DRAFTS = ("self", "ngram")  # for the cases where a third draft adds little


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


@pytest.fixture(scope="module")
def noisy(target):
    return make_noisy_copy(target, 0.01)


def make_spec(kind: str, target, noisy, k: int = 8) -> hf_specdec.SpecDecoder:
    if kind == "self":
        return hf_specdec.SpecDecoder(draft_model=target, num_speculative_tokens=k)
    if kind == "noisy":
        return hf_specdec.SpecDecoder(draft_model=noisy, num_speculative_tokens=k)
    return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3)


def generated(model, inputs, **kwargs) -> torch.Tensor:  # [B, N] new tokens of a plain greedy run
    out = model.generate(**inputs, do_sample=False, **kwargs)
    return out[:, inputs["input_ids"].shape[1] :]


def first_positions(tokens: torch.Tensor, token_id: int) -> list[int | None]:
    """Per row, the index of the first occurrence of token_id in tokens [B, N] (None where absent)."""
    return [row.index(token_id) if token_id in row else None for row in tokens.tolist()]


def staggered_stop_token(tokens: torch.Tensor, min_pos: int = 2) -> int:
    """A token that ends at least two rows, at different positions >= min_pos (tokens [B, N])."""
    for token_id in range(3, int(tokens.max()) + 1):
        seen = [p for p in first_positions(tokens, token_id) if p is not None]
        if len(set(seen)) >= 2 and min(seen) >= min_pos:
            return token_id
    raise AssertionError(f"no staggered stop token in {tokens.tolist()}")


def assert_same(target, inputs, spec, **kwargs) -> torch.Tensor:
    expected = target.generate(**inputs, do_sample=False, **kwargs)
    out = spec_generate(target, inputs, spec, do_sample=False, **kwargs)
    assert torch.equal(out, expected), f"{spec.method}: {out.tolist()} != {expected.tolist()}"
    return out


@pytest.mark.parametrize("kind", DRAFTS)
def test_eos_in_the_middle_of_an_accepted_block(target, noisy, kind):
    inputs = make_prompts(1, seed=3)
    tokens = generated(target, inputs, max_new_tokens=MAX_NEW, eos_token_id=None)  # [1, N]
    eos = tokens[0, 6].item()  # appears mid-way: the self draft accepts all 8, so EOS lands mid-block
    stop_at = tokens[0].tolist().index(eos)
    out = assert_same(target, inputs, make_spec(kind, target, noisy), max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert out.shape[1] - inputs["input_ids"].shape[1] == stop_at + 1 < MAX_NEW
    assert out[0, -1].item() == eos


@pytest.mark.parametrize("kind", DRAFTS)
def test_rows_stop_at_different_steps_and_are_padded_like_generate(target, noisy, kind):
    inputs = make_prompts(4, seed=3)
    tokens = generated(target, inputs, max_new_tokens=MAX_NEW, eos_token_id=None)
    eos = staggered_stop_token(tokens)
    out = assert_same(target, inputs, make_spec(kind, target, noisy), max_new_tokens=MAX_NEW, eos_token_id=eos)
    new = out[:, inputs["input_ids"].shape[1] :]
    assert (new == PAD_ID).any(), "no row was padded: the test would not see the pad fill"


@pytest.mark.parametrize("kind", DRAFTS)
def test_list_of_eos_ids(target, noisy, kind):
    inputs = make_prompts(3, seed=3)
    tokens = generated(target, inputs, max_new_tokens=MAX_NEW, eos_token_id=None)
    eos_ids = [tokens[i, 3 + 4 * i].item() for i in range(3)]  # every row meets one of them, at a different step
    out = assert_same(target, inputs, make_spec(kind, target, noisy), max_new_tokens=MAX_NEW, eos_token_id=eos_ids)
    assert out.shape[1] - inputs["input_ids"].shape[1] < MAX_NEW


@pytest.mark.parametrize("kind", FAST_DRAFTS)
@pytest.mark.parametrize("max_new_tokens", [1, 5, 11, 13])
def test_max_new_tokens_mid_block(target, noisy, kind, max_new_tokens):
    inputs = make_prompts(3, seed=4)
    out = assert_same(target, inputs, make_spec(kind, target, noisy), max_new_tokens=max_new_tokens, eos_token_id=None)
    assert out.shape[1] == inputs["input_ids"].shape[1] + max_new_tokens


@pytest.mark.parametrize("kind", FAST_DRAFTS)
def test_max_length(target, noisy, kind):
    inputs = make_prompts(3, seed=4)
    max_length = inputs["input_ids"].shape[1] + 9
    out = assert_same(target, inputs, make_spec(kind, target, noisy), max_length=max_length, eos_token_id=None)
    assert out.shape[1] == max_length


@pytest.mark.parametrize("kind", DRAFTS)
def test_min_new_tokens_suppresses_an_early_eos(target, noisy, kind):
    inputs = make_prompts(1, seed=3)
    tokens = generated(target, inputs, max_new_tokens=MAX_NEW, eos_token_id=None)
    eos = tokens[0, 2].item()
    first = tokens[0].tolist().index(eos)
    out = assert_same(
        target, inputs, make_spec(kind, target, noisy), max_new_tokens=MAX_NEW, eos_token_id=eos, min_new_tokens=8
    )
    assert out.shape[1] - inputs["input_ids"].shape[1] > first + 1  # the early EOS was not allowed


class StopOnTokens(StoppingCriteria):
    """Stops a row when its newest token is one of `token_ids` (a user criterion that knows nothing of speculation)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = torch.tensor(token_ids)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.isin(input_ids[:, -1], self.token_ids.to(input_ids.device))


@pytest.mark.parametrize("kind", DRAFTS)
@pytest.mark.parametrize("with_eos", [True, False], ids=["eos", "no_eos"])
def test_user_stopping_criteria_mid_block(target, noisy, kind, with_eos):
    """HF's stock assisted decoding checks user criteria only at the end of a block; this must stop inside it."""
    inputs = make_prompts(3, seed=3)
    tokens = generated(target, inputs, max_new_tokens=MAX_NEW, eos_token_id=None)
    stop_ids = [tokens[i, 3 + 4 * i].item() for i in range(3)]  # rows stop at (or before) steps 4, 8, 12
    out = assert_same(
        target,
        inputs,
        make_spec(kind, target, noisy),
        max_new_tokens=MAX_NEW,
        eos_token_id=EOS_ID if with_eos else None,
        stopping_criteria=StoppingCriteriaList([StopOnTokens(stop_ids)]),
    )
    assert out.shape[1] - inputs["input_ids"].shape[1] <= 12 < MAX_NEW
    if with_eos:
        assert (out[:, inputs["input_ids"].shape[1] :] == PAD_ID).any()  # early rows were padded


@pytest.mark.parametrize("kind", FAST_DRAFTS)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_stop_strings(target, noisy, kind, batch_size):
    tokenizer = make_tokenizer()
    inputs = make_prompts(batch_size, seed=3)
    tokens = generated(target, inputs, max_new_tokens=MAX_NEW, eos_token_id=None)
    stop = tokenizer.decode(tokens[0, 4:6]).strip()  # text that row 0 produces mid-way (may span tokens)
    expected = target.generate(
        **inputs, do_sample=False, max_new_tokens=MAX_NEW, stop_strings=stop, tokenizer=tokenizer
    )
    row0 = expected[0, inputs["input_ids"].shape[1] :]
    assert row0.numel() < MAX_NEW or (row0 == PAD_ID).any(), f"stop string {stop!r} never fired"
    spec = make_spec(kind, target, noisy)
    out = spec_generate(
        target, inputs, spec, do_sample=False, max_new_tokens=MAX_NEW, spec_stop_strings=stop, spec_tokenizer=tokenizer
    )
    assert torch.equal(out, expected)
    hf_specdec.install()
    try:
        routed = target.generate(
            **inputs, spec_decoder=spec, do_sample=False, max_new_tokens=MAX_NEW, stop_strings=stop, tokenizer=tokenizer
        )
    finally:
        hf_specdec.uninstall()
    assert torch.equal(routed, expected)


@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_on_the_device_equal_the_criterion_on_each_prefix(seed):
    """Every (row, new token) is checked at once over a window of the criterion's `maximum_token_len` columns
    ending at the token (`stopping._stop_string_hits`): the same answer as transformers' criterion called on that
    row's whole prefix, also where the prefix is shorter than the window (columns before the buffer)."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    from hf_specdec.stopping import _stop_string_hits

    tokenizer = make_tokenizer()
    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=["aab", "e3e", "t"])
    pieces = tokenizer.convert_tokens_to_ids(["a", "##b", "e", "##3", "##e", "3", "t", "##t", "b", "##a", "x"])
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.tensor(pieces)[torch.randint(0, len(pieces), (6, 12), generator=g)]  # [B, C]
    index = torch.randint(0, 12, (6, 5), generator=g)  # [B, w] columns of new tokens, short prefixes included
    token_ids[0, :2] = torch.tensor(tokenizer.convert_tokens_to_ids(["##a", "##b"]))  # "ab": not "aab", though
    index[0, 0] = 1  # a window that repeated column 0 ("##a ##a ##b") would read it so
    got = _stop_string_hits(criterion, token_ids, index)
    expected = torch.tensor([[bool(criterion(token_ids[i : i + 1, : int(c) + 1], None)[0]) for c in row]
                             for i, row in enumerate(index)])  # fmt: skip
    assert expected.any() and not expected.all()  # both answers occur: the check can fail
    assert torch.equal(got, expected)
