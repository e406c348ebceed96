"""Adaptive speculation length: the width choice, the acceptance statistics, the step costs, the schedule driven
step by step against simulated costs and acceptance, and greedy equality end to end."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec import adaptive
from hf_specdec.adaptive import AcceptanceStats, AdaptiveSchedule, StepCosts, best_width, context_bucket
from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.base import Proposal

K = 8


def _linear_costs(slope: float, k: int = K) -> torch.Tensor:  # [k + 1] step time of widths 1..k+1
    return 1.0 + slope * torch.arange(k + 1, dtype=torch.float32)


def _geometric(acceptance: list[float], k: int = K) -> torch.Tensor:  # [B, k] S(j) = a^j
    return torch.tensor(acceptance)[:, None] ** torch.arange(1, k + 1)


def test_no_speculation_when_verify_is_expensive_and_acceptance_low():
    width, used = best_width(_geometric([0.1, 0.3]), torch.tensor([K, K]), _linear_costs(0.5))
    assert width == 1 and used.tolist() == [0, 0]


def test_long_verify_when_acceptance_is_high_and_verify_cheap():
    width, used = best_width(_geometric([0.95, 0.99]), torch.tensor([K, 5]), _linear_costs(0.03))
    assert width == K + 1 and used.tolist() == [K, 5]  # each row verifies all its drafts at the chosen width


def test_cheapest_width_per_token_wins_over_a_narrower_dearer_one():
    # A 2-core CPU's GEMMs: widths 2-3 cost more than 5 (see docs/benchmarks.md); wider ones cost more again.
    costs = torch.tensor([1.0, 1.7, 2.1, 1.5, 1.35, 2.0, 2.2, 2.4, 2.6])
    width, used = best_width(_geometric([0.9]), torch.tensor([K]), costs)
    assert width == 5 and used.tolist() == [4]


def test_never_wider_than_the_longest_draft():
    costs = torch.tensor([1.0, 3.0, 3.0, 1.1, 1.1, 1.1, 1.1, 1.1, 1.1])  # widths 2-3 dear, 4+ cheap
    width, used = best_width(_geometric([0.9, 0.9]), torch.tensor([2, 1]), costs)
    assert width == 1 and used.tolist() == [0, 0]  # the verify could only be 3 wide: not worth it


def test_margin():
    costs = _linear_costs(0.2)
    # One draft with acceptance 0.25 gains 1.25 / 1.2 - 1 = 4%: taken with a 3% margin, not with 5%.
    survival = torch.tensor([[0.25] + [0.0] * (K - 1)])
    assert best_width(survival, torch.tensor([K]), costs, margin=0.03)[0] == 2
    assert best_width(survival, torch.tensor([K]), costs, margin=0.05)[0] == 1


def test_acceptance_stats_are_a_product_limit_estimate():
    stats = AcceptanceStats(max_k=4, prior_weight=0.0, decay=1.0)
    # Key 2: one step of 4 drafts with 1 accepted, one with all 4, one with 2 of 2 (censored after position 2).
    stats.record(torch.tensor([2, 2, 2]), torch.tensor([4, 4, 2]), torch.tensor([1, 4, 2]))
    # Position 1: 3 at risk, 0 rejected; position 2: 3 at risk, 1 rejected; 3 and 4: 1 at risk, 0 rejected.
    expected = torch.tensor([1.0, 2 / 3, 2 / 3, 2 / 3])
    assert torch.allclose(stats.survival(torch.tensor([2]))[0], expected)
    # Rows without drafts are not observations.
    stats.record(torch.tensor([2]), torch.tensor([0]), torch.tensor([0]))
    assert torch.allclose(stats.survival(torch.tensor([2]))[0], expected)


def test_acceptance_stats_start_at_the_prior_and_drift_back_to_it():
    stats = AcceptanceStats(max_k=3, prior=0.5, prior_weight=2.0, decay=1.0, idle_decay=0.9)
    assert torch.allclose(stats.survival(torch.tensor([5])), torch.tensor([[0.5, 0.25, 0.125]]))
    for _ in range(20):
        stats.record(torch.tensor([1]), torch.tensor([3]), torch.tensor([0]))  # key 1 always rejected
    low = float(stats.survival(torch.tensor([1]))[0, 0])
    assert low < 0.1
    for _ in range(50):  # steps in which key 1 is not tried
        stats.record(torch.tensor([3]), torch.tensor([3]), torch.tensor([3]))
    assert float(stats.survival(torch.tensor([1]))[0, 0]) > low + 0.2
    assert float(stats.survival(torch.tensor([3]))[0, 2]) > 0.9


def test_step_costs_time_three_widths_per_call_and_interpolate_the_rest():
    timed = []

    def time_verify(width: int) -> float:
        timed.append(width)
        return float(width) + len(timed)  # later timings are slower: the fastest (first) one is kept

    costs = StepCosts()
    widths = range(1, 6)
    costs.calibrate(time_verify, widths)
    assert timed == [1, 2, 5] and costs.covers(widths) and not costs.complete(widths)
    assert costs.forward_at(3) == pytest.approx(4.0 + (8.0 - 4.0) / 3)  # between w2 (2 + 2) and w5 (5 + 3)
    for _ in range(4):
        costs.calibrate(time_verify, widths)
    assert timed[3:6] == [3, 4, 1] and len(timed) == 15 and costs.complete(widths)
    assert costs.forward == {1: 2.0, 2: 4.0, 3: 7.0, 4: 9.0, 5: 8.0}
    costs.calibrate(time_verify, widths)  # complete: nothing more is timed
    assert len(timed) == 15


@pytest.mark.parametrize("drafting", [True, False])
def test_adaptive_schedule_times_at_most_three_forwards_per_call(drafting):
    """A first call on a model pays three timing forwards, and so does the second (a first pass may be slowed by
    warm-up); later calls do only after a call that drafted, until every width is timed three times; then none.
    After calls that never drafted (a useless draft switched off), nothing more is timed."""

    class Model:  # any weak-referenceable object stands for the target
        pass

    model, timed = Model(), []
    for call in range(8):
        schedule = AdaptiveSchedule(2, model, "ngram:1-4", propose_first=True)
        schedule.calibrate(lambda width, call=call: timed.append(call) or 1.0)
        costs = schedule.costs(batch_size=1)
        costs.record(2 if drafting else 1, 64, 1.0, drafts_separately=False)  # the call's steps
    assert timed == ([0, 0, 0, 1, 1, 1, 2, 2, 2] if drafting else [0, 0, 0, 1, 1, 1])  # 3 widths x 3 or 2 timings


def test_on_a_gpu_the_first_dynamic_call_times_every_width_once(monkeypatch):
    """Where a width's first forward is timed again anyway (a GPU; forced here), the model's first dynamic call
    times each width once and later calls time none: the first call warms up, the later ones should not pay."""
    monkeypatch.setattr(adaptive, "builds_plans_per_shape", lambda device: True)

    class Model:
        pass

    model, timed = Model(), []
    for call in range(4):
        schedule = AdaptiveSchedule(4, model, "draft:0", propose_first=False)
        schedule.start(1, torch.device("cpu"))
        schedule.calibrate(lambda width, call=call: timed.append((call, width)) or 1.0)
        schedule.costs(batch_size=1).record(3, 64, 1.0, drafts_separately=True)  # the call drafted
    assert timed == [(0, width) for width in (1, 2, 5, 3, 4)], timed


def test_step_costs_measure_widths_and_scale_the_others():
    costs = StepCosts(forward={1: 1.0, 2: 1.5, 3: 1.2}, smoothing=1.0, min_samples=2)
    costs.record(1, 64, 1.2, drafts_separately=False)  # plain steps take 20% more than calibrated
    assert costs.contexts[64].ratio == pytest.approx(1.2)
    assert torch.allclose(costs.table(3, 64), torch.tensor([1.2, 1.8, 1.44]))  # unmeasured widths scale alike
    costs.record(1, 64, 1.2, drafts_separately=False)
    costs.record(3, 64, 1.3, drafts_separately=False)
    costs.record(3, 64, 1.3, drafts_separately=False)  # measured twice: its own average from now on
    assert costs.step_time(1, 64) == pytest.approx(1.2) and costs.step_time(3, 64) == pytest.approx(1.3)
    assert costs.draft_cost == 0.0  # n-gram: proposing is part of every step
    costs.record(1, 64, 50.0, drafts_separately=False)  # a hiccup: clipped to twice the scaled forward, and then
    assert costs.contexts[64].seconds[1] == pytest.approx(1.2)  # the least of the recent steps does not move
    window = adaptive.MeasuredSteps.WINDOW
    for _ in range(window):
        costs.record(1, 64, 1.5, drafts_separately=False)  # a lasting rise moves it once the window holds only it
    assert costs.contexts[64].seconds[1] == pytest.approx(1.5)
    costs.record(1, 64, 1.1, drafts_separately=False)  # a fall at once
    assert costs.contexts[64].seconds[1] == pytest.approx(1.1)


def test_step_costs_learn_a_draft_models_cost_per_draft():
    costs = StepCosts(forward={1: 1.0, 2: 1.1, 3: 1.2}, smoothing=1.0, min_samples=5)
    costs.record(1, 64, 1.0, drafts_separately=True)
    costs.record(3, 64, 1.6, drafts_separately=True)  # 0.4 s beyond the forward for 2 drafts
    assert costs.draft_cost == pytest.approx(0.2)
    assert costs.step_time(2, 64) == pytest.approx(1.1 + 0.2)  # unmeasured: forward plus one draft
    for _ in range(100):  # plain steps only: the drafting cost fades, so speculation is tried again
        costs.record(1, 64, 1.0, drafts_separately=True)
    assert costs.draft_cost < 0.14
    for _ in range(1000):  # but not below half of what drafting was measured to cost (the prior is 0 here)
        costs.record(1, 64, 1.0, drafts_separately=True)
    assert costs.draft_cost == pytest.approx(0.1, rel=1e-3)


def test_step_costs_are_kept_per_context_bucket():
    assert [context_bucket(n) for n in (1, 64, 65, 700, 1500)] == [64, 64, 128, 1024, 2048]
    costs = StepCosts(forward={1: 1.0, 2: 1.2}, smoothing=1.0, min_samples=1)
    costs.record(2, 128, 1.2, drafts_separately=False)
    costs.record(1, 1024, 1.5, drafts_separately=False)  # long contexts: dearer
    costs.record(2, 1024, 3.0, drafts_separately=False)  # and wide verifies more so
    assert torch.allclose(costs.table(2, 128), torch.tensor([1.0, 1.2]))
    assert torch.allclose(costs.table(2, 1024), torch.tensor([1.5, 3.0]))
    assert costs.at(2048).ratio == costs.contexts[1024].ratio  # a new bucket starts from the nearest one


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drive(
    monkeypatch: pytest.MonkeyPatch,
    forward: list[float],  # seconds of a forward of width 1..K+1
    acceptance: dict[int, float],  # draft key -> per-position acceptance
    keys: list[int],  # each row's draft key (every row always has K drafts)
    steps: int = 300,
    propose_first: bool = True,
    schedule: AdaptiveSchedule | None = None,
    draft_seconds: float = 0.0,  # what drafting one token takes (a draft model's forward)
    slow: Callable[[int], float] | None = None,  # seconds a step of this many drafts takes on top
) -> list[list[int]]:
    """Run the schedule (one call) against simulated forwards and i.i.d. acceptance per key; return the drafts it
    verified per step. Pass `schedule` to run a further call with what an earlier one learned."""
    clock = FakeClock()
    monkeypatch.setattr(adaptive.time, "perf_counter", clock)
    schedule = schedule or AdaptiveSchedule(K, model=None, cost_key="sim", propose_first=propose_first)
    schedule.calibrate(lambda width: forward[width - 1])
    batch_size = len(keys)
    schedule.start(batch_size, torch.device("cpu"))
    batch = RaggedBatch(
        torch.zeros(batch_size, 4, dtype=torch.long),
        torch.full((batch_size,), 4),
        torch.zeros(batch_size, dtype=torch.long),
        torch.arange(batch_size),
        4,
    )
    g = torch.Generator().manual_seed(0)
    key_tensor = torch.tensor(keys)
    rates = torch.tensor([acceptance[key] for key in keys])[:, None]  # [B, 1]
    verified = []
    for _ in range(steps):
        budget = schedule.budgets(batch)  # [B]
        num = budget.clone()
        proposal = Proposal(torch.zeros(batch_size, K, dtype=torch.long), num, draft_keys=key_tensor)
        used = torch.minimum(schedule.trim(proposal), budget)
        verified.append(used.tolist())
        draws = torch.rand(batch_size, K, generator=g) < rates  # [B, K]
        accepted = torch.where(draws.all(1), K, (~draws).int().argmax(1))
        schedule.observe(used, torch.minimum(accepted, used))
        clock.now += forward[int(used.max())] + draft_seconds * int(used.max()) + 0.001
        clock.now += slow(int(used.max())) if slow is not None else 0.0
    return verified


@pytest.mark.parametrize("draft_share", [0.0, 1.0])
def test_a_draft_as_large_as_the_target_never_looks_free(monkeypatch, draft_share):
    """Wide verifies cost the same as narrow ones (a GPU, a tiny model) and each draft token costs a whole forward:
    drafting never pays. Without a prior for the drafting cost the schedule drafts until it has measured it; with
    `draft_share` (the draft's size next to the target's) it does not start."""
    schedule = AdaptiveSchedule(K, model=None, cost_key="sim", propose_first=False, draft_share=draft_share)
    flat = [1.0] * (K + 1)
    verified = _drive(monkeypatch, flat, {0: 0.0}, keys=[0, 0], propose_first=False, schedule=schedule,
                      draft_seconds=1.0)  # fmt: skip
    drafting_steps = sum(max(row) > 0 for row in verified)
    if draft_share:
        assert drafting_steps == 0, verified[:20]
    else:
        assert drafting_steps > 0


def test_schedule_switches_itself_off_where_drafts_are_bad(monkeypatch):
    verified = _drive(monkeypatch, forward=[1.0 + 0.5 * w for w in range(K + 1)], acceptance={1: 0.05}, keys=[1, 1])
    late = verified[50:]
    assert sum(max(row) > 0 for row in late) <= 10, verified[:60]


def test_schedule_speculates_long_when_it_pays(monkeypatch):
    verified = _drive(monkeypatch, forward=[1.0 + 0.03 * w for w in range(K + 1)], acceptance={4: 0.95}, keys=[4, 4])
    late = verified[50:]
    assert sum(min(row) >= 6 for row in late) >= 0.9 * len(late), verified[:60]


def test_schedule_learns_per_key_and_picks_a_cheap_width(monkeypatch):
    # CPU-like costs: widths 2-3 dear, 5 cheap. Key 1 drafts are poor, key 4 drafts good: at B = 1 a key-1 row
    # decodes plainly and a key-4 row verifies at a cheap width.
    forward = [1.0, 1.7, 2.1, 1.5, 1.35, 1.6, 1.8, 1.5, 1.6]
    poor = _drive(monkeypatch, forward, {1: 0.15}, keys=[1])[100:]
    good = _drive(monkeypatch, forward, {4: 0.8}, keys=[4])[100:]
    assert sum(row[0] > 0 for row in poor) <= 10
    widths = [row[0] + 1 for row in good]
    assert sum(w in (5, 8, 9) for w in widths) >= 0.9 * len(widths), widths[:40]


@pytest.mark.parametrize("row_weight", [1.0, 1e9])  # 1e9: no row record (the control, which keeps drafting)
def test_a_row_whose_drafts_keep_failing_stops_though_its_key_is_good(monkeypatch, row_weight):
    forward = [1.0 + 0.06 * w for w in range(K + 1)]
    schedule = AdaptiveSchedule(K, model=None, cost_key="sim", propose_first=True, row_weight=row_weight)
    _drive(monkeypatch, forward, {4: 0.9}, keys=[4], schedule=schedule)  # the key learns: its drafts are good
    failing = _drive(monkeypatch, forward, {4: 0.0}, keys=[4], steps=100, schedule=schedule)  # a text where not
    tries = sum(row[0] > 0 for row in failing)
    if row_weight == 1e9:
        assert tries > 50, failing
    else:
        assert tries <= 20, failing


def test_schedule_choosing_before_drafting_gives_budgets(monkeypatch):
    # A draft model: the choice comes before drafting, from the one key's statistics.
    verified = _drive(monkeypatch, [1.0 + 0.05 * w for w in range(K + 1)], {0: 0.9}, keys=[0, 0], propose_first=False)
    assert sum(min(row) >= 4 for row in verified[50:]) >= 0.9 * 250


def test_costs_of_a_batch_size_met_mid_call_are_borrowed(monkeypatch):
    schedule = AdaptiveSchedule(2, model=None, cost_key="sim", propose_first=True)
    schedule.calibrate(lambda width: float(width))
    assert schedule.costs(4).forward == {1: 1.0, 2: 2.0, 3: 3.0}
    schedule.time_verify = None  # mid-call: no calibration; the nearest calibrated batch size lends its table
    borrowed = schedule.costs(3)
    assert borrowed.forward == {1: 1.0, 2: 2.0, 3: 3.0} and not borrowed.calibrated
    schedule.calibrate(lambda width: 10.0 * width)  # a later call starting at batch size 3 calibrates it
    assert schedule.costs(3).forward == {1: 10.0, 2: 20.0, 3: 30.0}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_adaptive_greedy_matches_plain_generate(llama, method):
    inputs = make_prompts(3, seed=4)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    expected = llama.generate(**inputs, **kwargs)
    draft = make_noisy_copy(llama, noise=0.01) if method == "draft" else None
    spec = hf_specdec.SpecDecoder(
        method=method, draft_model=draft, num_speculative_tokens=6, num_speculative_tokens_schedule="adaptive"
    )
    for _ in range(2):  # the first call calibrates (forwards that are undone), the second reuses the tables
        assert torch.equal(spec_generate(llama, inputs, spec, **kwargs), expected)
    memory = adaptive._MEMORY[llama]
    assert any(costs.calibrated and costs.covers(range(1, 8)) for costs in memory.costs.values())


def test_adaptive_sampling_runs_with_a_seed(llama, llama_draft):
    inputs = make_prompts(2, seed=1)
    spec = hf_specdec.SpecDecoder(draft_model=llama_draft, num_speculative_tokens=4, seed=3,
                                  num_speculative_tokens_schedule="adaptive")  # fmt: skip
    out = spec_generate(llama, inputs, spec, max_new_tokens=12, do_sample=True)
    assert out.shape[1] <= inputs["input_ids"].shape[1] + 12


def test_bad_schedule_name_says_what_to_pass():
    with pytest.raises(ValueError, match="'adaptive'.*got 'fast'|got 'fast'"):
        hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens_schedule="fast")


@pytest.mark.parametrize("room", [1, 2, 3, 4])
def test_calibration_never_feeds_past_a_learned_position_limit(room):
    """GPT-2 with n_positions=64: prompts ending `room` positions before the limit calibrate (a fresh model each
    time, so its first call times every width) without a position past the table, and match plain generate."""
    target = make_model("gpt2", seed=0, n_positions=64)
    draft = make_model("gpt2", seed=1, layers=1, hidden=32, n_positions=64)
    ids = torch.randint(3, 90, (2, 64 - room), generator=torch.Generator().manual_seed(room))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    expected = target.generate(**inputs, max_new_tokens=room, do_sample=False, eos_token_id=None)
    for spec in (
        hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4, num_speculative_tokens_schedule="adaptive"),
        hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4, num_speculative_tokens_schedule="adaptive"),
    ):
        out = spec_generate(target, inputs, spec, max_new_tokens=room, do_sample=False, eos_token_id=None)
        assert torch.equal(out, expected), spec.method


def test_model_serial_names_a_model_and_is_never_reused():
    """Statistics are kept per draft model; `id()` of a freed draft is reused by the next one, a serial is not."""
    import gc

    from hf_specdec.adaptive import model_serial

    class Model:
        pass

    first = Model()
    serial = model_serial(first)
    assert model_serial(first) == serial
    del first
    gc.collect()
    assert model_serial(Model()) != serial


def test_a_draft_models_cost_prior_follows_the_fastest_forward():
    """A first call's timing may include compiling the forward (seconds where a forward takes milliseconds): the
    drafting cost taken before drafting is measured follows later, faster timings, or the schedule would never
    draft again after its first call."""

    class Model:
        pass

    model = Model()
    for seconds in (30.0, 0.01):  # the first call's timings compile; the second call's do not
        schedule = AdaptiveSchedule(2, model, "draft:0", propose_first=False, draft_share=0.1)  # 3 widths per call
        schedule.calibrate(lambda width, seconds=seconds: seconds)
        costs = schedule.costs(batch_size=1)
    assert costs.draft_cost == pytest.approx(0.001)
    costs.record(3, 64, 0.05, drafts_separately=True)  # a measured drafting step: the measure counts from now on
    schedule.costs(batch_size=1)
    assert costs.draft_measured and costs.draft_cost != pytest.approx(0.001)


def test_static_and_dynamic_calls_keep_their_own_step_costs():
    """A captured static step on a GPU costs a third of an eager one: calls on the two paths, alternating on one
    target, must not price each other's steps (the static path then never drafted). Acceptance is shared."""

    class Model:
        pass

    model = Model()
    dynamic = AdaptiveSchedule(2, model, "draft:0", propose_first=False)
    dynamic.calibrate(lambda width: 0.03)
    static = AdaptiveSchedule(2, model, "draft:0", propose_first=False, static=True)
    static.calibrate(lambda width: 0.01)
    assert static.costs(1).forward == {1: 0.01, 3: 0.01}  # a static verify has width 1 or 1 + k: only those
    assert dynamic.costs(1).forward == {1: 0.03, 2: 0.03, 3: 0.03}
    assert static.stats is dynamic.stats


