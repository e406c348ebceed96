"""Exact on every call: a model changed between calls never replays kept graphs, and what a call returned stays as
it was returned (CUDA graphs emulated on the CPU, `cache_implementation="static"`, graph reuse on).

Each change a kept graph would miss (a hook, a replaced or wrapped module or weight, a Python attribute a forward
reads, a PEFT adapter added, switched, disabled or merged) is made between two calls, and the second call must give
plain `generate`'s tokens on the changed model, with a draft model, prompt lookup and MTP. Changes written in place
(optimizer steps) adopt the kept graphs and stay exact."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec import graph_reuse

pytestmark = pytest.mark.usefixtures("one_thread")

GEN = dict(max_new_tokens=14, do_sample=False, eos_token_id=None)


@pytest.fixture(autouse=True)
def reuse_on(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.delenv(graph_reuse.REUSE_ENV, raising=False)


def _inputs(seed: int = 3) -> dict:
    return make_prompts(2, seed=seed, min_len=4, max_len=7)  # left-padded: rows of different lengths


def _steering(module, args, out):  # noqa: ANN001, ANN202 - a forward hook that moves a layer's output
    shift = torch.linspace(-1.0, 1.0, out.shape[-1], device=out.device)
    return out + 2.0 * shift


class Scaled(torch.nn.Module):
    """A wrapper whose forward reads a Python attribute."""

    def __init__(self, inner: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden) * self.scale


def _layer(model):  # noqa: ANN001, ANN202
    return model.get_decoder().layers[0]


CHANGES = {
    "forward hook": lambda m: _layer(m).mlp.register_forward_hook(_steering),
    "pre-hook": lambda m: m.get_decoder().norm.register_forward_pre_hook(lambda mod, args: (args[0] * 3.0,)),
    "weight replaced": lambda m: setattr(
        _layer(m).self_attn.o_proj, "weight", torch.nn.Parameter(_layer(m).self_attn.o_proj.weight.detach() * -2.0)
    ),
    "module wrapped": lambda m: setattr(_layer(m), "mlp", Scaled(_layer(m).mlp, 3.0)),
}


def _spec(method: str, draft=None, mtp=None) -> hf_specdec.SpecDecoder:  # noqa: ANN001
    if method == "draft":
        return hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    if method == "mtp":
        return hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=2)
    return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3)


def _models(method: str) -> tuple:
    if method == "mtp":
        from proposers.test_mtp import make_mtp_target

        target, mtp = make_mtp_target("glm4_moe")
        for model in (target, mtp):
            model.set_experts_implementation("batched_mm")
        return target, None, mtp
    target = make_model("llama", seed=0)
    return target, make_noisy_copy(target, seed=4), None


def _check(target, spec, inputs) -> hf_specdec.SpecDecodeStats:  # noqa: ANN001
    """One static call: equal to plain generate on the model as it is now; its stats."""
    out = spec_generate(target, inputs, spec, **GEN, cache_implementation="static")
    assert torch.equal(out, target.generate(**inputs, **GEN))
    assert spec.last_stats.num_graph_replays > 0
    return spec.last_stats


@pytest.mark.parametrize("method", ["draft", "ngram", "mtp"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_model_changed_between_calls_captures_anew_and_stays_exact(emulated_graphs, method, change):
    target, draft, mtp = _models(method)
    inputs = _inputs()
    assert _check(target, _spec(method, draft, mtp), inputs).graph_reuse == "captured"
    assert _check(target, _spec(method, draft, mtp), inputs).graph_reuse == "adopted"  # nothing changed
    CHANGES[change](target)
    stats = _check(target, _spec(method, draft, mtp), inputs)
    assert stats.graph_reuse == "captured" and "the model changed" in stats.graph_reuse_reason
    assert _check(target, _spec(method, draft, mtp), inputs).graph_reuse == "adopted"  # the new model's graphs
    graph_reuse.forget_graphs(target)


def test_a_python_attribute_the_forward_reads_and_a_drafts_change_are_seen(emulated_graphs):
    target, draft, _ = _models("draft")
    _layer(target).mlp = Scaled(_layer(target).mlp, 2.0)
    inputs = _inputs()
    for scale in (2.0, 2.0, 0.5, 0.5):
        _layer(target).mlp.scale = scale
        stats = _check(target, _spec("draft", draft), inputs)
    assert stats.graph_reuse == "adopted"
    _layer(draft).mlp.register_forward_hook(_steering)  # the draft's forward changed: its kept drafts would be stale
    stats = _check(target, _spec("draft", draft), inputs)
    assert stats.graph_reuse == "captured" and "[1]" in stats.graph_reuse_reason  # the draft is model [1]
    graph_reuse.forget_graphs(target)


def test_torch_global_hooks_are_seen(emulated_graphs):
    target, draft, _ = _models("draft")
    inputs = _inputs()
    _check(target, _spec("draft", draft), inputs)
    lm_head = target.lm_head
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out.flip(-1) if module is lm_head else None
    )
    try:
        assert "global" in _check(target, _spec("draft", draft), inputs).graph_reuse_reason
    finally:
        handle.remove()
    graph_reuse.forget_graphs(target)


def test_optimizer_steps_between_calls_adopt_the_kept_graphs_and_stay_exact(emulated_graphs):
    """AdamW writes the weights in place: the kept graphs read the new values, no capture is needed."""
    target, draft, _ = _models("draft")
    optimizer = torch.optim.AdamW(target.parameters(), lr=0.05)
    inputs = _inputs()
    _check(target, _spec("draft", draft), inputs)
    for step in range(3):
        target.train()
        ids = make_prompts(2, seed=10 + step, min_len=8, max_len=8)["input_ids"]
        target(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        target.eval()
        assert _check(target, _spec("draft", draft), inputs).graph_reuse == "adopted"
    graph_reuse.forget_graphs(target)


def test_peft_adapters_added_switched_disabled_and_merged_between_calls(emulated_graphs):
    peft = pytest.importorskip("peft")
    target, draft, _ = _models("draft")
    inputs = _inputs()
    _check(target, _spec("draft", draft), inputs)
    config = dict(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = peft.get_peft_model(target, peft.LoraConfig(**config))
    model.add_adapter("second", peft.LoraConfig(**config, lora_alpha=64))

    def check(label: str) -> hf_specdec.SpecDecodeStats:
        spec = _spec("draft", draft)
        out = model.generate(**inputs, **GEN, custom_generate=hf_specdec.generate, spec_decoder=spec,
                             cache_implementation="static")  # fmt: skip
        assert torch.equal(out, model.generate(**inputs, **GEN)), label
        assert spec.last_stats.num_graph_replays > 0
        return spec.last_stats

    assert check("adapter added").graph_reuse == "captured"
    model.set_adapter("second")
    assert check("adapter switched").graph_reuse == "captured"
    with model.disable_adapter():
        assert check("adapter disabled").graph_reuse == "captured"
    model.set_adapter("default")
    assert check("first adapter again").graph_reuse == "captured"  # a changed model's entry is dropped, not kept
    assert check("unchanged").graph_reuse == "adopted"
    model.merge_adapter()
    assert check("adapter merged").graph_reuse == "captured"
    model.unmerge_adapter()
    check("adapter unmerged")
    graph_reuse.forget_graphs(target)


@pytest.mark.parametrize("form", ["sequences", "dict", "sampled"])
def test_what_a_call_returned_is_not_written_by_later_calls(emulated_graphs, form):
    """Calls with the same shapes adopt each other's graphs; each returned tensor stays as it was returned."""
    target, draft, _ = _models("draft")
    gen = dict(GEN)
    if form == "dict":
        gen.update(return_dict_in_generate=True)
    if form == "sampled":
        gen.update(do_sample=True, top_k=0)
    returned, copies = [], []
    for seed in (1, 2, 3, 4):
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3, seed=seed)
        out = spec_generate(target, _inputs(seed), spec, **gen, cache_implementation="static")
        tensors = [out.sequences] if form == "dict" else [out]
        returned.append(tensors)
        copies.append([t.clone() for t in tensors])
    assert spec.last_stats.graph_reuse == "adopted"
    for tensors, kept in zip(returned, copies):
        assert all(torch.equal(t, k) for t, k in zip(tensors, kept))
    assert not torch.equal(copies[0][0], copies[1][0])  # the calls did write different tokens
    graph_reuse.forget_graphs(target)


