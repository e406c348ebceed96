"""EAGLE-3 heads on static caches (`hf_specdec/proposers/eagle3_static.py`), with steps captured (CUDA graphs emulated on
the CPU: tests/emulated_graphs.py) and without.

Both published layouts, a draft vocabulary half the target's: every draft of an uncaptured static call equals the
head's equations (test_eagle3.py's reference); captured calls at batch 3 (left-padded) give plain `generate`'s greedy
tokens and the uncaptured static path's acceptance, replaying their steps; seeded sampling draws the same captured and
uncaptured, and keeps the target's law; calls of equal shapes adopt the kept graphs and stay exact.

The captured tests use an "agreeing" target and head: the target's layers barely write to the residual stream and
its embeddings live in the 32 dimensions the head's attention carries, so the head (attending to its own slot)
mostly predicts the target's next token; acceptance is ragged (partial and full accepts).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_prompts, record_proposals, spec_generate
from core.test_emulated_capture import assert_captured_drafts_equal_uncaptured, captured_and_uncaptured_stats
from first_tokens_law import check_first_tokens, exact_joint_law
from proposers.test_eagle3 import LAYERS, VOCAB, check_drafts, head_weights, save_eagle_layout, save_speculators_layout

import hf_specdec
from hf_specdec import graph_reuse
from hf_specdec.proposers.eagle3_static import StaticEagle3Proposer

pytestmark = pytest.mark.usefixtures("one_thread")
STATIC = dict(do_sample=False, cache_implementation="static")
AUX = {"eagle": [2, LAYERS // 2, LAYERS - 3], "speculators": [1, 4, 5]}  # the eagle layout's default ids


def save_head(path, weights: dict, layout: str):  # noqa: ANN001
    """Write `weights` in `layout` and load them back: (head, weights, aux ids, norm_before_residual)."""
    path.mkdir()
    if layout == "eagle":
        save_eagle_layout(path, weights, VOCAB, VOCAB // 2)
    else:
        save_speculators_layout(path, weights, VOCAB, VOCAB // 2, AUX[layout], True)
    return hf_specdec.load_draft_head(path), weights, AUX[layout], layout == "speculators"


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0, layers=LAYERS, vocab=VOCAB)


@pytest.fixture(scope="module")
def agreeing_target():
    """A tiny Llama whose next token is (nearly) a function of the current one, read from 32 embedding dims."""
    model = make_model("llama", seed=0, layers=LAYERS, vocab=VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
        model.model.embed_tokens.weight[:, 32:] = 0
    return model


@pytest.fixture(scope="module")
def random_heads(target, tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle3_static")
    return {
        layout: save_head(base / layout, head_weights(target, VOCAB // 2, seed), layout)
        for layout, seed in (("eagle", 1), ("speculators", 2))
    }


@pytest.fixture(scope="module")
def agreeing_heads(agreeing_target, tmp_path_factory):
    """Heads in both layouts that mostly draft the agreeing target's next token: their draft vocabulary (half the
    target's) holds the target's likeliest next tokens first; a small random `fc` makes drafts read the target's
    states too."""
    with torch.no_grad():
        following = agreeing_target(torch.arange(VOCAB)[:, None]).logits[:, 0].argmax(-1)  # [V]
    likely = torch.unique(following).tolist()
    others = [t for t in range(VOCAB) if t not in likely]
    chosen = torch.tensor(sorted((likely + others)[: VOCAB // 2]))
    base = tmp_path_factory.mktemp("eagle3_agreeing")
    heads = {}
    for layout, seed in (("eagle", 3), ("speculators", 4)):
        weights = head_weights(agreeing_target, VOCAB // 2, seed, agree=True, chosen=chosen)
        weights["fc.weight"] = torch.randn(weights["fc.weight"].shape, generator=torch.Generator().manual_seed(seed))
        weights["fc.weight"] *= 0.02
        heads[layout] = save_head(base / layout, weights, layout)
    return heads


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_static_drafts_equal_the_heads_equations(target, random_heads, layout, monkeypatch) -> None:
    """Uncaptured static steps (the context fed in commit at the verify's width, k head forwards per step): every
    draft is the head's own forward over the row's whole sequence, and the output is plain's."""
    inputs = make_prompts(3, vocab=VOCAB, seed=5, repetitive=False)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    steps = record_proposals(monkeypatch, StaticEagle3Proposer)
    spec = hf_specdec.SpecDecoder(draft_head=random_heads[layout][0], num_speculative_tokens=3)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=12, **STATIC), expected)
    assert spec.last_stats.num_graph_replays == 0  # no GPU, no emulation: the static steps ran uncaptured
    assert check_drafts(steps, target, random_heads[layout]) > 0