def test_on_static_caches_every_drafting_step_costs_the_full_verify(monkeypatch):
    """A static verify has width 1 + k whatever the drafts: the schedule prices every drafting width as that, so
    when drafting pays it drafts k (never fewer drafts for the same cost)."""
    schedule = AdaptiveSchedule(K, model=None, cost_key="sim", propose_first=False, static=True)
    forward = [1.0] + [1.0 + 0.02 * w for w in range(1, K + 1)]  # what the static path would time: 1 and K + 1
    verified = _drive(monkeypatch, forward, {0: 0.6}, keys=[0], propose_first=False, schedule=schedule)
    assert all(row[0] in (0, K) for row in verified), verified[:20]
    assert sum(row[0] == K for row in verified[50:]) >= 0.9 * 250


def _drive_captured(
    monkeypatch,
    schedule: AdaptiveSchedule,
    alpha: float,
    steps: int = 40,
    slow: Callable[[int, str], float] | None = None,
    seed: int = 0,
    drafting_seconds: float = 0.017,
) -> str:
    """One call on static caches against the costs of captured steps on an H100 at batch 1 (a plain step 10.5 ms, a
    drafting step `drafting_seconds`: 17 ms with a 4-layer draft), with a calibration whose eager width-1 forward
    paid a one-time 925 ms (as measured there); each kind's first step of the call is a warm-up or a capture
    (`discard_timing`). Returns the kinds run ("d" drafting, "p" plain) after the prefill step. `slow(index, kind)`:
    seconds a step takes on top (a hiccup of the machine in a step counted as steady)."""
    clock = FakeClock()
    monkeypatch.setattr(adaptive.time, "perf_counter", clock)
    schedule.calibrate(lambda width: 0.925 if width == 1 else 0.03)
    schedule.start(1, torch.device("cpu"))
    batch = RaggedBatch(torch.zeros(1, 4, dtype=torch.long), torch.full((1,), 4), torch.zeros(1, dtype=torch.long),
                        torch.arange(1), 4)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    kinds, seen = [], set()
    for _ in range(steps):
        used = schedule.budgets(batch)  # [1]
        draws = torch.rand(1, schedule.max_k, generator=g) < alpha
        accepted = torch.where(draws.all(1), schedule.max_k, (~draws).int().argmax(1))
        schedule.observe(used, torch.minimum(accepted, used))
        kind = "d" if int(used.max()) else "p"
        if kind not in seen:  # a warm-up or a capture: longer than such steps take from now on
            seen.add(kind)
            schedule.discard_timing()
        clock.now += (drafting_seconds if kind == "d" else 0.0105) + (0.2 if kind not in kinds else 0.0)
        clock.now += slow(len(kinds), kind) if slow is not None else 0.0
        kinds.append(kind)
    return "".join(kinds[1:])


