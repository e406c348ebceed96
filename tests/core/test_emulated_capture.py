"""Captured static steps on the CPU, with CUDA-graph semantics emulated (tests/emulated_graphs.py): each step kind
is captured once and then replayed with no Python, and the output must still equal plain `generate`.

The emulation is what lets CI test the captured path at all (CI has no GPU): a step that reads a Python value the
replay would not update, or a tensor the capture created but a later call reads, gives wrong tokens here as on a
GPU. `test_static_cache.py` runs the same planned steps uncaptured."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, make_prompts, spec_generate
from emulated_graphs import EmulatedGraph, EmulatedGraphs, StaleGraphInput

import hf_specdec

GREEDY = dict(do_sample=False, eos_token_id=None, cache_implementation="static")


def test_the_emulation_replays_without_python_and_refuses_host_reads():
    x = torch.arange(4.0)
    graph = EmulatedGraph()
    with EmulatedGraphs.capture(graph):
        x.add_(1)  # written during the capture: put back after it
        y = x * 2  # created: garbage until the first replay
    assert x.tolist() == [0, 1, 2, 3] and torch.isnan(y).all()
    graph.replay()
    graph.replay()
    assert x.tolist() == [2, 3, 4, 5] and y.tolist() == [4, 6, 8, 10]  # each replay reads x as it is then
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        with EmulatedGraphs.capture(EmulatedGraph()):
            x.sum().item()
    assert x.tolist() == [2, 3, 4, 5]


def test_the_emulation_refuses_a_replay_that_reads_a_freed_tensor():
    """A real graph holds addresses, not tensors: a replay after the program dropped a tensor it reads would read
    freed memory on a GPU (an illegal memory access, or silently wrong data). The emulation names it instead."""
    kept, dropped = torch.arange(4.0), torch.ones(4)
    view = kept[1:]  # a view made before the capture and dropped after it: its storage is still held by `kept`
    graph = EmulatedGraph()
    with EmulatedGraphs.capture(graph):
        made = torch.tensor([1.0, 2.0, 3.0])  # made during the capture: the graph's own memory on a GPU
        out = view * 2 + dropped[1:] + made
    del view
    graph.replay()
    assert out.tolist() == [4.0, 7.0, 10.0]
    del dropped
    with pytest.raises(StaleGraphInput, match=r"shape \(4,\) \(first used by aten.slice"):
        graph.replay()


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_captured_steps_equal_plain(emulated_graphs, method, schedule, batch_size):
    target = make_model("llama", seed=0)
    drafting = (
        dict(draft_model=make_noisy_copy(target, noise=0.3, seed=4)) if method == "draft" else dict(method="ngram")
    )
    inputs = make_prompts(batch_size, seed=20 + batch_size)
    expected = target.generate(**inputs, max_new_tokens=32, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=3, num_speculative_tokens_schedule=schedule)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=32, **GREEDY), expected)
    assert spec.last_stats.num_graph_replays > 0


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gpt2", "gemma", "phi3"])
def test_captured_steps_equal_plain_across_architectures(emulated_graphs, arch):
    """The captured step of each test architecture (sliding windows, learned positions, tied heads, ...) with a
    smaller draft of its kind gives plain's tokens, and is captured. (A one-off sweep of this check over the 91
    causal-LM classes of transformers 5.24 that build from a tiny decoder config: 90 captured and identical; the
    91st was XLM-RoBERTa-XL loaded bidirectionally, now refused.)"""
    target, draft = make_model(arch, seed=0), make_model(arch, seed=1, layers=1, hidden=32)
    inputs = make_prompts(3, seed=41)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    assert torch.equal(spec_generate(target, inputs, spec, max_new_tokens=24, **GREEDY), expected)
    assert spec.last_stats.num_graph_replays > 0


@pytest.mark.parametrize(
    "processors",
    [dict(temperature=0.8, top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(typical_p=0.9, temperature=1.3)],
    ids=["temperature-top_p", "top_k", "min_p", "typical_p"],
)
def test_seeded_sampling_is_the_same_captured(emulated_graphs, monkeypatch, processors):
    """The draws are keyed by a device step counter and the processors run in the graph: a captured call draws
    exactly what an uncaptured one does (whose law the chi-square tests check)."""
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.3, seed=4)
    inputs = make_prompts(3, seed=7)
    gen = dict(max_new_tokens=24, do_sample=True, eos_token_id=None, cache_implementation="static", **processors)

    spec = dict(draft_model=draft, num_speculative_tokens=3, seed=11)
    assert_captured_draws_equal_uncaptured(target, inputs, spec, gen, monkeypatch)


def assert_captured_draws_equal_uncaptured(target, inputs: dict, spec: dict, gen: dict, monkeypatch,  # noqa: ANN001
                                           before_each=lambda: None) -> None:  # noqa: ANN001  # fmt: skip
    """A seeded call with its steps captured, then the same with capture off: replays only in the first, and the
    same tokens (the draws are keyed by row seed and a device step counter, which replays advance)."""

    def run() -> tuple[torch.Tensor, int]:
        before_each()
        decoder = hf_specdec.SpecDecoder(**spec)
        return spec_generate(target, inputs, decoder, **gen), decoder.last_stats.num_graph_replays

    captured, replays = run()
    monkeypatch.setenv("HF_SPECDEC_CAPTURE_STEPS", "0")
    uncaptured, none = run()
    assert replays > 0 and none == 0
    assert torch.equal(captured, uncaptured)


def captured_and_uncaptured_stats(target, inputs: dict, spec: dict, gen: dict, expected: torch.Tensor) -> dict:  # noqa: ANN001
    """Greedy static calls with a fresh `SpecDecoder(**spec)`, captured (no capture may be refused: a refusal warns)
    and then with `HF_SPECDEC_CAPTURE_STEPS=0`, each equal to `expected`; their `last_stats` by `captured`, after
    checking that only the captured call replayed graphs."""
    stats = {}
    for captured in (True, False):
        decoder = hf_specdec.SpecDecoder(**spec)
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
            warnings.simplefilter("error", RuntimeWarning)  # a refused capture would warn
            if not captured:
                patch.setenv("HF_SPECDEC_CAPTURE_STEPS", "0")
            out = spec_generate(target, inputs, decoder, **gen, do_sample=False, cache_implementation="static")
            assert torch.equal(out, expected), captured
        stats[captured] = decoder.last_stats
    assert stats[True].num_graph_replays > 0 and stats[False].num_graph_replays == 0
    return stats


def assert_captured_drafts_equal_uncaptured(target, inputs: dict, spec: dict, gen: dict, monkeypatch) -> None:  # noqa: ANN001
    """`assert_captured_draws_equal_uncaptured`, and every step's drafts and draft probabilities are the same too: the
    verify logs them into a tensor indexed by the device step counter, inside the step, so replays log theirs (a
    drafter whose replays read stale state would propose other drafts, or the same ones with other probabilities)."""
    from hf_specdec.decoding import SpeculativeLoop

    verify = SpeculativeLoop.verify
    logs: list[dict[str, torch.Tensor]] = []

    def logging_verify(loop, proposal):  # noqa: ANN001, ANN202
        ids, probs = proposal.draft_token_ids, proposal.draft_probs  # [B, k], [B, k, V] or None
        if ids.shape[1]:  # a drafting step (the others propose nothing)
            log, steps = logs[-1], gen["max_new_tokens"] + 1
            if "ids" not in log:  # made at the first (uncaptured) step that proposes or drafts
                log["ids"] = torch.full((steps, *ids.shape), -2, dtype=ids.dtype)
            if probs is not None and "probs" not in log:
                log["probs"] = torch.zeros(steps, *probs.shape)
            at = loop.sampling.step.clamp(max=steps - 1).reshape(1)  # [1] the device step counter
            log["ids"].index_copy_(0, at, ids[None])
            if probs is not None:
                log["probs"].index_copy_(0, at, probs[None])
        return verify(loop, proposal)

    monkeypatch.setattr(SpeculativeLoop, "verify", logging_verify)
    with monkeypatch.context() as patch:
        assert_captured_draws_equal_uncaptured(target, inputs, spec, gen, patch, before_each=lambda: logs.append({}))
    captured, uncaptured = logs
    assert (captured["ids"] >= 0).any() and torch.equal(captured["ids"], uncaptured["ids"])
    assert torch.equal(captured["probs"], uncaptured["probs"])


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_captured_steps_with_stops_and_compactions_equal_plain(emulated_graphs, monkeypatch, method):
    """Rows that stop at EOS at different steps (frozen in the batch), and a cache so short that lagging rows make
    it compact (those steps run eagerly, the next ones replay): still plain's tokens."""
    from hf_specdec import cache_route

    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)
    monkeypatch.setattr(cache_route, "STATIC_HOLE_ROOM", 8)
    target = make_model("llama", seed=0)
    drafting = (
        dict(draft_model=make_noisy_copy(target, noise=0.05, seed=4)) if method == "draft" else dict(method="ngram")
    )
    inputs = make_prompts(6, seed=31, min_len=2, max_len=20)
    for eos in (None, 7):
        gen = dict(max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=0)
        expected = target.generate(**inputs, **gen)
        spec = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=4, num_speculative_tokens_schedule="constant")
        out = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
        assert torch.equal(out, expected), eos
        assert spec.last_stats.num_graph_replays > 0
    if method == "draft":  # rows accept different numbers of drafts: holes, then compactions
        assert spec.last_stats.num_compactions > 0


