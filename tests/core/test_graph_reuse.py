"""`hf_specdec.graph_reuse`: a later call adopts a finished call's state tensors (the addresses its graphs read).

Replaying a kept CUDA graph needs a GPU (tests/core/test_captured_threads.py and the H100 benchmark check outputs);
these check, on real hf_specdec objects, what adoption copies and rebinds, when it refuses, and who may use an entry."""

from __future__ import annotations

import pytest
import torch

from hf_specdec import graph_reuse
from hf_specdec.batch import RaggedBatch
from hf_specdec.metrics import SpecDecodeStats


def _state(prompt: list[list[int]]) -> SpecDecodeStats:
    root = SpecDecodeStats()
    root.batch = RaggedBatch.from_prompts(torch.tensor(prompt), None, 8)
    root.scratch = None  # a tensor the step writes before it reads (set lazily)
    return root


def test_adopt_copies_the_new_call_into_the_kept_tensors_and_points_its_attributes_there():
    old = _state([[1, 2, 3]])
    old.scratch = torch.zeros(2)
    kept_ids = old.batch.token_ids
    entry = graph_reuse.Entry(signature="s", root=old, device=torch.device("cpu"))
    graph_reuse.snapshot(entry)
    old.scratch = None  # dropped after the last step (as the statistics drop their device counters): still kept
    new = _state([[4, 5, 6]])
    assert graph_reuse.adopt(entry, new)
    assert new.batch.token_ids is kept_ids and kept_ids[0, :3].tolist() == [4, 5, 6]  # the new prompt, old address
    assert new.batch.lengths is old.batch.lengths
    assert new.scratch is entry.slots[("", "scratch")]  # lazily set in the new call: takes the kept tensor


def test_adopt_refuses_other_shapes_and_changes_nothing():
    old = _state([[1, 2, 3]])
    entry = graph_reuse.Entry(signature="s", root=old, device=torch.device("cpu"))
    graph_reuse.snapshot(entry)
    new = _state([[4, 5, 6], [7, 8, 9]])  # another batch size
    ids = new.batch.token_ids
    assert not graph_reuse.adopt(entry, new)
    assert new.batch.token_ids is ids and old.batch.token_ids[0, :3].tolist() == [1, 2, 3]


def test_reuse_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(graph_reuse.REUSE_ENV, raising=False)
    assert graph_reuse.enabled()
    monkeypatch.setenv(graph_reuse.REUSE_ENV, "0")
    assert not graph_reuse.enabled()


def test_kept_entries_hold_at_most_max_kept_bytes(monkeypatch):
    """The oldest entries go once the kept tensors pass the byte budget; an entry above it alone is not kept."""

    class Model:
        pass

    model = Model()

    def entry(i: int) -> graph_reuse.Entry:
        kept = graph_reuse.Entry(signature=("B", i), root=_state([[1, 2, 3]]), device=torch.device("cpu"))
        graph_reuse.snapshot(kept)
        return kept

    size = graph_reuse.entry_bytes(entry(0))
    assert size > 0
    monkeypatch.setattr(graph_reuse, "MAX_KEPT_BYTES", 2 * size)
    for i in range(3):
        graph_reuse.keep(model, entry(i))
    assert [e.signature for e in graph_reuse.entries(model)] == [("B", 1), ("B", 2)]
    monkeypatch.setattr(graph_reuse, "MAX_KEPT_BYTES", size - 1)
    graph_reuse.clear(model)
    graph_reuse.keep(model, entry(3))
    assert graph_reuse.checkout(model, ("B", 3))[0] is None


def test_an_entry_serves_one_call_at_a_time_and_only_its_signature(monkeypatch):
    monkeypatch.delenv(graph_reuse.REUSE_ENV, raising=False)  # reuse is on by default

    class Model:
        pass

    model = Model()
    entry = graph_reuse.Entry(signature=("B", 1), root=_state([[1]]), device=torch.device("cpu"))
    graph_reuse.keep(model, entry)
    assert graph_reuse.checkout(model, ("B", 2))[0] is None
    assert graph_reuse.checkout(model, ("B", 1))[0] is entry
    assert graph_reuse.checkout(model, ("B", 1))[0] is None  # in use by the first caller
    graph_reuse.keep(model, entry)  # released
    assert graph_reuse.checkout(model, ("B", 1))[0] is entry
    for i in range(graph_reuse.MAX_ENTRIES + 2):
        graph_reuse.keep(
            model, graph_reuse.Entry(signature=("B", 10 + i), root=_state([[1]]), device=torch.device("cpu"))
        )
    assert len(graph_reuse.entries(model)) == graph_reuse.MAX_ENTRIES
    graph_reuse.clear(model)
    assert graph_reuse.checkout(model, ("B", 10 + graph_reuse.MAX_ENTRIES + 1))[0] is None


