"""`hf_specdec.install()` / `uninstall()`: routing of `generate`'s speculative kwargs and a clean undo.

After `install()`, `spec_decoder=`, `assistant_model=` (batch > 1 too, which stock HF refuses) and
`prompt_lookup_num_tokens=` run through hf_specdec and equal plain greedy `generate`; `uninstall()`
puts the identical original `GenerationMixin.generate` back, with stock behaviour; `install()` is
idempotent. The `installed` fixture uninstalls even when a test fails.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts
from transformers import GenerationMixin

import hf_specdec

MAX_NEW = 16
ORIGINAL_GENERATE = GenerationMixin.generate


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return make_noisy_copy(target, 0.01)


@pytest.fixture
def installed():
    assert not hf_specdec.is_installed()
    hf_specdec.install()
    try:
        yield
    finally:
        hf_specdec.uninstall()
    assert GenerationMixin.generate is ORIGINAL_GENERATE


def plain_greedy(target, inputs) -> torch.Tensor:
    return ORIGINAL_GENERATE(target, **inputs, do_sample=False, max_new_tokens=MAX_NEW)


def stock_refuses_batched_assisted_decoding(target, inputs, **speculation) -> bool:
    try:
        target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, **speculation)
    except ValueError as error:
        return "batch" in str(error).lower()
    return False


@pytest.mark.parametrize("batch_size", [1, 3])
def test_spec_decoder_kwarg_is_routed(target, draft, installed, batch_size):
    inputs = make_prompts(batch_size, seed=3)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
    out = target.generate(**inputs, spec_decoder=spec, do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(out, plain_greedy(target, inputs))
    assert spec.last_stats is not None and spec.last_stats.num_draft_tokens > 0  # it ran through hf_specdec


def test_explicit_custom_generate_still_works_when_installed(target, draft, installed):
    """`custom_generate=hf_specdec.generate, spec_decoder=spec` keeps working with the hook in place."""
    inputs = make_prompts(2, seed=4)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    out = target.generate(
        **inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, do_sample=False, max_new_tokens=MAX_NEW
    )
    assert torch.equal(out, plain_greedy(target, inputs))
    assert spec.last_stats is not None and spec.last_stats.num_steps > 0


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize(
    "speculation",
    [{"assistant_model": "draft"}, {"prompt_lookup_num_tokens": 4}],
    ids=["assistant_model", "prompt_lookup"],
)
def test_hf_speculation_kwargs_are_routed(target, draft, batch_size, speculation):
    speculation = {k: draft if v == "draft" else v for k, v in speculation.items()}
    inputs = make_prompts(batch_size, seed=3)
    expected = plain_greedy(target, inputs)
    if batch_size > 1:  # stock HF refuses this call: success below proves the routing
        assert stock_refuses_batched_assisted_decoding(target, inputs, **speculation)
    hf_specdec.install()
    try:
        out = target.generate(
            **inputs, do_sample=False, max_new_tokens=MAX_NEW, return_dict_in_generate=True, **speculation
        )
    finally:
        hf_specdec.uninstall()
    assert isinstance(out, hf_specdec.SpecDecodeOutput) and out.spec_stats.num_steps > 0  # hf_specdec ran it
    assert torch.equal(out.sequences, expected)
    if batch_size > 1:  # and stock behaviour is back after uninstall()
        assert stock_refuses_batched_assisted_decoding(target, inputs, **speculation)


def test_uninstall_restores_the_identical_original():
    assert GenerationMixin.generate is ORIGINAL_GENERATE
    hf_specdec.install()
    try:
        assert hf_specdec.is_installed()
        wrapper = GenerationMixin.generate
        assert wrapper is not ORIGINAL_GENERATE and wrapper.__wrapped__ is ORIGINAL_GENERATE
        hf_specdec.install()  # idempotent: no second layer of wrapping
        assert GenerationMixin.generate is wrapper
    finally:
        hf_specdec.uninstall()
    assert not hf_specdec.is_installed()
    assert GenerationMixin.generate is ORIGINAL_GENERATE
    hf_specdec.uninstall()  # a second uninstall is a no-op
    assert GenerationMixin.generate is ORIGINAL_GENERATE


def test_plain_calls_are_untouched_when_installed(target, installed):
    inputs = make_prompts(3, seed=3)
    out = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(out, plain_greedy(target, inputs))


@pytest.mark.parametrize("value", [0, -2])
def test_prompt_lookup_num_tokens_below_one_is_refused_as_stock_does(llama, value):
    """Stock transformers raises for prompt_lookup_num_tokens=0; after install() it must not silently run plain."""
    inputs = make_prompts(1)
    with pytest.raises(ValueError, match="Invalid max_matching_ngram_size or num_output_tokens"):
        llama.generate(**inputs, max_new_tokens=4, prompt_lookup_num_tokens=value)
    hf_specdec.install()
    try:
        with pytest.raises(ValueError, match=f"prompt_lookup_num_tokens={value} is invalid"):
            llama.generate(**inputs, max_new_tokens=4, prompt_lookup_num_tokens=value)
    finally:
        hf_specdec.uninstall()


@pytest.mark.library_default
def test_spec_decoder_defaults_to_the_adaptive_schedule():
    assert hf_specdec.SpecDecoder().num_speculative_tokens_schedule == "adaptive"
    named = hf_specdec.SpecDecoder(num_speculative_tokens_schedule="constant")
    assert named.num_speculative_tokens_schedule == "constant"


@pytest.mark.parametrize(
    ("kwargs", "schedule", "k"),
    [
        ({"assistant_model": "draft"}, "adaptive", 5),
        ({"prompt_lookup_num_tokens": 7}, "adaptive", 7),
        ({"assistant_early_exit": 1}, "adaptive", 5),
        ({"assistant_model": "draft", "num_assistant_tokens": 6}, "constant", 6),
        ({"assistant_model": "draft", "num_assistant_tokens_schedule": "heuristic"}, "heuristic", 20),
        ({"assistant_model": "draft", "assistant_confidence_threshold": 0.3}, "constant", 20),
        ({"assistant_model": "draft", "assistant_config": {"num_assistant_tokens": 3}}, "constant", 3),
        ({"prompt_lookup_num_tokens": 4, "num_assistant_tokens_schedule": "constant"}, "constant", 4),
    ],
    ids=[
        "assistant",
        "lookup",
        "early_exit",
        "hf_k",
        "hf_schedule",
        "hf_threshold",
        "assistant_config",
        "lookup_named",
    ],
)
def test_install_routes_are_adaptive_unless_hf_knobs_are_named(target, draft, kwargs, schedule, k):
    """Every install() route uses the adaptive schedule, unless the caller names a schedule or one of HF's assistant
    knobs (in the call or in a generation_config): then HF's meaning (its defaults for the knobs not named)."""
    from transformers import GenerationConfig

    from hf_specdec.routing import _spec_from_kwargs

    kwargs = dict(kwargs)
    assistant = None
    if kwargs.get("assistant_model") == "draft":
        assistant = make_noisy_copy(target, 0.01)  # a fresh copy: its generation_config may be edited below
        assistant.generation_config = GenerationConfig(**kwargs.pop("assistant_config", {}))
        kwargs["assistant_model"] = assistant
    spec = _spec_from_kwargs(target, kwargs)
    assert (spec.num_speculative_tokens_schedule, spec.num_speculative_tokens) == (schedule, k)
    assert not set(kwargs) & {"num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"assistant_model": "draft", "num_assistant_tokens": 0},
        {"assistant_model": "draft", "num_assistant_tokens": 2.5},
        {"assistant_early_exit": 1, "num_assistant_tokens": -1},
        {"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 0},
    ],
)
def test_invalid_hf_knobs_are_refused_before_any_model_work(target, draft, installed, kwargs):
    """Stock transformers refuses max_matching_ngram_size=0 and silently drafts nothing for num_assistant_tokens=0;
    both are mistakes, and both get an error naming the knob and its value."""
    kwargs = {k: draft if v == "draft" else v for k, v in kwargs.items()}
    name, value = [(k, v) for k, v in kwargs.items() if k in ("num_assistant_tokens", "max_matching_ngram_size")][0]
    with pytest.raises(ValueError, match=f"{name}={value!r} is invalid"):
        target.generate(**make_prompts(1), max_new_tokens=4, **kwargs)


