"""Hybrid models whose layers include recurrent state (gated delta-net, Mamba2, Kimi delta attention).

Tiny random fp32 targets of five families (Qwen3.5 text, Qwen3-Next, Granite-MoE-hybrid's and Bamba's Mamba2,
Bailing-hybrid's KDA) decode greedy-identical to plain `generate` over ragged left-padded batches, with a
noisy-copy draft (accepting 20-70%: recurrent states roll back nearly every step) and with prompt lookup, on the
dynamic and (Qwen3.5, Bamba, Granite-MoE-hybrid) the static cache; the recurrent and conv states after rejections
equal plain decoding's of the same kept tokens, for every recurrent layer of the target and of a hybrid draft;
sampling follows the target's law; and what is not supported is refused before any model work. About 55 s on 2
shared cores (one torch thread).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch
import transformers
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, make_prompts, spec_generate
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.modeling_layers import MtpModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import hf_specdec
from hf_specdec import cache as cache_module
from hf_specdec import compat
from hf_specdec.decoding import SpeculativeLoop
from hf_specdec.recurrent import recurrent_layer_indices
from hf_specdec.static_cache import StaticCacheView

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 40
STATIC_NEW_TOKENS = 24
#: What this transformers lacks of the recurrent cache API (5.17 has no `Cache.get_conv_state`): hybrids are then
#: refused, which is all this module tests there.
MISSING_API = compat.missing_recurrent_cache_api()
_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=EOS_ID, initializer_range=0.4,
)  # fmt: skip
_QWEN = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
             linear_value_head_dim=16)  # fmt: skip
CONFIGS = {
    "qwen3_5_text": _QWEN,  # 3 gated delta-net layers, then full attention
    "qwen3_next": dict(
        _QWEN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),  # fmt: skip
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
        mamba_expand=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        shared_intermediate_size=64,
    ),  # fmt: skip
    "bamba": dict(
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
        mamba_expand=2,
    ),  # fmt: skip
    "bailing_hybrid": dict(
        moe_intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=8,
        head_dim=16,
        num_key_value_heads=4,
        layer_group_size=2,
        first_k_dense_replace=1,
    ),  # fmt: skip
}


@pytest.fixture(autouse=True)
def needs_recurrent_api(request: pytest.FixtureRequest) -> None:
    if MISSING_API and request.node.originalname != "test_a_transformers_without_the_recurrent_cache_api_is_refused":
        pytest.skip(f"transformers {transformers.__version__} lacks {MISSING_API}: hybrids are refused")


def make_hybrid(model_type: str, seed: int = 0, vocab: int = 96, **overrides) -> torch.nn.Module:
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = AutoConfig.for_model(model_type, **{**_COMMON, "vocab_size": vocab, **CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def hybrid(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, a noisy copy that accepts 20-70% of its drafts) for each hybrid family."""
    target = make_hybrid(request.param)
    assert recurrent_layer_indices(target), request.param
    return target, make_noisy_copy(target, 0.02)


def greedy(**kwargs) -> dict:
    return {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": None, **kwargs}


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 4])
def test_hybrid_greedy_matches_plain(hybrid, batch_size, method, k):
    target, draft = hybrid
    inputs = make_prompts(batch_size, seed=batch_size + k)
    expected = target.generate(**inputs, **greedy())
    spec_kwargs = {"draft_model": draft} if method == "draft" else {"method": "ngram"}
    spec = hf_specdec.SpecDecoder(num_speculative_tokens=k, **spec_kwargs)
    assert torch.equal(spec_generate(target, inputs, spec, **greedy()), expected)
    stats = spec.last_stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections: recurrent states rolled back
    if method == "draft":
        assert 0.1 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9, stats


