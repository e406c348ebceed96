"""The static-cache path (`cache_implementation="static"`) equals plain `generate`, and keeps its shapes fixed.

On the CPU it runs without graphs (transformers compiles only on CUDA-like devices), with the same static caches,
fixed verify widths, frozen finished rows and in-place compaction that the compiled GPU path uses.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec.static_cache import StaticCacheView

MAX_NEW = 16
STATIC = dict(cache_implementation="static", do_sample=False)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_static_greedy_matches_plain_generate(arch_models, batch_size):
    arch, target, small = arch_models
    inputs = make_prompts(batch_size, seed=batch_size)
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    for k in (1, 4, 8):
        for spec in (
            hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3),
            hf_specdec.SpecDecoder(draft_model=small, num_speculative_tokens=k),
        ):
            out = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, **STATIC)
            assert torch.equal(out, expected), f"{arch} B={batch_size} k={k} {spec.method}: {out} != {expected}"


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_static_ragged_acceptance_and_early_finishers(arch):
    """Rows accept different numbers of tokens and finish (EOS) at different steps; they stay in the batch, frozen."""
    target = make_model(arch, seed=0)
    draft = make_noisy_copy(target, noise=0.01)
    inputs = make_prompts(8, seed=5, min_len=2, max_len=20)
    for eos in (None, 7, 11):  # frequent EOS ids make rows stop early at different steps
        expected = target.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=eos)
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=6)
        out = spec_generate(target, inputs, spec, max_new_tokens=40, eos_token_id=eos, **STATIC)
        assert torch.equal(out, expected), f"{arch} eos={eos}"


def test_static_long_generation_compacts_in_place_and_stays_exact(monkeypatch):
    """Lagging rows leave holes; past the static length's slack the cache compacts in place (sliding window too)."""
    from hf_specdec import cache_route

    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)  # exactly the room below
    monkeypatch.setattr(cache_route, "STATIC_HOLE_ROOM", 8)  # little room for holes: compact often
    target = make_model("mistral", seed=0)
    draft = make_noisy_copy(target, noise=0.02)
    inputs = make_prompts(4, seed=3, min_len=2, max_len=30)
    expected = target.generate(**inputs, max_new_tokens=120, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
    out = spec_generate(target, inputs, spec, max_new_tokens=120, eos_token_id=None, **STATIC)
    assert torch.equal(out, expected)
    assert spec.last_stats.num_compactions > 0


def test_captured_steps_compact_between_steps_and_still_replay(emulated_graphs, monkeypatch):
    """Ragged rows leave holes until a cache must compact. It compacts before the step, which still replays: no
    captured step runs eagerly to compact inside its forward (on an H200 such steps took 4-8 times a replay)."""
    from hf_specdec import cache_route
    from hf_specdec.step_graph import StepGraph

    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)  # exactly the room below
    monkeypatch.setattr(cache_route, "STATIC_HOLE_ROOM", 8)  # little room for holes: compact often
    eager_after_capture = []  # keys run eagerly although their graph was captured (to compact inside the step)
    eager = StepGraph._eager
    monkeypatch.setattr(
        StepGraph, "_eager", lambda self, key: (eager_after_capture.append(key in self.graphs), eager(self, key))[1]
    )
    target = make_model("llama", seed=0)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, noise=0.2, seed=3), num_speculative_tokens=4)
    inputs = make_prompts(4, seed=5)
    gen = dict(max_new_tokens=80, do_sample=False, eos_token_id=None)
    out = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
    assert torch.equal(out, target.generate(**inputs, **gen))
    stats = spec.last_stats
    assert stats.num_compactions > 0 and stats.num_graph_replays > 0
    assert eager_after_capture and not any(eager_after_capture)


@pytest.mark.library_default
@pytest.mark.parametrize("batch_size", [1, 3])
def test_static_adaptive_planned_steps_match_plain_generate(batch_size, monkeypatch):
    """The default (adaptive) schedule on static caches decides each step on the host before its device work
    (`SpeculativeLoop.plan_step`: the key of the step's CUDA graph on a GPU) and learns after it (`after_step`): the
    same split runs here, uncaptured, and must equal plain decoding with steps that draft and steps that do not."""
    from hf_specdec.decoding import PLAIN_BLOCK, SpeculativeLoop

    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.3, seed=4)
    inputs = make_prompts(batch_size, seed=6)
    expected = target.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=None)
    keys: list = []
    plan_step = SpeculativeLoop.plan_step
    monkeypatch.setattr(SpeculativeLoop, "plan_step", lambda self: keys.append(plan_step(self)) or keys[-1])
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
    out = spec_generate(target, inputs, spec, max_new_tokens=40, eos_token_id=None, **STATIC)
    assert torch.equal(out, expected)
    assert keys and all(key in (("plain",), ("plain", PLAIN_BLOCK), ("draft", 1), ("draft", 2), None) for key in keys)
    blocks = [key[1] if key[:1] == ("plain",) and len(key) == 2 else 1 for key in keys]
    assert spec.last_stats.num_steps == sum(blocks) + 1  # every step after the prefill was planned


