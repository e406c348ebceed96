"""`hf_specdec.proposers.draft_model`: the draft's catch-up widths are warmed once per draft model where a forward's
first run at a new shape is costly (a GPU; forced here on the CPU), and the warm-up leaves no trace in the output."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec.proposers import draft_model
from hf_specdec.static_cache import StaticCacheView

pytestmark = pytest.mark.usefixtures("one_thread")


def test_catch_up_widths_are_warmed_once_and_change_nothing(monkeypatch, emulated_graphs):
    monkeypatch.setattr(draft_model, "builds_plans_per_shape", lambda device: True)
    widths: list[int] = []
    forward = StaticCacheView.forward

    def recording(self, token_ids, num_new, logits_to_keep=None, width=None, eager=False):  # noqa: ANN001, ANN202
        if eager:
            widths.append(width)
        return forward(self, token_ids, num_new, logits_to_keep, width, eager)

    monkeypatch.setattr(StaticCacheView, "forward", recording)
    warm_forwards: list[int] = []  # per call: the eager forwards its warm-up ran
    warm = draft_model.DraftModelProposer._warm_catch_up

    def counting(self, batch):  # noqa: ANN001, ANN202
        before = len(widths)
        warm(self, batch)
        warm_forwards.append(len(widths) - before)

    monkeypatch.setattr(draft_model.DraftModelProposer, "_warm_catch_up", counting)
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.05)
    inputs = make_prompts(3, seed=2, min_len=4, max_len=12)
    gen = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, cache_implementation="static", **gen)
    assert torch.equal(out, expected)
    warmed = draft_model._WARM_WIDTHS[draft]
    assert {32, 16, 8, 4, 2} <= warmed and set(widths) >= warmed
    assert torch.equal(spec_generate(target, inputs, spec, cache_implementation="static", **gen), expected)
    assert warm_forwards[0] >= 5 and warm_forwards[1] == 0  # the second call warms nothing


@pytest.mark.parametrize("batch", [1, 3])
def test_dynamic_catch_up_after_plain_steps_runs_in_fixed_widths(monkeypatch, batch):
    """Dynamic caches where first runs cost more (a GPU; forced here): a draft that sat out plain steps (or its whole
    prompt, at the first drafting step) catches up in `catch_up_widths` forwards, so the widths it meets are a few
    fixed ones, and the output is plain's."""
    from hf_specdec import adaptive
    from hf_specdec.cache import CacheView

    monkeypatch.setattr(draft_model, "builds_plans_per_shape", lambda device: True)

    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.05)
    draft_widths: list[int] = []
    forward = CacheView.forward

    def recording(self, token_ids, num_new, logits_to_keep=None, host_num_new=None):  # noqa: ANN001, ANN202
        if self.model is draft:
            draft_widths.append(int(host_num_new.max()) if host_num_new is not None else int(num_new.max()))
        return forward(self, token_ids, num_new, logits_to_keep, host_num_new)

    monkeypatch.setattr(CacheView, "forward", recording)
    steps = iter(range(10_000))
    choose = adaptive.AdaptiveSchedule._choose

    def every_seventh(self, keys, num):  # noqa: ANN001, ANN202
        chosen = choose(self, keys, num)
        return num.clone() if next(steps) % 7 == 6 else torch.zeros_like(chosen)

    monkeypatch.setattr(adaptive.AdaptiveSchedule, "_choose", every_seventh)
    inputs = make_prompts(batch, seed=4, min_len=9, max_len=30)
    gen = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=3, num_speculative_tokens_schedule="adaptive"
    )
    out = spec_generate(target, inputs, spec, cache_implementation="dynamic", **gen)
    assert torch.equal(out, expected)
    assert spec.last_stats.num_draft_tokens > 0
    assert set(draft_widths) <= {1, 2, *draft_model.CATCH_UP_WIDTHS}, draft_widths
    assert set(draft_widths) & set(draft_model.CATCH_UP_WIDTHS[:-1]), draft_widths  # a wide catch-up ran


@pytest.mark.parametrize("batch", [1, 3])
def test_one_token_draft_forwards_take_plain_decodings_path_and_draft_the_same(monkeypatch, batch):
    """When every row feeds the draft one token (its drafts after the first), the draft's forward is plain
    decoding's (`CacheView.forward_newest(keep=False)`: a few operations, logged for the rollback). A noisy draft
    (ragged acceptance, so rollbacks cut into those forwards) drafts exactly what `CacheView.forward` makes it
    draft: the same accepted counts per position, call after call."""
    from hf_specdec.cache import CacheView

    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.05, seed=3)
    inputs = make_prompts(batch, seed=5, min_len=3, max_len=14)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    newest = CacheView.forward_newest
    calls = []

    def counted(self, token_ids, keep=True):
        calls.append(keep)
        return newest(self, token_ids, keep)

    def run():
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3,
                                      num_speculative_tokens_schedule="constant")  # fmt: skip
        outs = [spec_generate(target, inputs, spec, **gen) for _ in range(2)]
        stats = spec.last_stats
        return outs, (stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_position)

    monkeypatch.setattr(CacheView, "forward_newest", counted)
    fast_outs, fast = run()
    assert False in calls
    monkeypatch.setattr(CacheView, "forward_newest", lambda self, token_ids, keep=True: None)  # always `forward`
    slow_outs, slow = run()
    expected = target.generate(**inputs, **gen)
    assert all(torch.equal(out, expected) for out in fast_outs + slow_outs)
    assert fast == slow and 0 < fast[1] < fast[0]
