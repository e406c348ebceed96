"""On a GPU: the loop runs on CUDA tensors through the Triton sampler and stays exact (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec

pytestmark = pytest.mark.requires_cuda


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_on_cuda_matches_plain_generate(method: str) -> None:
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.01).cuda()
    target = target.cuda()
    inputs = {name: t.cuda() for name, t in make_prompts(5, seed=2).items()}
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(method=method, draft_model=draft if method == "draft" else None)
    out = spec_generate(target, inputs, spec, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert torch.equal(out, expected)


def test_sampling_on_cuda_uses_the_kernels_and_is_seeded() -> None:
    target = make_model("llama", seed=0)
    draft = make_noisy_copy(target, noise=0.01).cuda()
    target = target.cuda()
    inputs = {name: t.cuda() for name, t in make_prompts(4, seed=3).items()}
    outs = [
        spec_generate(
            target, inputs, hf_specdec.SpecDecoder(draft_model=draft, seed=5), max_new_tokens=16, do_sample=True
        )
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1])


def test_dynamic_calls_run_without_cudnn_attention_static_ones_with_it(monkeypatch) -> None:
    """cuDNN's SDPA builds a plan per new shape on the host (20 s first calls on the dynamic path,
    `hf_specdec.attention_backends`); the static path's shapes are fixed, and its long contexts want cuDNN. Each
    attention call records the flag (eager forwards, warm-ups and captures run Python; replays do not)."""
    target = make_model("llama", seed=0).cuda()
    inputs = {name: t.cuda() for name, t in make_prompts(2, seed=4).items()}
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    torch.backends.cuda.enable_cudnn_sdp(True)
    for route, cudnn in (("dynamic", False), (None, True)):
        seen.clear()
        spec = hf_specdec.SpecDecoder(method="ngram")
        spec_generate(target, inputs, spec, max_new_tokens=8, do_sample=False, eos_token_id=None,
                      cache_implementation=route)  # fmt: skip
        assert spec.last_stats.num_graph_replays > 0 or route == "dynamic"
        assert seen and all(on == cudnn for on in seen), route
        assert torch.backends.cuda.cudnn_sdp_enabled()
