"""Host stopping criteria (`max_time`, your own) on captured steps, called exactly as plain `generate` calls them.

A recording criterion keyed by batch index sees the very calls plain `generate` makes (same number, same full-batch
`input_ids`, in order), on static caches with emulated CUDA graphs (steps replayed) and on the dynamic cache, with
and without EOS; rows that ran past their stop are cut there. `max_time` replays and stops at a token boundary
without streaming a token after its stop. A captured step still reads the host once (the criteria's own answers
aside), a cut row's cache is handed back as plain's, and criteria that read an assistant's scores are refused.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, make_prompts, spec_generate
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria

import hf_specdec
from hf_specdec.decoding import SpeculativeLoop
from hf_specdec.host_criteria import HostCriteria

MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


def make_spec(target, method: str) -> hf_specdec.SpecDecoder:
    if method == "draft":
        return hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, noise=0.05, seed=4), num_speculative_tokens=4)
    return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)


class Recorder(StoppingCriteria):
    """Row i stops when its newest token is in `stop_ids[i]` (keyed by batch index); keeps every input it is shown."""

    def __init__(self, stop_ids: list[set[int]]) -> None:
        self.stop_ids = stop_ids
        self.calls: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.calls.append(input_ids.clone())
        newest = input_ids[:, -1].tolist()  # fails on a batch that is not the caller's whole batch
        return torch.tensor([t in s for t, s in zip(newest, self.stop_ids, strict=True)], device=input_ids.device)


def staggered_stops(target, inputs: dict) -> list[set[int]]:
    """Per row, a token that plain greedy decoding emits at new position 3 + 4i (rows stop at different steps)."""
    width = inputs["input_ids"].shape[1]
    free = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)[:, width:]
    return [{int(free[i, 3 + 4 * i])} for i in range(free.shape[0])]


def record_cuts(monkeypatch) -> list[tuple[int, int]]:  # noqa: ANN001
    """(tokens the row held, length it was stopped at) of every row a host criterion stopped while it was live."""
    cuts: list[tuple[int, int]] = []
    advance = HostCriteria.advance

    def recording(self, caller_rows):  # noqa: ANN001, ANN202
        stops = advance(self, caller_rows)
        cuts.extend((self.known[s.row], s.length) for s in stops if s.live)
        return stops

    monkeypatch.setattr(HostCriteria, "advance", recording)
    return cuts


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("with_eos", [True, False], ids=["eos", "no_eos"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_user_criterion_sees_plain_calls_and_stops_like_plain(emulated_graphs, monkeypatch, target, method, with_eos,
                                                              cache):  # fmt: skip
    inputs = make_prompts(3, seed=3)  # left padded, different lengths
    width = inputs["input_ids"].shape[1]
    stop_ids = staggered_stops(target, inputs)
    gen = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS_ID if with_eos else None, pad_token_id=PAD_ID)
    reference = Recorder(stop_ids)
    expected = target.generate(**inputs, **gen, stopping_criteria=StoppingCriteriaList([reference]))
    assert expected.shape[1] - width < MAX_NEW  # the criterion really ended the call
    cuts = record_cuts(monkeypatch)
    spec = make_spec(target, method)
    criterion = Recorder(stop_ids)
    out = spec_generate(target, inputs, spec, **gen, stopping_criteria=[criterion], cache_implementation=cache)
    assert torch.equal(out, expected), (out.tolist(), expected.tolist())
    assert len(criterion.calls) == len(reference.calls)
    for ours, plain in zip(criterion.calls, reference.calls):
        assert torch.equal(ours, plain)
    if cache == "static":
        assert spec.last_stats.num_graph_replays > 0
    if with_eos:
        assert cuts, "no row stopped by the criterion while live"


def test_some_row_is_cut_after_running_past_its_stop(emulated_graphs, monkeypatch, target):
    """A row that accepted more drafts than the others holds tokens past its stop when the criterion is called at
    it: those are dropped (the test above would see them in the output)."""
    inputs = make_prompts(3, seed=3)
    stop_ids = staggered_stops(target, inputs)
    cuts = record_cuts(monkeypatch)
    gen = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    expected = target.generate(**inputs, **gen, stopping_criteria=[Recorder(stop_ids)])
    spec = hf_specdec.SpecDecoder(draft_model=target, num_speculative_tokens=6)  # accepts everything
    out = spec_generate(target, inputs, spec, **gen, stopping_criteria=[Recorder(stop_ids)],
                        cache_implementation="static")  # fmt: skip
    assert torch.equal(out, expected)
    assert any(held > length for held, length in cuts), cuts


class Streamer:
    def __init__(self) -> None:
        self.columns: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 1:  # a generated column (a prompt comes as [B, P])
            self.columns.append(value.clone())

    def end(self) -> None:
        pass


@pytest.mark.parametrize("with_eos", [True, False], ids=["eos", "no_eos"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_max_time_replays_and_stops_at_a_token_boundary(emulated_graphs, monkeypatch, target, method, with_eos):
    """A fake clock moves one second per step; max_time=6.5 passes at the 8th step. The call replays steps, stops
    every row at one length (a token boundary), its tokens are plain's, and nothing past the stop was streamed."""
    inputs = make_prompts(3, seed=3)
    width = inputs["input_ids"].shape[1]
    gen = dict(do_sample=False, eos_token_id=EOS_ID if with_eos else None, pad_token_id=PAD_ID)
    plain = target.generate(**inputs, **gen, max_new_tokens=48)
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    step = SpeculativeLoop.step

    def timed_step(self):  # noqa: ANN001, ANN202
        step(self)
        clock[0] += 1.0

    monkeypatch.setattr(SpeculativeLoop, "step", timed_step)
    spec = make_spec(target, method)
    streamer = Streamer()
    out = spec_generate(target, inputs, spec, **gen, max_new_tokens=48, max_time=6.5, spec_streamer=streamer,
                        cache_implementation="static")  # fmt: skip
    assert spec.last_stats.num_graph_replays > 0
    assert width < out.shape[1] < plain.shape[1], "max_time did not stop the call"
    assert torch.equal(out, plain[:, : out.shape[1]])  # plain's tokens (rows that ended before: plain's padding)
    assert spec.last_stats.num_steps == 8  # it stopped at the first step after the time passed
    assert torch.equal(torch.stack(streamer.columns, 1), out[:, width:])  # streamed exactly what is returned


