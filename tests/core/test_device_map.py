"""Targets placed with accelerate's `device_map`: exact on every placement, proposer and route (issue 40).

Every model here is saved and loaded back with `from_pretrained(device_map=..., offload_folder=...)`, so accelerate's
real dispatch and hooks run. On the CPU (CI) the placements offload weights to the CPU and the disk: the hooks stream
them into each forward, and with the embedding on the disk `model.device` says `meta`. With one GPU the same tests run
on a target whose layers are partly offloaded (main device cuda:0); with two GPUs on a target split over cuda:0 and
cuda:1, where the issue's crash was (a row index on cuda:0 indexing a cache layer on cuda:1 when rows left the batch,
in `continuation.stash`). The draft model sits on the target's first device unless a test says otherwise.
Greedy outputs are compared token for token with plain `generate` on the same placed model.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import EOS_ID, PAD_ID, make_dflash_drafter, make_model, make_noisy_copy, make_prompts, spec_generate
from transformers import AutoModelForCausalLM, DynamicCache

import hf_specdec
from hf_specdec import cache_route
from hf_specdec.placement import capture_blocker, module_device, placement

pytestmark = pytest.mark.usefixtures("one_thread")

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
MAX_NEW = 14


def device_map(kind: str, layers: int) -> dict[str, object]:
    """A device_map for a decoder of `layers` layers (Llama / DeepSeek module names)."""
    if kind == "cpu_disk":  # the CPU computes; the embedding, every other layer and the head are on the disk
        layer = ["cpu", "disk"]
        ends = {"model.embed_tokens": "disk", "model.norm": "cpu", "lm_head": "disk", "model.rotary_emb": "cpu"}
    elif kind == "gpu_offload":  # cuda:0 computes; layers streamed from the CPU and the disk
        layer = ["cpu", 0, "disk"]
        ends = {"model.embed_tokens": 0, "model.norm": 0, "lm_head": "cpu", "model.rotary_emb": 0}
    elif kind == "two_gpus":  # the first half of the layers on cuda:0, the rest and the head on cuda:1
        half = layers // 2
        return {
            "model.embed_tokens": 0,
            "model.rotary_emb": 0,
            **{f"model.layers.{i}": 0 if i < half else 1 for i in range(layers)},
            "model.norm": 1,
            "lm_head": 1,
        }
    elif kind == "two_gpus_offload":  # split over both GPUs, one layer streamed from the CPU
        layer = [0, "cpu", 1]
        ends = {"model.embed_tokens": 0, "model.norm": 1, "lm_head": 1, "model.rotary_emb": 0}
    else:
        raise ValueError(kind)
    return {**{f"model.layers.{i}": layer[i % len(layer)] for i in range(layers)}, **ends}


PLACEMENTS = [
    "cpu_disk",
    pytest.param("gpu_offload", marks=pytest.mark.requires_cuda),
    pytest.param("two_gpus", marks=[pytest.mark.requires_cuda, TWO_GPUS]),
    pytest.param("two_gpus_offload", marks=[pytest.mark.requires_cuda, TWO_GPUS]),
]


def place(model: torch.nn.Module, kind: str, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """`model` saved and loaded back with accelerate's dispatch over the placement `kind`."""
    folder = tmp_path_factory.mktemp(kind)
    model.save_pretrained(folder)
    layers = model.config.num_hidden_layers
    placed = AutoModelForCausalLM.from_pretrained(
        folder, device_map=device_map(kind, layers), offload_folder=folder / "offload", attn_implementation="sdpa"
    ).eval()
    placed.generation_config.pad_token_id = PAD_ID
    placed.generation_config.eos_token_id = EOS_ID
    return placed


