"""MTPProposer: greedy identity, exact sampling and cache bounds with two real MTP architectures.

Targets are tiny DeepSeek-V3 (MLA attention, MoE) and GLM-4.5 (`glm4_moe`: GQA, partial RoPE, MoE) built
from configs with `num_mtp_layers=2`; their `MtpModel` is transformers' own. Its weights are random but
start from the target's decoder layer (so drafts are often right and acceptance is ragged), and mix in
the previous hidden state, so a wrong hidden-state hand-off changes the drafts. Every draft of the first
MTP cycle is checked against transformers' own `MtpModel.forward` over the committed prefix.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, PAD_ID, VOCAB, make_prompts, spec_generate, tiny_config_kwargs
from scipy import stats
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

import hf_specdec
from hf_specdec.proposers.mtp import MTPProposer, StaticMtpLayerView

NUM_MTP_LAYERS = 2
MTP_ARCHS = {
    "deepseek_v3": dict(
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16
    ),
    "glm4_moe": dict(num_key_value_heads=2, head_dim=16),
}


def make_mtp_target(arch: str, seed: int = 0, vocab: int = VOCAB) -> tuple[torch.nn.Module, MtpModel]:
    """A 1-layer MoE target with 2 MTP layers: copies of its layer plus noise, fed [embedding, hidden]."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        arch,
        **{**tiny_config_kwargs(vocab, layers=1, hidden=64), **MTP_ARCHS[arch]},
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        num_mtp_layers=NUM_MTP_LAYERS,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    hidden = config.hidden_size
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6))  # RMS 1: enorm(embedding) == embedding
        mtp = MtpModel(model, NUM_MTP_LAYERS).eval()
        for layer in mtp.layers:
            layer.mtp_block.load_state_dict(model.get_decoder().layers[0].state_dict())
            mix = torch.randn(hidden, hidden) * 0.3 / hidden**0.5
            layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), mix], dim=1))
            layer.post_norm.weight.copy_(model.get_decoder().norm.weight)
            for p in layer.parameters():
                p.add_(torch.randn(p.shape) * 0.05 * p.abs().mean())
    return model, mtp


@pytest.fixture(scope="module", params=sorted(MTP_ARCHS))
def mtp_target(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, MtpModel]:
    return make_mtp_target(request.param)


def reference_drafts(model: torch.nn.Module, mtp: MtpModel, tokens: torch.Tensor) -> torch.Tensor:  # [n]
    """transformers' own MTP chain over a committed sequence `tokens` ([L], no padding): its n greedy drafts."""
    hidden = model.get_decoder()(tokens[None]).last_hidden_state  # [1, L, H]
    drafts, _, _ = mtp(
        input_ids=tokens[None, 1:],
        last_hidden_states=hidden[:, :-1],
        attention_mask=None,
        position_ids=torch.arange(1, len(tokens))[None],
        mtp_cache=MtpCache(config=model.config.get_mtp_config()),
    )
    return drafts[0]