def test_eager_experts_refuse_capture_and_the_warning_names_the_fix(emulated_graphs):
    """A mixture-of-experts target with transformers' "eager" experts routes tokens with host reads: its steps are
    refused (and run exactly, uncaptured) with a warning that says which experts implementation captures; with
    "grouped_mm" the same call is captured."""
    from proposers.test_mtp import make_mtp_target

    target, _ = make_mtp_target("deepseek_v3")
    draft, _ = make_mtp_target("deepseek_v3", seed=3)
    inputs = make_prompts(2, seed=5)
    gen = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    for implementation in ("eager", "grouped_mm"):
        for model in (target, draft):
            model.set_experts_implementation(implementation)
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
        assert torch.equal(out, expected), implementation
        said = [str(w.message) for w in caught if "could not capture" in str(w.message)]
        if implementation == "eager":
            assert spec.last_stats.num_graph_replays == 0
            assert said and "experts_implementation='grouped_mm'" in said[0]
        else:
            assert spec.last_stats.num_graph_replays > 0 and not said


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("k", [2, 3])
def test_captured_mtp_steps_equal_plain(emulated_graphs, arch, k):
    """MTP on static caches: each layer's cache is a `StaticMtpLayerView` fed a fixed catch-up width, and its ring
    store needs no host read, so the whole step (catch-up, k draft steps cycling through the layers, verify, commit)
    is captured; greedy output equals plain's, and the drafts are the dynamic path's (the same acceptance)."""
    from proposers.test_mtp import make_mtp_target

    target, mtp = make_mtp_target(arch)
    inputs = make_prompts(3, seed=13)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None)
    accepted = {}
    for schedule in ("constant", "adaptive"):
        for cache in ("dynamic", "static"):
            spec = hf_specdec.SpecDecoder(
                method="mtp", mtp_model=mtp, num_speculative_tokens=k, num_speculative_tokens_schedule=schedule
            )
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # a refused capture would warn
                out = spec_generate(
                    target, inputs, spec, max_new_tokens=24, **{**GREEDY, "cache_implementation": cache}
                )
            assert torch.equal(out, expected), (schedule, cache)
            assert (spec.last_stats.num_graph_replays > 0) == (cache == "static"), (schedule, cache)
            accepted[schedule, cache] = spec.last_stats.num_accepted_tokens
    assert accepted["constant", "static"] == accepted["constant", "dynamic"] > 0