@pytest.fixture(scope="module", params=PLACEMENTS)
def placed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(placement kind, the placed 4-layer target, its unplaced twin on the placed target's input device)."""
    reference = make_model("llama", seed=0, layers=4)
    target = place(reference, request.param, tmp_path_factory)
    return request.param, target, reference.to(placement(target).input_device)


def on(device: torch.device, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in inputs.items()}


def early_eos(model: torch.nn.Module, inputs: dict) -> int:
    """A token the last row generates early on: as EOS, that row leaves the batch while the others go on."""
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    return int(out[-1, inputs["input_ids"].shape[1] + 2])


def spec_for(method: str, reference: torch.nn.Module) -> hf_specdec.SpecDecoder:
    if method == "ngram":
        return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    return hf_specdec.SpecDecoder(draft_model=make_noisy_copy(reference, noise=0.05), num_speculative_tokens=3)


def test_placement_reads_the_device_map(placed) -> None:
    kind, target, reference = placed
    where = placement(target)
    assert where.input_device == torch.device("cpu" if kind == "cpu_disk" else "cuda:0")
    offloaded = {"cpu_disk": ("disk",), "gpu_offload": ("cpu", "disk"), "two_gpus": (), "two_gpus_offload": ("cpu",)}
    assert where.offloaded == offloaded[kind]
    assert where.spread == kind.startswith("two_gpus")
    if kind == "cpu_disk":
        assert target.device.type == "meta"  # the embedding's weights are on the disk
        assert where.devices == (torch.device("cpu"),)


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_equals_plain_generate(placed, method: str, batch_size: int) -> None:
    """Rows leave the batch at different steps (an early EOS): their cache rows are selected on every device."""
    kind, target, reference = placed
    inputs = on(reference.device, make_prompts(batch_size, seed=batch_size))
    eos = early_eos(reference, inputs) if batch_size > 1 else EOS_ID
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    assert torch.equal(
        expected, reference.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    )
    if batch_size > 1:
        finished = (expected == eos).any(1)
        assert finished.any() and not finished.all(), "the test needs rows that leave the batch before the others"
    spec = spec_for(method, reference)
    got = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_returned_cache_equals_plain_generates(placed, method: str) -> None:
    """The handoff stashes leaving rows' cache layers and hands back plain decoding's cache: on each layer's device."""
    kind, target, reference = placed
    inputs = on(reference.device, make_prompts(3, seed=5))
    eos = early_eos(reference, inputs)
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, return_dict_in_generate=True)
    expected = target.generate(**inputs, past_key_values=DynamicCache(config=target.config), **kwargs)
    spec = spec_for(method, reference)
    got = spec_generate(target, inputs, spec, past_key_values=DynamicCache(config=target.config), **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    ours, theirs = got.past_key_values, expected.past_key_values
    assert ours.get_seq_length() == theirs.get_seq_length()
    real = inputs["attention_mask"].bool()
    for a, b in zip(ours.layers, theirs.layers):
        assert a.keys.device == b.keys.device  # each layer's cache where its layer computes
        mask = torch.cat([real, real.new_ones(real.shape[0], a.keys.shape[2] - real.shape[1])], 1)
        mask = mask[:, None, :, None].to(a.keys.device)  # left-padding columns hold anything
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            torch.testing.assert_close(torch.where(mask, x, 0), torch.where(mask, y, 0), rtol=1e-4, atol=1e-4)


def test_explicit_static_cache_equals_plain_generate(placed) -> None:
    kind, target, reference = placed
    inputs = on(reference.device, make_prompts(3, seed=7))
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    spec = spec_for("draft", reference)
    got = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False, cache_implementation="static")
    assert torch.equal(got, expected)


def test_sampling_draws_what_the_unplaced_model_draws(placed) -> None:
    """Seeded sampling: the placed target draws exactly the unplaced twin's tokens (whose law tests/core checks)."""
    kind, target, reference = placed
    inputs = on(reference.device, make_prompts(3, seed=8))
    spec = lambda: hf_specdec.SpecDecoder(  # noqa: E731
        draft_model=make_noisy_copy(reference, noise=0.05), num_speculative_tokens=3, seed=3
    )
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=True, cache_implementation="dynamic")
    assert torch.equal(
        spec_generate(target, inputs, spec(), **kwargs), spec_generate(reference, inputs, spec(), **kwargs)
    )


