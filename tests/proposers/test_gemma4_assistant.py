"""Gemma4AssistantProposer: greedy identity, drafts equal to transformers' own assistant forward, exact sampling.

The target is a tiny random Gemma 4 (sliding and full layers, the last two sharing keys through
`num_kv_shared_layers`, per-layer inputs); its assistant is a tiny `Gemma4AssistantForCausalLM` that leans towards
drafting the token it is fed (so drafts are often right and acceptance is ragged). Every draft is checked against
transformers' own `Gemma4AssistantForCausalLM.forward` on the row's committed prefix, run alone and unpadded.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import (
    filled_cache_call,
    make_gemma4,
    make_gemma4_assistant,
    make_prompts,
    record_proposals,
    spec_generate,
)
from first_tokens_law import check_first_tokens, exact_joint_law

import hf_specdec
from hf_specdec.proposers.gemma4_assistant import Gemma4AssistantProposer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not hasattr(transformers, "Gemma4AssistantForCausalLM"), reason="this transformers has no Gemma 4 assistants"
    ),
]


@pytest.fixture(scope="module")
def gemma4():
    target = make_gemma4()
    return target, make_gemma4_assistant(target, echo=0.7)


def reference_drafts(target, assistant, tokens: torch.Tensor, k: int) -> list[int]:
    """k greedy drafts of transformers' own assistant forward for one unpadded row `tokens` [L]."""
    with torch.no_grad():
        out = target(tokens[None, :-1], output_hidden_states=True, return_shared_kv_states=True)
        hidden = out.hidden_states[-1][:, -1:]  # [1, 1, H]
        token = tokens[None, -1:]  # [1, 1]
        position = torch.tensor([[tokens.shape[0] - 1]])
        drafts = []
        for _ in range(k):
            inputs = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
            step = assistant(inputs_embeds=inputs, position_ids=position, shared_kv_states=dict(out.shared_kv_states))
            token, hidden = step.logits.argmax(-1), step.last_hidden_state
            drafts.append(int(token))
    return drafts


def record_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    return record_proposals(monkeypatch, Gemma4AssistantProposer)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_matches_generate_and_transformers_assistant(gemma4, batch_size, k, monkeypatch) -> None:
    target, assistant = gemma4
    inputs = make_prompts(batch_size, seed=batch_size, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    steps = record_drafts(monkeypatch)
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=k)
    assert spec.method == "gemma4_assistant"
    out = spec_generate(target, inputs, spec, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, expected)
    stats = spec.last_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # some drafts accepted, some rejected
    checked = 0
    for token_ids, lengths, pad_lengths, drafts in steps[:: max(1, len(steps) // 4)]:
        for i in range(token_ids.shape[0]):
            num = int((drafts[i] >= 0).sum())
            if num:
                row = token_ids[i, pad_lengths[i] : lengths[i]]
                assert drafts[i, :num].tolist() == reference_drafts(target, assistant, row, num)
                checked += 1
    assert checked > 0


def test_full_layers_with_their_own_head_dim(monkeypatch) -> None:
    """Real Gemma 4 full-attention layers have wider heads than sliding ones: each type's keys go to its layers."""
    target = make_gemma4(seed=5, global_head_dim=32)
    assistant = make_gemma4_assistant(target, echo=0.7, global_head_dim=32)
    inputs = make_prompts(3, seed=5, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    steps = record_drafts(monkeypatch)
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=3)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=12, do_sample=False), expected)
    for token_ids, lengths, pad_lengths, drafts in steps[1::2]:
        for i in range(token_ids.shape[0]):
            num = int((drafts[i] >= 0).sum())
            if num:
                row = token_ids[i, pad_lengths[i] : lengths[i]]
                assert drafts[i, :num].tolist() == reference_drafts(target, assistant, row, num)
    with pytest.raises(ValueError, match="full_attention layers expect keys of 2 heads x 16"):
        spec_generate(
            target, inputs, hf_specdec.SpecDecoder(draft_model=make_gemma4_assistant(target)), max_new_tokens=2
        )