def test_static_mtp_matches_plain_generate():
    from proposers.test_mtp import make_mtp_target

    target, mtp = make_mtp_target("deepseek_v3")
    inputs = make_prompts(3, seed=2)
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=3)
    out = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, **STATIC)
    assert torch.equal(out, expected)


def test_static_shapes_are_fixed_after_the_prefill(llama, llama_draft, monkeypatch):
    """Every target forward after the prefill has width 1 + k, every draft forward width 2 or 1: one graph each."""
    widths: dict[str, set[int]] = {"target": set(), "draft": set()}
    original = StaticCacheView.forward

    def recording(self, token_ids, num_new, logits_to_keep=None, width=None):
        if self.prefilled:
            widths["target" if self.model is llama else "draft"].add(width)
        return original(self, token_ids, num_new, logits_to_keep, width)

    monkeypatch.setattr(StaticCacheView, "forward", recording)
    inputs = make_prompts(5, seed=4)
    spec = hf_specdec.SpecDecoder(draft_model=llama_draft, num_speculative_tokens=4)
    spec_generate(llama, inputs, spec, max_new_tokens=24, eos_token_id=None, **STATIC)
    assert widths == {"target": {5}, "draft": {2, 1}}


@pytest.mark.parametrize(
    "method", ["draft", "ngram", "mtp", "early_exit", "eagle3", "dflash", "gemma4_assistant", "suffix"]
)
def test_static_path_syncs_the_host_once_per_step(llama, llama_draft, monkeypatch, method):
    """After step 0, a greedy draft-model step, a prompt-lookup step with the constant schedule (the device
    matcher), an MTP step (fixed catch-up widths), an early-exit step, or a step of a drafter fed the target's states
    (EAGLE-3, DFlash, Gemma 4 assistant: the context fed at the verify's width), or a suffix-decoding step (drafts
    planned on the host, the committed tokens carried by the same read) reads the device from the host once (which
    rows are done).

    Every host read of a tensor is counted (`item`, `tolist`, `bool`, `int`, `cpu`, `numpy`), except inside the
    CPU reference sampler, which only runs where there is no GPU (on CUDA the Triton kernels run, and read nothing).
    """
    import sys

    from hf_specdec.decoding import SpeculativeLoop

    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__int__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            frame = sys._getframe(1)
            if not frame.f_code.co_filename.endswith("sampling/reference.py"):
                reads.append(f"{_name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    per_step: list[list[str]] = []
    original_step = SpeculativeLoop.step

    def step(self):
        before = len(reads)
        original_step(self)
        per_step.append(reads[before:])

    monkeypatch.setattr(SpeculativeLoop, "step", step)
    inputs = make_prompts(4, seed=6)
    target = llama
    if method == "draft":
        spec = hf_specdec.SpecDecoder(draft_model=llama_draft, num_speculative_tokens=4)
    elif method == "mtp":
        from proposers.test_mtp import make_mtp_target

        target, mtp = make_mtp_target("deepseek_v3")
        spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=3)
    elif method == "early_exit":
        target = make_model("llama", seed=0, layers=3)
        spec = hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=1, num_speculative_tokens=3)
    elif method == "eagle3":
        spec = hf_specdec.SpecDecoder(draft_head=random_eagle3_head(llama, [1, 1, 2]), num_speculative_tokens=3)
    elif method == "dflash":
        from conftest import make_dflash_drafter

        spec = hf_specdec.SpecDecoder(method="dflash", draft_model=make_dflash_drafter(llama), num_speculative_tokens=3)
    elif method == "gemma4_assistant":
        from conftest import make_gemma4, make_gemma4_assistant

        target = make_gemma4()
        spec = hf_specdec.SpecDecoder(draft_model=make_gemma4_assistant(target, echo=0.7), num_speculative_tokens=3)
    else:
        spec = hf_specdec.SpecDecoder(
            method=method, num_speculative_tokens=4, num_speculative_tokens_schedule="constant"
        )
    spec_generate(target, inputs, spec, max_new_tokens=20, eos_token_id=None, **STATIC)
    monkeypatch.undo()
    assert len(per_step) > 3 and spec.last_stats.num_draft_tokens > 0
    assert [reads for reads in per_step[1:] if len(reads) != 1] == []