def test_hybrid_compacts_and_matches_plain(monkeypatch):
    """Long enough, with a low compaction threshold, that the attention columns compact between rollbacks."""
    target = make_hybrid("qwen3_5_text")
    monkeypatch.setattr(cache_module, "COMPACT_MIN_COLUMNS", 16)
    compactions = []
    original = cache_module.CacheView.compact
    monkeypatch.setattr(
        cache_module.CacheView, "compact", lambda self, keep: (compactions.append(1), original(self, keep))
    )
    inputs = make_prompts(8, seed=4)
    kwargs = dict(max_new_tokens=60, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.05), num_speculative_tokens=4)
    assert torch.equal(spec_generate(target, inputs, spec, **kwargs), target.generate(**inputs, **kwargs))
    assert compactions


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_hybrid_static_cache_greedy_matches_plain(model_type, batch_size):
    """`cache_implementation="static"`: plain static `generate` equals plain dynamic on these hybrids, and the
    static speculative path (eager: hybrids are never compiled or captured) equals both, draft and n-gram, k 1 and 4."""
    target = make_hybrid(model_type)
    draft = make_noisy_copy(target, 0.02)
    inputs = make_prompts(batch_size, seed=batch_size + 1)
    kwargs = greedy(max_new_tokens=STATIC_NEW_TOKENS)
    expected = target.generate(**inputs, **kwargs)
    assert torch.equal(target.generate(**inputs, **kwargs, cache_implementation="static"), expected)
    for method, k in itertools.product(("draft", "ngram"), (1, 4)):
        spec_kwargs = {"draft_model": draft} if method == "draft" else {"method": "ngram"}
        spec = hf_specdec.SpecDecoder(num_speculative_tokens=k, **spec_kwargs)
        out = spec_generate(target, inputs, spec, **kwargs, cache_implementation="static")
        assert torch.equal(out, expected), f"{model_type} B={batch_size} {method} k={k}"
        stats = spec.last_stats
        assert stats.num_graph_replays == 0
        if method == "draft":  # rejections: recurrent states rolled back
            assert stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_hybrid_static_cache_compacts_in_place_and_matches_plain(monkeypatch):
    """Little room for holes: the static attention columns compact in place (recurrent layers left alone)."""
    from hf_specdec import cache_route

    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)  # exactly the room below
    monkeypatch.setattr(cache_route, "STATIC_HOLE_ROOM", 8)
    target = make_hybrid("granitemoehybrid")
    inputs = make_prompts(4, seed=3, min_len=2, max_len=20)
    kwargs = greedy(max_new_tokens=60)
    expected = target.generate(**inputs, **kwargs)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.05), num_speculative_tokens=4)
    assert torch.equal(spec_generate(target, inputs, spec, **kwargs, cache_implementation="static"), expected)
    assert spec.last_stats.num_compactions > 0


def test_a_smaller_hybrid_draft_and_a_hybrid_draft_for_an_attention_target():
    """The draft's own cache is hybrid: a 2-layer Qwen3.5 drafting for a 4-layer Qwen3-Next, and for a Llama."""
    inputs = make_prompts(3, seed=9)
    draft = make_hybrid("qwen3_5_text", seed=3, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    for target in (make_hybrid("qwen3_next"), make_model("llama")):
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
        assert torch.equal(spec_generate(target, inputs, spec, **greedy()), target.generate(**inputs, **greedy()))


def test_hybrid_drafts_on_the_static_cache():
    """A 2-layer Qwen3.5 draft on static caches, for a Granite-MoE-hybrid target and for a Llama target (whose own
    forwards may compile; the step is never captured since the draft is a hybrid)."""
    inputs = make_prompts(3, seed=9)
    draft = make_hybrid("qwen3_5_text", seed=3, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    kwargs = greedy(max_new_tokens=STATIC_NEW_TOKENS)
    for target in (make_hybrid("granitemoehybrid"), make_model("llama")):
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
        out = spec_generate(target, inputs, spec, **kwargs, cache_implementation="static")
        assert torch.equal(out, target.generate(**inputs, **kwargs))
        assert spec.last_stats.num_draft_tokens > 0


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_rows_leaving_the_batch_keep_the_others_states(cache):
    """An EOS that rows reach at different steps: finished rows leave the batch (recurrent states select rows), or
    on the static cache stay in it, frozen (fed nothing; the rollback puts their states back every step)."""
    target = make_hybrid("granitemoehybrid")
    inputs = make_prompts(8, seed=6)
    plain = target.generate(**inputs, **greedy())
    width = inputs["input_ids"].shape[1]
    eos = int(torch.mode(plain[:, width + 5 :].flatten()).values)  # a frequent token: rows stop at different steps
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=PAD_ID)
    expected = target.generate(**inputs, **kwargs)
    stops = {int((row == eos).nonzero()[0]) if bool((row == eos).any()) else -1 for row in expected[:, width:]}
    assert len(stops) > 2, expected  # rows finish at different steps
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.02), num_speculative_tokens=4)
    assert torch.equal(spec_generate(target, inputs, spec, **kwargs, cache_implementation=cache), expected)


