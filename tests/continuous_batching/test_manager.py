"""What speculative continuous batching refuses (before any model work, with the value and the fix), and the entry
points besides `generate_batch`: `init_continuous_batching`, the context manager, paged `generate`, a default spec."""

from __future__ import annotations

import pytest
import torch
from cb_helpers import (
    cb_config,
    greedy_config,
    installed,  # noqa: F401 (the autouse fixture)
    tokens,
)
from conftest import make_model

import hf_specdec
from hf_specdec.continuous_batching.entry import set_default_spec
from hf_specdec.continuous_batching.manager import SpecContinuousBatchingManager

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10]]


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0)


def refuse(model, match: str, spec=None, generation_config=None, **cb) -> None:
    spec = spec or hf_specdec.SpecDecoder(method="ngram")
    with pytest.raises((ValueError, TypeError), match=match):
        model.generate_batch(
            PROMPTS, generation_config or greedy_config(), continuous_batching_config=cb_config(**cb), spec_decoder=spec
        )


def test_refusals(target):
    refuse(target, "method=", spec=hf_specdec.SpecDecoder(method="early_exit", early_exit_layers=1))
    refuse(  # transformers drops it by default (plain CB too); kept, it is refused
        target,
        "RepetitionPenalty",
        generation_config=greedy_config(repetition_penalty=1.3),
        drop_unsupported_processors=False,
    )
    refuse(target, "return_logprobs", return_logprobs=True)
    refuse(target, "use_async_batching", use_async_batching=True)
    refuse(target, "seed=<int>", spec=hf_specdec.SpecDecoder(method="ngram", seed=[1, 2]))
    refuse(target, "num_return_sequences", generation_config=greedy_config(num_return_sequences=2, do_sample=True))
    refuse(target, "vocabulary", spec=hf_specdec.SpecDecoder(draft_model=make_model("llama", vocab=64)))
    with pytest.raises(ValueError, match="list of non-empty lists"):
        target.generate_batch([[]], greedy_config(), spec_decoder=hf_specdec.SpecDecoder(method="ngram"))


def test_sliding_window_is_refused():
    mistral = make_model("mistral", seed=0)  # sliding_window=8: a ring the drafts would overwrite
    refuse(mistral, "sliding")


def test_init_context_manager_and_default_spec(target):
    gen = greedy_config()
    plain = tokens(target.generate_batch(PROMPTS, gen, continuous_batching_config=cb_config()))
    spec = hf_specdec.SpecDecoder(method="ngram")
    with target.continuous_batching_context_manager(
        gen, continuous_batching_config=cb_config(), spec_decoder=spec
    ) as manager:
        assert isinstance(manager, SpecContinuousBatchingManager)
        ids = manager.add_requests(PROMPTS)
        results = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out.generated_tokens
    assert results == plain
    set_default_spec(target, spec)
    try:
        manager = target.init_continuous_batching(gen, cb_config())
        assert isinstance(manager, SpecContinuousBatchingManager) and manager.spec_decoder is spec
        manager.destroy()
    finally:
        set_default_spec(target, None)
    assert not isinstance(target.init_continuous_batching(gen, cb_config()), SpecContinuousBatchingManager)


def test_paged_generate_with_prompt_lookup_strips_left_padding(target):
    """generate(cache_implementation="paged", prompt_lookup_num_tokens=3) speculates; rows are the unpadded prompts."""
    input_ids = torch.tensor([[0, 0] + PROMPTS[1], PROMPTS[0]])
    mask = (input_ids != 0).long()
    out = target.generate(
        input_ids,
        attention_mask=mask,
        cache_implementation="paged",
        prompt_lookup_num_tokens=3,
        max_new_tokens=12,
        do_sample=False,
        continuous_batching_config=cb_config(),
    )
    plain = tokens(
        target.generate_batch(
            [PROMPTS[1], PROMPTS[0]], greedy_config(max_new_tokens=12), continuous_batching_config=cb_config()
        )
    )
    assert out.shape[0] == 1
    assert out[0, 0, : len(PROMPTS[1]) + len(plain["req_0"])].tolist() == PROMPTS[1] + plain["req_0"]
    assert out[0, 1, : len(PROMPTS[0]) + len(plain["req_1"])].tolist() == PROMPTS[0] + plain["req_1"]


def test_custom_generate_with_paged_cache_speculates_in_continuous_batching(target):
    """transformers takes its paged route before a callable custom_generate: installed, hf_specdec routes it to
    speculative continuous batching (left padding removed) instead of letting generate_batch drop spec_decoder."""
    spec = hf_specdec.SpecDecoder(method="ngram")
    out = target.generate(
        torch.tensor([[0, 0] + PROMPTS[1]]),
        attention_mask=torch.tensor([[0, 0] + [1] * len(PROMPTS[1])]),
        custom_generate=hf_specdec.generate,
        spec_decoder=spec,
        cache_implementation="paged",
        max_new_tokens=8,
        do_sample=False,
        continuous_batching_config=cb_config(),
    )
    plain = tokens(target.generate_batch([PROMPTS[1]], greedy_config(max_new_tokens=8),
                                         continuous_batching_config=cb_config()))  # fmt: skip
    assert out[0, 0].tolist() == PROMPTS[1] + plain["req_0"]
    assert spec.last_stats is not None


def test_older_transformers_are_refused():
    from hf_specdec.continuous_batching.compat import check_transformers_version

    check_transformers_version("5.24.0")
    with pytest.raises(RuntimeError, match=r"transformers >= 5\.24.*found 5\.17\.0"):
        check_transformers_version("5.17.0")


def test_loop_runs_without_cudnn_attention_and_gives_the_setting_back(target, monkeypatch):
    """The loop's forwards meet new query/key length pairs every step (cuDNN would plan each on the host): cuDNN's
    SDPA is off in the background thread while the loop runs, and the user's setting is back once it stopped. The
    model is on the CPU here, so the switch is made as for a CUDA model (the flags are process-wide)."""
    from hf_specdec.continuous_batching import manager as manager_module
    from hf_specdec.continuous_batching.proposers import NgramCBProposer

    switch = manager_module.without_cudnn_attention
    monkeypatch.setattr(manager_module, "without_cudnn_attention", lambda device: switch(torch.device("cuda")))
    seen: list[bool] = []
    propose = NgramCBProposer.propose

    def recording(self, *args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(NgramCBProposer, "propose", recording)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        out = target.generate_batch(PROMPTS, greedy_config(), continuous_batching_config=cb_config(),
                                    spec_decoder=hf_specdec.SpecDecoder(method="ngram"))  # fmt: skip
        tokens(out)
        assert seen and not any(seen)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
