"""Fused RMSNorm and rotary kernels: which code they replace, and that they compute it to the bit.

On the CPU the kernels run in the Triton interpreter, in fp16 only: the interpreter's fp32 -> bf16 conversion does
not round to nearest-even as a GPU (and torch) does. On a GPU (skipped without CUDA) bf16 and fp16 are compared over
many shapes, and greedy outputs of bf16 models with the fused kernels captured stay plain `generate`'s.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate
from transformers.models.gemma import modeling_gemma
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3
from triton_interpreter import in_subprocess, interpreted, rerun_interpreted

import hf_specdec
from hf_specdec import fused_kernels, fused_layers


class KernelCalls:
    """Counts the fused kernels' calls, so that a comparison cannot pass by running the original code twice."""

    def __init__(self) -> None:
        self.count = 0

    def counting(self, function):  # noqa: ANN001, ANN201
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.count += 1
            return function(*args, **kwargs)

        return counted


@pytest.fixture(autouse=True)
def kernel_calls(monkeypatch) -> KernelCalls:
    calls = KernelCalls()
    monkeypatch.setattr(fused_kernels, "rms_norm", calls.counting(fused_kernels.rms_norm))
    monkeypatch.setattr(fused_kernels, "rotary", calls.counting(fused_kernels.rotary))
    return calls


def _norm(hidden: int, dtype: torch.dtype, device: str, weight_dtype: torch.dtype | None = None, seed: int = 0):
    torch.manual_seed(seed)
    norm = modeling_llama.LlamaRMSNorm(hidden, eps=1e-5).to(device=device, dtype=weight_dtype or dtype)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


@torch.no_grad()
def _check_norm(shape: tuple[int, ...], dtype: torch.dtype, device: str, weight_dtype=None, scale=3.0, seed=0) -> None:
    norm = _norm(shape[-1], dtype, device, weight_dtype, seed)
    x = (torch.randn(shape, device=device) * scale).to(dtype)
    fused = fused_layers._fused_rms_norm(modeling_llama.LlamaRMSNorm.forward)
    expected, got = norm(x), fused(norm, x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected), (shape, dtype, (got.float() - expected.float()).abs().max())


@torch.no_grad()
def _check_rotary(B: int, H: int, KV: int, T: int, D: int, dtype: torch.dtype, device: str, batch_cos: bool) -> None:
    torch.manual_seed(B * 1000 + T)
    q = torch.randn(B, T, H * D, device=device).to(dtype).view(B, T, H, D).transpose(1, 2)  # as LlamaAttention's
    k = torch.randn(B, T, KV * D, device=device).to(dtype).view(B, T, KV, D).transpose(1, 2)
    cos = torch.randn(B if batch_cos else 1, T, D, device=device).to(dtype)
    sin = torch.randn(B if batch_cos else 1, T, D, device=device).to(dtype)
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = fused_layers._fused_rotary(modeling_llama.apply_rotary_pos_emb)(q, k, cos, sin)
    for e, g in zip(expected, got):
        assert g.stride() == e.stride() and g.dtype == e.dtype
        assert torch.equal(g, e), (B, H, T, D, dtype, (g.float() - e.float()).abs().max())


# --- which code is replaced (no kernel runs) --------------------------------------------------------------------


def test_llama_and_qwen3_layers_are_recognised_gemma_is_not() -> None:
    llama = make_model("llama")
    found = {(getattr(o, "__name__", ""), n) for o, n, _ in fused_layers.swaps([llama])}
    assert found == {("LlamaRMSNorm", "forward"), ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb")}
    qwen = make_model("qwen3")
    found = {(getattr(o, "__name__", ""), n) for o, n, _ in fused_layers.swaps([qwen])}
    assert ("Qwen3RMSNorm", "forward") in found
    assert ("transformers.models.qwen3.modeling_qwen3", "apply_rotary_pos_emb") in found
    # Gemma's RMSNorm scales by (1 + weight) in fp32: other code, kept.
    gemma = make_model("gemma")
    names = {getattr(o, "__name__", "") for o, _, _ in fused_layers.swaps([gemma])}
    assert "GemmaRMSNorm" not in names


def test_a_changed_forward_is_not_replaced() -> None:
    class ScaledNorm(modeling_llama.LlamaRMSNorm):
        def forward(self, hidden_states):  # noqa: ANN001, ANN202 - one token different from Llama's
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + 2 * self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    holder = torch.nn.Sequential(ScaledNorm(8), modeling_llama.LlamaRMSNorm(8))
    replaced = {o for o, _, _ in fused_layers.swaps([holder])}
    assert modeling_llama.LlamaRMSNorm in replaced and ScaledNorm not in replaced


def test_swaps_come_back_when_the_last_block_ends_across_threads() -> None:
    model = make_model("qwen3")
    original_norm = modeling_qwen3.Qwen3RMSNorm.__dict__["forward"]
    original_rope = modeling_qwen3.apply_rotary_pos_emb
    inside, release = threading.Event(), threading.Event()

    def other_call() -> None:
        with fused_layers.fused(fused_layers.swaps([model])):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other_call)
    thread.start()
    inside.wait(10)
    with fused_layers.fused(fused_layers.swaps([model])):  # found while the other call's swap is in force
        assert modeling_qwen3.apply_rotary_pos_emb is not original_rope
        release.set()
        thread.join()
        assert modeling_qwen3.Qwen3RMSNorm.__dict__["forward"] is not original_norm  # still ours
    assert modeling_qwen3.Qwen3RMSNorm.__dict__["forward"] is original_norm
    assert modeling_qwen3.apply_rotary_pos_emb is original_rope
    assert modeling_gemma.GemmaRMSNorm.__dict__["forward"] is not None


