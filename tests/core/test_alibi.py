"""ALiBi models: BLOOM and Falcon (`alibi=True`) greedy-identical to plain `generate`; MPT at batch 1 only.

BLOOM and Falcon build each key's ALiBi bias from `cumsum(attention_mask) - 1` of the 2-D mask, so `CacheView` hands
them the 2-D mask of its column map (zeros at holes): a row's real columns hold its buffer indices in order, and the
cumsum gives each key the position plain decoding gives it. Tiny random fp32 models, ragged left-padded prompts, and
drafts that disagree often (noisy copies: ragged acceptance leaves holes in the middle of rows, long runs compact);
a sampling-law check on BLOOM. MPT's bias comes from the cache column index: exact for one unpadded row on the dynamic
cache (no holes ever), refused before any model work everywhere else.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, PAD_ID, VOCAB, make_noisy_copy, make_prompts, spec_generate
from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM

import hf_specdec
from hf_specdec import cache as cache_module
from hf_specdec import cache_route
from hf_specdec.model_support import alibi_from_columns, alibi_from_mask

NEW_TOKENS = 48
#: Draft noise per architecture: acceptance ~15-40% at k = 4, so rows reject often and at different positions.
DRAFT_NOISE = {"bloom": 0.2, "falcon": 0.2}
IDS = dict(pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=EOS_ID, initializer_range=0.4)


def make_alibi_model(arch: str, seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny random BLOOM (eager: it has no sdpa path), Falcon with ALiBi (sdpa) or MPT (eager)."""
    if arch == "bloom":
        cls, config, impl = (
            BloomForCausalLM,
            BloomConfig(vocab_size=vocab, hidden_size=64, n_layer=2, n_head=4, **IDS),
            "eager",
        )
    elif arch == "falcon":
        config = FalconConfig(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
            new_decoder_architecture=False, multi_query=False, **IDS,
        )  # fmt: skip
        cls, impl = FalconForCausalLM, "sdpa"
    else:
        cls, config, impl = (
            MptForCausalLM,
            MptConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, **IDS),
            "eager",
        )
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=impl)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.use_cache = True  # MPT's config defaults to False
    return model.eval()


@pytest.fixture(scope="module", params=["bloom", "falcon"])
def alibi_pair(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """(arch, target, draft): the draft is the target with noisy weights (it disagrees often)."""
    target = make_alibi_model(request.param)
    return request.param, target, make_noisy_copy(target, DRAFT_NOISE[request.param])


@pytest.fixture
def compactions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts `CacheView.compact` calls (dynamic caches) during the test."""
    count = [0]
    original = cache_module.CacheView.compact

    def counting(self, keep):  # noqa: ANN001, ANN202
        count[0] += 1
        return original(self, keep)

    monkeypatch.setattr(cache_module.CacheView, "compact", counting)
    return count


GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)


def spec_decoder(method: str, draft: torch.nn.Module, k: int) -> hf_specdec.SpecDecoder:
    if method == "draft":
        return hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=k)
    return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=k)


def test_alibi_models_take_positions_from_the_mask(alibi_pair) -> None:
    assert alibi_from_mask(alibi_pair[1])
    rotary_falcon = make_alibi_model("falcon")
    rotary_falcon.config.alibi = False
    assert not alibi_from_mask(rotary_falcon) and not alibi_from_mask(make_alibi_model("mpt"))
    assert alibi_from_columns(make_alibi_model("mpt")) and not alibi_from_columns(alibi_pair[1])


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 4])
def test_alibi_greedy_matches_plain(alibi_pair, batch_size, method, k) -> None:
    arch, target, draft = alibi_pair
    inputs = make_prompts(batch_size, seed=batch_size + k)
    expected = target.generate(**inputs, **GREEDY)
    spec = spec_decoder(method, draft, k)
    assert torch.equal(spec_generate(target, inputs, spec, **GREEDY), expected)
    stats = spec.last_stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections: holes in the cache


def test_alibi_long_ragged_run_compacts(alibi_pair, compactions) -> None:
    """Ragged acceptance over 8 rows leaves holes in the middle of rows until they dominate: compaction moves each
    row's real columns (holes go left), and the 2-D mask's cumsum still counts each row's own tokens."""
    arch, target, draft = alibi_pair
    inputs = make_prompts(8, seed=3)
    kwargs = {**GREEDY, "max_new_tokens": 2 * NEW_TOKENS}
    expected = target.generate(**inputs, **kwargs)
    spec = spec_decoder("draft", draft, 4)
    assert torch.equal(spec_generate(target, inputs, spec, **kwargs), expected)
    assert compactions[0] > 0 and 0 < spec.last_stats.num_accepted_tokens < spec.last_stats.num_draft_tokens


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_alibi_on_the_static_cache_matches_plain(alibi_pair, method, monkeypatch) -> None:
    """The static path: the 2-D mask over the whole static length, one write offset, compaction in place."""
    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)  # room for 64 holes exactly: lagging rows compact
    monkeypatch.setattr(cache_route, "STATIC_HOLE_ROOM", 64)
    arch, target, draft = alibi_pair
    inputs = make_prompts(8, seed=3)
    expected = target.generate(**inputs, **GREEDY)
    spec = spec_decoder(method, draft, 4)
    assert torch.equal(spec_generate(target, inputs, spec, cache_implementation="static", **GREEDY), expected)
    stats = spec.last_stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    if method == "draft":
        assert stats.num_compactions > 0, stats


