"""Plain steps on the dynamic path (`SpeculativeLoop.plain_step`): a step in which no row drafts, as the host knows
before it, runs plain decoding's few operations instead of the whole step. Mixed with drafting steps in any order,
with padding, every kind of stop, processors and sampling, it must give what the whole step gives: plain
`generate`'s tokens when greedy, and the very same draws when sampling (the same seeds, the same acceptance call).

A schedule with a fixed pattern decides which rows draft at each step; each test checks that plain steps ran."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, make_prompts, make_tokenizer, spec_generate
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from hf_specdec import plan
from hf_specdec.decoding import SpeculativeLoop
from hf_specdec.schedules import SpeculationSchedule

#: which rows draft at each step (step numbers from 1, row indices of the live batch)
PATTERNS = {
    "never": lambda step, row: False,
    "every third": lambda step, row: step % 3 == 0,
    "staggered rows": lambda step, row: (step + row) % 3 == 0,  # one row of three drafts at each step
    "after five": lambda step, row: step > 5,
}


class Pattern(SpeculationSchedule):
    """Each row's budget from a fixed pattern, decided on the host (so the loop knows a plain step before it)."""

    pattern = staticmethod(PATTERNS["never"])

    def start(self, batch_size: int, device: torch.device) -> None:
        self.step = 0

    def host_budgets(self, batch) -> torch.Tensor:  # noqa: ANN001
        self.step += 1
        drafts = [self.max_k if self.pattern(self.step, row) else 0 for row in range(batch.batch_size)]
        return torch.tensor(drafts, dtype=torch.long)


@pytest.fixture
def patterned(monkeypatch):
    """Sets the pattern; counts the plain steps that ran (the real method, called through)."""
    monkeypatch.setattr(plan, "build_schedule", lambda spec, *args, **kwargs: Pattern(spec.num_speculative_tokens))
    counts = {"plain": 0}
    real = SpeculativeLoop.plain_step

    def counted(loop, proposal):  # noqa: ANN001, ANN202
        ran = real(loop, proposal)
        counts["plain"] += ran
        return ran

    monkeypatch.setattr(SpeculativeLoop, "plain_step", counted)

    def use(name: str) -> dict:
        monkeypatch.setattr(Pattern, "pattern", staticmethod(PATTERNS[name]))
        counts["plain"] = 0
        return counts

    return use


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


def make_spec(kind: str, target) -> hf_specdec.SpecDecoder:  # noqa: ANN001
    if kind == "draft":
        return hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.05), num_speculative_tokens=3)
    if kind == "early exit":
        return hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=1, num_speculative_tokens=3)
    return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)


def stop_token(target, inputs: dict, gen: dict) -> int:  # noqa: ANN001
    """A token that ends a row of the plain run early (so EOS really cuts)."""
    new = target.generate(**inputs, **gen)[:, inputs["input_ids"].shape[1] :]
    for token in new[:, 3:-3].reshape(-1).tolist():
        return int(token)
    raise AssertionError("no token to stop at")


def fired_stop_string(target, inputs: dict, tokenizer, tokens: torch.Tensor) -> str:  # noqa: ANN001
    """Text that row 1 of the plain run writes early and that, as a stop string, cuts it there."""
    width = inputs["input_ids"].shape[1]
    for start in range(3, 12):
        stop = tokenizer.decode(tokens[1, start : start + 2]).strip()
        out = target.generate(**inputs, do_sample=False, max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer,
                              eos_token_id=EOS_ID, pad_token_id=PAD_ID)  # fmt: skip
        if stop and bool((out[1, width + start + 2 :] == PAD_ID).all()):
            return stop
    raise AssertionError("no stop string cuts row 1")


