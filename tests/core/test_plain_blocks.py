"""Blocks of plain steps (`SpeculativeLoop.plain_block`): while the schedule keeps drafting off, a captured static
call runs `PLAIN_BLOCK` plain steps as one graph with one host read. Rows that finish inside a block are frozen on
the device, so outputs stay plain's (greedy) and the target's law (sampling); CUDA graphs are emulated on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, make_model, make_prompts, spec_generate
from proposers.first_tokens_law import check_first_tokens, exact_joint_law

import hf_specdec
from hf_specdec.decoding import PLAIN_BLOCK, SpeculativeLoop
from hf_specdec.step_graph import StepGraph

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.library_default]  # the adaptive schedule


@pytest.fixture
def keys(monkeypatch) -> list:
    """The key of every planned step's graph."""
    seen: list = []
    plan_step = SpeculativeLoop.plan_step
    monkeypatch.setattr(SpeculativeLoop, "plan_step", lambda self: seen.append(plan_step(self)) or seen[-1])
    return seen


@pytest.fixture
def replays(monkeypatch) -> list:
    """The key of every replayed (not eager) step."""
    seen: list = []
    run = StepGraph.run

    def counting(self, key):  # noqa: ANN001, ANN202
        before = self.replays
        run(self, key)
        if self.replays > before:
            seen.append(key)

    monkeypatch.setattr(StepGraph, "run", counting)
    return seen


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_useless_draft_runs_blocks_of_plain_steps_and_gives_plain_tokens(emulated_graphs, keys, replays, batch_size):
    """A draft the target never agrees with: after a few steps the schedule stops drafting and the plain steps run
    in replayed blocks; rows end at EOS inside blocks (and at max_new_tokens), and every row is plain's."""
    target = make_model("llama", seed=0)
    useless = make_model("llama", seed=11)  # another random model: its drafts are almost never accepted
    inputs = make_prompts(batch_size, seed=7, min_len=3, max_len=14)
    gen = dict(max_new_tokens=48, do_sample=False, eos_token_id=EOS_ID)
    expected = target.generate(**inputs, **gen)
    spec = hf_specdec.SpecDecoder(draft_model=useless, num_speculative_tokens=3)
    for _ in range(2):  # the second call adopts the first's graphs, the block's included
        keys.clear()
        out = spec_generate(target, inputs, spec, cache_implementation="static", **gen)
        assert torch.equal(out, expected)
    assert ("plain", PLAIN_BLOCK) in replays, (replays, keys)
    blocks = [key[1] if key[:1] == ("plain",) and len(key) == 2 else 1 for key in keys]
    assert spec.last_stats.num_steps == sum(blocks) + 1


def test_rows_that_stop_inside_a_block_are_frozen_there(emulated_graphs, keys, monkeypatch):
    """Every plain step a block (from the first step on): rows of one batch stop at EOS at many points inside
    blocks, and none emits past its EOS."""
    monkeypatch.setattr(SpeculativeLoop, "plain_block", lambda self: PLAIN_BLOCK if self.longest_room >= PLAIN_BLOCK else 1)  # fmt: skip
    target = make_model("llama", seed=0, vocab=12)
    inputs = make_prompts(8, seed=3, min_len=2, max_len=9, vocab=12)
    gen = dict(max_new_tokens=30, do_sample=False, eos_token_id=EOS_ID)
    expected = target.generate(**inputs, **gen)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=2, num_speculative_tokens_schedule="adaptive")
    out = spec_generate(target, inputs, spec, cache_implementation="static", **gen)
    assert torch.equal(out, expected)
    assert ("plain", PLAIN_BLOCK) in keys
    ends = (expected[:, inputs["input_ids"].shape[1] :] == EOS_ID).int().argmax(1)
    assert len(set(ends.tolist())) > 2, "rows should end at different steps"


def test_sampled_blocks_follow_the_target_law(emulated_graphs, keys, monkeypatch):
    """4000 rows of one seeded call, plain steps in blocks from the first step after the prefill: the first three
    tokens (two of them drawn inside a block) follow the target's law."""
    monkeypatch.setattr(SpeculativeLoop, "plain_block", lambda self: PLAIN_BLOCK if self.longest_room >= PLAIN_BLOCK else 1)  # fmt: skip
    monkeypatch.setattr("hf_specdec.adaptive.AdaptiveSchedule._choose", lambda self, keys, num: torch.zeros_like(num))
    target = make_model("llama", seed=0, vocab=12)
    useless = make_model("llama", seed=5, vocab=12)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11]])
    samples = 4000
    inputs = {"input_ids": prompt.expand(samples, -1), "attention_mask": torch.ones(samples, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(draft_model=useless, num_speculative_tokens=2, seed=7)
    sampling = dict(max_new_tokens=6, do_sample=True, temperature=1.0, top_k=0, cache_implementation="static")
    out = spec_generate(target, inputs, spec, **sampling)
    assert ("plain", PLAIN_BLOCK) in keys
    check_first_tokens(out, prompt, exact_joint_law(target, prompt, 3, 1.0), 3)


@pytest.mark.parametrize("method", ["draft", "ngram", "early_exit", "mtp"])
def test_blocks_between_drafting_steps_give_plain_tokens(emulated_graphs, keys, monkeypatch, method):
    """Every static drafter, batch 3: a schedule that drafts one step in seven, so blocks of plain steps run between
    drafting steps and the drafter catches up after each (its host counters moved by a whole block); plain's tokens."""
    from proposers.test_mtp import make_mtp_target

    from hf_specdec.adaptive import AdaptiveSchedule

    calls = {"n": 0}

    def every_seventh(self, keys_, num):  # noqa: ANN001, ANN202
        calls["n"] += 1
        return num.clone() if calls["n"] % 7 == 0 else torch.zeros_like(num)

    monkeypatch.setattr(AdaptiveSchedule, "_choose", every_seventh)
    if method == "mtp":
        target, mtp = make_mtp_target("deepseek_v3")
        spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=2)
    else:
        target = make_model("llama", seed=0)
        spec = {"draft": lambda: hf_specdec.SpecDecoder(draft_model=make_model("llama", seed=0)),
                "ngram": lambda: hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3),
                "early_exit": lambda: hf_specdec.SpecDecoder(early_exit_layers=1)}[method]()  # fmt: skip
    inputs = make_prompts(3, seed=9, min_len=4, max_len=12)
    gen = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    out = spec_generate(target, inputs, spec, cache_implementation="static", **gen)
    assert torch.equal(out, expected)
    assert ("plain", PLAIN_BLOCK) in keys and any(key is not None and key[0] == "draft" for key in keys)
    assert spec.last_stats.num_graph_replays > 0