@pytest.mark.parametrize("alpha", [0.8, 0.0])
def test_captured_steps_price_each_kind_by_its_own_steady_steps(monkeypatch, alpha):
    """On a GPU's static path the schedule prices a plain and a drafting step by their own steady (replayed) steps:
    an eager calibration (first runs of a width cost 30x the rest) must neither switch off a draft that pays nor
    keep a useless one (an H100 run drafted nothing at alpha = 0.8 before this). Costs persist: a second call
    needs no exploring."""

    class Model:
        pass

    model = Model()
    kinds = []
    for _ in range(2):
        schedule = AdaptiveSchedule(4, model, "draft:0", propose_first=False, draft_share=0.015, static=True)
        kinds.append(_drive_captured(monkeypatch, schedule, alpha))
    first, second = kinds
    if alpha:
        assert first[10:].count("d") >= 0.9 * len(first[10:]), first  # explored plain steps, then drafts
        assert second.count("d") >= 0.9 * len(second), second
    else:
        assert first[8:].count("p") >= 0.9 * len(first[8:]), first  # off within 8 steps
        assert second[2:].count("p") >= 0.9 * len(second[2:]), second


@pytest.mark.parametrize("row_doubt", [2.0, 0.0])  # 0: every shortfall judged (the control)
def test_unlucky_steps_do_not_switch_a_good_draft_off_for_the_call(monkeypatch, row_doubt):
    """A draft model at per-position acceptance 0.6 on the static path, where drafting pays (1.35x): a step whose
    drafts are all rejected comes in 40% of steps, and must not keep the row from drafting for the rest of a
    64-token call. Judged alone, such a step cut the row's estimate to a third: on an H100 some sampled calls
    drafted in 6-40% of their steps, others in 95%."""

    class Model:
        pass

    model, shares = Model(), []
    for seed in range(32):
        schedule = AdaptiveSchedule(4, model, "draft:0", propose_first=False, draft_share=0.015, static=True,
                                    row_doubt=row_doubt)  # fmt: skip
        kinds = _drive_captured(monkeypatch, schedule, 0.6, steps=64, seed=seed)
        shares.append(kinds.count("d") / len(kinds))
    # Calls that drafted in under 75% of their steps (the first call explores plain steps); a few runs of bad luck
    # long enough to doubt the row remain (11 of 31 calls without the doubt, 2 with it)
    cut_short = sum(share < 0.75 for share in shares[1:])
    if row_doubt:
        assert cut_short <= 3, shares
    else:
        assert cut_short >= 8, shares


