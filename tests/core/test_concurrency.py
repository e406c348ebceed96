"""Several threads on one model, and a fault in every user hook mid-call, on each CPU path.

Gradio, FastAPI and every threaded server call `generate` from several threads at once. Here six threads share one
tiny target (and its draft), and either one `SpecDecoder` or one each, on every CPU path: a draft model, prompt
lookup, the default (adaptive) schedule, `cache_implementation="static"`, and `install()`'s `assistant_model=` route.
Each thread runs calls of different batch shapes; every output must be plain greedy `generate`'s, token for token.

Then a fault in each user hook mid-call (a streamer raising, `KeyboardInterrupt` from a streamer, a
`StoppingCriteria` raising, a `LogitsProcessor` raising): the caller gets that very exception, and the next call on
the same model and `SpecDecoder` is identical to plain decoding, with nothing left behind (no forward hooks on any
module, `install()` as it was).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts
from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_specdec

pytestmark = pytest.mark.usefixtures("one_thread")

THREADS = 6
MAX_NEW = 16
GREEDY = dict(do_sample=False, max_new_tokens=MAX_NEW)
#: Batch shapes the threads mix: (batch size, prompt seed); each thread runs two of them.
SHAPES = [(1, 11), (3, 12), (2, 13), (1, 14), (3, 15), (2, 16), (1, 17)]
PATHS = ("draft", "ngram", "adaptive", "static", "install")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return make_model("llama", seed=0)


@pytest.fixture(scope="module")
def draft(target) -> torch.nn.Module:
    return make_noisy_copy(target, noise=0.05)  # accepts some drafts and rejects others: ragged rows


@pytest.fixture(scope="module")
def plain(target) -> dict[tuple[int, int], torch.Tensor]:
    """Plain greedy `generate` of every shape, computed alone, before any thread runs."""
    return {shape: target.generate(**make_prompts(*shape), **GREEDY) for shape in SHAPES}


def new_spec(path: str, draft: torch.nn.Module, **fields: Any) -> hf_specdec.SpecDecoder | None:
    """The SpecDecoder of a path (None for `install`, whose call builds its own from `assistant_model=`)."""
    if path == "install":
        return None
    if path == "ngram":
        return hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4, prompt_lookup_max=2, **fields)
    if path == "adaptive":  # the library's default schedule, named (the suite pins a constant one otherwise)
        return hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens_schedule="adaptive", **fields)
    return hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3, **fields)


def run_path(
    path: str, target: torch.nn.Module, draft: torch.nn.Module, spec: Any, inputs: dict, **kwargs: Any
) -> torch.Tensor:
    """One `model.generate` call on `path` (for `install`, `install()` must be in effect)."""
    if path == "install":
        return target.generate(**inputs, assistant_model=draft, **GREEDY, **kwargs)
    if path == "static":
        kwargs["cache_implementation"] = "static"
    return target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **GREEDY, **kwargs)


@pytest.fixture
def installed_for(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`installed_for(path)` calls `install()` for the `install` path and undoes it after the test."""

    def install_if_needed(path: str) -> None:
        if path == "install":
            hf_specdec.install()
            request.addfinalizer(hf_specdec.uninstall)

    return install_if_needed