def test_the_mask_cumsum_is_the_plain_position() -> None:
    """The claim the exactness rests on: at every real column, `cumsum(mask) - 1` is buffer index - left padding."""
    model = make_alibi_model("bloom")
    view = cache_module.CacheView(model, 2, torch.tensor([2, 0]))
    # Row 0: padding (holes), then indices 2..4, a rejected draft (hole), 5, 6 after compaction-like gaps.
    keys = torch.tensor([[-1, -1, 2, 3, -1, 4, -1, -1, 5, 6], [0, 1, -1, 2, 3, -1, -1, 4, 5, -1]])  # [B, W]
    mask = view._attention_mask(torch.tensor([[6], [5]]), keys)
    assert mask.shape == keys.shape
    positions = (mask.cumsum(-1) - 1) * mask  # what build_alibi_tensor computes for each key
    real = keys >= 0
    assert torch.equal(positions[real], (keys - view.pad_lengths[:, None])[real])


def test_alibi_sampling_follows_the_target_law() -> None:
    """Speculative sampling on BLOOM draws (t1, t2, t3) from the target's exact joint law (chi-square, as in
    test_sampling_distribution.py, with 6000 rows): rows reject at different positions, so holes differ per row."""
    from test_sampling_distribution import NUM_TOKENS, exact_joint_law, goodness_of_fit

    vocab, rows = 12, 6000
    target = make_alibi_model("bloom", vocab=vocab)
    draft = make_noisy_copy(target, 0.3, seed=3)  # accepts ~45% per draft
    prompt = torch.tensor([[11, 3, 9, 11, 3, 9, 11, 3]])
    sampling = dict(temperature=1.2, top_k=None)
    law = exact_joint_law(target, prompt, **sampling)
    wrong = exact_joint_law(target, prompt, **{**sampling, "temperature": 1.5})
    inputs = {"input_ids": prompt.expand(rows, -1), "attention_mask": torch.ones(rows, prompt.shape[1])}
    for cache in ("dynamic", "static"):
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=2, seed=99)
        out = spec_generate(
            target, inputs, spec, max_new_tokens=NUM_TOKENS, do_sample=True, cache_implementation=cache, **sampling
        )
        tokens = out[:, prompt.shape[1] :]  # [N, 3]
        index = (tokens * vocab ** torch.arange(NUM_TOKENS - 1, -1, -1)).sum(1)  # [N] cell of (t1, t2, t3)
        counts = torch.bincount(index, minlength=vocab**NUM_TOKENS).double()
        assert 0.1 < spec.last_stats.acceptance_rate < 0.9, spec.last_stats
        p_value, tv, impossible = goodness_of_fit(counts, law)
        wrong_p, _, _ = goodness_of_fit(counts, wrong)
        assert impossible == 0 and p_value > 1e-3, f"{cache}: p={p_value:.3g} TV={tv:.4f}"
        assert wrong_p < 1e-6, f"{cache}: cannot tell temperature 1.5 apart (p={wrong_p:.3g})"


