"""Adaptive speculation length: the decision function, the online cost tables, and greedy equality end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec import adaptive
from hf_specdec.adaptive import AdaptiveSchedule, StepCosts, best_num_drafts, expected_tokens
from hf_specdec.batch import RaggedBatch

K = 8


def _linear_costs(slope: float, k: int = K) -> torch.Tensor:  # [k + 1] step time of widths 1..k+1
    return 1.0 + slope * torch.arange(k + 1, dtype=torch.float32)


def test_expected_tokens_is_the_geometric_sum():
    a = torch.tensor([0.0, 0.5, 1.0, 0.9])
    k = torch.tensor([4.0, 2.0, 3.0, 0.0])
    assert torch.allclose(expected_tokens(a, k), torch.tensor([1.0, 1.75, 4.0, 1.0]))


def test_no_speculation_when_verify_is_expensive_and_acceptance_low():
    acceptance = torch.tensor([0.0, 0.1, 0.3])
    assert best_num_drafts(acceptance, _linear_costs(0.5)).tolist() == [0, 0, 0]


def test_large_k_when_acceptance_is_high_and_verify_cheap():
    k = best_num_drafts(torch.tensor([0.95, 0.99]), _linear_costs(0.03))
    assert k.tolist()[1] == K and k.tolist()[0] >= 6


def test_per_row_choice_and_margin():
    costs = _linear_costs(0.2)
    k = best_num_drafts(torch.tensor([0.0, 0.6, 0.9]), costs)
    assert k[0] == 0 and 0 < k[1] < k[2]
    # A gain smaller than the margin is not taken: a = 0.22 with one draft gains 1.22 / 1.2 - 1 = 1.7% here.
    assert best_num_drafts(torch.tensor([0.22]), costs, margin=0.03).item() == 0
    assert best_num_drafts(torch.tensor([0.22]), costs, margin=0.0).item() == 1


def test_step_costs_interpolate_and_extrapolate():
    costs = StepCosts(max_k=4)
    for width, seconds in ((1, 9.0), (1, 1.0), (3, 5.0), (3, 2.0)):  # first samples are warm-up outliers
        costs.record(width, seconds)
    table = costs.table()
    assert torch.allclose(table, torch.tensor([1.0, 1.5, 2.0, 2.5, 3.0]))
    only_plain = StepCosts(max_k=2)
    only_plain.record(1, 2.0)
    assert torch.allclose(only_plain.table(prior_slope=0.1), torch.tensor([2.0, 2.2, 2.4]))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(monkeypatch, slope: float, acceptance: float, steps: int = 200, batch_size: int = 2) -> list[int]:
    """Run the schedule against a simulated step cost `1 + slope * (w - 1)` and i.i.d. acceptance; return its k's."""
    clock = FakeClock()
    monkeypatch.setattr(adaptive.time, "perf_counter", clock)
    schedule = AdaptiveSchedule(K, model=None, cost_key="sim")
    schedule.start(batch_size, torch.device("cpu"))
    batch = RaggedBatch(
        torch.zeros(batch_size, 4, dtype=torch.long),
        torch.full((batch_size,), 4),
        torch.zeros(batch_size, dtype=torch.long),
        torch.arange(batch_size),
        4,
    )
    g = torch.Generator().manual_seed(0)
    chosen = []
    for _ in range(steps):
        k = schedule.budgets(batch)
        chosen.append(int(k.max()))
        draws = torch.rand(batch_size, K, generator=g) < acceptance  # [B, K]
        accepted = torch.where(draws.all(1), K, (~draws).int().argmax(1))
        schedule.observe(k, torch.minimum(accepted, k))
        clock.now += 1.0 + slope * int(k.max())
    return chosen


def test_online_schedule_switches_itself_off(monkeypatch):
    chosen = _simulate(monkeypatch, slope=0.5, acceptance=0.05)
    # After the first probes speculation stays off, apart from rare cheap re-probes.
    assert sum(k > 0 for k in chosen[50:]) <= 10, chosen
    assert sum(chosen[50:]) / 150 < 0.3


def test_online_schedule_speculates_long_when_it_pays(monkeypatch):
    chosen = _simulate(monkeypatch, slope=0.03, acceptance=0.95)
    late = chosen[50:]
    assert sum(k >= 6 for k in late) >= 0.9 * len(late), chosen


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_adaptive_greedy_matches_plain_generate(llama, method):
    inputs = make_prompts(3, seed=4)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    expected = llama.generate(**inputs, **kwargs)
    draft = make_noisy_copy(llama, noise=0.01) if method == "draft" else None
    spec = hf_specdec.SpecDecoder(
        method=method, draft_model=draft, num_speculative_tokens=6, num_speculative_tokens_schedule="adaptive"
    )
    for _ in range(2):  # the second call reuses the cost tables learned by the first
        assert torch.equal(spec_generate(llama, inputs, spec, **kwargs), expected)


def test_adaptive_sampling_runs_with_a_seed(llama, llama_draft):
    inputs = make_prompts(2, seed=1)
    spec = hf_specdec.SpecDecoder(draft_model=llama_draft, num_speculative_tokens=4, seed=3,
                                  num_speculative_tokens_schedule="adaptive")  # fmt: skip
    out = spec_generate(llama, inputs, spec, max_new_tokens=12, do_sample=True)
    assert out.shape[1] <= inputs["input_ids"].shape[1] + 12


def test_bad_schedule_name_says_what_to_pass():
    with pytest.raises(ValueError, match="'adaptive'.*got 'fast'|got 'fast'"):
        hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens_schedule="fast")