def test_a_thread_adding_a_hook_while_others_generate(emulated_graphs):
    """One thread adds a steering hook while two others generate: no error, and every call that saw one model from
    its start to its end gives plain's tokens for that model (a call during the change keeps no graphs)."""
    target, draft, _ = _models("draft")
    inputs = _inputs()
    plain_before = target.generate(**inputs, **GEN)
    hooked = {"on": False}
    results, errors = [], []
    lock = threading.Lock()

    def client() -> None:
        try:
            for _ in range(4):
                before = hooked["on"]
                out = spec_generate(target, inputs, _spec("draft", draft), **GEN, cache_implementation="static")
                with lock:
                    results.append((before, hooked["on"], out))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    def changer() -> None:
        while len(results) < 2 and not errors:
            threading.Event().wait(0.01)
        _layer(target).mlp.register_forward_hook(_steering)
        hooked["on"] = True

    threads = [threading.Thread(target=client) for _ in range(2)] + [threading.Thread(target=changer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    plain_after = target.generate(**inputs, **GEN)
    assert not torch.equal(plain_before, plain_after)
    for started, ended, out in results:
        if started == ended:
            assert torch.equal(out, plain_after if started else plain_before)
    assert any(s and e for s, e, _ in results) and any(not s and not e for s, e, _ in results)
    assert torch.equal(spec_generate(target, inputs, _spec("draft", draft), **GEN, cache_implementation="static"),
                       plain_after)  # fmt: skip
    graph_reuse.forget_graphs(target)


@pytest.mark.requires_cuda
@pytest.mark.parametrize(
    "route, change",
    [(None, change) for change in CHANGES] + [("static", "forward hook"), ("static", "weight replaced")],
)
def test_a_model_changed_between_calls_on_cuda(route, change):
    """The same on a GPU: real CUDA graphs on the no-flag default, and compiled forwards inside captured steps on
    `cache_implementation="static"` (dynamo skips hook guards by default: hf_specdec compiles anew)."""
    target, draft, _ = _models("draft")
    target, draft = target.cuda(), draft.cuda()
    inputs = {k: v.cuda() for k, v in _inputs().items()}
    gen = dict(GEN, **({"cache_implementation": route} if route else {}))

    def check() -> hf_specdec.SpecDecodeStats:
        spec = _spec("draft", draft)
        assert torch.equal(spec_generate(target, inputs, spec, **gen), target.generate(**inputs, **GEN))
        assert spec.last_stats.num_graph_replays > 0
        return spec.last_stats

    check()
    assert check().graph_reuse == "adopted"
    CHANGES[change](target)
    assert check().graph_reuse == "captured"
    assert check().graph_reuse == "adopted"
    graph_reuse.forget_graphs(target)