def test_models_with_kept_graphs_are_freed_when_dropped_and_copies_start_without_them(monkeypatch, emulated_graphs):
    """Kept graphs refer back to their target and draft (the loop holds both). Held in a module-level table keyed
    weakly by the model, they kept both models (and the kept static caches) alive for the whole process; the model
    now holds them itself, so dropping the models frees everything, and a deep copy starts with no entries."""
    import copy
    import gc
    import weakref

    from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

    import hf_specdec

    monkeypatch.delenv(graph_reuse.REUSE_ENV, raising=False)
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target)
    inputs = make_prompts(1, seed=1, min_len=6, max_len=6)
    spec = hf_specdec.SpecDecoder(draft_model=draft)
    spec_generate(target, inputs, spec, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert len(graph_reuse.entries(target)) == 1
    assert graph_reuse.entries(copy.deepcopy(target)) == []
    alive = weakref.ref(target), weakref.ref(draft)
    del target, draft, spec
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True]


@pytest.mark.parametrize("method", ["draft", "ngram", "early_exit"])
def test_calls_that_adopt_a_kept_calls_state_give_plain_output(adopted, emulated_graphs, method):
    """Static calls with equal signatures: each later one adopts the graphs and the state its predecessor left
    (CUDA graphs emulated on the CPU) and gives plain's tokens; a call of another batch size does not adopt them."""
    from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

    import hf_specdec

    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target)
    gen = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, cache_implementation="static")
    for batch_size, seed in ((3, 1), (3, 2), (3, 3), (2, 4)):
        inputs = make_prompts(batch_size, seed=seed, min_len=6, max_len=6)  # one prompt width: equal max_length
        spec = {"draft": lambda: hf_specdec.SpecDecoder(draft_model=draft), "ngram": hf_specdec.SpecDecoder,
                "early_exit": lambda: hf_specdec.SpecDecoder(early_exit_layers=1)}[method]()  # fmt: skip
        plain = target.generate(**inputs, **{k: v for k, v in gen.items() if k != "cache_implementation"})
        assert torch.equal(spec_generate(target, inputs, spec, **gen), plain)
    assert adopted == [False, True, True, False]
    graph_reuse.clear(target)


@pytest.mark.parametrize("method", ["draft", "ngram", "early_exit"])
def test_calls_of_other_prompt_and_answer_lengths_adopt_kept_graphs(adopted, emulated_graphs, method):
    """Calls whose prompts and max_new_tokens differ, within one static-cache length bucket, adopt the graphs a call
    kept (the max-length rule is a tensor the graphs read, the token buffer as wide as the bucketed caches), and each
    gives plain's tokens, stopping at its own max_length inside captured steps and plain blocks (CUDA graphs
    emulated on the CPU: a replay re-runs the captured ops with the capture's Python numbers)."""
    from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

    import hf_specdec

    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target)
    gen = dict(do_sample=False, eos_token_id=None, cache_implementation="static")
    for width, max_new_tokens, seed in ((6, 20, 1), (9, 13, 2), (6, 27, 3), (11, 17, 4)):
        inputs = make_prompts(3, seed=seed, min_len=width - 3, max_len=width)
        spec = {"draft": lambda: hf_specdec.SpecDecoder(draft_model=draft), "ngram": hf_specdec.SpecDecoder,
                "early_exit": lambda: hf_specdec.SpecDecoder(early_exit_layers=1)}[method]()  # fmt: skip
        plain = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
        out = spec_generate(target, inputs, spec, max_new_tokens=max_new_tokens, **gen)
        assert torch.equal(out, plain), (width, max_new_tokens)
        assert spec.last_stats.num_graph_replays > 0
    assert adopted == [False, True, True, True]
    graph_reuse.clear(target)


def test_plain_static_generate_between_calls_leaves_kept_graphs_adoptable(adopted, emulated_graphs):
    """Plain `generate(cache_implementation="static")` (compiled plain, what a speed-minded user also calls) keeps
    its cache's bookkeeping on the model (`_previous_max_cache_length`, `_cache`): no forward reads it, so the next
    call still adopts the kept graphs (an H100 grid run recaptured after every compiled plain call before)."""
    from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

    import hf_specdec

    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target)
    inputs = make_prompts(2, seed=5, min_len=6, max_len=6)
    gen = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, cache_implementation="static")
    for max_new_tokens in (12, 12, 30):
        plain = target.generate(**inputs, **{**gen, "max_new_tokens": max_new_tokens})  # plain static, between calls
        spec = hf_specdec.SpecDecoder(draft_model=draft)
        assert torch.equal(spec_generate(target, inputs, spec, **gen), plain[:, : plain.shape[1] - max_new_tokens + 12])
    assert adopted == [False, True, True]
    graph_reuse.clear(target)


