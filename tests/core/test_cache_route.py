"""`hf_specdec.cache_route`: the cache path of a call, decided before any model work.

On a CUDA-less machine the default stays the dynamic path; on CUDA the default is the captured static path, with
eager forwards, wherever the step can be captured, and the dynamic path (said once) elsewhere. The CUDA decision is
checked on a real tiny model whose `device` reads as CUDA (no forward runs: the route is chosen from the model's
placement and config, the SpecDecoder and the generation config)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_model
from transformers import CompileConfig, GenerationConfig

import hf_specdec
from hf_specdec import cache_route
from hf_specdec.cache_route import choose_route


@pytest.fixture
def models():
    target = make_model("llama", seed=0)
    return target, make_model("llama", seed=1, layers=1, hidden=32)


def _on_cuda(monkeypatch, model) -> None:  # noqa: ANN001
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))


def test_the_default_on_a_cpu_is_the_dynamic_path(models):
    target, draft = models
    route = choose_route(target, hf_specdec.SpecDecoder(draft_model=draft), GenerationConfig())
    assert (route.static, route.by_default) == (False, False)
    assert choose_route(target, hf_specdec.SpecDecoder(), GenerationConfig(cache_implementation="static")).static


def test_the_default_on_cuda_is_the_captured_static_path_with_eager_forwards(models, monkeypatch):
    target, draft = models
    _on_cuda(monkeypatch, target)
    spec = hf_specdec.SpecDecoder(draft_model=draft)
    route = choose_route(target, spec, GenerationConfig())
    assert (route.static, route.compile, route.by_default) == (True, False, True)
    assert choose_route(target, hf_specdec.SpecDecoder(), GenerationConfig()).static  # prompt lookup too
    assert choose_route(target, hf_specdec.SpecDecoder(method="mtp"), GenerationConfig()).static  # and MTP
    early_exit = hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=1)
    assert choose_route(target, early_exit, GenerationConfig()).static  # and early exit
    compiled = choose_route(target, spec, GenerationConfig(compile_config=CompileConfig()))
    assert (compiled.static, compiled.compile) == (True, True)
    explicit = choose_route(target, spec, GenerationConfig(cache_implementation="static"))
    assert (explicit.static, explicit.compile, explicit.by_default) == (True, True, False)
    assert not choose_route(target, spec, GenerationConfig(cache_implementation="dynamic")).static
    monkeypatch.setenv(cache_route.DEFAULT_STATIC_ENV, "0")
    assert not choose_route(target, spec, GenerationConfig()).static


def test_what_cannot_be_captured_takes_the_dynamic_path_and_says_why_once(models, monkeypatch, caplog):
    target, draft = models
    _on_cuda(monkeypatch, target)
    monkeypatch.setattr(cache_route, "_SAID", set())
    uncapturable = [
        hf_specdec.SpecDecoder(draft_model=draft, draft_confidence_threshold=0.4),
        hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens_schedule="heuristic"),
        hf_specdec.SpecDecoder(draft_model=draft, on_step=lambda record: None),
    ]
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        for spec in uncapturable:
            for _ in range(2):
                route = choose_route(target, spec, GenerationConfig())
                assert (route.static, route.by_default) == (False, True), spec
        capturable = hf_specdec.SpecDecoder(draft_model=draft)
        assert not choose_route(target, capturable, GenerationConfig(return_dict_in_generate=True)).static
    said = [r.getMessage() for r in caplog.records if "eager dynamic cache" in r.getMessage()]
    assert len(said) == len(uncapturable) + 1  # once per reason, however many calls
    assert any("draft_confidence_threshold" in message for message in said)


def test_every_method_is_captured_or_names_what_keeps_it_off_the_captured_path():
    """Each drafting method either runs in the captured step or says why not (its state that a capture would need)."""
    from hf_specdec.config import METHODS

    for method in METHODS:
        reason = cache_route.UNCAPTURED_METHODS.get(method, "")
        assert method in cache_route.CAPTURABLE_METHODS or "host" in reason or "dynamic" in reason, method


def test_every_drafting_method_takes_the_captured_static_path_on_cuda(models, monkeypatch):
    """The default on CUDA for the methods drafting from the target's own states or layers (issue 39)."""
    from core.test_static_cache import random_eagle3_head

    target, draft = models
    _on_cuda(monkeypatch, target)
    for spec in (
        hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=1),
        hf_specdec.SpecDecoder(draft_head=random_eagle3_head(target, [1, 1, 2])),
        hf_specdec.SpecDecoder(method="dflash", draft_model=draft),
        hf_specdec.SpecDecoder(method="gemma4_assistant", draft_model=draft),
    ):
        route = choose_route(target, spec, GenerationConfig())
        assert (route.static, route.compile, route.by_default) == (True, False, True), spec.method
