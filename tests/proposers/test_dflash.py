"""DFlashProposer: greedy identity, drafts equal to transformers' own drafter forward, exact sampling, refusals.

The target is a tiny random Llama (3 layers); the drafter a tiny random `MuseGlimmerAssistantModel` reading the
target's first and last layers' states. Every draft is checked against the drafter's own forward over the row's
whole context at once (the target's states of its committed tokens but the newest, unpadded, no cache), which is
what the batched, ragged, cached path must reproduce.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import filled_cache_call, make_dflash_drafter, make_model, make_prompts, record_proposals, spec_generate
from first_tokens_law import check_first_tokens, exact_joint_law

import hf_specdec
from hf_specdec.proposers.dflash import DFlashProposer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not hasattr(transformers, "MuseGlimmerAssistantModel"), reason="this transformers has no DFlash drafter"
    ),
]
VOCAB = 16


@pytest.fixture(scope="module")
def dflash():
    target = make_model("llama", seed=0, layers=3, vocab=VOCAB)
    return target, make_dflash_drafter(target)


def reference_drafts(target, drafter, tokens: torch.Tensor, k: int) -> list[int]:
    """k greedy drafts of the drafter's own forward over one unpadded row `tokens` [L], no cache."""
    config = drafter.config
    with torch.no_grad():
        out = target(tokens[None, :-1], output_hidden_states=True)
        context = torch.cat([out.hidden_states[i + 1] for i in config.target_layer_ids], dim=-1)  # [1, L-1, nH]
        block = torch.tensor([[int(tokens[-1])] + [config.mask_token_id] * (config.block_size - 1)])
        positions = torch.arange(tokens.shape[0] - 1 + config.block_size)[None]
        embeds = target.get_input_embeddings()(block)
        hidden = drafter(noise_embeds=embeds, context_hidden_states=context, position_ids=positions).last_hidden_state
        return target.get_output_embeddings()(hidden[:, 1 : k + 1]).argmax(-1)[0].tolist()


