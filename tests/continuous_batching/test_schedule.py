"""Per-request draft lengths: constant, HF's heuristic (1..K) and the adaptive variant (0..K with probes)."""

from __future__ import annotations

import pytest
import torch
from cb_helpers import greedy_config, installed, plain_and_spec  # noqa: F401 (installed: the autouse fixture)
from conftest import make_model

import hf_specdec
from hf_specdec.continuous_batching.schedule import PROBE_EVERY, RequestSchedule


def test_constant_keeps_k():
    schedule = RequestSchedule("constant", 4)
    schedule.record("r", 4, 0)
    assert schedule.budget("r") == 4


def test_heuristic_moves_within_one_and_k():
    schedule = RequestSchedule("heuristic", 5)
    for _ in range(10):
        schedule.record("r", schedule.budget("r"), 0)
    assert schedule.budget("r") == 1
    schedule.record("r", 1, 1)
    assert schedule.budget("r") == 3
    schedule.record("r", 3, 3)
    schedule.record("r", 5, 5)
    assert schedule.budget("r") == 5  # capped at K


def test_adaptive_stops_drafting_and_probes():
    schedule = RequestSchedule("adaptive", 3)
    for _ in range(3):
        schedule.record("r", schedule.budget("r"), 0)
    assert schedule.budget("r") == 0
    for _ in range(PROBE_EVERY - 1):
        schedule.record("r", 0, 0)
        assert schedule.budget("r") == 0
    schedule.record("r", 0, 0)
    assert schedule.budget("r") == 1  # a probe
    schedule.record("r", 1, 0)  # it failed: back to idling
    assert schedule.budget("r") == 0
    for _ in range(PROBE_EVERY):
        schedule.record("r", 0, 0)
    schedule.record("r", schedule.budget("r"), 1)  # a probe that pays: drafting resumes
    assert schedule.budget("r") == 2
    assert schedule.budget("other") == 3  # each request its own


@pytest.mark.parametrize("mode", ["adaptive", "heuristic"])
def test_useless_draft_drafts_little_under_adaptive(mode):
    """A draft that is never right: the adaptive schedule soon stops drafting (outputs stay plain's)."""
    target = make_model("llama", seed=0)
    draft = make_model("llama", seed=5, layers=1, hidden=32)
    with torch.no_grad():  # a draft that always proposes token 95 (which the target never picks here)
        draft.lm_head.weight.zero_()
        draft.lm_head.bias = None
        draft.lm_head.weight[95].fill_(1.0)
        draft.model.norm.weight.fill_(1.0)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4, num_speculative_tokens_schedule=mode)
    inputs = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10]]
    plain, spec_out = plain_and_spec(target, inputs, spec, greedy_config(max_new_tokens=40, eos_token_id=-1))
    assert spec_out == plain
    drafted = spec.last_stats.num_draft_tokens
    if mode == "adaptive":
        assert drafted <= 2 * (4 + 3 + 2 + 1 + 40 // PROBE_EVERY)
    else:
        assert drafted >= 2 * 30  # HF's heuristic never goes below one draft per step
