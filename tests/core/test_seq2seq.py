"""Encoder-decoder targets: Whisper batched with a shared-encoder draft, BART / T5 at batch 1, all exact.

Whisper (`WhisperForConditionalGeneration`, whose decoder takes position ids) speculates at batch 1, 3 and 8 with
a `WhisperForCausalLM` draft (distil-whisper's pattern), a smaller Whisper, prompt lookup, and itself (which
must accept every draft: proof that the draft reads the right encoder rows); forced language / task tokens
and timestamps keep working; at batch 1 an installed call equals HF's own assisted Whisper. BART and Marian, whose
decoders take no position ids, get each row's positions through a hook on their position table and are exact
at batch 1, 3 and 8; T5 (relative position bias) is exact at batch 1 and refused with a clear error above it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_seq2seq, make_whisper, spec_generate
from transformers import EncoderDecoderCache, GenerationMixin

import hf_specdec

MAX_NEW = 12
ORIGINAL_GENERATE = GenerationMixin.generate


@pytest.fixture(scope="module")
def whisper():
    return make_whisper(seed=0)


@pytest.fixture(scope="module")
def drafts(whisper):
    return {
        "causal": make_whisper(seed=1, decoder_layers=1, causal=True),
        "seq2seq": make_whisper(seed=2, decoder_layers=1),
        "self": whisper,
    }


def features(batch_size: int, seed: int = 0) -> torch.Tensor:  # [B, mel bins, frames]
    return torch.randn(batch_size, 8, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_whisper_greedy_matches_plain_generate(whisper, drafts, batch_size):
    audio = features(batch_size, seed=batch_size)
    expected = whisper.generate(audio, max_new_tokens=MAX_NEW, do_sample=False)
    specs = {name: hf_specdec.SpecDecoder(draft_model=d, num_speculative_tokens=3) for name, d in drafts.items()}
    specs["ngram"] = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    for name, spec in specs.items():
        out = spec_generate(whisper, {"input_features": audio}, spec, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(out, expected), f"{name} B={batch_size}"
    assert specs["self"].last_stats.acceptance_rate == 1.0  # the draft cross-attends to its own row's encoding


@pytest.mark.parametrize(
    "options",
    [dict(language="fr", task="transcribe"), dict(return_timestamps=True), dict(language="en", return_timestamps=True)],
)
def test_whisper_language_task_and_timestamps_keep_working(whisper, drafts, options):
    audio = features(3, seed=7)
    expected = whisper.generate(audio, max_new_tokens=MAX_NEW, do_sample=False, **options)
    for draft in (drafts["causal"], drafts["self"]):
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
        out = spec_generate(
            whisper, {"input_features": audio}, spec, max_new_tokens=MAX_NEW, do_sample=False, **options
        )
        assert torch.equal(out, expected), options


def test_installed_whisper_call_equals_hf_stock_assisted_at_batch_1(whisper, drafts):
    audio = features(1, seed=3)
    settings = dict(max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafts["causal"], num_assistant_tokens=3)
    stock = whisper.generate(audio, **settings)
    plain = whisper.generate(audio, max_new_tokens=MAX_NEW, do_sample=False)
    batched = features(3, seed=3)
    hf_specdec.install()
    try:
        routed = whisper.generate(audio, **settings)
        routed_batch = whisper.generate(batched, **settings)  # stock refuses batch > 1
    finally:
        hf_specdec.uninstall()
    assert torch.equal(stock, plain)
    assert torch.equal(routed, plain)
    assert torch.equal(routed_batch, whisper.generate(batched, max_new_tokens=MAX_NEW, do_sample=False))


def text_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    """Left-padded encoder inputs of different lengths."""
    g = torch.Generator().manual_seed(batch_size)
    input_ids = torch.randint(3, 96, (batch_size, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    for i in range(1, batch_size, 2):
        attention_mask[i, : 1 + i % 4] = 0
        input_ids[i, : 1 + i % 4] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("arch", ["bart", "marian"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_text_seq2seq_greedy_matches_plain_generate(arch, batch_size):
    """BART / Marian decoders take no position ids: each row's come from a hook on their position table."""
    target, small = make_seq2seq(arch, seed=0), make_seq2seq(arch, seed=3, decoder_layers=1)
    inputs = text_inputs(batch_size)
    expected = ORIGINAL_GENERATE(target, **inputs, max_new_tokens=MAX_NEW, do_sample=False)
    specs = {
        "small": hf_specdec.SpecDecoder(draft_model=small, num_speculative_tokens=3),
        "self": hf_specdec.SpecDecoder(draft_model=target, num_speculative_tokens=3),
        "ngram": hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2),
    }
    for name, spec in specs.items():
        out = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(out, expected), f"{arch} {name} B={batch_size}"
    assert specs["self"].last_stats.acceptance_rate == 1.0  # the draft's per-row positions are right too
    if batch_size == 1:
        stock = ORIGINAL_GENERATE(target, **inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=small)
        assert torch.equal(stock, expected)