class Recorder:
    """Wraps the real MTPProposer methods: keeps each step's committed rows and drafts, checks cache bounds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_accepted = 0
        self.num_commits = 0
        propose, commit = MTPProposer.propose, MTPProposer.commit

        def recording_propose(proposer, batch, max_draft_tokens, sampling, width=None):  # noqa: ANN001, ANN202
            proposal = propose(proposer, batch, max_draft_tokens, sampling, width)
            self.steps.append(
                (batch.token_ids.clone(), batch.lengths.clone(), batch.pad_lengths.clone(), proposal.draft_token_ids)
            )
            return proposal

        def checking_commit(proposer, batch, num_accepted):  # noqa: ANN001, ANN202
            commit(proposer, batch, num_accepted)
            self.num_accepted += int(num_accepted.clamp(min=0).sum())  # a frozen row of a static batch says -1
            self.num_commits += 1
            for d, view in enumerate(proposer.views):
                # The MTP caches never hold a position the sequence does not, and their KV matches the map.
                assert bool((view.cached_lengths <= batch.lengths).all())
                assert bool((view.column_index < batch.lengths[:, None]).all())
                assert bool(((view.column_index >= 0).sum(1) <= batch.lengths - batch.pad_lengths - 1 - d).all())
                if not isinstance(view, StaticMtpLayerView):  # a static cache keeps its full length
                    assert view.cache.layers[d].keys.shape[-2] == view.width

        monkeypatch.setattr(MTPProposer, "propose", recording_propose)
        monkeypatch.setattr(MTPProposer, "commit", checking_commit)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("k", [NUM_MTP_LAYERS, 2 * NUM_MTP_LAYERS])
def test_greedy_matches_generate_and_transformers_mtp(mtp_target, batch_size, k, cache, monkeypatch) -> None:
    """Greedy output is plain's and every draft is transformers' own MTP chain's, on dynamic caches and on static
    ones (fixed catch-up widths: the bound `catch_up_width` is never exceeded)."""
    model, mtp = mtp_target
    inputs = make_prompts(batch_size, seed=batch_size)
    expected = model.generate(**inputs, max_new_tokens=14, do_sample=False)
    recorder = Recorder(monkeypatch)
    backlog = []
    catch_up = MTPProposer._catch_up

    def recording_catch_up(self, batch, d, end):  # noqa: ANN001, ANN202
        backlog.append(int((end - self.views[d].cached_lengths).max()))
        return catch_up(self, batch, d, end)

    monkeypatch.setattr(MTPProposer, "_catch_up", recording_catch_up)
    spec = hf_specdec.SpecDecoder(method="mtp", num_speculative_tokens=k, mtp_model=mtp)
    out = spec_generate(model, inputs, spec, max_new_tokens=14, do_sample=False, cache_implementation=cache)
    assert max(backlog) <= max(k, NUM_MTP_LAYERS) + 2
    assert torch.equal(out, expected)
    assert recorder.num_accepted > 0, "the test MTP layers should get some drafts accepted"
    assert spec.last_stats.num_draft_tokens > recorder.num_accepted, "and some rejected"
    for token_ids, lengths, pad_lengths, drafts in recorder.steps:
        for i in range(token_ids.shape[0]):
            num = min(NUM_MTP_LAYERS, int((drafts[i] >= 0).sum()))
            if num:
                want = reference_drafts(model, mtp, token_ids[i, pad_lengths[i] : lengths[i]])
                assert torch.equal(drafts[i, :num], want[:num])


def test_steps_without_drafts_keep_the_mtp_caches_in_step(mtp_target, monkeypatch) -> None:
    """Past max_draft_len no row drafts, propose is skipped, and commit alone catches the MTP layers up."""
    model, mtp = mtp_target
    inputs = make_prompts(3, seed=7)
    expected = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    recorder = Recorder(monkeypatch)
    spec = hf_specdec.SpecDecoder(method="mtp", num_speculative_tokens=2, mtp_model=mtp, max_draft_len=12)
    assert torch.equal(spec_generate(model, inputs, spec, max_new_tokens=10, do_sample=False), expected)
    assert recorder.num_commits > len(recorder.steps) > 0


def test_adaptive_schedule_calibration_leaves_the_mtp_state_intact(mtp_target) -> None:
    """The adaptive schedule times target forwards after the prefill; the MTP hook sees them and must not care."""
    model, mtp = mtp_target
    inputs = make_prompts(2, seed=3)
    expected = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    spec = hf_specdec.SpecDecoder(method="mtp", num_speculative_tokens=4, mtp_model=mtp,
                                  num_speculative_tokens_schedule="adaptive")  # fmt: skip
    for _ in range(2):
        assert torch.equal(spec_generate(model, inputs, spec, max_new_tokens=12, do_sample=False), expected)


def test_sampling_is_seeded_and_exact_for_the_first_speculated_token(mtp_target) -> None:
    model, mtp = mtp_target
    prompt = make_prompts(1, seed=3)["input_ids"]  # [1, P]
    rows = 400
    inputs = {"input_ids": prompt.expand(rows, -1)}
    spec = hf_specdec.SpecDecoder(method="mtp", num_speculative_tokens=NUM_MTP_LAYERS, mtp_model=mtp, seed=11)
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=0.7, top_k=0)
    out = spec_generate(model, inputs, spec, **kwargs)
    assert torch.equal(out, spec_generate(model, inputs, spec, **kwargs))  # seeded: reproducible
    assert spec.last_stats.num_draft_tokens > 0
    # t1 comes from the prefill; t2, the first token of the first speculative step (an accepted MTP draft or a
    # recovered token), must follow the target's own (tempered) law: sum over t1 of p(t1) p(t2 | t1).
    with torch.no_grad():
        first = torch.softmax(model(prompt).logits[0, -1] / 0.7, dim=-1).double()  # [V]
        vocab = first.shape[0]
        continued = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)  # [V, P + 1]
        second = torch.softmax(model(continued).logits[:, -1] / 0.7, dim=-1).double()  # [V, V]
    probs = first @ second  # [V]
    counts = torch.bincount(out[:, prompt.shape[1] + 1], minlength=vocab).double()
    common = probs * rows >= 5
    observed = torch.cat([counts[common], counts[~common].sum()[None]])
    expected = torch.cat([probs[common], probs[~common].sum()[None]]) * rows
    keep = expected > 0
    expected = expected[keep] * rows / expected[keep].sum()
    assert stats.chisquare(observed[keep], expected).pvalue > 1e-3


def test_use_mtp_routes_after_install_and_stock_generate_is_untouched(mtp_target, monkeypatch) -> None:
    model, mtp = mtp_target
    from hf_specdec.proposers import mtp as mtp_module

    monkeypatch.setitem(mtp_module._LOADED_MTP_MODELS, model, mtp)  # as if loaded from the target's checkpoint
    inputs = make_prompts(2, seed=5)
    expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    recorder = Recorder(monkeypatch)
    hf_specdec.install()
    try:
        out = model.generate(
            **inputs, max_new_tokens=8, do_sample=False, use_mtp=True, num_assistant_tokens=NUM_MTP_LAYERS
        )  # a constant k (HF's meaning of num_assistant_tokens): drafts every step, whatever the timings
    finally:
        hf_specdec.uninstall()
    assert torch.equal(out, expected)
    assert recorder.steps, "use_mtp=True should have run the MTP proposer"
    assert all(drafts.shape[1] <= NUM_MTP_LAYERS for *_, drafts in recorder.steps)  # HF's k: one per MTP layer


def test_target_without_mtp_layers_gets_a_clear_error(llama) -> None:
    spec = hf_specdec.SpecDecoder(method="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_mtp_layers.*method='draft'.*method='ngram'"):
        spec_generate(llama, make_prompts(1), spec, max_new_tokens=4)


def test_the_hook_is_removed_even_when_the_call_fails(mtp_target) -> None:
    model, mtp = mtp_target
    decoder = model.get_decoder()
    spec = hf_specdec.SpecDecoder(method="mtp", num_speculative_tokens=2, mtp_model=mtp)
    with pytest.raises(ZeroDivisionError):  # raised by a logits processor inside the loop, after attach()
        spec_generate(model, make_prompts(1), spec, max_new_tokens=4, logits_processor=[lambda ids, s: 1 / 0])
    assert not decoder._forward_hooks
    spec_generate(model, make_prompts(1), spec, max_new_tokens=4)
    assert not decoder._forward_hooks


def test_threads_sharing_the_target_and_a_spec_decoder_get_plain_output(mtp_target) -> None:
    """The MTP proposer reads the target's hidden states through a hook on the shared decoder: it must record only
    its own thread's forwards (six threads, one SpecDecoder, and a plain `generate` running beside them)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    model, mtp = mtp_target
    greedy = dict(do_sample=False, max_new_tokens=12)
    shapes = [(1, 11), (3, 12), (2, 13), (1, 14), (3, 15), (2, 16)]
    plain = {shape: model.generate(**make_prompts(*shape), **greedy) for shape in shapes}
    spec = hf_specdec.SpecDecoder(method="mtp", num_speculative_tokens=2, mtp_model=mtp)
    start = threading.Barrier(len(shapes) + 1)

    def client(index: int) -> list[bool]:
        start.wait()
        calls = (shapes[index], shapes[(index + 3) % len(shapes)])
        return [torch.equal(spec_generate(model, make_prompts(*s), spec, **greedy), plain[s]) for s in calls]

    def plain_client() -> list[bool]:
        start.wait()
        return [torch.equal(model.generate(**make_prompts(*s), **greedy), plain[s]) for s in shapes[:3]]

    with ThreadPoolExecutor(len(shapes) + 1) as pool:
        futures = [pool.submit(client, i) for i in range(len(shapes))] + [pool.submit(plain_client)]
        results = [future.result(timeout=600) for future in futures]
    assert results == [[True, True]] * len(shapes) + [[True] * 3]
    assert not model.get_decoder()._forward_hooks
