"""The proposer registry: every method of `SpecDecoder` has a registered constructor, found without imports."""

from __future__ import annotations

import pytest

from hf_specdec import proposers
from hf_specdec.config import METHODS, SpecDecoder


def test_every_method_is_registered():
    proposers._discover()
    assert set(METHODS) <= set(proposers._REGISTRY), sorted(set(METHODS) - set(proposers._REGISTRY))


def test_ngram_is_built_by_its_module():
    from hf_specdec.proposers.ngram import NgramProposer

    spec = SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    proposer = proposers.build(spec, None, proposers.ProposerContext())
    assert isinstance(proposer, NgramProposer)


def test_conditional_constructor_comes_first(monkeypatch):
    monkeypatch.setattr(proposers, "_REGISTRY", {})
    monkeypatch.setattr(proposers, "_discovered", True)
    proposers.register("toy")(lambda spec, target, context: "plain")
    proposers.register("toy", when=lambda spec: spec.tag == "special")(lambda spec, target, context: "special")

    class Spec:
        method, tag = "toy", "special"

    assert proposers.build(Spec(), None, proposers.ProposerContext()) == "special"
    Spec.tag = "other"
    assert proposers.build(Spec(), None, proposers.ProposerContext()) == "plain"
    Spec.method = "missing"
    with pytest.raises(ValueError, match="No proposer is registered for method='missing'"):
        proposers.build(Spec(), None, proposers.ProposerContext())


def test_a_static_port_builds_the_calls_on_static_caches(monkeypatch):
    monkeypatch.setattr(proposers, "_REGISTRY", {})
    monkeypatch.setattr(proposers, "_discovered", True)
    proposers.register("toy", static=True)(lambda spec, target, context: "static")
    proposers.register("toy")(lambda spec, target, context: "plain")

    class Spec:
        method = "toy"

    assert proposers.build(Spec(), None, proposers.ProposerContext(static=True)) == "static"
    assert proposers.build(Spec(), None, proposers.ProposerContext()) == "plain"


@pytest.mark.parametrize("method", ["eagle3", "dflash", "gemma4_assistant"])
def test_static_ports_register_for_their_methods(method):
    """The methods drafting from the target's states have static-cache ports in their own modules."""
    proposers._discover()
    assert any(static for _, static, _ in proposers._REGISTRY[method])