def test_offloaded_draft_runs_where_it_was_placed(placed, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A draft placed with its own device_map (its first weights on `meta`) is fed on its own device, not moved."""
    kind, target, reference = placed
    draft_kind = "cpu_disk" if kind == "cpu_disk" else "two_gpus" if kind.startswith("two") else "gpu_offload"
    draft = place(make_noisy_copy(reference, noise=0.05), draft_kind, tmp_path_factory)
    where = placement(draft)
    inputs = on(reference.device, make_prompts(3, seed=9))
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    got = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(got, expected)
    assert placement(draft) == where  # hf_specdec left the draft where it was


@pytest.mark.requires_cuda
@TWO_GPUS
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_draft_on_another_gpu_than_the_target(cache_implementation: str | None) -> None:
    """A target on cuda:0 and its draft on cuda:1: the draft is fed on cuda:1, its logits come back; the default then
    runs uncaptured (a graph replays one device), an explicit static cache too."""
    target = make_model("llama", seed=0, layers=4).to("cuda:0")
    draft = make_noisy_copy(target, noise=0.05).to("cuda:1")
    inputs = on(torch.device("cuda:0"), make_prompts(4, seed=13))
    eos = early_eos(target, inputs)
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    got = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                        cache_implementation=cache_implementation)  # fmt: skip
    assert torch.equal(got, expected)
    assert spec.last_stats.num_graph_replays == 0
    assert "draft model computes on cuda:1" in capture_blocker(target, draft)
    assert next(draft.parameters()).device == torch.device("cuda:1")  # left where it was


@pytest.mark.parametrize("arch", ["deepseek_v3"])
def test_mtp_on_a_placed_target(arch: str, placed, tmp_path_factory: pytest.TempPathFactory) -> None:
    """MTP layers share the target's embedding (first device) and head (last device), and sit with its last layer."""
    from proposers.test_mtp import NUM_MTP_LAYERS, make_mtp_target
    from transformers.modeling_layers import MtpModel

    kind = placed[0]
    model, mtp = make_mtp_target(arch)
    target = place(model, kind, tmp_path_factory)
    placed_mtp = MtpModel(target, NUM_MTP_LAYERS).eval()
    shared = ("embed_tokens.", "shared_head.")
    own = {name: value for name, value in mtp.state_dict().items() if not name.startswith(shared)}
    placed_mtp.load_state_dict(own, strict=False)
    for name, child in placed_mtp.named_children():  # its own modules go with the target's last layer
        if name not in ("embed_tokens", "shared_head", "rotary_emb"):
            child.to(module_device(target.model.layers[-1]))
    device = placement(target).input_device
    inputs = on(device, make_prompts(3, seed=10))
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(expected, model.to(device).generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False))
    spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=placed_mtp, num_speculative_tokens=NUM_MTP_LAYERS)
    got = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("method", ["early_exit", "dflash"])
def test_drafters_that_read_the_target(placed, method: str) -> None:
    """Early exit runs the placed target's first layers; DFlash reads states of layers on every device."""
    kind, target, reference = placed
    inputs = on(reference.device, make_prompts(3, seed=12))
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    if method == "early_exit":
        spec = hf_specdec.SpecDecoder(early_exit_layers=2, num_speculative_tokens=3)
    else:
        drafter = make_dflash_drafter(reference).to(reference.device)
        spec = hf_specdec.SpecDecoder(method="dflash", draft_model=drafter, num_speculative_tokens=3)
    got = spec_generate(target, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(got, expected)
    assert spec.last_stats.num_draft_tokens > 0


def test_the_route_says_why_once(placed, caplog: pytest.LogCaptureFixture) -> None:
    """On the CPU an offloaded target takes the CPU's dynamic path silently (its `model.device` is `meta`, which is no
    reason to warn); on a GPU the default says once that the placement keeps the step uncaptured, and why."""
    kind, target, reference = placed
    cache_route._SAID.clear()
    inputs = on(reference.device, make_prompts(2, seed=11))
    spec = spec_for("draft", reference)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        spec_generate(target, inputs, spec, max_new_tokens=4, do_sample=False)
    said = [r.getMessage() for r in caplog.records if "eager dynamic cache" in r.getMessage()]
    blocker = capture_blocker(target, spec.draft_model)
    if kind == "cpu_disk":
        assert said == []
    else:
        assert len(said) == 1 and blocker is not None and blocker in said[0]
        assert ("several devices" in blocker) == kind.startswith("two_gpus")