@pytest.fixture(scope="module")
def mpt() -> torch.nn.Module:
    return make_alibi_model("mpt")


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 4])
def test_mpt_one_unpadded_row_matches_plain(mpt, method, k) -> None:
    """At batch 1 without padding the cache is laid out as plain decoding's (rollback crops): columns are positions."""
    spec = spec_decoder(method, make_noisy_copy(mpt, 0.2), k)
    for seed in range(3):
        inputs = make_prompts(1, seed=seed)
        expected = mpt.generate(**inputs, **GREEDY)
        assert torch.equal(spec_generate(mpt, inputs, spec, **GREEDY), expected)
        assert spec.last_stats.num_accepted_tokens < spec.last_stats.num_draft_tokens


def one_padded_row() -> dict[str, torch.Tensor]:
    inputs = make_prompts(1, seed=4)
    return {
        "input_ids": torch.cat([torch.full((1, 2), PAD_ID), inputs["input_ids"]], 1),
        "attention_mask": torch.cat([torch.zeros(1, 2, dtype=torch.long), inputs["attention_mask"]], 1),
    }


MPT_REFUSALS = {
    "batch": (lambda: make_prompts(3), {}, "a batch of 3 rows"),
    "left-padding": (one_padded_row, {}, "left padding"),
    "static": (lambda: make_prompts(1), {"cache_implementation": "static"}, 'cache_implementation="static"'),
}


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("case", list(MPT_REFUSALS))
def test_mpt_with_holes_is_refused_before_any_model_work(mpt, role, case) -> None:
    """Where the cache could hold holes, MPT (bias from cache columns) is refused with a message naming the model,
    what is wrong, the call's value and the fixes, before any forward of either model."""
    bloom = make_alibi_model("bloom")
    target, draft = (mpt, bloom) if role == "target" else (bloom, mpt)
    make_inputs, kwargs, value = MPT_REFUSALS[case]

    def no_forward(*args):  # noqa: ANN002, ANN202
        raise AssertionError("a model ran before the refusal")

    hooks = [model.register_forward_pre_hook(no_forward) for model in (mpt, bloom)]
    try:
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=2)
        with pytest.raises(NotImplementedError) as error:
            spec_generate(target, make_inputs(), spec, max_new_tokens=8, do_sample=False, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    message = str(error.value)
    for part in (f"{role} model MptForCausalLM", "cache column", "holes", value, "one unpadded prompt", "BLOOM"):
        assert part in message, message


def test_mpt_is_refused_through_install(mpt) -> None:
    """`install()` routes `prompt_lookup_num_tokens=` to hf_specdec, which refuses a batched MPT call the same way."""
    hf_specdec.install()
    try:
        with pytest.raises(NotImplementedError, match="MptForCausalLM.*ALiBi.*a batch of 2 rows"):
            mpt.generate(**make_prompts(2), max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
    finally:
        hf_specdec.uninstall()


def test_alibi_through_install(alibi_pair) -> None:
    """`install()` routes `assistant_model=` at batch > 1 (which stock transformers refuses) to hf_specdec: identical."""
    arch, target, draft = alibi_pair
    inputs = make_prompts(3, seed=7)
    expected = target.generate(**inputs, **GREEDY)
    hf_specdec.install()
    try:
        out = target.generate(**inputs, assistant_model=draft, **GREEDY)
    finally:
        hf_specdec.uninstall()
    assert torch.equal(out, expected)


def test_alibi_cache_handed_back_and_continued(alibi_pair) -> None:
    """The cache hf_specdec hands back equals plain decoding's at every real column (padding columns are never
    attended), and continuing it for a second turn gives plain's tokens (`hf_specdec.continuation`)."""
    arch, target, draft = alibi_pair
    inputs = make_prompts(3, seed=5)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    plain = target.generate(**inputs, **kwargs)
    out = spec_generate(target, inputs, spec_decoder("draft", draft, 4), **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    width = plain.past_key_values.layers[0].keys.shape[2]
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, 20, dtype=torch.long)], 1)  # [B, P + 20]
    real = mask[:, :width].bool()  # [B, W]
    for ours, theirs in zip(out.past_key_values.layers, plain.past_key_values.layers):
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert (a - b).abs().amax((1, 3))[real].max() < 1e-4
    turn = {"input_ids": torch.cat([plain.sequences, torch.full((3, 2), 7)], 1)}
    turn["attention_mask"] = torch.cat([mask, torch.ones(3, 2, dtype=torch.long)], 1)
    second = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = target.generate(**turn, past_key_values=plain.past_key_values, **second)
    spec = spec_decoder("draft", draft, 4)
    assert torch.equal(spec_generate(target, turn, spec, past_key_values=out.past_key_values, **second), expected)
