"""`hf_specdec.attention_backends`: cuDNN's SDPA kernels are off while a dynamic-path call on a GPU runs (static-path
calls keep them) and the user's setting comes back after the last call in flight ends, in whatever order threads
end (the flags are process-wide; toggled here without a GPU, as torch allows)."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_specdec.attention_backends import without_cudnn_attention

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def backends_as_found():
    backends = torch.backends.cuda
    found = (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(),
             backends.math_sdp_enabled())  # fmt: skip
    yield
    for enable, on in zip(
        (backends.enable_cudnn_sdp, backends.enable_flash_sdp, backends.enable_mem_efficient_sdp,
         backends.enable_math_sdp),
        found,
    ):  # fmt: skip
        enable(on)


def test_off_on_cuda_and_back_after():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with without_cudnn_attention(CUDA):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_environment_can_keep_cudnn(monkeypatch):
    from hf_specdec.attention_backends import KEEP_CUDNN_ENV

    monkeypatch.setenv(KEEP_CUDNN_ENV, "1")
    torch.backends.cuda.enable_cudnn_sdp(True)
    with without_cudnn_attention(CUDA):
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_nothing_changes_off_cuda_or_when_cudnn_is_all_the_user_left():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with without_cudnn_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
    for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp,
                   torch.backends.cuda.enable_math_sdp):  # fmt: skip
        enable(False)
    with without_cudnn_attention(CUDA):
        assert torch.backends.cuda.cudnn_sdp_enabled()  # no other kernel left: turning it off would break attention
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_user_setting_of_off_stays_off():
    torch.backends.cuda.enable_cudnn_sdp(False)
    with without_cudnn_attention(CUDA):
        pass
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_overlapping_calls_on_threads_restore_once_the_last_ends():
    """Thread A enters, B enters, A ends first: cuDNN stays off until B ends, then comes back (a save/restore per
    call would turn it back on under B, and B's restore would then leave it off for good)."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    a_in, b_in, a_out, b_done = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def a() -> None:
        with without_cudnn_attention(CUDA):
            a_in.set()
            b_in.wait()
        a_out.set()

    def b() -> None:
        a_in.wait()
        with without_cudnn_attention(CUDA):
            b_in.set()
            a_out.wait()
            seen["under b after a ended"] = torch.backends.cuda.cudnn_sdp_enabled()
        b_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert seen == {"under b after a ended": False}
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_only_dynamic_path_calls_enter_the_switch(monkeypatch):
    """The static path's lengths are fixed per graph and its long contexts want cuDNN: only dynamic-path calls turn it
    off (on the CPU the switch itself does nothing; which calls enter it is the same as on a GPU)."""
    from conftest import make_model, make_prompts, spec_generate

    import hf_specdec
    from hf_specdec import generation

    entered: list[torch.device] = []

    def recording(device: torch.device):  # noqa: ANN202
        entered.append(device)
        return without_cudnn_attention(device)

    monkeypatch.setattr(generation, "without_cudnn_attention", recording)
    target = make_model("llama", seed=0)
    inputs = make_prompts(2, seed=4)
    for route, calls in (("dynamic", 1), ("static", 0)):
        entered.clear()
        spec = hf_specdec.SpecDecoder(method="ngram")
        spec_generate(target, inputs, spec, max_new_tokens=4, do_sample=False, cache_implementation=route)
        assert len(entered) == calls, route