def test_a_call_after_the_kernels_change_captures_its_own_graphs(adopted, emulated_graphs):
    """A kept graph bakes in the kernels its models ran: after `set_experts_implementation` (or
    `set_attn_implementation`) the next call does not adopt it, and captures graphs of the new kernels."""
    from conftest import make_prompts, spec_generate
    from proposers.test_mtp import make_mtp_target

    import hf_specdec

    target, mtp = make_mtp_target("glm4_moe")
    inputs = make_prompts(2, seed=3, min_len=5, max_len=5)
    gen = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, cache_implementation="static")
    plain = target.generate(**inputs, **{k: v for k, v in gen.items() if k != "cache_implementation"})
    for implementation in ("grouped_mm", "grouped_mm", "batched_mm", "batched_mm"):
        for model in (target, mtp):
            model.set_experts_implementation(implementation)
        spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=2)
        assert torch.equal(spec_generate(target, inputs, spec, **gen), plain), implementation
    assert adopted == [False, True, False, True]
    graph_reuse.clear(target)


def test_kept_graphs_are_adopted_only_by_calls_with_the_same_stop_strings(adopted, emulated_graphs):
    """Stop strings are checked inside the captured step against their token tables: a later call adopts the kept
    graphs only with the same strings (`StopRules.stop_strings_key`); with other strings it captures its own and
    stops where plain `generate` does."""
    from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, make_prompts, make_tokenizer, spec_generate

    import hf_specdec

    target, tokenizer = make_model("llama", seed=0), make_tokenizer()
    draft = make_noisy_copy(target, seed=4)
    inputs = make_prompts(2, seed=3, min_len=6, max_len=6)
    gen = dict(max_new_tokens=20, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    plain = target.generate(**inputs, **gen)
    new = plain[:, inputs["input_ids"].shape[1] :]  # [B, N]
    row = int((new != PAD_ID).sum(1).argmax())
    strings = [tokenizer.decode(new[row, s : s + 2]).strip().removeprefix("##") for s in (3, 9)]
    for stop in (strings[0], strings[0], strings[1]):
        expected = target.generate(**inputs, **gen, stop_strings=stop, tokenizer=tokenizer)
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
        out = spec_generate(target, inputs, spec, **gen, cache_implementation="static", spec_stop_strings=stop,
                            spec_tokenizer=tokenizer)  # fmt: skip
        assert torch.equal(out, expected), stop
    assert adopted == [False, True, False]
    graph_reuse.clear(target)


def test_kept_graphs_are_adopted_only_by_calls_with_the_same_bad_words(adopted, emulated_graphs):
    """A device form bakes its constants into the graph (the bad words' token lists): they are part of the
    signature (`key()`), so a call with other bad words captures its own graphs and bans its own words."""
    from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

    import hf_specdec

    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, seed=4)
    inputs = make_prompts(2, seed=3, min_len=6, max_len=6)
    gen = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    plain = target.generate(**inputs, **gen)
    frequent = torch.bincount(plain[:, 6:].flatten()).topk(2).indices.tolist()  # tokens plain writes most
    for words in ([[frequent[0]]], [[frequent[0]]], [[frequent[1]]]):
        expected = target.generate(**inputs, **gen, bad_words_ids=words)
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
        out = spec_generate(target, inputs, spec, **gen, bad_words_ids=words, cache_implementation="static")
        assert torch.equal(out, expected), words
    assert adopted == [False, True, False]
    graph_reuse.clear(target)


def test_the_kept_budget_grows_with_a_large_gpu(monkeypatch):
    """2 GiB per model, or 5% of a GPU's memory where that is more (4 GB on an 80 GB card)."""

    class Properties:
        total_memory = 80 * 10**9

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    assert graph_reuse.kept_budget(torch.device("cpu")) == graph_reuse.MAX_KEPT_BYTES
    assert graph_reuse.kept_budget(torch.device("cuda", 0)) == 4 * 10**9
    Properties.total_memory = 16 * 10**9  # a small card: the floor
    assert graph_reuse.kept_budget(torch.device("cuda", 0)) == graph_reuse.MAX_KEPT_BYTES