def test_captured_mtp_sampling_draws_what_the_uncaptured_step_draws(emulated_graphs, monkeypatch):
    from proposers.test_mtp import make_mtp_target

    target, mtp = make_mtp_target("deepseek_v3")
    inputs = make_prompts(2, seed=17)
    gen = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.95, eos_token_id=None,
               cache_implementation="static")  # fmt: skip
    spec = dict(
        method="mtp", mtp_model=mtp, num_speculative_tokens=3, seed=5, num_speculative_tokens_schedule="constant"
    )
    assert_captured_draws_equal_uncaptured(target, inputs, spec, gen, monkeypatch)


PREFIX_READERS = dict(
    repetition_penalty=1.3,
    no_repeat_ngram_size=3,
    min_new_tokens=10,
    bad_words_ids=[[3], [5, 9]],
    forced_eos_token_id=7,
)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_prefix_reading_processors_are_captured_and_equal_plain(emulated_graphs, method):
    """Repetition penalty, no-repeat n-gram, bad words, forced EOS and a minimum of new tokens (with an EOS the
    model emits early) run in
    the captured step through their device forms (`sampling/prefix_processors.py`): replays, and plain's tokens."""
    target = make_model("llama", seed=0)
    drafting = dict(draft_model=make_noisy_copy(target, seed=4)) if method == "draft" else dict(method="ngram")
    inputs = make_prompts(3, seed=17)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=7, pad_token_id=0, **PREFIX_READERS)
    expected = target.generate(**inputs, **gen)
    spec = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
    assert torch.equal(out, expected)
    assert spec.last_stats.num_graph_replays > 0  # a per-prefix processor would keep the steps uncaptured


