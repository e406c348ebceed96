"""`hf_specdec.model_guard`: the fingerprint of what a model's forward can see changes with every change a kept
graph or a compiled forward would miss, and with nothing written in place."""

from __future__ import annotations

import torch
from conftest import make_model

from hf_specdec.model_guard import ModelGuard, fingerprint, model_version


def _changes() -> dict:
    """Each change kind a kept graph would replay stale, as a function of the model."""

    def hook(model):  # noqa: ANN001, ANN202
        model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out + 1.0)

    def pre_hook(model):  # noqa: ANN001, ANN202
        model.model.norm.register_forward_pre_hook(lambda module, args: None)

    def replaced_weight(model):  # noqa: ANN001, ANN202
        proj = model.model.layers[1].mlp.down_proj
        proj.weight = torch.nn.Parameter(proj.weight.detach() * 2)

    def wrapped_module(model):  # noqa: ANN001, ANN202
        model.model.layers[0].mlp = torch.nn.Sequential(model.model.layers[0].mlp)

    def python_attribute(model):  # noqa: ANN001, ANN202
        model.model.layers[0].self_attn.scaling = 0.5

    def training(model):  # noqa: ANN001, ANN202
        model.train()

    def config_value(model):  # noqa: ANN001, ANN202
        model.config.rms_norm_eps = 0.1

    def plain_tensor_attribute(model):  # noqa: ANN001, ANN202
        model.model.rotary_emb.original_inv_freq = torch.zeros(3)

    return {f.__name__: f for f in (hook, pre_hook, replaced_weight, wrapped_module, python_attribute, training,
                                    config_value, plain_tensor_attribute)}  # fmt: skip


def test_every_change_a_forward_can_see_changes_the_fingerprint_and_is_named():
    for name, change in _changes().items():
        model = make_model("llama", seed=0)
        before = fingerprint([model])
        assert fingerprint([model]) == before, name  # stable when nothing changes
        change(model)
        difference = fingerprint([model]).difference(before, [model])
        assert difference is not None, name
        assert difference.split(":")[0].split()[0] in ("modules", "tensors", "hooks", "attributes"), difference


def test_the_difference_names_the_module_path():
    model = make_model("llama", seed=0)
    before = fingerprint([model])
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out)
    assert fingerprint([model]).difference(before, [model]) == "hooks of [0].model.layers.1.mlp: entries added"


def test_torch_global_module_hooks_change_the_fingerprint():
    model = make_model("llama", seed=0)
    before = fingerprint([model])
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert "global" in fingerprint([model]).difference(before, [model])
    finally:
        handle.remove()
    assert fingerprint([model]) == before


def test_values_written_in_place_keep_the_fingerprint():
    """Graphs read the same memory: an optimizer step, `load_state_dict` and in-place edits need no new capture."""
    model = make_model("llama", seed=0)
    before = fingerprint([model])
    state = {k: v * 1.1 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    model(torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    optimizer.step()
    model.eval()
    assert fingerprint([model]) == before


def test_a_guard_reads_every_model_and_sees_changes_during_a_call():
    target, draft = make_model("llama", seed=0), make_model("llama", seed=1, num_hidden_layers=1)
    guard = ModelGuard([target, draft])
    assert guard.changed_during_call() is None
    handle = draft.lm_head.register_forward_hook(lambda module, args, out: out)
    assert guard.changed_during_call() == "hooks of [1].lm_head: entries added"
    handle.remove()
    assert guard.changed_since(fingerprint([target, draft])) is None


def test_a_model_version_moves_when_its_fingerprint_changes():
    """What hf_specdec learns about a draft (acceptance) is kept per version: a changed draft is judged anew."""
    draft = make_model("llama", seed=1)
    first = model_version(draft)
    assert model_version(draft) == first
    draft.model.layers[0].self_attn.scaling = 0.5
    second = model_version(draft)
    assert second != first and second.split(".")[0] == first.split(".")[0]
    assert model_version(draft) == second


def test_a_forward_compiled_under_a_changed_fingerprint_is_traced_anew():
    """Dynamo keeps compiled code per code object and does not guard what it did not read (or, by default, hooks):
    under a new fingerprint hf_specdec compiles the model's call through a code object of its own."""
    from torch._dynamo.utils import counters

    from hf_specdec import compat

    model = make_model("llama", seed=0)
    ids = torch.tensor([[3, 4, 5]])
    settings = {"backend": "eager"}
    first = compat._guarded_compile(model, settings, fingerprint([model]))
    first(ids)
    assert compat._guarded_compile(model, settings, fingerprint([model])) is first  # unchanged: the same call
    traced = counters["stats"]["unique_graphs"]
    model.model.layers[0].self_attn.unread_flag = True  # the forward never reads it: dynamo's guards still pass
    second = compat._guarded_compile(model, settings, fingerprint([model]))
    assert second is not first
    assert torch.equal(second(ids).logits, model(ids).logits)
    assert counters["stats"]["unique_graphs"] > traced
    compat.forget_compiled(model)