@pytest.mark.library_default
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_default_adaptive_schedule_on_a_hybrid(cache):
    """The default schedule times a verify and rolls it back (every row keeps nothing: the snapshot comes back)."""
    target = make_hybrid("qwen3_5_text")
    inputs = make_prompts(3, seed=8)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.02))
    out = spec_generate(target, inputs, spec, **greedy(cache_implementation=cache))
    assert torch.equal(out, target.generate(**inputs, **greedy()))


def test_without_the_rollback_the_output_differs(monkeypatch):
    """The control: skipping the recurrent rollback changes the tokens (the tests above exercise it)."""
    target = make_hybrid("qwen3_5_text")
    inputs = make_prompts(3, seed=5)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.05), num_speculative_tokens=4)
    expected = target.generate(**inputs, **greedy())
    monkeypatch.setattr("hf_specdec.recurrent.RecurrentRollback.rollback", lambda self, lengths: None)
    assert not torch.equal(spec_generate(target, inputs, spec, **greedy()), expected)


def plain_states(model: torch.nn.Module, tokens: list[int]) -> DynamicCache:
    """The cache of plain decoding of `tokens`: a prefill of the first half, then one token at a time."""
    cache = DynamicCache(config=model.config)
    split = max(1, len(tokens) // 2)
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens[:split]]), past_key_values=cache, use_cache=True)
        for token in tokens[split:]:
            model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize(
    ("model_type", "cache"),
    [
        ("qwen3_5_text", "dynamic"),
        ("granitemoehybrid", "dynamic"),
        ("bailing_hybrid", "dynamic"),
        ("qwen3_5_text", "static"),
        ("granitemoehybrid", "static"),
    ],
)
def test_recurrent_states_after_rejections_equal_plain_decoding(monkeypatch, model_type, cache):
    """After steps that rejected drafts, every row's conv and recurrent states of every recurrent layer, in the target
    and in the (hybrid) draft, are those of plain decoding of the row's kept tokens (dynamic and static caches)."""
    target = make_hybrid(model_type)
    draft = make_noisy_copy(target, 0.05)
    checked = []

    def rollback_and_check(loop: SpeculativeLoop, num_accepted: torch.Tensor) -> None:
        original_rollback(loop, num_accepted)
        if len(checked) >= 3 or not bool((num_accepted < loop.proposer.last_num_drafted).any()):
            return
        batch = loop.batch
        views = [(target, loop.target), (draft, loop.proposer.inner.view)]
        assert all(isinstance(view, StaticCacheView) == (cache == "static") for _, view in views)
        for model, view in views:
            for row in range(batch.batch_size):
                pad, length = int(batch.pad_lengths[row]), int(view.cached_lengths[row])
                reference = plain_states(model, batch.token_ids[row, pad:length].tolist())
                for index in recurrent_layer_indices(model):
                    ours, plain = view.cache.layers[index], reference.layers[index]
                    for s in range(ours.number_of_states):
                        # Rounding only: a verify of k + 1 tokens over a padded batch does not round like
                        # one-token steps (without the rollback the states are off by O(1)).
                        close = dict(atol=2e-4, rtol=1e-4)
                        torch.testing.assert_close(ours.conv_states[s][row], plain.conv_states[s][0], **close)
                        torch.testing.assert_close(ours.recurrent_states[s][row], plain.recurrent_states[s][0], **close)
        checked.append(True)

    original_rollback = SpeculativeLoop.rollback
    monkeypatch.setattr(SpeculativeLoop, "rollback", rollback_and_check)
    original_commit = SpeculativeLoop.commit

    def commit(loop, proposal, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        loop.proposer.last_num_drafted = proposal.num_draft_tokens
        return original_commit(loop, proposal, *args, **kwargs)

    monkeypatch.setattr(SpeculativeLoop, "commit", commit)
    inputs = make_prompts(3, seed=11)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
    out = spec_generate(target, inputs, spec, **greedy(cache_implementation=cache))
    assert torch.equal(out, target.generate(**inputs, **greedy()))
    assert len(checked) == 3


def test_hybrid_sampling_follows_the_target_law():
    """The first three tokens of a Qwen3.5 hybrid sampled with a draft: chi-square against the exact joint law."""
    import test_sampling_distribution as law_test

    target = make_hybrid(
        "qwen3_5_text", vocab=law_test.VOCAB, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]
    )
    draft = make_noisy_copy(target, 0.05, seed=3)
    prompt = torch.tensor([law_test.PROMPTS["drafts_likely"]])
    sampling = dict(temperature=1.2, top_k=None)
    law = law_test.exact_joint_law(target, prompt, **sampling)
    wrong = law_test.exact_joint_law(target, prompt, **{**sampling, "temperature": 1.2 * 1.15})
    num_samples = 4000
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=2, seed=1234)
    inputs = {"input_ids": prompt.expand(num_samples, -1), "attention_mask": torch.ones(num_samples, prompt.shape[1])}
    out = spec_generate(target, inputs, spec, max_new_tokens=law_test.NUM_TOKENS, do_sample=True, **sampling)
    tokens = out[:, prompt.shape[1] :]  # [N, 3]
    index = (tokens * law_test.VOCAB ** torch.arange(law_test.NUM_TOKENS - 1, -1, -1)).sum(1)
    counts = torch.bincount(index, minlength=law_test.VOCAB**law_test.NUM_TOKENS).double()
    assert 0.1 < spec.last_stats.acceptance_rate < 0.9, spec.last_stats
    p_value, tv, impossible = law_test.goodness_of_fit(counts, law)
    wrong_p, _, _ = law_test.goodness_of_fit(counts, wrong)
    print(f"hybrid sampling: chi-square p={p_value:.3g} TV={tv:.4f}; temperature x1.15: p={wrong_p:.3g}")
    assert impossible == 0 and p_value > law_test.P_VALUE_FLOOR, (p_value, tv)
    assert wrong_p < 1e-3, wrong_p  # the statistic has the power to see a slightly wrong law


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen35() -> torch.nn.Module:
    return make_hybrid("qwen3_5_text")