def test_a_useless_draft_costs_little_more_than_plain_at_batch_4(target, installed):
    """A draft that is never right (another random model), routed with HF's defaults (the adaptive schedule): after
    a few steps the loop stops drafting, so the target and draft forwards stay near plain decoding's count."""
    useless = make_model("llama", seed=7)
    counts = {"target": 0, "draft": 0}
    hooks = [
        model.register_forward_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
        for name, model in (("target", target), ("draft", useless))
    ]
    inputs = make_prompts(4, seed=3)
    new_tokens = 48
    try:
        plain = ORIGINAL_GENERATE(target, **inputs, do_sample=False, max_new_tokens=new_tokens)
        plain_forwards, counts["target"] = counts["target"], 0
        out = target.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, assistant_model=useless)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(out, plain) and plain_forwards == new_tokens
    # The first call times 6 widths (k = 5) once; drafting stops after a few rejected steps.
    assert counts["target"] <= plain_forwards + 6 + 4, counts
    assert counts["draft"] <= 0.5 * plain_forwards, counts


@pytest.mark.library_default
def test_the_install_route_runs_the_custom_generate_plan_and_adopts_its_graphs(monkeypatch, emulated_graphs, target):
    """`install()` + `assistant_model=draft` (no other flag) is the route most users meet; on an H100 it measured
    slower and more variable than `custom_generate` with `SpecDecoder(draft_model=draft)` (issue 38). Both must run
    one plan: the same SpecDecoder settings, the same graph signature and adaptive memory, so that a routed call
    adopts the graphs a custom_generate call kept and the reverse (the GPU's default path: the captured static
    route, emulated on the CPU)."""
    from hf_specdec import adaptive, cache_route, graph_reuse, plan, routing
    from hf_specdec.step_graph import StepGraph

    monkeypatch.delenv(graph_reuse.REUSE_ENV, raising=False)
    choose = cache_route.choose_route

    def captured_default(model, spec, config, cache=None):  # noqa: ANN001, ANN202 - what a CUDA call gets
        if config.cache_implementation is None and cache_route.default_blocker(model, spec, config, cache) is None:
            return cache_route.CacheRoute(static=True, compile=False, by_default=True)
        return choose(model, spec, config, cache)

    monkeypatch.setattr(plan, "choose_route", captured_default)
    graphs: list[StepGraph] = []
    init = StepGraph.__init__
    monkeypatch.setattr(StepGraph, "__init__", lambda self, *a, **k: (init(self, *a, **k), graphs.append(self))[0])
    routed: list[hf_specdec.SpecDecoder] = []
    build = routing._spec_from_kwargs
    monkeypatch.setattr(routing, "_spec_from_kwargs", lambda *a: routed.append(build(*a)) or routed[-1])
    draft = make_noisy_copy(target, 0.01, seed=11)  # its own serial: no kept graphs or costs from other tests
    inputs = make_prompts(1, seed=5, min_len=6, max_len=6)
    gen = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
    plain = plain_greedy(target, inputs)
    specs = []
    hf_specdec.install()
    try:
        for route in ("custom", "install", "custom", "install"):
            if route == "custom":
                specs.append(hf_specdec.SpecDecoder(draft_model=draft))
                out = target.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=specs[-1])
            else:
                out = target.generate(**inputs, **gen, assistant_model=draft)
                specs.append(routed[-1])
            assert torch.equal(out, plain), route
    finally:
        hf_specdec.uninstall()
    assert [s.to_dict() for s in specs[1:]] == [specs[0].to_dict()] * 3
    assert len({g.signature for g in graphs}) == 1 and graphs[0].signature is not None
    assert [s.last_stats.graph_reuse for s in specs] == ["captured", "adopted", "adopted", "adopted"]
    assert [s.last_stats.calibration_time_s > 0 for s in specs] == [True, False, False, False]
    assert (
        len(
            [
                key
                for key in adaptive._MEMORY[target].costs
                if key[0].endswith(f":{adaptive.model_serial(draft)}@static")
            ]
        )
        == 1
    )
    graph_reuse.clear(target)