@pytest.mark.parametrize("kind", ["draft", "ngram", "early exit"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("batch", [1, 3])
def test_plain_steps_between_drafting_steps_equal_plain(target, patterned, kind, pattern, batch):
    counts = patterned(pattern)
    inputs = make_prompts(batch, seed=batch, min_len=4, max_len=12)
    spec = make_spec(kind, target)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert torch.equal(spec_generate(target, inputs, spec, **gen), target.generate(**inputs, **gen))
    assert counts["plain"] > 0
    eos = stop_token(target, inputs, gen)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=PAD_ID)
    expected = target.generate(**inputs, **gen)
    assert expected.shape[1] < inputs["input_ids"].shape[1] + 24 or batch > 1
    assert torch.equal(spec_generate(target, inputs, spec, **gen), expected)


def test_plain_steps_stop_where_plain_stops(target, patterned):
    """EOS lists, max_length, stop strings and a user criterion, rows stopping at different steps (every step plain,
    so that every stop is found by a plain step)."""
    counts = patterned("never")
    inputs = make_prompts(3, seed=7, min_len=4, max_len=12)
    spec = make_spec("draft", target)
    plain_new = target.generate(**inputs, max_new_tokens=20, do_sample=False, eos_token_id=None)
    width = inputs["input_ids"].shape[1]
    tokens = plain_new[:, width:]
    eos_ids = [int(tokens[0, 5]), int(tokens[2, 9])]

    class LengthStop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001, ANN204
            return input_ids[:, -1] == int(tokens[1, 7])

    tokenizer = make_tokenizer()
    stop = fired_stop_string(target, inputs, tokenizer, tokens)
    cases = {
        "eos list": dict(max_new_tokens=20, eos_token_id=eos_ids, pad_token_id=PAD_ID),
        "max_length": dict(max_length=width + 13, eos_token_id=None),
        "criterion": dict(max_new_tokens=20, stopping_criteria=StoppingCriteriaList([LengthStop()]), eos_token_id=None),
        "criterion and eos": dict(
            max_new_tokens=20, stopping_criteria=StoppingCriteriaList([LengthStop()]), eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        ),
        "stop string": dict(
            max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer, eos_token_id=EOS_ID, pad_token_id=PAD_ID
        ),
    }
    for name, kwargs in cases.items():
        expected = target.generate(**inputs, do_sample=False, **kwargs)
        counts["plain"] = 0
        hf_specdec.install()
        try:
            out = target.generate(**inputs, do_sample=False, spec_decoder=spec, **kwargs)
        finally:
            hf_specdec.uninstall()
        assert torch.equal(out, expected), name
        assert counts["plain"] > 0, name


@pytest.mark.parametrize(
    "processing",
    [
        dict(),
        dict(temperature=0.7, top_k=20, top_p=0.9),
        dict(repetition_penalty=1.3, top_k=30),
    ],
    ids=["plain", "top-k top-p", "repetition penalty"],
)
def test_sampled_plain_steps_draw_what_the_whole_step_draws(target, patterned, monkeypatch, processing):
    """With the same seeds, a plain step takes the same draws as the whole step it replaces: identical tokens."""
    counts = patterned("staggered rows")
    inputs = make_prompts(3, seed=11, min_len=4, max_len=12)
    gen = dict(max_new_tokens=24, do_sample=True, eos_token_id=None, **processing)
    torch.manual_seed(5)
    fast = spec_generate(target, inputs, make_spec("draft", target), **gen)
    assert counts["plain"] > 0
    monkeypatch.setattr(SpeculativeLoop, "plain_step", lambda loop, proposal: False)
    torch.manual_seed(5)
    whole = spec_generate(target, inputs, make_spec("draft", target), **gen)
    assert torch.equal(fast, whole)


@pytest.mark.parametrize("pattern", ["never", "every third"])
def test_plain_steps_on_every_architecture(arch_models, patterned, pattern):
    """Each architecture's masks (sliding windows: Mistral, Gemma; learned positions: GPT-2) on padded rows."""
    arch, target, draft = arch_models
    counts = patterned(pattern)
    inputs = make_prompts(3, seed=2, min_len=3, max_len=14)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    gen = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(spec_generate(target, inputs, spec, **gen), target.generate(**inputs, **gen)), arch
    assert counts["plain"] > 0


@pytest.mark.parametrize("arch", ["whisper", "bart"])
def test_plain_steps_on_encoder_decoder_targets(patterned, arch):
    """The decoder's positions go through the encoder-decoder view's own forward (Whisper's position ids, BART's hook
    on its position table), rows padded by their forced tokens."""
    from conftest import make_seq2seq, make_whisper

    counts = patterned("every third")
    if arch == "whisper":
        target, draft = make_whisper(seed=0), make_whisper(seed=1, decoder_layers=1, causal=True)
        inputs = {"input_features": torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(3))}
    else:
        target, draft = make_seq2seq("bart", seed=0), make_seq2seq("bart", seed=1, decoder_layers=1)
        inputs = make_prompts(3, seed=4, min_len=4, max_len=10)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    gen = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(spec_generate(target, inputs, spec, **gen), target.generate(**inputs, **gen))
    assert counts["plain"] > 0


@pytest.mark.parametrize("pattern", ["never", "every third"])
def test_plain_steps_leave_the_cache_plain_leaves(patterned, pattern):
    """A chat that continues its `past_key_values` over three turns (`test_continuation.py`): the cache handed back
    after plain steps holds what plain `generate`'s holds."""
    from test_continuation import assert_same_cache, chat, early_eos, plain, speculative, turns
    from transformers import DynamicCache

    counts = patterned(pattern)
    target = make_model("mistral", seed=0)
    first = make_prompts(3, seed=3, max_len=9)
    later = turns(3, seed=3)
    eos = early_eos(target, first)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.05), num_speculative_tokens=3)
    config = target.config.get_text_config(decoder=True)
    expected = chat(target, first, later, DynamicCache(config=config), plain, eos)
    got = chat(target, first, later, DynamicCache(config=config), speculative(spec), eos)
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours.sequences, theirs.sequences)
        width = ours.sequences.shape[1] - 1
        mask = (torch.arange(width) >= (first["attention_mask"] == 0).sum(1)[:, None]).long()
        assert_same_cache(ours.past_key_values, theirs.past_key_values, mask)
    assert counts["plain"] > 0


@pytest.mark.parametrize("catch_up_on_gpu", [False, True])
def test_a_draft_that_is_the_target_drafts_what_the_target_writes_after_plain_steps(
    patterned, monkeypatch, catch_up_on_gpu
):
    """The target as its own draft accepts every draft, also in the forwards that first feed a backlog (the tokens of
    a row's plain steps, a different number per row here): each row drafts from its own last slot's logits
    (`DraftModelProposer._last_logits`, which runs the head on those slots only; on a GPU the backlog is fed first in
    `catch_up_widths`). Exactness cannot see wrong drafts; acceptance does."""
    from hf_specdec.proposers import draft_model

    monkeypatch.setattr(draft_model, "builds_plans_per_shape", lambda device: catch_up_on_gpu)
    patterned("staggered rows")
    target = make_model("llama", seed=0)
    inputs = make_prompts(3, seed=5, min_len=3, max_len=14)
    spec = hf_specdec.SpecDecoder(draft_model=target, num_speculative_tokens=3)
    gen = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(spec_generate(target, inputs, spec, **gen), target.generate(**inputs, **gen))
    assert spec.last_stats.num_draft_tokens > 0
    assert spec.last_stats.acceptance_rate == 1.0