def test_t5_is_exact_at_batch_1_and_refused_above():
    """T5's relative position bias is computed from cache columns, so holes cannot be skipped: batch 1 only."""
    target, small = make_seq2seq("t5", seed=0), make_seq2seq("t5", seed=3, decoder_layers=1)
    inputs = text_inputs(3)
    one = {"input_ids": inputs["input_ids"][:1]}
    expected = ORIGINAL_GENERATE(target, **one, max_new_tokens=MAX_NEW, do_sample=False)
    for spec in (
        hf_specdec.SpecDecoder(draft_model=small, num_speculative_tokens=3),
        hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3),
    ):
        out = spec_generate(target, one, spec, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(out, expected)
    with pytest.raises(NotImplementedError, match="speculates at batch 1 only"):
        spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW)


def test_unsupported_encoder_decoder_settings_are_refused(whisper):
    audio = {"input_features": features(2)}
    with pytest.raises(NotImplementedError, match="method='early_exit' is not supported for encoder-decoder"):
        spec_generate(whisper, audio, hf_specdec.SpecDecoder(early_exit_layers=1), max_new_tokens=4)
    wide = make_whisper(seed=4, decoder_layers=1, causal=True, d_model=64)
    with pytest.raises(ValueError, match="must read the target's encoder output"):
        spec_generate(whisper, audio, hf_specdec.SpecDecoder(draft_model=wide), max_new_tokens=4)
    out = whisper.generate(**audio, max_new_tokens=4, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, EncoderDecoderCache)
    with pytest.raises(NotImplementedError, match="decoder-only targets only"):
        spec_generate(
            whisper,
            {**audio, "decoder_input_ids": torch.ones(2, 3, dtype=torch.long)},
            hf_specdec.SpecDecoder(method="ngram"),
            past_key_values=out.past_key_values,
            max_new_tokens=4,
        )


def test_sampling_keeps_the_target_law_for_an_encoder_decoder():
    """Marian with a 12-token vocabulary: the first three sampled tokens follow the target's exact joint law."""
    import importlib.util
    import itertools
    from pathlib import Path

    from conftest import make_noisy_copy

    law_module = importlib.util.spec_from_file_location(
        "sampling_law", Path(__file__).with_name("test_sampling_distribution.py")
    )
    law = importlib.util.module_from_spec(law_module)
    law_module.loader.exec_module(law)
    vocab, samples, sampling = 12, 20_000, dict(temperature=1.1, top_k=None)
    target = make_seq2seq("marian", seed=0, vocab=vocab)
    draft = make_noisy_copy(target, noise=0.5, seed=3)
    source = torch.tensor([[5, 6, 11, 5, 6, 11, 7]])
    start = target.generation_config.decoder_start_token_id

    exact = torch.ones(1, dtype=torch.double)
    for i in range(3):  # p(t1) p(t2 | t1) p(t3 | t1, t2), rows that drew EOS stay finished (pad)
        prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=i)), dtype=torch.long).reshape(vocab**i, i)
        decoder = torch.cat([torch.full((len(prefixes), 1), start), prefixes], 1)
        out = ORIGINAL_GENERATE(
            target,
            source.expand(len(prefixes), -1),
            decoder_input_ids=decoder,
            max_new_tokens=1,
            do_sample=True,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        step = out.scores[0].double().softmax(-1)
        finished = (prefixes == 2).any(1)
        step[finished] = 0.0
        step[finished, 0] = 1.0
        exact = (exact[:, None] * step).reshape(-1)

    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=2, seed=99)
    out = spec_generate(
        target, {"input_ids": source.expand(samples, -1)}, spec, max_new_tokens=3, do_sample=True, **sampling
    )
    tokens = out[:, 1:4]
    counts = torch.bincount((tokens * vocab ** torch.arange(2, -1, -1)).sum(1), minlength=vocab**3).double()
    p_value, tv, impossible = law.goodness_of_fit(counts, exact)
    assert 0.1 < spec.last_stats.acceptance_rate < 0.95, spec.last_stats
    assert impossible == 0 and p_value > 1e-3 and tv < 0.05, (p_value, tv)