def test_unsupported_cache_implementation_is_refused(llama):
    inputs = make_prompts(1)
    spec = hf_specdec.SpecDecoder(method="ngram")
    with pytest.raises(NotImplementedError, match="cache_implementation='offloaded'"):
        spec_generate(llama, inputs, spec, max_new_tokens=4, cache_implementation="offloaded")


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_static_seeded_sampling_equals_the_dynamic_path(llama, method):
    """Draws are counter-based per (row seed, step, stream): with a constant k the static path, whose verifies are
    padded to k + 1 and whose finished rows stay frozen, draws exactly what the dynamic path draws."""
    draft = make_noisy_copy(llama, noise=0.01)
    inputs = make_prompts(6, seed=8)
    outs = []
    for cache in ("dynamic", "static"):
        if method == "draft":
            spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3, seed=42)
        else:
            spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2, seed=42)
        outs.append(
            spec_generate(
                llama, inputs, spec, max_new_tokens=24, do_sample=True, top_k=None, cache_implementation=cache
            )
        )
    assert torch.equal(outs[0], outs[1])


@pytest.mark.requires_cuda
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_compiled_path_on_cuda_is_exact_and_compiles_once(method):
    """fp32 on a GPU: the compiled static path equals eager hf_specdec and plain static `generate` (itself compiled
    by transformers); a second call with the same shapes compiles nothing."""
    from hf_specdec import compat

    torch._dynamo.config.cache_size_limit = 64
    target = make_model("llama", seed=0).cuda()
    draft = make_model("llama", seed=1, layers=1, hidden=32).cuda()
    inputs = {name: t.cuda() for name, t in make_prompts(3, seed=1).items()}
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen, cache_implementation="static")
    assert torch.equal(expected, target.generate(**inputs, **gen))

    def make_spec():
        if method == "draft":
            return hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
        return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4)

    eager = spec_generate(target, inputs, make_spec(), **gen)
    assert compat.compiled_call(target, target.generation_config) is not None  # the static path runs compiled
    spec = make_spec()
    compiled = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
    assert torch.equal(eager, expected) and torch.equal(compiled, expected)
    # Steps are captured whole (`hf_specdec.step_graph`): prompt lookup searches on the device, and the adaptive
    # schedule plans its steps on the host before their graphs.
    assert spec.last_stats.num_graph_replays > 0
    graphs = compat.num_compiled_graphs()
    again = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
    assert torch.equal(again, expected)
    assert compat.num_compiled_graphs() == graphs
    assert spec.last_stats.compile_time_s < 0.5  # only the step's capture


@pytest.mark.requires_cuda
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_prompt_lookup_steps_are_captured_on_cuda_with_the_constant_schedule(batch_size, monkeypatch):
    """Greedy prompt lookup with the constant schedule searches on the device (`ngram_device`), so its static steps
    are captured whole and replayed; the tokens equal plain static `generate`, and the same with capture off."""
    from hf_specdec.cache_route import CAPTURE_ENV

    torch._dynamo.config.cache_size_limit = 64
    target = make_model("llama", seed=0).cuda()
    inputs = {name: t.cuda() for name, t in make_prompts(batch_size, seed=9, min_len=4, max_len=24).items()}
    gen = dict(max_new_tokens=48, do_sample=False, eos_token_id=None, cache_implementation="static")
    expected = target.generate(**inputs, **gen)
    for capture in ("1", "0"):
        monkeypatch.setenv(CAPTURE_ENV, capture)
        for k in (1, 4):
            spec = hf_specdec.SpecDecoder(
                method="ngram", num_speculative_tokens=k, num_speculative_tokens_schedule="constant"
            )
            assert torch.equal(spec_generate(target, inputs, spec, **gen), expected), f"capture={capture} k={k}"
            assert (spec.last_stats.num_graph_replays > 0) == (capture == "1")
            assert spec.last_stats.num_draft_tokens > 0


