"""Drafts with another tokenizer (HF's universal assisted generation), batched and exact.

Two real BPE tokenizers trained in-process with different vocabulary sizes (so different merges) stand for the
target's and the draft's; the target and draft models have those vocabularies. Greedy output equals plain
`generate` at batch 1, 3 and 8 (and HF's own universal assisted generation at batch 1), drafts really are
proposed through the text translation, sampling keeps a row's output a function of its seed, and missing
tokenizers are refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BPE_CORPUS, make_bpe_tokenizer, make_model, spec_generate
from transformers import GenerationMixin

import hf_specdec
from hf_specdec.proposers.cross_tokenizer import draft_text_to_target_ids

MAX_NEW = 16
ORIGINAL_GENERATE = GenerationMixin.generate


@pytest.fixture(scope="module")
def tokenizers():
    return make_bpe_tokenizer(80), make_bpe_tokenizer(160)  # target's, draft's


@pytest.fixture(scope="module")
def models(tokenizers):
    target_tok, draft_tok = tokenizers
    target = make_model("llama", seed=0, vocab=len(target_tok))
    draft = make_model("qwen3", seed=1, vocab=len(draft_tok), layers=1, hidden=32)
    return target, draft


def prompts(tokenizer, batch_size: int) -> dict[str, torch.Tensor]:
    texts = [BPE_CORPUS[i % len(BPE_CORPUS)][: 12 + 7 * i] for i in range(batch_size)]
    return dict(tokenizer(texts, return_tensors="pt", padding=True))


def test_the_tokenizers_really_differ(tokenizers):
    target_tok, draft_tok = tokenizers
    text = BPE_CORPUS[0]
    assert target_tok(text).input_ids != draft_tok(text).input_ids
    assert len(target_tok(text).input_ids) > len(draft_tok(text).input_ids)


def test_drafted_text_becomes_target_tokens(tokenizers):
    target_tok, draft_tok = tokenizers
    known = draft_tok(["the cat", "a quick"]).input_ids
    drafted = [draft_tok(" sat on the mat", add_special_tokens=False).input_ids, []]
    translated = draft_text_to_target_ids(target_tok, draft_tok, known, drafted)
    assert translated[0] == target_tok(" sat on the mat", add_special_tokens=False).input_ids
    assert target_tok.decode(translated[0]) == " sat on the mat"
    assert translated[1] == []


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_matches_plain_generate(tokenizers, models, batch_size):
    target_tok, draft_tok = tokenizers
    target, draft = models
    inputs = prompts(target_tok, batch_size)
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    for k in (1, 4):
        spec = hf_specdec.SpecDecoder(
            draft_model=draft, draft_tokenizer=draft_tok, tokenizer=target_tok, num_speculative_tokens=k
        )
        out = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(out, expected), f"B={batch_size} k={k}"
        assert spec.last_stats.num_draft_tokens > 0  # the translation produced drafts that were verified


def test_installed_call_equals_hf_stock_universal_assisted_generation(tokenizers, models):
    target_tok, draft_tok = tokenizers
    target, draft = models
    inputs = prompts(target_tok, 1)
    settings = dict(max_new_tokens=MAX_NEW, do_sample=False, assistant_model=draft, num_assistant_tokens=4)
    tokens = dict(tokenizer=target_tok, assistant_tokenizer=draft_tok)
    stock = ORIGINAL_GENERATE(target, **inputs, **settings, **tokens)
    plain = ORIGINAL_GENERATE(target, **inputs, max_new_tokens=MAX_NEW, do_sample=False)
    batched = prompts(target_tok, 3)
    hf_specdec.install()
    try:
        routed = target.generate(**inputs, **settings, **tokens)
        routed_batch = target.generate(**batched, **settings, **tokens)
        with pytest.raises(ValueError, match="assistant_tokenizer= was passed without tokenizer="):
            target.generate(**inputs, **settings, assistant_tokenizer=draft_tok)
    finally:
        hf_specdec.uninstall()
    assert torch.equal(stock, plain)
    assert torch.equal(routed, plain)
    assert torch.equal(routed_batch, ORIGINAL_GENERATE(target, **batched, max_new_tokens=MAX_NEW, do_sample=False))


def test_sampling_rows_depend_only_on_their_seed(tokenizers, models):
    target_tok, draft_tok = tokenizers
    target, draft = models
    inputs = prompts(target_tok, 3)
    outs = []
    for rows in ([0, 1, 2], [2, 1, 0]):
        spec = hf_specdec.SpecDecoder(
            draft_model=draft,
            draft_tokenizer=draft_tok,
            tokenizer=target_tok,
            num_speculative_tokens=3,
            seed=[10 + r for r in rows],
        )
        batch = {k: v[rows] for k, v in inputs.items()}
        outs.append(spec_generate(target, batch, spec, max_new_tokens=MAX_NEW, do_sample=True, eos_token_id=None))
    assert torch.equal(outs[0], outs[1][[2, 1, 0]])
    assert spec.last_stats.num_draft_tokens > 0  # sampled over the tokens both BPE vocabularies share


def test_missing_target_tokenizer_is_refused(tokenizers, models):
    _, draft_tok = tokenizers
    target, draft = models
    spec = hf_specdec.SpecDecoder(draft_model=draft, draft_tokenizer=draft_tok)
    with pytest.raises(ValueError, match="needs both tokenizers"):
        spec_generate(target, {"input_ids": torch.tensor([[5, 6, 7]])}, spec, max_new_tokens=4)
    with pytest.raises(ValueError, match="does not apply to a draft with another tokenizer"):
        hf_specdec.SpecDecoder(draft_model=draft, draft_tokenizer=draft_tok, draft_confidence_threshold=0.4)


def test_the_target_drafting_for_itself_through_text_is_often_accepted():
    """Same vocabulary, two tokenizer objects: every draft goes through decode / re-encode. Drafts match the
    target's own choices unless re-encoding merges its tokens differently (random models emit odd splits and
    special tokens), so acceptance is far above chance (1/80) but below 1."""
    target_tok, draft_tok = make_bpe_tokenizer(80), make_bpe_tokenizer(80)
    target = make_model("llama", seed=0, vocab=80)
    inputs = prompts(target_tok, 3)
    spec = hf_specdec.SpecDecoder(
        draft_model=target, draft_tokenizer=draft_tok, tokenizer=target_tok, num_speculative_tokens=4
    )
    out = spec_generate(target, inputs, spec, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert torch.equal(out, target.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None))
    assert spec.last_stats.acceptance_rate > 0.3, spec.last_stats