def test_off_the_gpu_or_in_fp32_the_original_code_runs(monkeypatch) -> None:
    """Outside the interpreter, CPU tensors never reach a kernel; fp32 never does (contraction)."""
    monkeypatch.setattr(fused_layers, "_runs_kernels", lambda *t: False)
    norm = _norm(16, torch.float32, "cpu")
    x = torch.randn(2, 3, 16)
    assert torch.equal(fused_layers._fused_rms_norm(modeling_llama.LlamaRMSNorm.forward)(norm, x), norm(x))


# --- the kernels in the interpreter (fp16) -------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 96), (1, 6, 40), (3, 2, 4, 32)])
def test_rms_norm_kernels_equal_the_eager_chain_in_fp16(shape: tuple[int, ...], kernel_calls: KernelCalls) -> None:
    _check_norm(shape, torch.float16, "cpu")
    _check_norm(shape, torch.float16, "cpu", weight_dtype=torch.float32)
    assert kernel_calls.count > 0  # the kernels ran, not the original code


@interpreted
@pytest.mark.parametrize("batch_cos", [False, True])
def test_rotary_kernel_equals_the_eager_chain_in_fp16(batch_cos: bool, kernel_calls: KernelCalls) -> None:
    _check_rotary(2, 4, 2, 5, 16, torch.float16, "cpu", batch_cos)
    _check_rotary(1, 3, 3, 1, 8, torch.float16, "cpu", batch_cos)
    assert kernel_calls.count > 0  # the kernels ran, not the original code


@interpreted
@torch.no_grad()
def test_what_the_kernels_do_not_handle_runs_the_original_code(kernel_calls: KernelCalls) -> None:
    """fp32 (a chain the kernels could contract differently), bf16 in the interpreter, autograd, a non-contiguous
    input and a cos of another dtype: the original code, no kernel."""
    fused_norm = fused_layers._fused_rms_norm(modeling_llama.LlamaRMSNorm.forward)
    for dtype in (torch.float32, torch.bfloat16):
        norm = _norm(16, dtype, "cpu")
        x = torch.randn(2, 3, 16).to(dtype)
        assert torch.equal(fused_norm(norm, x), norm(x))
    norm = _norm(16, torch.float16, "cpu")
    x = torch.randn(3, 2, 16).to(torch.float16).transpose(0, 1)  # not contiguous
    assert torch.equal(fused_norm(norm, x), norm(x))
    with torch.enable_grad():
        x = torch.randn(2, 3, 16).to(torch.float16)
        assert torch.equal(fused_norm(norm, x), norm(x))
    q = torch.randn(1, 2, 3, 8).to(torch.float16)
    cos = torch.randn(1, 3, 8)  # fp32 against fp16 q and k: promoted in the eager chain
    fused_rope = fused_layers._fused_rotary(modeling_llama.apply_rotary_pos_emb)
    for got, expected in zip(fused_rope(q, q, cos, cos), modeling_llama.apply_rotary_pos_emb(q, q, cos, cos)):
        assert torch.equal(got, expected)
    assert kernel_calls.count == 0


@in_subprocess
def test_fused_kernels_in_subprocess() -> None:
    rerun_interpreted(__file__, timeout=600)


# --- on a GPU -----------------------------------------------------------------------------------------------------


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_kernels_equal_the_eager_chain_on_cuda(dtype: torch.dtype, kernel_calls: KernelCalls) -> None:
    shapes = [(1, 1, 4096), (1, 6, 4096), (4, 6, 4096), (64, 6, 4096), (1, 128, 4096), (1, 1, 2048), (2, 5, 3072),
              (1, 3, 896), (1, 7, 576), (2, 6, 8, 128), (1, 1, 32, 128), (3, 1, 5120), (1, 2, 100)]  # fmt: skip
    for seed, shape in enumerate(shapes):
        for scale in (0.02, 1.0, 30.0):
            _check_norm(shape, dtype, "cuda", scale=scale, seed=seed)
        _check_norm(shape, dtype, "cuda", weight_dtype=torch.float32, seed=seed)
    assert kernel_calls.count > 0  # the kernels ran, not the original code


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_kernel_equals_the_eager_chain_on_cuda(dtype: torch.dtype, kernel_calls: KernelCalls) -> None:
    for B, H, KV, T, D in [(1, 32, 8, 1, 128), (1, 32, 8, 6, 128), (4, 32, 8, 6, 128), (64, 32, 8, 6, 128),
                           (1, 32, 8, 128, 128), (2, 9, 3, 5, 64), (1, 15, 5, 7, 64), (1, 4, 4, 3, 256)]:  # fmt: skip
        for batch_cos in (False, True):
            _check_rotary(B, H, KV, T, D, dtype, "cuda", batch_cos)
    assert kernel_calls.count > 0  # the kernels ran, not the original code


@pytest.mark.requires_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_captured_steps_with_fused_kernels_stay_exact_in_bf16(arch: str, kernel_calls: KernelCalls) -> None:
    target = make_model(arch, seed=0).to(torch.bfloat16)
    draft = make_noisy_copy(target, noise=0.01).cuda()
    target = target.cuda()
    assert fused_layers.swaps([target]), "the fused kernels must have something to replace here"
    inputs = {name: t.cuda() for name, t in make_prompts(3, seed=2).items()}
    expected = target.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=None)
    for _ in range(2):  # the second call replays kept graphs
        spec = hf_specdec.SpecDecoder(draft_model=draft)
        out = spec_generate(target, inputs, spec, max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert spec.last_stats.num_graph_replays > 0
        assert torch.equal(out, expected)
    assert kernel_calls.count > 0  # captured with the fused kernels
