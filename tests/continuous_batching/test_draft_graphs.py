"""The draft's captured forwards in continuous batching (`draft_graphs.py`), on the CPU's emulation of CUDA graphs:
plain `generate_batch`'s tokens, the same drafts as eager forwards, replays where shapes repeat, a capture CUDA would
refuse running eagerly with a warning, and graphs dropped when the draft changes."""

from __future__ import annotations

import copy

import pytest
import torch
from cb_helpers import cb_config, greedy_config, installed, plain_and_spec, tokens  # noqa: F401 (the autouse fixture)
from conftest import make_model

import hf_specdec
from hf_specdec.continuous_batching import draft_graphs
from hf_specdec.continuous_batching.draft_graphs import DraftGraphs, kv_bucket

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6], [9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41], [7] * 9]


@pytest.fixture
def made(monkeypatch) -> list[DraftGraphs]:
    """Every `DraftGraphs` the proposers make during the test."""
    found: list[DraftGraphs] = []
    original = DraftGraphs.for_device.__func__

    def for_device(cls, device, **kwargs):  # noqa: ANN001, ANN202
        graphs = original(cls, device, **kwargs)
        if graphs is not None:
            found.append(graphs)
        return graphs

    monkeypatch.setattr(DraftGraphs, "for_device", classmethod(for_device))
    return found


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = make_model("llama", seed=0)
    draft = copy.deepcopy(target)  # drafts the target's own tokens: long accepted blocks, many forwards
    with torch.no_grad():  # ... except where a little noise changes its mind
        for p in draft.model.layers[0].mlp.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return target, draft


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
def test_captured_draft_forwards_give_plain_tokens_and_the_eager_drafts(emulated_graphs, made, schedule):
    target, draft = _pair()
    config = greedy_config(max_new_tokens=30, eos_token_id=-1)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4, num_speculative_tokens_schedule=schedule)
    plain, captured = plain_and_spec(target, PROMPTS, spec, config)
    assert captured == plain
    assert made and sum(g.replays for g in made) > 10 and all(g.enabled for g in made)
    assert all(len(key) >= 2 and key[0] % 64 == 0 for g in made for key in g.graphs)  # padded query sizes
    captured_stats = spec.last_stats

    made.clear()
    with pytest.MonkeyPatch.context() as patch:  # the same run with eager forwards only
        patch.setattr(draft_graphs, "MAX_CAPTURED_TOKENS", 0)
        eager = tokens(
            target.generate_batch(PROMPTS, config, continuous_batching_config=cb_config(), spec_decoder=spec)
        )
    assert eager == plain and sum(g.replays for g in made) == 0
    assert spec.last_stats.num_draft_tokens == captured_stats.num_draft_tokens
    assert spec.last_stats.num_accepted_tokens == captured_stats.num_accepted_tokens


def test_no_graphs_where_steps_are_not_captured(made):
    """Without the emulation, the CPU runs every draft forward eagerly (CUDA graphs exist on CUDA only)."""
    target, draft = _pair()
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    plain, out = plain_and_spec(target, PROMPTS[:2], spec, greedy_config(max_new_tokens=12, eos_token_id=-1))
    assert out == plain and made == []


def test_a_capture_cuda_would_refuse_runs_eagerly_with_a_warning(emulated_graphs, made):
    target, draft = _pair()
    reads = []
    draft.model.layers[0].register_forward_hook(lambda m, a, out: reads.append(out[0].sum().item()))  # a host read
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=3, num_speculative_tokens_schedule="constant"
    )
    with pytest.warns(UserWarning, match="run eagerly: capturing one failed"):
        plain, out = plain_and_spec(target, PROMPTS, spec, greedy_config(max_new_tokens=20, eos_token_id=-1))
    assert out == plain
    assert made and not made[0].enabled and made[0].graphs == {}


def test_graphs_are_dropped_when_the_draft_changes(emulated_graphs, made):
    target, draft = _pair()
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=3, num_speculative_tokens_schedule="constant"
    )
    plain_and_spec(target, PROMPTS[:3], spec, greedy_config(max_new_tokens=16, eos_token_id=-1))
    graphs = made[-1]
    assert graphs.graphs
    graphs.check_model()  # unchanged: kept
    assert graphs.graphs
    draft.lm_head.weight = torch.nn.Parameter(draft.lm_head.weight.detach().clone())  # a replaced weight
    graphs.check_model()
    assert graphs.graphs == {} and graphs.seen == set()


def test_kv_bucket_pads_by_at_most_a_quarter():
    for size in [1, 100, 256, 257, 1000, 4097, 5000, 20000, 100_000]:
        padded = kv_bucket(size, 1 << 30)
        assert padded >= size and (padded - size <= max(draft_graphs.MIN_KV_STEP, size // 4))
    assert kv_bucket(0, 4096) == 0 and kv_bucket(5000, 4096) == 4096


def test_sampling_with_captured_draft_forwards_draws_what_eager_forwards_draw(emulated_graphs, made):
    """Sampling reads the draft's probabilities from the replayed logits: with one seed, the same tokens as eager
    forwards (draws are keyed by request and position, so equal drafts give equal outputs)."""
    target, draft = _pair()
    config = greedy_config(max_new_tokens=24, eos_token_id=-1, do_sample=True, temperature=0.8, top_p=0.9)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3, seed=7)
    captured = tokens(target.generate_batch(PROMPTS, config, continuous_batching_config=cb_config(), spec_decoder=spec))
    assert sum(g.replays for g in made) > 5
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_graphs, "MAX_CAPTURED_TOKENS", 0)
        eager = tokens(
            target.generate_batch(PROMPTS, config, continuous_batching_config=cb_config(), spec_decoder=spec)
        )
    assert captured == eager