def count_host_reads(monkeypatch) -> tuple[list[str], list[list[str]]]:  # noqa: ANN001
    """Every read of a tensor on the host (`item`, `tolist`, `bool`, `int`, `cpu`, `numpy`) by file, per step; the CPU
    reference sampler's are left out (on CUDA the Triton kernels run, and read nothing)."""
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__int__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):  # noqa: ANN001, ANN202
            frame = sys._getframe(1)
            if not frame.f_code.co_filename.endswith("sampling/reference.py"):
                reads.append(f"{_name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    per_step: list[list[str]] = []
    step = SpeculativeLoop.step

    def counted_step(self):  # noqa: ANN001, ANN202
        before = len(reads)
        step(self)
        per_step.append(reads[before:])

    monkeypatch.setattr(SpeculativeLoop, "step", counted_step)
    return reads, per_step


@pytest.mark.parametrize("criterion", ["max_time", "own"])
def test_a_captured_step_with_host_criteria_reads_the_host_once(emulated_graphs, monkeypatch, target, criterion):
    """`max_time` adds no read at all (the clock is the host's); your own criterion adds only its answers, one per
    call, after the step's one read."""
    inputs = make_prompts(3, seed=6)
    stops = staggered_stops(target, inputs)
    extra = dict(max_time=3600.0) if criterion == "max_time" else dict(stopping_criteria=[Recorder(stops)])
    _, per_step = count_host_reads(monkeypatch)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, noise=0.05, seed=4), num_speculative_tokens=4,
                                  num_speculative_tokens_schedule="constant")  # fmt: skip
    spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                  cache_implementation="static", **extra)  # fmt: skip
    assert spec.last_stats.num_graph_replays > 0
    for reads in per_step[1:]:  # the criterion's own reads (in this file) and its answers' aside
        device_reads = [r for r in reads if "/hf_specdec/" in r and "host_criteria.py" not in r]
        assert len(device_reads) == 1, device_reads
        if criterion == "max_time":
            assert len(reads) == 1, reads


def test_a_cut_row_hands_back_plain_cache(target):
    """Dynamic cache, return_dict_in_generate: a row the criterion stops mid-block (its cache holds columns past
    the stop) hands back plain's cache: its columns up to the stop, then the padding plain decoding fed it."""
    from core.test_continuation import assert_same_cache

    from hf_specdec import compat

    inputs = make_prompts(3, seed=3)
    stop_ids = staggered_stops(target, inputs)
    gen = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
               return_dict_in_generate=True)  # fmt: skip
    plain = target.generate(**inputs, **gen, stopping_criteria=[Recorder(stop_ids)])
    spec = make_spec(target, "draft")
    out = spec_generate(target, inputs, spec, **gen, stopping_criteria=[Recorder(stop_ids)])
    assert torch.equal(out.sequences, plain.sequences)
    grown = plain.sequences.shape[1] - 1 - inputs["attention_mask"].shape[1]
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, grown, dtype=torch.long)], 1)
    assert_same_cache(compat.output_cache(out), compat.output_cache(plain), mask)


def test_criteria_that_read_an_assistants_scores_are_refused(target):
    from transformers.generation.stopping_criteria import ConfidenceCriteria

    with pytest.raises(NotImplementedError, match="ConfidenceCriteria reads the scores"):
        spec_generate(target, make_prompts(1), make_spec(target, "ngram"), max_new_tokens=4,
                      stopping_criteria=[ConfidenceCriteria(0.5)])  # fmt: skip


class EosOrTokens(EosTokenCriteria):
    """A subclass of transformers' EOS criterion that also stops at `stop_ids`: matched by exact type, it is called
    as written (on the host), not replaced by the device's EOS check."""

    def __init__(self, eos_token_id: int, stop_ids: list[int]) -> None:
        super().__init__(eos_token_id)
        self.stop_ids = torch.tensor(stop_ids)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        newest = input_ids[:, -1]
        return super().__call__(input_ids, scores) | torch.isin(newest, self.stop_ids.to(newest.device))


def test_a_subclass_of_a_device_rule_is_called_as_written(emulated_graphs, target):
    inputs = make_prompts(3, seed=3)
    stop_ids = [next(iter(s)) for s in staggered_stops(target, inputs)]
    gen = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    criteria = lambda: StoppingCriteriaList([EosOrTokens(EOS_ID, stop_ids)])  # noqa: E731
    expected = target.generate(**inputs, **gen, stopping_criteria=criteria())
    assert not torch.equal(expected, target.generate(**inputs, **gen))  # it stops rows the EOS alone would not
    spec = make_spec(target, "draft")
    out = spec_generate(target, inputs, spec, **gen, stopping_criteria=criteria(), cache_implementation="static")
    assert torch.equal(out, expected)
    assert spec.last_stats.num_graph_replays > 0