@contextlib.contextmanager
def no_model_work(model: torch.nn.Module) -> Iterator[None]:
    """Any forward of `model` inside the block fails the test: a refusal comes before any model work."""

    def forbidden(*args):  # noqa: ANN002, ANN202
        raise AssertionError("a refused call ran the model")

    handle = model.register_forward_pre_hook(forbidden)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("spec_kwargs", "call_kwargs", "match"),
    [
        ({"method": "ngram"}, {"return_dict_in_generate": True}, "return_dict_in_generate=False"),
        ({"early_exit_layers": 1}, {}, r"method='early_exit'.*use method='draft'"),
    ],
)
def test_unsupported_hybrid_calls_are_refused_up_front(monkeypatch, qwen35, spec_kwargs, call_kwargs, match):
    inputs = make_prompts(2)
    with no_model_work(qwen35), pytest.raises(NotImplementedError, match=match) as error:
        spec_generate(qwen35, inputs, hf_specdec.SpecDecoder(**spec_kwargs), max_new_tokens=5, **call_kwargs)
    assert "Qwen3_5ForCausalLM has recurrent (linear_attention) layers" in str(error.value)


def test_a_callers_cache_is_refused(monkeypatch, qwen35):
    inputs = make_prompts(2)
    with no_model_work(qwen35), pytest.raises(NotImplementedError, match="pass no past_key_values"):
        spec_generate(
            qwen35, inputs, hf_specdec.SpecDecoder(method="ngram"), max_new_tokens=5,
            past_key_values=DynamicCache(config=qwen35.config),
        )  # fmt: skip


def test_a_cross_tokenizer_hybrid_draft_is_refused(monkeypatch, qwen35):
    from conftest import make_tokenizer

    tokenizer = make_tokenizer()
    spec = hf_specdec.SpecDecoder(draft_model=qwen35, draft_tokenizer=tokenizer, tokenizer=tokenizer)
    target = make_model("llama")
    with (
        no_model_work(target),
        pytest.raises(NotImplementedError, match="The draft model Qwen3_5ForCausalLM .*draft_tokenizer"),
    ):
        spec_generate(target, make_prompts(2), spec, max_new_tokens=5)


