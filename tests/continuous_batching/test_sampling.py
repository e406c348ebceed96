"""Speculative sampling in continuous batching draws the first two tokens of each request from the target's law.

Every request has the same prompt and its own seed (from its request id), so 3 000 requests are 3 000 independent
samples of (t1, t2). CB drafts once a request decodes: t1 comes from the prefill, t2 from the first verify (an
accepted draft or a recovered token; three new tokens leave room for one draft) and t3, not tested, is its bonus; their counts are checked against the exact law p(t1) p(t2 | t1) of the target's processed
scores with a chi-square test. A 12-token vocabulary keeps the table small. The prompt makes EOS likely at t1
(requests end inside the verified block) and the draft is a noisy copy of the target (ragged acceptance, recovered
tokens from the residual). A negative control shows the test rejects a slightly wrong law on the same samples.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from cb_helpers import (
    cb_config,
    installed,  # noqa: F401 (the autouse fixture)
)
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy
from scipy.stats import chisquare
from transformers import GenerationConfig

import hf_specdec

VOCAB = 12
NUM_TOKENS = 2
NUM_SAMPLES = 3000
PROMPT = [5, 6, 11, 5, 6, 11, 5, 6]
SAMPLING = dict(temperature=0.9, top_k=8)


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0, vocab=VOCAB)


def exact_law(target, temperature: float) -> torch.Tensor:  # [V ** NUM_TOKENS]
    """P(t1, t2) of plain sampling from the target's processed scores (finished rows pad with PAD_ID)."""
    law = torch.ones(1, dtype=torch.double)
    for i in range(NUM_TOKENS):
        prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=i)), dtype=torch.long).reshape(VOCAB**i, i)
        rows = torch.cat([torch.tensor([PROMPT]).expand(len(prefixes), -1), prefixes], dim=1)
        out = target.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            max_new_tokens=1,
            do_sample=True,
            output_scores=True,
            return_dict_in_generate=True,
            temperature=temperature,
            top_k=SAMPLING["top_k"],
        )
        step = out.scores[0].double().softmax(-1)  # [V ** i, V]
        finished = (prefixes == EOS_ID).any(1)
        step[finished] = 0.0
        step[finished, PAD_ID] = 1.0
        law = (law[:, None] * step).reshape(-1)
    return law


def p_value(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square p-value, cells expected below 5 merged into one."""
    expected = law / law.sum() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    assert counts[law == 0].sum() == 0, "a sample the target law gives probability 0"
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_first_two_tokens_follow_the_target_law(target, method):
    draft = make_noisy_copy(target, noise=0.05, seed=3) if method == "draft" else None
    spec = hf_specdec.SpecDecoder(
        method=method,
        draft_model=draft,
        num_speculative_tokens=2,
        seed=1234,
        num_speculative_tokens_schedule="constant",
    )
    gen = GenerationConfig(
        max_new_tokens=NUM_TOKENS + 1, do_sample=True, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **SAMPLING
    )
    outputs = target.generate_batch(
        [PROMPT] * NUM_SAMPLES,
        gen,
        continuous_batching_config=cb_config(num_blocks=512, max_batch_tokens=1024),
        spec_decoder=spec,
    )
    assert len(outputs) == NUM_SAMPLES and all(o.error is None for o in outputs.values())
    cells = torch.tensor([(o.generated_tokens + [PAD_ID])[:NUM_TOKENS] for o in outputs.values()])  # [N, 2]
    counts = torch.bincount(cells[:, 0] * VOCAB + cells[:, 1], minlength=VOCAB**NUM_TOKENS).double()
    assert spec.last_stats.num_draft_tokens > 0
    assert p_value(counts, exact_law(target, SAMPLING["temperature"])) > 1e-3
    # Negative control: the same samples against another temperature's law are rejected
    assert p_value(counts, exact_law(target, 1.3)) < 1e-3