def test_a_drafts_catch_up_before_its_step_is_not_priced_as_the_step(monkeypatch):
    """After plain steps a draft catches up eagerly between the schedule's choice and the step's graph (up to 63
    forwards of the whole draft after 128 plain steps, before `catch_up_widths`). That is a cost of switching back to
    drafting, not of a drafting step: the loop restarts the step's clock after it (`restart_timing`), so a drafting
    step costs what its replay took (here 17 ms), not 0.5 s more."""

    class Model:
        pass

    clock = FakeClock()
    monkeypatch.setattr(adaptive.time, "perf_counter", clock)
    schedule = AdaptiveSchedule(4, Model(), "draft:0", propose_first=False, draft_share=0.015, static=True)
    schedule.calibrate(lambda width: 0.01)
    schedule.start(1, torch.device("cpu"))
    batch = RaggedBatch(torch.zeros(1, 4, dtype=torch.long), torch.full((1,), 4), torch.zeros(1, dtype=torch.long),
                        torch.arange(1), 4)  # fmt: skip
    for _ in range(6):
        used = schedule.host_budgets(batch)  # [1]
        if int(used.max()):  # drafting (the schedule explores it first): each time after a 0.5 s catch-up
            clock.now += 0.5
            schedule.restart_timing()
        clock.now += 0.017 if int(used.max()) else 0.0105
        schedule.observe(used, torch.zeros_like(used))
    steps = schedule.costs(1).at(context_bucket(1.0))
    assert steps.samples.get(5, 0) >= 2 and steps.seconds[5] == pytest.approx(0.017)