@pytest.mark.parametrize(
    ("layout", "schedule"), [("eagle", "constant"), ("speculators", "constant"), ("speculators", "adaptive")]
)
def test_captured_steps_equal_plain(emulated_graphs, agreeing_target, agreeing_heads, layout, schedule) -> None:
    """Batch 3, left-padded, greedy: the steps replay, the tokens are plain's, and the acceptance is the uncaptured
    static path's (the same drafts); with the adaptive schedule, plain and drafting steps are both captured."""
    target = agreeing_target
    inputs = make_prompts(3, vocab=VOCAB, seed=2, repetitive=False)
    gen = dict(max_new_tokens=20, eos_token_id=None)
    expected = target.generate(**inputs, **gen, do_sample=False)
    spec = dict(
        draft_head=agreeing_heads[layout][0], num_speculative_tokens=2, num_speculative_tokens_schedule=schedule
    )
    stats = captured_and_uncaptured_stats(target, inputs, spec, gen, expected)
    if schedule == "constant":
        drafted, accepted = stats[True].num_draft_tokens, stats[True].num_accepted_tokens
        assert 0 < accepted < drafted, stats[True]
        assert stats[True].accepted_per_position[-1] > 0, stats[True]  # some rows accepted every draft
        assert stats[True].accepted_per_position == stats[False].accepted_per_position


def test_captured_sampling_draws_what_the_uncaptured_step_draws(emulated_graphs, agreeing_target, agreeing_heads,
                                                               monkeypatch) -> None:  # fmt: skip
    """Seeded sampling from the reduced draft vocabulary: the captured call draws exactly the uncaptured one's tokens
    (the draft probabilities, and so the acceptances and residual draws, depend on every draft's inputs)."""
    gen = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.95, eos_token_id=None,
               cache_implementation="static")  # fmt: skip
    spec = dict(draft_head=agreeing_heads["speculators"][0], num_speculative_tokens=3, seed=5)
    inputs = make_prompts(3, vocab=VOCAB, seed=17, repetitive=False)
    assert_captured_drafts_equal_uncaptured(agreeing_target, inputs, spec, gen, monkeypatch)


def test_sampling_on_static_caches_follows_the_target_law(tmp_path, monkeypatch) -> None:
    """test_eagle3.py's law test on static caches: a reduced vocabulary (half the target's), q = 0 outside it."""
    from hf_specdec import cache_route

    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)  # 6000 rows: keep the static caches short
    small = make_model("llama", seed=0, layers=LAYERS, vocab=12)
    weights = head_weights(small, 6, seed=4, chosen=torch.tensor([1, 3, 6, 8, 9, 11]))
    weights["lm_head.weight"] *= 0.1
    save_speculators_layout(tmp_path, weights, 12, 6, [1, 3, LAYERS], False)
    head = hf_specdec.load_draft_head(tmp_path)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11, 5, 6]])
    samples = 6000
    inputs = {"input_ids": prompt.expand(samples, -1), "attention_mask": torch.ones(samples, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(draft_head=head, num_speculative_tokens=2, seed=1234)
    out = spec_generate(small, inputs, spec, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0,
                        cache_implementation="static")  # fmt: skip
    assert 0.05 < spec.last_stats.acceptance_rate < 0.95, spec.last_stats
    check_first_tokens(out, prompt, exact_joint_law(small, prompt, 3, 1.0), 3)


def test_calls_that_adopt_kept_graphs_give_plain_output(adopted, emulated_graphs, agreeing_target,
                                                       agreeing_heads) -> None:  # fmt: skip
    """Calls of one batch size, with prompts and answers of other lengths in one cache-length bucket: each later one
    adopts the graphs and state (the head's static cache among them) that its predecessor kept, and gives plain's
    tokens; a call of another batch size captures its own."""

    target = agreeing_target
    graph_reuse.clear(target)  # graphs an earlier test of this module kept would serve the first call
    for batch_size, seed, width, new in ((3, 1, 6, 16), (3, 2, 9, 11), (3, 3, 7, 21), (2, 4, 6, 16)):
        inputs = make_prompts(batch_size, vocab=VOCAB, seed=seed, min_len=width - 2, max_len=width, repetitive=False)
        gen = dict(max_new_tokens=new, do_sample=False, eos_token_id=None)
        spec = hf_specdec.SpecDecoder(draft_head=agreeing_heads["eagle"][0], num_speculative_tokens=3)
        assert torch.equal(spec_generate(target, inputs, spec, **gen, cache_implementation="static"),
                           target.generate(**inputs, **gen)), seed  # fmt: skip
        assert spec.last_stats.num_graph_replays > 0 and spec.last_stats.num_accepted_tokens > 0
    assert adopted == [False, True, True, False]
    graph_reuse.clear(target)
