"""Per-request draft lengths: constant, HF's heuristic (1..K) and the adaptive variant (0..K with probes)."""

from __future__ import annotations

import random

import pytest
import torch
from cb_helpers import greedy_config, installed, plain_and_spec  # noqa: F401 (installed: the autouse fixture)
from conftest import make_model

import hf_specdec
from hf_specdec.continuous_batching.schedule import MAX_PROBE_EVERY, PROBE_EVERY, RequestSchedule


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


def _step(schedule: RequestSchedule, request_id: str, accepted_if_drafted: int | None = 0) -> int:
    """One loop step of one request: tick, budget, verify (all drafts accepted when `accepted_if_drafted` is None)."""
    schedule.tick()
    k = schedule.budget(request_id)
    schedule.record(request_id, k, k if accepted_if_drafted is None else min(k, accepted_if_drafted))
    return k


def test_adaptive_steps_down_to_zero_when_nothing_is_kept_and_stays_at_k_when_all_is():
    schedule = RequestSchedule("adaptive", 4)
    ks = [_step(schedule, "r") for _ in range(8)]
    assert ks[0] == 4 and ks == sorted(ks, reverse=True) and ks[-1] == 0
    schedule = RequestSchedule("adaptive", 4)
    assert [_step(schedule, "r", accepted_if_drafted=None) for _ in range(20)] == [4] * 20


def _mean_k(alpha: float, k_max: int = 4, steps: int = 400, seed: int = 0) -> float:
    """Mean draft length of one request whose drafts are each accepted with probability `alpha`."""
    rng = random.Random(seed)
    schedule, ks = RequestSchedule("adaptive", k_max), []
    for _ in range(steps):
        schedule.tick()
        k = schedule.budget("r")
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        schedule.record("r", k, accepted)
        ks.append(k)
    return sum(ks) / len(ks)


def test_adaptive_k_follows_the_acceptance():
    """The draft length grows with the per-draft acceptance: a strong draft drafts K (HF's +2/-1 rule averaged
    about 2 of 4 at alpha 0.8), a weak one almost nothing."""
    means = {alpha: _mean_k(alpha) for alpha in (0.1, 0.5, 0.8, 0.95)}
    assert means[0.95] >= 3.8 and means[0.8] >= 3.3
    assert 0.5 <= means[0.5] <= 2.5
    assert means[0.1] <= 0.2
    assert means[0.1] < means[0.5] < means[0.8] <= means[0.95]


def test_adaptive_probes_on_the_clock_with_a_doubling_wait():
    schedule = RequestSchedule("adaptive", 3)
    ks = [_step(schedule, "r") for _ in range(200)]
    stopped = ks.index(0) + 1  # the first step without drafts
    probes = [step for step, k in enumerate(ks, start=1) if k == 1 and step > stopped]
    assert all(step % PROBE_EVERY == 0 for step in probes)  # on the shared clock
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY] and set(gaps[3:]) == {MAX_PROBE_EVERY}
    # probes that pay resume drafting and reset the wait
    while _step(schedule, "r", accepted_if_drafted=None) == 0:
        pass
    assert schedule.budget("r") >= 1 and "r" not in schedule._wait
    assert schedule.budget("other") == 3  # each request its own


def test_probes_of_requests_that_stopped_at_different_steps_share_steps():
    schedule = RequestSchedule("adaptive", 2)
    probes: dict[str, list[int]] = {"a": [], "b": []}
    for step in range(1, 300):
        schedule.tick()
        for request_id in ("a", "b") if step >= 4 else ("a",):  # b arrives 3 steps later
            stopped = schedule.k_of(request_id) == 0
            k = schedule.budget(request_id)
            schedule.record(request_id, k, 0)
            if stopped and k == 1:
                probes[request_id].append(step)
    assert probes["a"] and probes["b"]
    assert all(step % PROBE_EVERY == 0 for step in probes["a"] + probes["b"])
    assert set(probes["b"][-2:]) <= set(probes["a"])  # once both wait the longest, they probe on the same steps


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