def test_batch_one_equals_transformers_route_and_plain(gemma4, monkeypatch) -> None:
    from transformers.generation import candidate_generator

    target, assistant = gemma4
    inputs = {"input_ids": make_prompts(1, seed=7, repetitive=False)["input_ids"]}
    plain = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    stock_drafts = []
    generator = candidate_generator.SinglePositionMultiTokenCandidateGenerator
    get_candidates = generator.get_candidates

    def recording(self, input_ids, **kwargs):  # noqa: ANN001, ANN003, ANN202
        ids, logits = get_candidates(self, input_ids, **kwargs)
        stock_drafts.append(ids[0, input_ids.shape[1] :].tolist())
        return ids, logits

    monkeypatch.setattr(generator, "get_candidates", recording)
    assistant.generation_config.num_assistant_tokens = 4
    stock = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=assistant)
    steps = record_drafts(monkeypatch)
    hf_specdec.install()
    try:  # the same call, routed: transformers' arguments, hf_specdec's loop
        routed = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=assistant)
        spec_via_install = target.generate(
            **inputs, max_new_tokens=16, do_sample=False, spec_decoder=hf_specdec.SpecDecoder(draft_model=assistant)
        )
    finally:
        hf_specdec.uninstall()
    assert torch.equal(stock, plain)
    assert torch.equal(routed, plain)
    assert torch.equal(spec_via_install, plain)
    # The first drafts of a call read the prefill's states: there both routes see the same keys (docs/design.md).
    first = next(drafts[0] for *_, drafts in steps if drafts.shape[1])
    assert first.tolist() == stock_drafts[1][: first.shape[0]]  # transformers' first call drafts nothing


def test_routed_call_runs_the_gemma4_proposer(gemma4, monkeypatch) -> None:
    target, assistant = gemma4
    steps = record_drafts(monkeypatch)
    inputs = make_prompts(3, seed=2, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=10, do_sample=False)
    hf_specdec.install()
    try:
        out = target.generate(
            **inputs, max_new_tokens=10, do_sample=False, assistant_model=assistant, num_assistant_tokens=3
        )
    finally:
        hf_specdec.uninstall()
    assert torch.equal(out, expected)
    assert steps and all(drafts.shape[1] <= 3 for *_, drafts in steps)


# --- sampling: the first tokens follow the target's exact law ------------------------------------------------

LAW_VOCAB = 12
NUM_TOKENS = 3
NUM_SAMPLES = 6000


def test_sampling_follows_the_target_law() -> None:
    target = make_gemma4(seed=3, vocab=LAW_VOCAB, initializer_range=0.3)
    assistant = make_gemma4_assistant(target, seed=4, echo=0.5)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11, 5, 6]])
    inputs = {"input_ids": prompt.expand(NUM_SAMPLES, -1), "attention_mask": torch.ones(NUM_SAMPLES, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=2, seed=1234)
    out = spec_generate(target, inputs, spec, max_new_tokens=NUM_TOKENS, do_sample=True, temperature=1.0, top_k=0)
    stats = spec.last_stats
    assert 0.05 < stats.acceptance_rate < 0.95, stats
    check_first_tokens(out, prompt, exact_joint_law(target, prompt, NUM_TOKENS, 1.0), NUM_TOKENS)


# --- refusals --------------------------------------------------------------------------------------------------


def test_refusals_teach(gemma4, llama) -> None:
    target, assistant = gemma4
    inputs = make_prompts(2, seed=1)
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=2)
    with pytest.raises(NotImplementedError, match="Gemma 4 target"):
        spec_generate(llama, inputs, spec, max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_confidence_threshold"):
        hf_specdec.SpecDecoder(draft_model=assistant, draft_confidence_threshold=0.4)
    wrong = hf_specdec.SpecDecoder(method="gemma4_assistant", draft_model=llama, num_speculative_tokens=2)
    with pytest.raises(TypeError, match="needs a Gemma4AssistantForCausalLM.*LlamaForCausalLM.*method='draft'"):
        spec_generate(target, inputs, wrong, max_new_tokens=4)
    hf_specdec.install()
    try:
        with pytest.raises(ValueError, match="assistant_confidence_threshold"):
            target.generate(**inputs, max_new_tokens=4, assistant_model=assistant, assistant_confidence_threshold=0.4)
    finally:
        hf_specdec.uninstall()
    longer, cache = filled_cache_call(target, make_prompts(2, seed=1))
    with pytest.raises(NotImplementedError, match="filled past_key_values"):
        spec_generate(target, longer, spec, max_new_tokens=4, past_key_values=cache)


def test_the_hooks_are_removed_even_when_the_call_fails(gemma4, monkeypatch) -> None:
    target, assistant = gemma4
    decoder = target.get_decoder()
    before = (len(decoder._forward_hooks), len(decoder._forward_pre_hooks))

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("assistant failed")

    monkeypatch.setattr(hf_specdec.compat, "gemma4_assistant_step", failing)
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=2)
    with pytest.raises(RuntimeError, match="assistant failed"):
        spec_generate(target, make_prompts(2, seed=1), spec, max_new_tokens=4)
    assert (len(decoder._forward_hooks), len(decoder._forward_pre_hooks)) == before