def test_one_slow_drafting_step_does_not_switch_a_paying_draft_off(monkeypatch):
    """The first steady drafting step takes 30x its cost (a garbage collection, a graph's first launch), and so does
    a later one: each is one sample among the recent ones, whose median (the lower of the first two) stays the
    drafting cost, and drafting goes on. When a step kind's cost was a running average started at its first
    sample, one such step switched drafting off for good (an H100 benchmark drafted nothing for a whole process)."""

    class Model:
        pass

    schedule = AdaptiveSchedule(4, Model(), "draft:0", propose_first=False, draft_share=0.015, static=True)
    kinds = _drive_captured(monkeypatch, schedule, 0.8, steps=60, slow=lambda i, kind: 0.5 * (i in (2, 12)))
    assert kinds[14:].count("d") >= 0.9 * len(kinds[14:]), kinds


def test_a_drafting_cost_measured_too_high_is_measured_again(monkeypatch):
    """Drafting steps measured while the GPU was contended (0.5 s each) switch drafting off; after
    `REPROBE_AFTER` plain steps in a row (across calls) the drafting cost is measured anew, and a draft that pays
    is used again."""

    class Model:
        pass

    model = Model()
    schedule = AdaptiveSchedule(4, model, "draft:0", propose_first=False, draft_share=0.015, static=True)
    first = _drive_captured(monkeypatch, schedule, 0.8, steps=60, slow=lambda i, kind: 0.5 * (kind == "d"))
    assert first[-20:] == "p" * 20, first  # every step slowed: drafting looked dear and was switched off
    later = ""
    for _ in range(4):
        schedule = AdaptiveSchedule(4, model, "draft:0", propose_first=False, draft_share=0.015, static=True)
        later += _drive_captured(monkeypatch, schedule, 0.8, steps=60)
    reprobe = later.index("d")
    assert reprobe <= adaptive.REPROBE_AFTER + 1, later
    assert later[reprobe + 10 :].count("d") >= 0.9 * len(later[reprobe + 10 :]), later