def no_hooks_left(*models: torch.nn.Module) -> bool:
    """Whether no module of `models` carries a forward hook or pre-hook, and no global module hook is set."""
    from torch.nn.modules import module as torch_module

    for model in models:
        for sub in model.modules():
            if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks:
                return False
    return not (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


@pytest.mark.parametrize("shared", [True, False], ids=["one_spec", "spec_per_thread"])
@pytest.mark.parametrize("path", PATHS)
def test_threads_sharing_a_model_get_plain_greedy_output(target, draft, plain, path, shared, installed_for):
    installed_for(path)
    shared_spec = new_spec(path, draft)
    start = threading.Barrier(THREADS)

    def client(index: int) -> list[tuple[tuple[int, int], torch.Tensor]]:
        spec = shared_spec if shared else new_spec(path, draft)
        start.wait()  # every thread enters generate together
        results = []
        for shape in (SHAPES[index % len(SHAPES)], SHAPES[(index + 3) % len(SHAPES)]):
            results.append((shape, run_path(path, target, draft, spec, make_prompts(*shape))))
        return results

    with ThreadPoolExecutor(THREADS) as pool:
        outcomes = [future.result(timeout=600) for future in [pool.submit(client, i) for i in range(THREADS)]]
    compared = 0
    for results in outcomes:
        for shape, out in results:
            assert torch.equal(out, plain[shape]), f"{path}: batch shape {shape} differs from plain greedy"
            compared += 1
    assert compared == 2 * THREADS
    assert no_hooks_left(target, draft)
    assert hf_specdec.is_installed() == (path == "install")


# --- faults in user hooks ---------------------------------------------------------------------------------------


class Fault(RuntimeError):
    """The error a user hook raises mid-call."""


class RaisingStreamer(BaseStreamer):
    """Raises `error` on its `fail_at`-th put (the prompt is put 1)."""

    def __init__(self, error: BaseException, fail_at: int = 4) -> None:
        self.error, self.fail_at, self.puts = error, fail_at, 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == self.fail_at:
            raise self.error

    def end(self) -> None:
        pass


class RaisingCriterion(StoppingCriteria):
    """Never stops; raises on its `fail_at`-th call."""

    def __init__(self, fail_at: int = 3) -> None:
        self.fail_at, self.calls = fail_at, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Fault("criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class RaisingProcessor(LogitsProcessor):
    """Leaves the scores as they are; raises on its `fail_at`-th call."""

    def __init__(self, fail_at: int = 3) -> None:
        self.fail_at, self.calls = fail_at, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Fault("processor failed")
        return scores


def fault_kwargs(fault: str, path: str) -> tuple[dict[str, Any], type[BaseException], Callable[[], int]]:
    """The call kwargs that inject `fault`, the exception the caller must get, and how many times the hook ran."""
    if fault in ("streamer", "keyboard_interrupt"):
        error = Fault("streamer failed") if fault == "streamer" else KeyboardInterrupt()
        streamer = RaisingStreamer(error)
        name = "streamer" if path == "install" else "spec_streamer"
        return {name: streamer}, type(error), lambda: streamer.puts
    if fault == "criterion":
        criterion = RaisingCriterion()
        return {"stopping_criteria": StoppingCriteriaList([criterion])}, Fault, lambda: criterion.calls
    processor = RaisingProcessor()
    return {"logits_processor": LogitsProcessorList([processor])}, Fault, lambda: processor.calls


FAULTS = ("streamer", "keyboard_interrupt", "criterion", "processor")


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("path", PATHS)
def test_a_fault_in_a_user_hook_reaches_the_caller_and_leaves_nothing_behind(
    target, draft, plain, path, fault, installed_for
):
    if path == "static" and fault == "processor":
        pytest.skip("user processors are refused on the static path before any model work")
    installed_for(path)
    generate_before = GenerationMixin.generate
    spec = new_spec(path, draft)
    shape = (3, 12)
    kwargs, error, hook_calls = fault_kwargs(fault, path)
    with pytest.raises(error):
        run_path(path, target, draft, spec, make_prompts(*shape), **kwargs)
    assert hook_calls() >= 3, "the hook must fail mid-call, after decoding began"
    assert no_hooks_left(target, draft)
    assert GenerationMixin.generate is generate_before
    assert hf_specdec.is_installed() == (path == "install")
    for next_shape in (shape, (1, 14)):  # the next calls, on the same model and SpecDecoder
        assert torch.equal(run_path(path, target, draft, spec, make_prompts(*next_shape)), plain[next_shape])
    assert no_hooks_left(target, draft)


def test_threads_with_one_failing_client_leave_the_others_exact(target, draft, plain):
    """One client's streamer raises while five others decode on the same model and SpecDecoder."""
    spec = new_spec("draft", draft)
    start = threading.Barrier(THREADS)

    def client(index: int) -> torch.Tensor | BaseException:
        shape = SHAPES[index % len(SHAPES)]
        kwargs = {"spec_streamer": RaisingStreamer(Fault("client 0 failed"))} if index == 0 else {}
        start.wait()
        try:
            return run_path("draft", target, draft, spec, make_prompts(*shape), **kwargs)
        except Fault as error:
            return error

    with ThreadPoolExecutor(THREADS) as pool:
        outcomes = [future.result(timeout=600) for future in [pool.submit(client, i) for i in range(THREADS)]]
    assert isinstance(outcomes[0], Fault)
    for index, out in enumerate(outcomes[1:], start=1):
        assert torch.equal(out, plain[SHAPES[index % len(SHAPES)]]), f"client {index}"
    assert no_hooks_left(target, draft)