def test_seeded_sampling_with_prefix_readers_is_the_same_captured(emulated_graphs, monkeypatch):
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.3, seed=4)
    gen = dict(max_new_tokens=24, do_sample=True, eos_token_id=None, cache_implementation="static", temperature=0.9,
               **PREFIX_READERS)  # fmt: skip
    spec = dict(draft_model=draft, num_speculative_tokens=3, seed=11)
    assert_captured_draws_equal_uncaptured(target, make_prompts(3, seed=7), spec, gen, monkeypatch)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_stop_strings_are_checked_in_the_captured_step(emulated_graphs, method):
    """Stop strings are decided on the device (`stopping._stop_string_hits`): the steps replay, and rows stop
    where plain `generate` stops them (a string that row 0 writes mid-way, spanning tokens)."""
    from conftest import make_tokenizer

    target = make_model("llama", seed=0)
    tokenizer = make_tokenizer()
    inputs = make_prompts(3, seed=3)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    plain = target.generate(**inputs, **gen)
    new = plain[:, inputs["input_ids"].shape[1] :]  # [B, N]
    row = int((new != PAD_ID).sum(1).argmax())  # the row that runs longest before EOS
    for start in range(3, 12):  # text it writes mid-way (two tokens): the first that stops plain generate
        stop = tokenizer.decode(new[row, start : start + 2]).strip().removeprefix("##")
        expected = target.generate(**inputs, **gen, stop_strings=stop, tokenizer=tokenizer)
        if not torch.equal(expected, plain):
            break
    assert not torch.equal(expected, plain), "no stop string fired"
    drafting = dict(draft_model=make_noisy_copy(target, seed=4)) if method == "draft" else dict(method="ngram")
    spec = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, **gen, cache_implementation="static", spec_stop_strings=stop,
                        spec_tokenizer=tokenizer)  # fmt: skip
    assert torch.equal(out, expected)
    assert spec.last_stats.num_graph_replays > 0


def biased_generation(target, inputs: dict) -> dict:  # noqa: ANN001
    """Sequence biases taken from plain greedy output (so that they fire: one-token and two-token sequences) and an
    exponential length penalty on EOS (rows then end at different steps)."""
    base = dict(max_new_tokens=24, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    new = target.generate(**inputs, **base, do_sample=False)[:, inputs["input_ids"].shape[1] :]
    bias = [[[int(new[0, 5])], -4.0], [[int(new[1, 3]), int(new[1, 4])], -6.0], [[int(new[2, 2])], 3.0],
            [[int(new[1, 3]), int(new[1, 4]), int(new[1, 5])], -2.5]]  # fmt: skip
    return dict(**base, sequence_bias=bias, exponential_decay_length_penalty=(6, 1.4))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sequence_bias_and_length_penalty_are_captured_and_equal_plain(emulated_graphs, method):
    """Sequence bias and the exponential length penalty run in the captured step through their device forms
    (`prefix_processors.SequenceBias`, `ExponentialDecay`): replays, and plain's tokens, which they changed."""
    target = make_model("llama", seed=0)
    inputs = make_prompts(3, seed=17)
    gen = dict(do_sample=False, **biased_generation(target, inputs))
    expected = target.generate(**inputs, **gen)
    unbiased = target.generate(**inputs, do_sample=False, max_new_tokens=24, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    assert not torch.equal(expected, unbiased)  # the processors act on this call
    drafting = dict(draft_model=make_noisy_copy(target, seed=4)) if method == "draft" else dict(method="ngram")
    spec = hf_specdec.SpecDecoder(**drafting, num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
    assert torch.equal(out, expected)
    assert spec.last_stats.num_graph_replays > 0


def test_seeded_sampling_with_sequence_bias_and_length_penalty_is_the_same_captured(emulated_graphs, monkeypatch):
    target = make_model("llama", seed=0)
    inputs = make_prompts(3, seed=7)
    gen = dict(do_sample=True, temperature=0.9, cache_implementation="static", **biased_generation(target, inputs))
    spec = dict(draft_model=make_noisy_copy(target, noise=0.3, seed=4), num_speculative_tokens=3, seed=11)
    assert_captured_draws_equal_uncaptured(target, inputs, spec, gen, monkeypatch)