def test_re_probes_of_a_useless_deep_draft_back_off_and_a_draft_that_turns_good_is_used_again(monkeypatch):
    """A useless draft whose drafting step costs 3.4 plain ones (a 28-layer draft of an 8B target): each re-probe
    that finds drafting not worth choosing doubles the plain steps before the next, up to `REPROBE_AFTER_MAX`
    (every 128 steps, a re-probe and a deep draft's catch-up took 10% of a call on an H200). When the draft turns
    good enough to pay for its cost, the next re-probe finds it, it drafts again, and the interval is back to
    `REPROBE_AFTER`."""

    class Model:
        pass

    model = Model()

    def calls(alpha: float, count: int) -> str:
        kinds = ""
        for index in range(count):
            schedule = AdaptiveSchedule(4, model, "draft:0", propose_first=False, draft_share=0.07, static=True)
            kinds += _drive_captured(monkeypatch, schedule, alpha, steps=60, seed=index, drafting_seconds=0.036)
        return kinds

    useless = calls(0.0, 60)
    gaps = [len(run) for run in re.findall("p+", useless)][:-1]  # plain steps between drafting steps
    expected = [adaptive.REPROBE_AFTER * 2**i for i in range(4)]
    assert all(abs(gap - want) <= 4 for gap, want in zip(gaps, expected)), gaps
    assert gaps[4:] and all(abs(gap - adaptive.REPROBE_AFTER_MAX) <= 4 for gap in gaps[4:]), gaps
    assert useless.count("d") <= 0.01 * len(useless), useless.count("d")  # every 128 steps: 2.4%
    good = calls(1.0, 30)  # 5 tokens a drafting step of 3.4 plain ones
    first = good.index("d")
    assert first <= adaptive.REPROBE_AFTER_MAX + 4, first
    assert good[first + 10 :].count("d") >= 0.9 * len(good[first + 10 :]), good
    assert adaptive._MEMORY[model].costs[("draft:0@static", 1)].reprobe_after == adaptive.REPROBE_AFTER