def test_an_unverified_hybrid_family_is_refused(monkeypatch):
    """Nemotron-H passes the layer checks (Mamba2, attention, MLP-only layers) but differed from plain decoding in
    a batch of 8: a hybrid family is trusted only once tested."""
    monkeypatch.setitem(CONFIGS, "nemotron_h", dict(
        hybrid_override_pattern="M*M-", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
        chunk_size=16, expand=2,
    ))  # fmt: skip
    model = make_hybrid("nemotron_h")
    with (
        no_model_work(model),
        pytest.raises(NotImplementedError, match=r"NemotronHForCausalLM \('nemotron_h'\).*verified"),
    ):
        spec_generate(model, make_prompts(2), hf_specdec.SpecDecoder(method="ngram"), max_new_tokens=5)


def bailing_hybrid_with_mtp(mtp_layer_type: str) -> tuple[torch.nn.Module, MtpModel]:
    """A Bailing-hybrid target and its one MTP layer: a copy of the target's last layer (attention or delta
    attention), fed [embedding, hidden] through an identity-plus-noise projection, so some drafts are accepted."""
    model = make_hybrid("bailing_hybrid", num_mtp_layers=1, mtp_layer_types=[mtp_layer_type],
                        mtp_mlp_layer_types=["sparse"])  # fmt: skip
    types = model.config.layer_types
    source = model.get_decoder().layers[max(i for i, kind in enumerate(types) if kind == mtp_layer_type)]  # a MoE one
    hidden = model.config.hidden_size
    with torch.no_grad():
        mtp = MtpModel(model, 1).eval()
        layer = mtp.layers[0]
        layer.mtp_block.load_state_dict(source.state_dict())
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), torch.randn(hidden, hidden) * 0.3 / hidden**0.5], 1))
        layer.post_norm.weight.copy_(model.get_decoder().norm.weight)
    return model, mtp


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_bailing_hybrid_mtp_matches_plain(batch_size, k, cache):
    """MTP layers keep their own (attention) caches; the target's recurrent states roll back as with any draft."""
    model, mtp = bailing_hybrid_with_mtp("full_attention")
    inputs = make_prompts(batch_size, seed=batch_size + k)
    spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=k,
                                  num_speculative_tokens_schedule="constant")  # fmt: skip
    out = spec_generate(model, inputs, spec, **greedy(), cache_implementation=cache)
    assert torch.equal(out, model.generate(**inputs, **greedy()))
    assert spec.last_stats.num_draft_tokens > 0


def test_recurrent_mtp_layers_are_refused(monkeypatch):
    model, mtp = bailing_hybrid_with_mtp("linear_attention")
    spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp)
    with no_model_work(model), pytest.raises(NotImplementedError, match=r"MTP layers are recurrent.*method='draft'"):
        spec_generate(model, make_prompts(1), spec, max_new_tokens=5)


def test_a_transformers_without_the_recurrent_cache_api_is_refused(monkeypatch, qwen35):
    """transformers releases whose cache lacks the conv/recurrent state API (5.17: `Cache.get_conv_state`)."""
    if not MISSING_API:  # this transformers has it: pretend it does not
        monkeypatch.setattr("hf_specdec.compat.missing_recurrent_cache_api", lambda: ["Cache.get_conv_state"])
    with no_model_work(qwen35), pytest.raises(NotImplementedError, match=r"lacks \[.*\]: upgrade transformers"):
        spec_generate(qwen35, make_prompts(1), hf_specdec.SpecDecoder(method="ngram"), max_new_tokens=5)


def test_install_routes_assistant_model_on_a_hybrid(qwen35):
    """transformers' own assisted decoding raises on hybrids ("stateful models"); install() routes it here."""
    inputs = make_prompts(3, seed=2)
    expected = qwen35.generate(**inputs, **greedy())
    with pytest.raises(ValueError, match="stateful"):  # stock transformers, without hf_specdec
        qwen35.generate(**inputs, prompt_lookup_num_tokens=4, **greedy())
    hf_specdec.install()
    try:
        draft = make_noisy_copy(qwen35, 0.02)
        assert torch.equal(qwen35.generate(**inputs, assistant_model=draft, **greedy()), expected)
        assert torch.equal(qwen35.generate(**inputs, prompt_lookup_num_tokens=4, **greedy()), expected)
    finally:
        hf_specdec.uninstall()
