"""Shared helpers of the continuous-batching tests: small paged caches, plain and speculative runs, the manager."""

from __future__ import annotations

import collections
import time

import pytest
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import hf_specdec
from hf_specdec.continuous_batching.processor import SpecBatchProcessor


@pytest.fixture(autouse=True)
def installed():
    """Every continuous-batching test runs with `hf_specdec.install()` and leaves transformers as it found it
    (imported by each test module: a second conftest.py would shadow the tests' `from conftest import ...`)."""
    was_installed = hf_specdec.is_installed()
    hf_specdec.install()
    try:
        yield
    finally:
        if not was_installed:
            hf_specdec.uninstall()


def cb_config(**overrides) -> ContinuousBatchingConfig:
    """A paged cache small enough for the CPU: 16-token pages, 64 blocks, 256 tokens per batch."""
    kwargs = dict(page_size=16, num_blocks=64, max_batch_tokens=256)
    kwargs.update(overrides)
    return ContinuousBatchingConfig(**kwargs)


def greedy_config(max_new_tokens: int = 24, eos_token_id: int = 2, **kwargs) -> GenerationConfig:
    kwargs.setdefault("do_sample", False)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0, **kwargs)


def tokens(outputs: dict) -> dict[str, list[int]]:
    """request id -> generated tokens, failing on any request error."""
    errors = {k: v.error for k, v in outputs.items() if v.error is not None}
    assert not errors, errors
    return {k: v.generated_tokens for k, v in outputs.items()}


def plain_and_spec(model, inputs, spec, generation_config, **cb) -> tuple[dict, dict]:
    """(plain generate_batch, speculative generate_batch) token lists for the same requests."""
    plain = model.generate_batch(inputs, generation_config, continuous_batching_config=cb_config(**cb))
    spec_out = model.generate_batch(
        inputs, generation_config, continuous_batching_config=cb_config(**cb), spec_decoder=spec
    )
    assert list(plain) == list(spec_out)
    return tokens(plain), tokens(spec_out)


def next_output(manager, request_id: str, timeout: float = 0.05):
    """The next output of `request_id`, or None after `timeout`. Other requests' outputs are kept here, in order,
    for their own calls: `get_result(request_id=...)` puts them back on the queue and returns at once, so a loop
    over it spins while they wait there, holding the GIL the generation thread needs (its steps then crawl)."""
    kept = manager.__dict__.setdefault("_test_outputs", collections.defaultdict(collections.deque))
    if kept[request_id]:
        return kept[request_id].popleft()
    result = manager.get_result(timeout=timeout)
    if result is None or result.request_id == request_id:
        return result
    kept[result.request_id].append(result)
    return None


def wait_for(manager, request_id: str, timeout: float = 60.0):
    """The finished output of `request_id` (other requests' outputs are kept for their own calls)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = next_output(manager, request_id)
        if result is not None and result.is_finished():
            return result
    raise TimeoutError(f"request {request_id} did not finish in {timeout}s")


def processor_of(manager) -> SpecBatchProcessor:
    processor = manager.batch_processor
    assert isinstance(processor, SpecBatchProcessor)
    return processor