def test_calibration_times_every_small_width_and_a_sparse_grid_above():
    from hf_specdec.adaptive import calibration_widths

    assert calibration_widths(5) == [1, 2, 3, 4, 5, 6]
    assert calibration_widths(8) == list(range(1, 10))
    assert calibration_widths(24) == [*range(1, 10), 13, 17, 25]
    assert calibration_widths(30) == [*range(1, 10), 13, 17, 25, 31]
    schedule = AdaptiveSchedule(24, None, "suffix:test", propose_first=True)
    assert list(schedule.widths) == calibration_widths(24)


def test_dynamic_drafting_costs_measured_too_high_are_measured_again(monkeypatch):
    """The dynamic path: every drafting width was measured far too slow (as a GPU's first runs of new widths were,
    50-1000 ms, before `first_shapes` left such steps untimed), so drafting is off. After `REPROBE_AFTER` plain
    steps in a row (across calls) what drafting steps were measured to cost is forgotten; the estimates (the
    calibrated forwards, the drafting cost faded towards its prior) say a good draft pays, so it drafts again and
    measures its true cost. Before, a width measured slow stayed so: on an H100 the eager path at alpha 0.8 drafted
    nothing in a whole process."""

    class Model:
        pass

    model = Model()
    forward = [0.020 + 0.001 * w for w in range(K + 1)]

    def call() -> list[int]:  # each step's widest drafts
        schedule = AdaptiveSchedule(4, model, "draft:0", propose_first=False, draft_share=0.05)
        verified = _drive(monkeypatch, forward, {0: 0.9}, keys=[0], steps=100, propose_first=False,
                          schedule=schedule, draft_seconds=0.002)  # fmt: skip
        return [max(row) for row in verified]

    assert sum(map(bool, call()[10:])) >= 80  # a good draft: drafting pays
    measured = adaptive._MEMORY[model].costs[("draft:0", 1)].contexts
    for steps in measured.values():
        for width in range(2, 6):
            steps.forget(width)
            steps.add(width, 0.5)
            steps.add(width, 0.5)
    later = call() + call() + call()
    reprobe = next(i for i, drafts in enumerate(later) if drafts)
    assert reprobe <= adaptive.REPROBE_AFTER + 3, later  # each call's prefill step is not a choice
    assert sum(map(bool, later[reprobe + 10 :])) >= 0.9 * len(later[reprobe + 10 :]), later
