"""Speculative sampling through `model.generate` draws the first two tokens from the target's exact joint law.

A tiny model with a 12-token vocabulary makes the joint table of (t1, t2) small enough to fill: the exact
law p(t1) * p(t2 | t1) comes from the target's own processed scores (plain `generate` with `output_scores`),
and 20 000 speculative samples (one seeded call, the same prompt on every row) are checked against it with a
chi-square goodness-of-fit test. Configs cover a draft model (draft probabilities), n-gram (one-hot drafts),
temperature / top-k / top-p and repetition penalty (scores that depend on each position's prefix), EOS inside
the verified block, and t2 as an accepted draft, a recovered token, a bonus token or the next step's token.
A negative control shows the statistic rejects a slightly wrong law (another temperature) on the same samples.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, spec_generate
from scipy.stats import chisquare

import hf_specdec

VOCAB = 12
NUM_SAMPLES = 20_000
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are merged
P_VALUE_FLOOR = 1e-3  # a correct sampler fails this with probability 1e-3 per config (and seeds are fixed)
#: Prompts built from a repeated motif, so n-gram lookup drafts the motif's continuation.
PROMPTS = {
    "eos_likely": [5, 6, 11, 5, 6, 11, 5, 6],  # the target gives EOS ~0.5: rows finish inside the verified block
    "drafts_likely": [11, 3, 9, 11, 3, 9, 11, 3],  # the target gives the n-gram drafts 9, 11 ~0.4 each
}
# max_new_tokens=2: the first step verifies one draft and t2 may be its bonus token (or the next step's token);
# max_new_tokens=3: the first step verifies two drafts and t2 may be an accepted draft or a recovered token.
CONFIGS = {
    "draft-temperature-topk-topp": dict(
        prompt="eos_likely", method="draft", max_new_tokens=3, sampling=dict(temperature=0.9, top_k=6, top_p=0.95)
    ),
    "ngram-temperature": dict(
        prompt="drafts_likely", method="ngram", max_new_tokens=3, sampling=dict(temperature=1.3, top_k=None)
    ),
    "draft-repetition-penalty-topp-bonus": dict(
        prompt="drafts_likely",
        method="draft",
        max_new_tokens=2,
        sampling=dict(temperature=1.1, repetition_penalty=1.8, top_k=None, top_p=0.9),
    ),
}


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft(target):
    return make_noisy_copy(target, noise=0.02, seed=3)  # accepts ~60% per position


def exact_joint_law(target, prompt: torch.Tensor, **sampling) -> torch.Tensor:  # [V, V]
    """P(t1, t2) of plain sampling, from the target's processed scores (the processors `generate` builds)."""
    first = target.generate(
        prompt, max_new_tokens=1, do_sample=True, output_scores=True, return_dict_in_generate=True, **sampling
    )
    p1 = first.scores[0].float().softmax(-1)[0]  # [V]
    continued = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)  # [V, P + 1]
    second = target.generate(
        continued,
        attention_mask=torch.ones_like(continued),
        max_new_tokens=1,
        do_sample=True,
        output_scores=True,
        return_dict_in_generate=True,
        **sampling,
    )
    joint = p1[:, None] * second.scores[0].float().softmax(-1)  # [V, V]
    # A row whose first token is EOS is finished: its second column holds the pad token.
    joint[EOS_ID] = 0.0
    joint[EOS_ID, PAD_ID] = p1[EOS_ID]
    return joint.double()


def speculative_pairs(
    target, prompt: torch.Tensor, spec: hf_specdec.SpecDecoder, max_new_tokens: int, **sampling
) -> torch.Tensor:  # [V, V]
    """Counts of the first two generated tokens over NUM_SAMPLES rows of one seeded call."""
    inputs = {"input_ids": prompt.expand(NUM_SAMPLES, -1), "attention_mask": torch.ones(NUM_SAMPLES, prompt.shape[1])}
    out = spec_generate(target, inputs, spec, max_new_tokens=max_new_tokens, do_sample=True, **sampling)
    pairs = out[:, prompt.shape[1] : prompt.shape[1] + 2]  # [N, 2]
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    return counts.reshape(VOCAB, VOCAB).double()


def goodness_of_fit(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square p-value, total variation distance, impossible draws) of `counts` against `law`."""
    n = counts.sum()
    observed, expected = counts.flatten(), law.flatten() / law.sum() * n
    impossible = int(observed[expected == 0].sum())
    order = torch.argsort(expected)
    observed, expected = observed[order], expected[order]
    # Merge the smallest cells into one until it reaches MIN_EXPECTED.
    cut = int(torch.searchsorted(torch.cumsum(expected, 0), torch.tensor(MIN_EXPECTED, dtype=expected.dtype)))
    cut = min(cut + 1, len(expected) - 2)
    observed = torch.cat([observed[:cut].sum(0, keepdim=True), observed[cut:]])
    expected = torch.cat([expected[:cut].sum(0, keepdim=True), expected[cut:]])
    p_value = float(chisquare(observed.numpy(), expected.numpy()).pvalue)
    tv = float((counts / n - law / law.sum()).abs().sum() / 2)
    return p_value, tv, impossible


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_two_tokens_follow_the_target_law(target, draft, name):
    config = CONFIGS[name]
    prompt = torch.tensor([PROMPTS[config["prompt"]]])
    sampling = config["sampling"]
    if config["method"] == "draft":
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=2, seed=1234)
    else:
        spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, seed=1234)
    counts = speculative_pairs(target, prompt, spec, config["max_new_tokens"], **sampling)
    stats = spec.last_stats
    # The first step verified max_new_tokens - 1 drafts on every row; the last was often accepted, often not.
    last = config["max_new_tokens"] - 2
    assert stats.drafted_per_position[last] >= NUM_SAMPLES, stats
    assert 0.1 < stats.acceptance_rate < 0.9, stats
    assert 0.05 * NUM_SAMPLES < stats.accepted_per_position[last] < 0.95 * NUM_SAMPLES, stats

    law = exact_joint_law(target, prompt, **sampling)
    p_value, tv, impossible = goodness_of_fit(counts, law)
    # Power: the same statistic rejects the law of a slightly different temperature.
    wrong = exact_joint_law(target, prompt, **{**sampling, "temperature": sampling["temperature"] * 1.15})
    wrong_p, wrong_tv, _ = goodness_of_fit(counts, wrong)
    print(f"{name}: chi-square p={p_value:.3g} TV={tv:.4f}; temperature x1.15: p={wrong_p:.3g} TV={wrong_tv:.4f}")
    assert impossible == 0, f"{name}: {impossible} draws of pairs the target gives probability 0"
    assert p_value > P_VALUE_FLOOR, f"{name}: chi-square p={p_value:.3g}, TV={tv:.4f}"
    assert tv < 0.03, f"{name}: TV distance {tv:.4f} to the exact law"
    assert wrong_p < 1e-6, f"{name}: the test cannot tell temperature x1.15 apart (p={wrong_p:.3g}, TV={wrong_tv:.4f})"