@pytest.mark.library_default
def test_adaptive_schedule_and_eager_attention_keep_greedy_identity(gemma4) -> None:
    target, assistant = gemma4
    inputs = make_prompts(4, seed=9, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    spec = hf_specdec.SpecDecoder(draft_model=assistant)  # the default: the adaptive schedule (calibrates)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=12, do_sample=False), expected)
    target.set_attn_implementation("eager")
    assistant.set_attn_implementation("eager")
    try:  # additive float masks instead of boolean ones
        eager = hf_specdec.SpecDecoder(
            draft_model=assistant, num_speculative_tokens=3, num_speculative_tokens_schedule="constant"
        )
        assert torch.equal(spec_generate(target, inputs, eager, max_new_tokens=12, do_sample=False), expected)
        assert assistant.config.get_text_config()._attn_implementation == "eager"
    finally:
        target.set_attn_implementation("sdpa")
        assistant.set_attn_implementation("sdpa")


def test_kv_shared_gemma4_targets_work_with_other_methods_and_cache_continuation(gemma4) -> None:
    """Gemma 4's KV-shared layers keep no cache (`DummyLayer`): prompt lookup is exact on dynamic and static caches,
    and a filled cache is continued and handed back like plain decoding's (its DummyLayers kept)."""
    import copy

    from transformers import DynamicCache

    target, _ = gemma4
    first = make_prompts(3, seed=4, max_len=8)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    expected = target.generate(**first, max_new_tokens=10, do_sample=False)
    assert torch.equal(spec_generate(target, first, spec, max_new_tokens=10, do_sample=False), expected)
    static = spec_generate(target, first, spec, max_new_tokens=10, do_sample=False, cache_implementation="static")
    assert torch.equal(static, expected)
    cache = DynamicCache(config=target.config)
    common = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    out = target.generate(**first, past_key_values=cache, **common)
    new = torch.randint(3, 96, (3, 3), generator=torch.Generator().manual_seed(1))
    mask = torch.cat([first["attention_mask"], torch.ones(3, 6 + 3, dtype=torch.long)], 1)
    inputs = {"input_ids": torch.cat([out.sequences, new], 1), "attention_mask": mask}
    theirs_cache = copy.deepcopy(cache)
    theirs = target.generate(**inputs, past_key_values=theirs_cache, **common)
    ours = spec_generate(target, inputs, spec, past_key_values=cache, **common)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert [type(layer) for layer in cache.layers] == [type(layer) for layer in theirs_cache.layers]
    width = ours.sequences.shape[1] - 1  # plain decoding's cache: every token but the last
    full_mask = torch.cat([mask, torch.ones(3, 6, dtype=torch.long)], 1)[:, :width]
    real = full_mask[:, None, :, None].bool()  # [B, 1, W, 1] padding columns hold anything
    for a, b in zip(cache.layers, theirs_cache.layers):
        if getattr(a, "keys", None) is not None and a.keys.numel():
            real_a = real[:, :, -a.keys.shape[2] :]
            assert torch.allclose(torch.where(real_a, a.keys, 0), torch.where(real_a, b.keys, 0), atol=1e-4)


def test_compacted_target_cache_keeps_the_drafts(gemma4, monkeypatch) -> None:
    """The assistant reads the target's keys with holes; after the target's cache is compacted (forced early
    here) its drafts are still transformers' own assistant forward on the committed prefix."""
    from hf_specdec import cache as cache_module

    monkeypatch.setattr(cache_module, "COMPACT_MIN_COLUMNS", 4)
    monkeypatch.setattr(cache_module, "COMPACT_HOLE_SHARE", 0.05)
    compactions = []
    compact = cache_module.CacheView.compact

    def counting(view, keep):  # noqa: ANN001, ANN202
        compactions.append(view.width)
        compact(view, keep)

    monkeypatch.setattr(cache_module.CacheView, "compact", counting)
    target, assistant = gemma4
    inputs = make_prompts(4, seed=11, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    steps = record_drafts(monkeypatch)
    spec = hf_specdec.SpecDecoder(draft_model=assistant, num_speculative_tokens=4)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=24, do_sample=False), expected)
    assert compactions
    for token_ids, lengths, pad_lengths, drafts in steps:
        for i in range(token_ids.shape[0]):
            num = int((drafts[i] >= 0).sum())
            if num:
                row = token_ids[i, pad_lengths[i] : lengths[i]]
                assert drafts[i, :num].tolist() == reference_drafts(target, assistant, row, num)
