"""Property: for any batch, padding, k, proposer, EOS setting, length and architecture, greedy = plain `generate`.

Hypothesis draws the batch size (1-5), each row's prompt (length 1-12, repetitive or not, so n-gram lookup
sometimes finds matches and sometimes not), k (1-8), the proposer (n-gram, a small draft model, a noisy copy
of the target with ragged acceptance, the target itself), the EOS ids (none, one, a list; drawn mostly among
tokens the target really generates, so rows do stop mid-block), max_new_tokens (1-20) and the architecture
(llama: RoPE + GQA, gpt2: learned absolute positions, mistral: sliding window of 8). The models are built
once per module.
"""

from __future__ import annotations

import functools

import torch
from conftest import EOS_ID, PAD_ID, VOCAB, make_model, make_noisy_copy, spec_generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_specdec

ARCHS = ("llama", "gpt2", "mistral")
PROPOSERS = ("ngram", "draft", "noisy_copy", "target")


@functools.cache
def models(arch: str) -> dict[str, torch.nn.Module]:
    """The target and its draft models for `arch`, built once per module run."""
    target = make_model(arch, seed=0)
    return {
        "target": target,
        "draft": make_model(arch, seed=1, layers=1, hidden=32),
        "noisy_copy": make_noisy_copy(target, noise=0.01),
    }


@st.composite
def prompt_batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """A left-padded batch of 1-5 prompts of 1-12 tokens."""
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        length = draw(st.integers(1, 12))
        if draw(st.booleans()):  # a repeated motif: n-gram lookup has matches
            motif = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4))
            rows.append((motif * length)[:length])
        else:
            rows.append(draw(st.lists(st.integers(3, VOCAB - 1), min_size=length, max_size=length)))
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[PAD_ID] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def eos_setting(draw: st.DrawFn, candidates: list[int]) -> int | list[int] | None:
    """No EOS, one EOS id, or a list of 1-3 ids, drawn mostly from `candidates` (tokens the target emits)."""
    kind = draw(st.sampled_from(["none", "one", "list"]))
    ids = st.one_of(st.sampled_from(candidates), st.integers(0, VOCAB - 1))
    if kind == "none":
        return None
    if kind == "one":
        return draw(ids)
    return draw(st.lists(ids, min_size=1, max_size=3, unique=True))


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(ARCHS),
    inputs=prompt_batches(),
    k=st.integers(1, 8),
    proposer=st.sampled_from(PROPOSERS),
    max_new_tokens=st.integers(1, 20),
    data=st.data(),
)
def test_greedy_speculation_equals_plain_generate(arch, inputs, k, proposer, max_new_tokens, data):
    target = models(arch)["target"]
    free_run = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    emitted = free_run[:, inputs["input_ids"].shape[1] :].flatten().tolist()
    eos = eos_setting(data.draw, sorted(set(emitted)) + [EOS_ID])
    expected = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)

    if proposer == "ngram":
        spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3)
    else:
        spec = hf_specdec.SpecDecoder(draft_model=models(arch)[proposer], num_speculative_tokens=k)
    out = spec_generate(target, inputs, spec, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, expected), f"{arch} {proposer} k={k} eos={eos}:\n{out}\n!=\n{expected}"
