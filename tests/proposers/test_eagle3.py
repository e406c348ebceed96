"""EAGLE-3 heads: both published layouts load; every draft equals a plain forward of the head written here from the
layout's equations; greedy identity at B 1/3/8 x k 1/4; exact sampling with a reduced draft vocabulary; refusals.

The heads are tiny random ones written to disk as the two families publish them (config.json + model.safetensors,
their exact key names and shapes): the EAGLE authors' (`midlayer.*`, a Llama config plus `draft_vocab_size`, aux
layers by default `[2, L // 2, L - 3]`) and speculators' (`speculators_model_type: "eagle3"`,
`transformer_layer_config`, `eagle_aux_hidden_state_layer_ids`, `layers.0.*`). The "agreeing" head reads the
target's last layer and copies its final norm and head rows, so its first draft is often accepted and later ones
often not: acceptance is ragged, as the rollback tests need.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import filled_cache_call, make_model, make_prompts, record_proposals, spec_generate
from first_tokens_law import check_first_tokens, exact_joint_law
from safetensors.torch import save_file

import hf_specdec
from hf_specdec.proposers.eagle3 import Eagle3Proposer

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 48
LAYERS = 6
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
THETA, EPS = 10000.0, 1e-6


def layer_config(vocab: int) -> dict:
    return {
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": EPS,
        "rope_theta": THETA, "max_position_embeddings": 512, "vocab_size": vocab, "hidden_act": "silu",
    }  # fmt: skip


def head_weights(
    target, draft_vocab: int, seed: int, agree: bool = False, chosen: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's tensors under the EAGLE authors' names (speculators': `layers.0.` for `midlayer.`)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    if chosen is None:  # [Vd] the target ids of the draft vocabulary, increasing
        chosen = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    w = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rand(HIDDEN, scale=0.1),
        "midlayer.input_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        "midlayer.mlp.gate_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, INTER, scale=0.1),
        "norm.weight": 1 + rand(HIDDEN, scale=0.1),
        "lm_head.weight": rand(draft_vocab, HIDDEN, scale=1.0),
        "d2t": chosen - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if agree:  # attends to its own slot and reads the token's embedding out (the bigram the target below follows)
        w["fc.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)
        w["midlayer.input_layernorm.weight"] = torch.ones(HIDDEN)
        per_kv = HEAD_DIM * KV_HEADS  # the embedding dims the key/value heads carry
        embed_part = torch.cat([torch.eye(per_kv, HIDDEN), torch.zeros(per_kv, HIDDEN)], dim=1)  # [32, 2H]
        w["midlayer.self_attn.k_proj.weight"] = embed_part.clone()
        w["midlayer.self_attn.v_proj.weight"] = embed_part.clone()
        group = HEADS // KV_HEADS  # query head h reads key head h // group: give it that head's dims, sharply
        w["midlayer.self_attn.q_proj.weight"] = 4 * embed_part.view(KV_HEADS, 1, HEAD_DIM, -1).expand(
            -1, group, -1, -1
        ).reshape(HEADS * HEAD_DIM, 2 * HIDDEN)
        o_proj = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
        for h in range(0, HEADS, group):  # one query head per key head writes its dims back
            o_proj[(h // group) * HEAD_DIM : (h // group + 1) * HEAD_DIM, h * HEAD_DIM : (h + 1) * HEAD_DIM] = (
                torch.eye(HEAD_DIM)
            )
        w["midlayer.self_attn.o_proj.weight"] = o_proj
        w["midlayer.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER)
        w["norm.weight"] = torch.ones(HIDDEN)
        w["lm_head.weight"] = target.lm_head.weight.detach()[chosen].clone()
    return w


def save_eagle_layout(path, weights: dict, vocab: int, draft_vocab: int) -> None:
    config = {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(vocab), "draft_vocab_size": draft_vocab}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))


def save_speculators_layout(path, weights: dict, vocab: int, draft_vocab: int, aux: list[int], norm_first: bool):
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "draft_vocab_size": draft_vocab, "norm_before_residual": norm_first, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": aux, "transformer_layer_config": layer_config(vocab),
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny-llama"}},
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    renamed = {k.replace("midlayer.", "layers.0."): v.contiguous() for k, v in weights.items()}
    save_file(renamed, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0, layers=LAYERS, vocab=VOCAB)


@pytest.fixture(scope="module")
def bigram_target():
    """A tiny Llama whose layers barely write to the residual stream: its next token mostly follows the current one."""
    model = make_model("llama", seed=0, layers=LAYERS, vocab=VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return model


@pytest.fixture(scope="module")
def heads(target, bigram_target, tmp_path_factory):
    """(head, its weights, aux layer ids, norm_before_residual) for: an EAGLE-layout random head, a speculators
    random head with norm_before_residual, and an agreeing speculators head for `bigram_target`."""
    made = {}
    base = tmp_path_factory.mktemp("eagle3")
    for name, seed in (("eagle", 1), ("speculators", 2), ("agree", 3)):
        path = base / name
        path.mkdir()
        agree = name == "agree"
        weights = head_weights(bigram_target if agree else target, VOCAB // 2, seed, agree=agree)
        if name == "eagle":
            save_eagle_layout(path, weights, VOCAB, VOCAB // 2)
            aux, norm_first = [2, LAYERS // 2, LAYERS - 3], False
        else:
            aux, norm_first = ([1, 3, LAYERS], False) if name == "agree" else ([1, 4, 5], True)
            save_speculators_layout(path, weights, VOCAB, VOCAB // 2, aux, norm_first)
        made[name] = (hf_specdec.load_draft_head(path), weights, aux, norm_first)
    return made


# -- the head's equations, written out (no transformers module, no cache) --------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [h, n, d]
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = positions[:, None].float() * inv[None]  # [n, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]], -1)
    return x * cos + half * sin


def head_layer(w: dict, embeds: torch.Tensor, hidden: torch.Tensor, norm_first: bool) -> torch.Tensor:
    """The EAGLE-3 layer over a whole sequence [n, H] at positions 0..n-1, causal."""
    n = embeds.shape[0]
    normed = rms(hidden, w["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), normed], -1)  # [n, 2H]
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    positions = torch.arange(n)
    q, k = rope(q, positions), rope(k, positions)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, HEADS * HEAD_DIM)
    h = (normed if norm_first else hidden) + attended @ w["midlayer.self_attn.o_proj.weight"].T
    gate = rms(h, w["midlayer.post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(gate @ w["midlayer.mlp.gate_proj.weight"].T) * (
        gate @ w["midlayer.mlp.up_proj.weight"].T
    )
    return h + mlp @ w["midlayer.mlp.down_proj.weight"].T


def reference_drafts(target, w: dict, aux: list[int], norm_first: bool, tokens: torch.Tensor, k: int) -> list[int]:
    """k greedy drafts for one unpadded row `tokens` [n]: pairs (embed(x_p), fc(target states at p - 1)) for
    p = 1..n-1, then each draft with the previous output; the draft vocabulary mapped by d2t."""
    with torch.no_grad():
        states = target(tokens[None], output_hidden_states=True).hidden_states  # input of layer i = states[i]
        g = torch.cat([states[i][0] for i in aux], -1)[:-1]  # [n-1, 3H] states of x_0 .. x_{n-2}
        embed = target.get_input_embeddings().weight
        embeds, hidden = embed[tokens[1:]], g @ w["fc.weight"].T  # [n-1, H]
        drafts: list[int] = []
        for _ in range(k):
            out = head_layer(w, embeds, hidden, norm_first)[-1]  # [H]
            logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T  # [Vd]
            draft = int(logits.argmax()) + int(w["d2t"][int(logits.argmax())])
            drafts.append(draft)
            embeds, hidden = torch.cat([embeds, embed[draft][None]]), torch.cat([hidden, out[None]])
    return drafts


def check_drafts(steps: list, target, head_entry, every: int = 1) -> int:
    """Compare the recorded drafts of every `every`-th step with `reference_drafts`; return how many rows."""
    _, w, aux, norm_first = head_entry
    checked = 0
    for token_ids, lengths, pad_lengths, drafts in steps[::every]:
        for i in range(token_ids.shape[0]):
            num = int((drafts[i] >= 0).sum())
            if num:
                row = token_ids[i, pad_lengths[i] : lengths[i]]
                assert drafts[i, :num].tolist() == reference_drafts(target, w, aux, norm_first, row, num)
                checked += 1
    return checked


# -- tests -----------------------------------------------------------------------------------------------------------


def test_both_layouts_load_with_their_settings(heads) -> None:
    eagle, _, _, _ = heads["eagle"]
    speculators, weights, _, _ = heads["speculators"]
    assert (eagle.layout, speculators.layout) == ("eagle", "speculators")
    assert eagle.aux_layer_ids is None and eagle.layer_ids_for(LAYERS) == [2, 3, 3]
    assert speculators.aux_layer_ids == [1, 4, 5] and speculators.norm_before_residual
    assert eagle.draft_vocab_size == VOCAB // 2 and eagle.embed_tokens is None
    assert torch.equal(speculators.midlayer.self_attn.q_proj.weight, weights["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(speculators.draft_to_target()[speculators.t2d[speculators.draft_to_target()]],
                       speculators.draft_to_target())  # fmt: skip


@pytest.mark.parametrize("name", ["eagle", "speculators"])
def test_every_draft_equals_the_heads_equations(target, heads, name, monkeypatch) -> None:
    head = heads[name][0]
    inputs = make_prompts(3, vocab=VOCAB, seed=5, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    steps = record_proposals(monkeypatch, Eagle3Proposer)
    spec = hf_specdec.SpecDecoder(draft_head=head, num_speculative_tokens=3)
    assert spec.method == "eagle3"
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=12, do_sample=False), expected)
    assert check_drafts(steps, target, heads[name]) > 0


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_matches_generate(bigram_target, heads, batch_size, k, monkeypatch) -> None:
    target = bigram_target
    inputs = make_prompts(batch_size, vocab=VOCAB, seed=batch_size, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    steps = record_proposals(monkeypatch, Eagle3Proposer)
    spec = hf_specdec.SpecDecoder(draft_head=heads["agree"][0], num_speculative_tokens=k)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=16, do_sample=False), expected)
    stats = spec.last_stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert check_drafts(steps, target, heads["agree"], every=max(1, len(steps) // 3)) > 0


def test_compacted_head_cache_keeps_the_drafts(bigram_target, heads, monkeypatch) -> None:
    """Ragged rows leave holes in the head's cache; compacting them (forced early here) changes no draft."""
    from hf_specdec import cache as cache_module

    monkeypatch.setattr(cache_module, "COMPACT_MIN_COLUMNS", 4)
    monkeypatch.setattr(cache_module, "COMPACT_HOLE_SHARE", 0.05)
    compactions = []
    compact = cache_module.CacheView.compact

    def counting(view, keep):  # noqa: ANN001, ANN202
        compactions.append(type(view).__name__)
        compact(view, keep)

    monkeypatch.setattr(cache_module.CacheView, "compact", counting)
    target = bigram_target
    inputs = make_prompts(4, vocab=VOCAB, seed=11, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    steps = record_proposals(monkeypatch, Eagle3Proposer)
    spec = hf_specdec.SpecDecoder(draft_head=heads["agree"][0], num_speculative_tokens=4)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=20, do_sample=False), expected)
    assert "Eagle3ContextView" in compactions
    assert check_drafts(steps, target, heads["agree"]) > 0