def record_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    return record_proposals(monkeypatch, DFlashProposer)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_matches_generate_and_the_drafter_forward(dflash, batch_size, k, monkeypatch) -> None:
    target, drafter = dflash
    inputs = make_prompts(batch_size, vocab=VOCAB, seed=batch_size, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    steps = record_drafts(monkeypatch)
    spec = hf_specdec.SpecDecoder(method="dflash", draft_model=drafter, num_speculative_tokens=k)
    out = spec_generate(target, inputs, spec, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, expected)
    assert spec.last_stats.num_draft_tokens > 0
    checked = 0
    for token_ids, lengths, pad_lengths, drafts in steps[:: max(1, len(steps) // 4)]:
        for i in range(token_ids.shape[0]):
            num = int((drafts[i] >= 0).sum())
            if num:
                row = token_ids[i, pad_lengths[i] : lengths[i]]
                assert drafts[i, :num].tolist() == reference_drafts(target, drafter, row, num)
                checked += 1
    assert checked > 0


def test_batch_one_equals_transformers_route_and_its_drafts(dflash, monkeypatch) -> None:
    from transformers.generation import candidate_generator

    target, drafter = dflash
    inputs = {"input_ids": make_prompts(1, vocab=VOCAB, seed=7, repetitive=False)["input_ids"]}
    plain = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    stock_drafts = []
    get_candidates = candidate_generator.DFlashTokenCandidateGenerator.get_candidates

    def recording(generator, input_ids, **kwargs):  # noqa: ANN001, ANN003, ANN202
        ids, logits = get_candidates(generator, input_ids, **kwargs)
        stock_drafts.append(ids[0, input_ids.shape[1] :].tolist())
        return ids, logits

    monkeypatch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates", recording)
    stock = target.generate(
        **inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter, speculation_type="dflash"
    )
    steps = record_drafts(monkeypatch)
    hf_specdec.install()
    try:  # the same call, routed: transformers' arguments, hf_specdec's loop (k = block_size - 1)
        routed = target.generate(
            **inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter, speculation_type="dflash"
        )
    finally:
        hf_specdec.uninstall()
    assert torch.equal(stock, plain)
    assert torch.equal(routed, plain)
    ours = [drafts[0][drafts[0] >= 0].tolist() for *_, drafts in steps]
    assert ours and max(len(d) for d in ours) == drafter.config.block_size - 1
    # Step by step the same drafts (the last steps near max_new_tokens: ours drafts only what still fits).
    assert len(stock_drafts) - 1 <= len(ours) <= len(stock_drafts)
    assert all(mine == theirs[: len(mine)] for mine, theirs in zip(ours, stock_drafts))


def test_more_drafts_than_the_block_holds_are_clamped(dflash) -> None:
    target, drafter = dflash
    inputs = make_prompts(3, vocab=VOCAB, seed=4)
    expected = target.generate(**inputs, max_new_tokens=10, do_sample=False)
    spec = hf_specdec.SpecDecoder(method="dflash", draft_model=drafter, num_speculative_tokens=8)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=10, do_sample=False), expected)
    assert not any(spec.last_stats.drafted_per_position[drafter.config.block_size - 1 :])  # 4 per step at most


def test_sampling_follows_the_target_law() -> None:
    target = make_model("llama", seed=0, vocab=12)
    drafter = make_dflash_drafter(target, seed=2, block_size=3)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11, 5, 6]])
    samples = 6000
    inputs = {"input_ids": prompt.expand(samples, -1), "attention_mask": torch.ones(samples, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(method="dflash", draft_model=drafter, num_speculative_tokens=2, seed=1234)
    out = spec_generate(target, inputs, spec, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0)
    assert 0.05 < spec.last_stats.acceptance_rate < 0.95, spec.last_stats
    check_first_tokens(out, prompt, exact_joint_law(target, prompt, 3, 1.0), 3)


def test_refusals_teach(dflash, llama) -> None:
    target, drafter = dflash
    inputs = make_prompts(2, vocab=VOCAB, seed=1)
    spec = hf_specdec.SpecDecoder(method="dflash", draft_model=drafter, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="hidden_size"):  # a drafter trained for another target
        spec_generate(make_model("llama", hidden=32, vocab=VOCAB), inputs, spec, max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_confidence_threshold"):
        hf_specdec.SpecDecoder(method="dflash", draft_model=drafter, draft_confidence_threshold=0.4)
    with pytest.raises(ValueError, match="needs a draft model"):
        hf_specdec.SpecDecoder(method="dflash")
    with pytest.raises(TypeError, match="needs a DFlash drafter"):
        spec_generate(target, inputs, hf_specdec.SpecDecoder(method="dflash", draft_model=llama), max_new_tokens=4)
    hf_specdec.install()
    try:
        with pytest.raises(ValueError, match="assistant_confidence_threshold"):
            target.generate(
                **inputs, max_new_tokens=4, assistant_model=drafter, speculation_type="dflash",
                assistant_confidence_threshold=0.4,
            )  # fmt: skip
    finally:
        hf_specdec.uninstall()
    longer, cache = filled_cache_call(target, inputs)
    with pytest.raises(NotImplementedError, match="filled past_key_values"):
        spec_generate(target, longer, spec, max_new_tokens=4, past_key_values=cache)


@pytest.mark.library_default
def test_adaptive_schedule_keeps_greedy_identity(dflash) -> None:
    target, drafter = dflash
    inputs = make_prompts(4, vocab=VOCAB, seed=9, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    spec = hf_specdec.SpecDecoder(method="dflash", draft_model=drafter)  # the default: the adaptive schedule
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=12, do_sample=False), expected)


def test_compacted_drafter_cache_keeps_the_drafts(dflash, monkeypatch) -> None:
    """Ragged rows leave holes in the drafter's context; compacting them (forced early here) changes nothing."""
    from hf_specdec import cache as cache_module

    monkeypatch.setattr(cache_module, "COMPACT_MIN_COLUMNS", 4)
    monkeypatch.setattr(cache_module, "COMPACT_HOLE_SHARE", 0.05)
    compactions = []
    compact = cache_module.CacheView.compact

    def counting(view, keep):  # noqa: ANN001, ANN202
        compactions.append(type(view).__name__)
        compact(view, keep)

    monkeypatch.setattr(cache_module.CacheView, "compact", counting)
    target, drafter = dflash
    inputs = make_prompts(4, vocab=VOCAB, seed=11, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    steps = record_drafts(monkeypatch)
    spec = hf_specdec.SpecDecoder(method="dflash", draft_model=drafter, num_speculative_tokens=4)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=24, do_sample=False), expected)
    assert "DFlashContextView" in compactions
    for token_ids, lengths, pad_lengths, drafts in steps:
        for i in range(token_ids.shape[0]):
            num = int((drafts[i] >= 0).sum())
            if num:
                row = token_ids[i, pad_lengths[i] : lengths[i]]
                assert drafts[i, :num].tolist() == reference_drafts(target, drafter, row, num)