@pytest.mark.requires_cuda
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_captured_steps_on_cuda_stay_exact_through_finishers_and_compaction(batch_size, monkeypatch):
    """Whole steps replayed as one CUDA graph: identical to plain static `generate` with a draft that is often
    wrong (holes), a generation long enough to compact, and rows that stop early at EOS (frozen inside the batch);
    the same call with capture switched off gives the same tokens."""
    import os

    from hf_specdec import cache_route
    from hf_specdec.cache_route import CAPTURE_ENV

    monkeypatch.setattr(cache_route, "STATIC_LENGTH_BUCKET", 1)  # exactly the room below
    monkeypatch.setattr(cache_route, "STATIC_HOLE_ROOM", 8)  # little room for holes: lagging rows compact often
    torch._dynamo.config.cache_size_limit = 64
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.2, seed=3).cuda()
    target = target.cuda()
    inputs = {name: t.cuda() for name, t in make_prompts(batch_size, seed=5).items()}
    long = dict(max_new_tokens=96, do_sample=False, eos_token_id=None)
    plain = target.generate(**inputs, **long, cache_implementation="static")
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
    assert torch.equal(spec_generate(target, inputs, spec, **long, cache_implementation="static"), plain)
    # One row never compacts: its rejected drafts are all at the end, and the write offset simply moves back.
    assert spec.last_stats.num_graph_replays > 0 and (spec.last_stats.num_compactions > 0) == (batch_size > 1)
    # EOS: the token the last row emits 30 tokens in, so that it (at least) stops early while others go on.
    eos = int(plain[-1, inputs["input_ids"].shape[1] + 30])
    gen = dict(max_new_tokens=96, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = target.generate(**inputs, **gen, cache_implementation="static")
    assert (expected[:, inputs["input_ids"].shape[1] :] == eos).any()  # a row stopped at EOS, before max_new_tokens
    assert torch.equal(spec_generate(target, inputs, spec, **gen, cache_implementation="static"), expected)
    assert spec.last_stats.num_graph_replays > 0
    os.environ[CAPTURE_ENV] = "0"
    try:
        uncaptured = spec_generate(target, inputs, spec, **gen, cache_implementation="static")
    finally:
        del os.environ[CAPTURE_ENV]
    assert torch.equal(uncaptured, expected) and spec.last_stats.num_graph_replays == 0


def test_twenty_calls_of_varied_shapes_share_a_few_cache_lengths(monkeypatch):
    """A server's calls differ in prompt length and new tokens: their static caches are rounded up to one length
    bucket (`cache_route.STATIC_LENGTH_BUCKET`), so the shapes that compiled forwards and captured steps see are one
    per batch size here, not one per call; every output equals plain's."""
    from hf_specdec.step_graph import StepGraph

    shapes = []
    init = StepGraph.__init__
    monkeypatch.setattr(StepGraph, "__init__", lambda self, root, *a, **k: (shapes.append((root.batch.batch_size, root.static.max_columns)), init(self, root, *a, **k))[1])  # fmt: skip
    target = make_model("llama", seed=0)
    spec = hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target), num_speculative_tokens=3)
    for call in range(20):
        batch_size = 1 + call % 3
        inputs = make_prompts(batch_size, seed=call, min_len=3, max_len=3 + 2 * call)  # prompts of 3-41 tokens
        gen = dict(max_new_tokens=4 + call % 7, do_sample=False, eos_token_id=None)
        expected = target.generate(**inputs, **gen)
        assert torch.equal(spec_generate(target, inputs, spec, **gen, cache_implementation="static"), expected)
    assert len(shapes) == 20
    assert sorted(set(shapes)) == [(1, 256), (2, 256), (3, 256)]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_steps_are_captured_on_cuda(arch):
    """MTP with no cache flag on CUDA takes the captured static path: its steps replay as CUDA graphs and the
    tokens equal plain `generate` (fp32 tiny targets, experts as "batched_mm"). With transformers' default
    "grouped_mm", torch's float32 grouped matmul copies between host and device, so the steps are refused with a
    warning that names the fix, and the tokens are still plain's."""
    from proposers.test_mtp import make_mtp_target

    target, mtp = make_mtp_target(arch)
    target, mtp = target.cuda(), mtp.cuda()
    inputs = {name: t.cuda() for name, t in make_prompts(3, seed=19).items()}
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    for implementation in ("batched_mm", "grouped_mm"):
        for model in (target, mtp):
            model.set_experts_implementation(implementation)
        spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(spec_generate(target, inputs, spec, **gen), expected), implementation
        said = [str(w.message) for w in caught if "could not capture" in str(w.message)]
        if implementation == "batched_mm":
            assert spec.last_stats.num_graph_replays > 0 and not said
        else:
            assert said and "set_experts_implementation('batched_mm')" in said[0]


def random_eagle3_head(target, aux_layer_ids: list[int]):  # noqa: ANN001, ANN201
    """An EAGLE-3 head with torch's default initialisation for `target` (its vocabulary, its hidden size)."""
    from transformers import LlamaConfig

    from hf_specdec.proposers.eagle3_head import Eagle3Head

    config = target.config
    layer = LlamaConfig(hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size,
                        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                        vocab_size=config.vocab_size)  # fmt: skip
    torch.manual_seed(3)
    return Eagle3Head(layer, config.vocab_size, config.hidden_size, aux_layer_ids=aux_layer_ids).eval()