@pytest.mark.library_default
def test_install_routes_assistant_model_with_the_adaptive_schedule(bigram_target, heads) -> None:
    target = bigram_target
    inputs = make_prompts(3, vocab=VOCAB, seed=9, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    hf_specdec.install()
    try:
        out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=heads["agree"][0])
    finally:
        hf_specdec.uninstall()
    assert torch.equal(out, expected)


def test_sampling_follows_the_target_law(tmp_path) -> None:
    """Drafts sampled from a reduced vocabulary (half the target's): tokens outside it get q = 0, and the output
    still has the target's law."""
    small = make_model("llama", seed=0, layers=LAYERS, vocab=12)
    path = tmp_path / "head"
    path.mkdir()
    # The target's likely tokens after the prompt are 6, 9 and 2; a draft vocabulary with two of them and a nearly
    # flat law over it is accepted often and rejected often.
    weights = head_weights(small, 6, seed=4, chosen=torch.tensor([1, 3, 6, 8, 9, 11]))
    weights["lm_head.weight"] *= 0.1
    save_speculators_layout(path, weights, 12, 6, [1, 3, LAYERS], False)
    head = hf_specdec.load_draft_head(path)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11, 5, 6]])
    samples = 6000
    inputs = {"input_ids": prompt.expand(samples, -1), "attention_mask": torch.ones(samples, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(draft_head=head, num_speculative_tokens=2, seed=1234)
    out = spec_generate(small, inputs, spec, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0)
    assert 0.05 < spec.last_stats.acceptance_rate < 0.95, spec.last_stats
    check_first_tokens(out, prompt, exact_joint_law(small, prompt, 3, 1.0), 3)


def test_draft_probabilities_are_zero_outside_the_draft_vocabulary(target, heads) -> None:
    head = heads["eagle"][0]
    proposer = Eagle3Proposer(target, head, 2)
    logits = proposer._target_logits(torch.randn(2, head.draft_vocab_size))  # [2, V]
    assert torch.equal(torch.isfinite(logits[0]), head.t2d)
    assert torch.equal(logits[:, head.draft_to_target()].isfinite().all(1), torch.tensor([True, True]))


def test_refusals_teach(target, heads, tmp_path) -> None:
    head = heads["eagle"][0]
    inputs = make_prompts(2, vocab=VOCAB, seed=1)
    spec = hf_specdec.SpecDecoder(draft_head=head, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="hidden_size=64"):  # a head trained for another target
        spec_generate(make_model("llama", hidden=32, vocab=VOCAB, layers=LAYERS), inputs, spec, max_new_tokens=4)
    with pytest.raises(ValueError, match="onto 48 target tokens"):
        spec_generate(make_model("llama", vocab=64, layers=LAYERS), inputs, spec, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"layers \[1, 4, 5\].*4 decoder layers"):
        spec = hf_specdec.SpecDecoder(draft_head=heads["speculators"][0])
        spec_generate(make_model("llama", vocab=VOCAB, layers=4), inputs, spec, max_new_tokens=4)
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
        hf_specdec.SpecDecoder(method="eagle3")
    with pytest.raises(ValueError, match="only method='eagle3' uses"):
        hf_specdec.SpecDecoder(method="ngram", draft_head=head)
    with pytest.raises(ValueError, match="draft_confidence_threshold"):
        hf_specdec.SpecDecoder(draft_head=head, draft_confidence_threshold=0.4)
    with pytest.raises(TypeError, match="load_draft_head"):
        spec_generate(target, inputs, hf_specdec.SpecDecoder(method="eagle3", draft_head=target), max_new_tokens=4)
    with pytest.raises(ValueError, match="no config.json"):
        hf_specdec.load_draft_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(layer_config(VOCAB)))
    with pytest.raises(ValueError, match="neither model.safetensors nor pytorch_model.bin"):
        hf_specdec.load_draft_head(tmp_path)
    weights = head_weights(target, VOCAB // 2, seed=1)
    save_eagle_layout(tmp_path, {**weights, "lm_head.weight": weights["lm_head.weight"][:, :32]}, VOCAB, VOCAB // 2)
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(24, 32\)"):
        hf_specdec.load_draft_head(tmp_path)
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        hf_specdec.load_draft_head(tmp_path)
    hf_specdec.install()
    try:
        with pytest.raises(ValueError, match="assistant_confidence_threshold"):
            target.generate(**inputs, max_new_tokens=4, assistant_model=head, assistant_confidence_threshold=0.4)
    finally:
        hf_specdec.uninstall()
    longer, cache = filled_cache_call(target, inputs)
    with pytest.raises(NotImplementedError, match="filled past_key_values"):
        spec_generate(target, longer, hf_specdec.SpecDecoder(draft_head=head), max_new_tokens=4, past_key_values=cache)


def test_rows_that_finish_early_leave_the_heads_cache(bigram_target, heads, monkeypatch) -> None:
    """A row that draws EOS leaves the batch (select_rows on the head's view, queued context and offsets); the others
    keep drafting exactly."""
    target = bigram_target
    inputs = make_prompts(5, vocab=VOCAB, seed=21, repetitive=False)
    first = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    width = inputs["input_ids"].shape[1]
    eos = int(first[0, width + 2])  # row 0's third token ends it early
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    lengths = (expected[:, width:] != 0).sum(1)
    assert lengths.min() < lengths.max(), "the test needs rows that stop at different steps"
    steps = record_proposals(monkeypatch, Eagle3Proposer)
    spec = hf_specdec.SpecDecoder(draft_head=heads["agree"][0], num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, expected)
    assert min(step[0].shape[0] for step in steps) < 5  # rows left the batch
    assert check_drafts(steps, target, heads["agree"]) > 0
