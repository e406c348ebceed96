"""Tests of `SuffixProposer` (`method="suffix"`): drafts on hand-built batches, exactness end to end, the global
tree kept across calls, the static path (planned host drafts, captured steps), routing and the options' errors.

Greedy outputs equal plain `generate` at batch 1 to 8 with left padding, on the dynamic and the static cache (and
through emulated CUDA graphs); sampling follows the target's exact law (chi-square) with drafts from both trees; a
second call drafts from the first call's outputs; rows that finish early hand their outputs to the global tree;
calls in several threads share one `SpecDecoder`; `install()` and pipelines route `spec_decoder=`.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import EOS_ID, make_model, make_prompts, make_tokenizer, spec_generate
from first_tokens_law import check_first_tokens, exact_joint_law

import hf_specdec
from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.suffix import SuffixProposer
from hf_specdec.proposers.suffix_cache import SuffixCache

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


def batch_of(rows: list[list[int]], capacity: int = 32) -> RaggedBatch:
    width = max(len(r) for r in rows)
    token_ids = torch.zeros(len(rows), capacity, dtype=torch.long)
    for i, row in enumerate(rows):
        token_ids[i, width - len(row) : width] = torch.tensor(row)
    return RaggedBatch(
        token_ids=token_ids,
        lengths=torch.full((len(rows),), width),
        pad_lengths=torch.tensor([width - len(r) for r in rows]),
        row_ids=torch.arange(len(rows)),
        prompt_width=width,
    )


def test_drafts_on_a_ragged_batch_and_the_rows_join_the_global_tree_when_they_leave():
    cache = SuffixCache(max_depth=8, max_requests=10, max_tokens=1000)
    cache.add(np.array([40, 41, 42, 43, 44, 45]))
    proposer = SuffixProposer(4, max_depth=8, cache=cache)
    batch = batch_of([[5, 6, 7, 8, 5, 6], [9, 40, 41, 42], [11, 12, 13]])
    proposer.prefill(batch, None)
    proposal = proposer.propose(batch, torch.tensor([4, 4, 4]), None)
    assert proposal.draft_probs is None
    assert proposal.num_draft_tokens.tolist() == [2, 3, 0]  # 2: m = 2 drafts 2; 3: from the global tree; none
    assert proposal.draft_token_ids.tolist() == [[7, 8, -1], [43, 44, 45], [-1, -1, -1]]
    assert proposal.draft_keys.tolist() == [2, 3, 0]
    # Row 1 accepts 43, 44 and gets 50; row 0 gets 7; then rows 0 and 2 finish and leave.
    batch.token_ids[0, 6] = 7
    batch.token_ids[1, 6:9] = torch.tensor([43, 44, 50])
    batch.lengths = torch.tensor([7, 9, 6])
    proposer.commit(batch, torch.tensor([0, 2, 0]))
    proposer.select_rows(torch.tensor([1]))
    assert cache.num_requests == 2  # row 0's output (row 2 generated nothing)
    assert cache.outputs[-1].tolist() == [5, 6, 7, 8, 5, 6, 7]  # its prompt (up to D tokens) and output
    proposer.detach()
    assert cache.num_requests == 3 and cache.outputs[-1].tolist()[-3:] == [43, 44, 50]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_equals_plain_generate_and_a_second_call_drafts_from_the_first(target, batch_size, cache):
    inputs = make_prompts(batch_size, seed=10 + batch_size, min_len=3, max_len=20)
    expected = target.generate(**inputs, max_new_tokens=24, **GREEDY)
    spec = hf_specdec.SpecDecoder(method="suffix", num_speculative_tokens=6)
    first = spec_generate(target, inputs, spec, max_new_tokens=24, cache_implementation=cache, **GREEDY)
    accepted_first = spec.last_stats.num_accepted_tokens
    assert torch.equal(first, expected)
    assert spec.suffix_cache.num_requests == batch_size
    second = spec_generate(target, inputs, spec, max_new_tokens=24, cache_implementation=cache, **GREEDY)
    assert torch.equal(second, expected)
    # The same requests again: their outputs are in the global tree, and most drafts are accepted.
    assert spec.last_stats.num_accepted_tokens > max(accepted_first, 12 * batch_size)
    assert spec.last_stats.acceptance_rate > 0.7


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gpt2"])
def test_greedy_equals_plain_across_architectures_with_the_default_k(arch):
    model = make_model(arch, seed=0)
    inputs = make_prompts(4, seed=3, min_len=4, max_len=16)
    expected = model.generate(**inputs, max_new_tokens=20, **GREEDY)
    spec = hf_specdec.SpecDecoder(method="suffix")
    assert spec.num_speculative_tokens == 24
    for _ in range(2):
        assert torch.equal(spec_generate(model, inputs, spec, max_new_tokens=20, **GREEDY), expected)


@pytest.mark.library_default
def test_the_adaptive_schedule_keeps_greedy_identity(target):
    inputs = make_prompts(3, seed=5)
    expected = target.generate(**inputs, max_new_tokens=24, **GREEDY)
    spec = hf_specdec.SpecDecoder(method="suffix")
    assert spec.num_speculative_tokens_schedule == "adaptive"
    for cache in ("dynamic", "static", "dynamic"):
        assert torch.equal(
            spec_generate(target, inputs, spec, max_new_tokens=24, cache_implementation=cache, **GREEDY), expected
        )
    assert spec.last_stats.num_draft_tokens > 0


def test_rows_that_stop_early_publish_their_outputs(target):
    """With EOS, rows finish at different steps and leave the batch; each hands its output to the global tree."""
    inputs = make_prompts(6, seed=7)
    expected = target.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=EOS_ID)
    spec = hf_specdec.SpecDecoder(method="suffix", num_speculative_tokens=4)
    out = spec_generate(target, inputs, spec, max_new_tokens=40, do_sample=False, eos_token_id=EOS_ID)
    assert torch.equal(out, expected)
    assert spec.suffix_cache.num_requests == 6


def test_static_steps_are_planned_and_captured(adopted, target, emulated_graphs, monkeypatch):
    """On static caches the drafts are made on the host in `plan_step` and the captured step reads them: with
    emulated CUDA graphs the output equals plain's and the steps replay; a second call adopts the first call's kept
    graphs (and its draft tensors, which its own `plan_step` then fills with drafts from the global tree)."""
    from hf_specdec.decoding import SpeculativeLoop

    keys: list = []
    plan_step = SpeculativeLoop.plan_step
    monkeypatch.setattr(SpeculativeLoop, "plan_step", lambda self: keys.append(plan_step(self)) or keys[-1])
    inputs = make_prompts(3, seed=21)
    expected = target.generate(**inputs, max_new_tokens=32, **GREEDY)
    for schedule in ("constant", "adaptive"):
        spec = hf_specdec.SpecDecoder(
            method="suffix", num_speculative_tokens=4, num_speculative_tokens_schedule=schedule
        )
        for _ in range(2):
            out = spec_generate(target, inputs, spec, max_new_tokens=32, cache_implementation="static", **GREEDY)
            assert torch.equal(out, expected)
            assert spec.last_stats.num_graph_replays > 0
    assert ("draft", ()) in keys
    assert adopted[:2] == [False, True]


def test_sampling_follows_the_target_law():
    """6000 rows of one seeded call; a first call with the same prompt fills the global tree with sampled outputs,
    so drafts come from both trees, often accepted, often not."""
    target = make_model("llama", seed=0, vocab=12)
    prompt = torch.tensor([[5, 6, 11, 5, 6, 11, 5, 6]])
    samples = 6000
    inputs = {"input_ids": prompt.expand(samples, -1), "attention_mask": torch.ones(samples, prompt.shape[1])}
    spec = hf_specdec.SpecDecoder(method="suffix", num_speculative_tokens=2, seed=1234)
    sampling = dict(max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0)
    spec_generate(target, {k: v[:200] for k, v in inputs.items()}, spec, **sampling)
    assert spec.suffix_cache.num_requests == 200
    out = spec_generate(target, inputs, spec, **sampling)
    assert 0.05 < spec.last_stats.acceptance_rate < 0.95, spec.last_stats
    check_first_tokens(out, prompt, exact_joint_law(target, prompt, 3, 1.0), 3)


def test_calls_in_threads_share_one_spec_decoder(target):
    inputs = [make_prompts(2, seed=30 + i) for i in range(4)]
    expected = [target.generate(**x, max_new_tokens=16, **GREEDY) for x in inputs]
    spec = hf_specdec.SpecDecoder(method="suffix", num_speculative_tokens=4)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(2):
                results[i] = spec_generate(target, inputs[i], spec, max_new_tokens=16, **GREEDY)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(torch.equal(results[i], expected[i]) for i in range(4))
    assert spec.suffix_cache.num_requests == 16


def test_install_and_pipelines_route_spec_decoder(target):
    from transformers import pipeline

    inputs = make_prompts(3, seed=9)
    expected = target.generate(**inputs, max_new_tokens=12, **GREEDY)
    spec = hf_specdec.SpecDecoder(method="suffix", num_speculative_tokens=4)
    hf_specdec.install()
    try:
        assert torch.equal(target.generate(**inputs, spec_decoder=spec, max_new_tokens=12, **GREEDY), expected)
        assert spec.last_stats is not None and spec.suffix_cache.num_requests == 3
        pipe = pipeline("text-generation", model=target, tokenizer=make_tokenizer(padding_side="left"))
        prompt = "a b c d a b c"
        plain = pipe(prompt, do_sample=False, max_new_tokens=12)
        spec.last_stats = None
        assert pipe(prompt, do_sample=False, max_new_tokens=12, spec_decoder=spec) == plain
        assert spec.last_stats is not None and spec.last_stats.num_generated_tokens > 0
    finally:
        hf_specdec.uninstall()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(suffix_max_tree_depth=0), "suffix_max_tree_depth must be an int in 1..128, got 0"),
        (dict(suffix_max_tree_depth=24.0), "suffix_max_tree_depth must be an int in 1..128, got 24.0"),
        (dict(suffix_max_cached_requests=-1), "suffix_max_cached_requests must be an int >= 0, got -1: .*0 turns"),
        (dict(suffix_max_cached_tokens=-5), "suffix_max_cached_tokens must be an int >= 0, got -5"),
        (dict(suffix_max_spec_factor=0), r"suffix_max_spec_factor must be a number in \(0, 64\], got 0"),
        (dict(suffix_min_token_prob=1.5), r"suffix_min_token_prob must be a probability in \[0, 1\], got 1.5"),
    ],
)
def test_bad_options_are_refused_before_any_model_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hf_specdec.SpecDecoder(method="suffix", **kwargs)


def test_suffix_options_with_another_method_are_refused():
    with pytest.raises(ValueError, match="was also given suffix_max_tree_depth, which only method='suffix' uses"):
        hf_specdec.SpecDecoder(method="ngram", suffix_max_tree_depth=12)
    assert hf_specdec.SpecDecoder(method="ngram").num_speculative_tokens == 5
    assert hf_specdec.SpecDecoder(method="suffix", num_speculative_tokens=3).num_speculative_tokens == 3
