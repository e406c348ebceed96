"""Speculative sampling through `model.generate` draws the first three tokens from the target's exact joint law.

A tiny model with a 12-token vocabulary makes the joint table of (t1, t2, t3) small enough to fill: the exact
law p(t1) p(t2 | t1) p(t3 | t1, t2) comes from the target's own processed scores (plain `generate` with
`output_scores`), and 20 000 speculative samples (one seeded call, the same prompt on every row) are checked
against it with a chi-square goodness-of-fit test. Step 0, whose verify is the prefill, checks drafts made from
the prompt. Configs cover a draft model (draft probabilities), early exit (the target's first layer drafts), a draft with
another tokenizer (sampled through the map of shared tokens, with its probabilities), n-gram (one-hot drafts),
temperature / top-k / top-p, repetition penalty, sequence bias and the exponential length penalty (scores that
depend on each position's prefix), EOS inside
the verified block, and t1..t3 as accepted drafts, recovered tokens, a bonus token or the next step's token.
A negative control shows the statistic rejects a slightly wrong law (another temperature) on the same samples.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import EOS_ID, PAD_ID, make_model, make_noisy_copy, spec_generate
from scipy.stats import chisquare
from transformers.generation.logits_process import ExponentialDecayLengthPenalty, LogitsProcessorList

import hf_specdec

VOCAB = 12
NUM_TOKENS = 3  # the law of the first NUM_TOKENS generated tokens is tested
NUM_SAMPLES = 20_000
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are merged
P_VALUE_FLOOR = 1e-3  # a correct sampler fails this with probability 1e-3 per config (and seeds are fixed)
#: Prompts built from a repeated motif, so n-gram lookup drafts the motif's continuation.
PROMPTS = {
    "eos_likely": [5, 6, 11, 5, 6, 11, 5, 6],  # the target gives EOS ~0.5: rows finish inside the verified block
    "drafts_likely": [11, 3, 9, 11, 3, 9, 11, 3],  # the target gives the n-gram drafts 9, 11 ~0.4 each
}
# Step 0 (whose verify is the prefill) checks k drafts made from the prompt. k=2: t1, t2 may be accepted drafts or
# recovered tokens, t3 the bonus token or the next step's; k=1: t2 may be the bonus token or the next step's.
CONFIGS = {
    "draft-temperature-topk-topp": dict(
        prompt="eos_likely", method="draft", k=2, sampling=dict(temperature=0.9, top_k=6, top_p=0.95)
    ),
    "ngram-temperature": dict(prompt="drafts_likely", method="ngram", k=2, sampling=dict(temperature=1.3, top_k=None)),
    "draft-repetition-penalty-topp-bonus": dict(
        prompt="drafts_likely",
        method="draft",
        k=1,
        sampling=dict(temperature=1.1, repetition_penalty=1.8, top_k=None, top_p=0.9),
    ),
    "draft-sequence-bias-length-penalty": dict(  # device forms: biases after "11" and "3", EOS pushed up from t2 on
        prompt="drafts_likely",
        method="draft",
        k=2,
        sampling=dict(
            temperature=1.1,
            top_k=None,
            sequence_bias=[[[11, 3], 1.5], [[9], -1.0], [[3, 9], 0.7]],
            # Given as a processor: `exponential_decay_length_penalty=` would count from each call's prompt width,
            # which `exact_joint_law` grows by the prefixes it scores.
            logits_processor=LogitsProcessorList([ExponentialDecayLengthPenalty((0, 2.5), EOS_ID, 8)]),
        ),
    ),
    "another-tokenizer-temperature": dict(
        prompt="drafts_likely", method="cross_tokenizer", k=2, sampling=dict(temperature=1.2, top_k=None)
    ),
    "early-exit-temperature-topk": dict(
        prompt="eos_likely", method="early_exit", k=2, sampling=dict(temperature=0.9, top_k=8)
    ),
}


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=0, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft(target):
    return make_noisy_copy(target, noise=0.02, seed=3)  # accepts ~60% per position


#: The word tokenizers of the another-tokenizer config: the draft's lists the target's words in reverse, plus four.
TARGET_WORDS = list("abcdefghi")
DRAFT_WORDS = TARGET_WORDS[::-1] + ["xx", "yy", "zz", "ww"]


def cross_tokenizer_draft(target):
    """(target tokenizer, draft tokenizer, draft): the draft is a noisy copy of the target with its vocabulary
    reordered to the draft tokenizer's ids; the words are shared, so sampling drafts through the vocabulary map
    (it drafts what the target favours only if the translation is right)."""
    import copy

    from conftest import make_word_tokenizer

    target_tok, draft_tok = make_word_tokenizer(TARGET_WORDS), make_word_tokenizer(DRAFT_WORDS)
    draft = copy.deepcopy(make_noisy_copy(target, noise=0.3, seed=5))
    rows = [0, 1, 2] + [3 + TARGET_WORDS.index(w) for w in DRAFT_WORDS[: len(TARGET_WORDS)]]  # draft id -> target id
    draft.resize_token_embeddings(len(draft_tok), mean_resizing=False)
    with torch.no_grad():
        for table in (draft.get_input_embeddings().weight, draft.get_output_embeddings().weight):
            source = table[:VOCAB].clone()
            table.zero_()
            table[: len(rows)] = source[rows]
    return target_tok, draft_tok, draft.eval()


def exact_joint_law(target, prompt: torch.Tensor, **sampling) -> torch.Tensor:  # [V ** NUM_TOKENS]
    """P(t1, .., tn) of plain sampling, from the target's processed scores (the processors `generate` builds)."""
    law = torch.ones(1, dtype=torch.double)  # [V ** i] the law of the first i tokens
    for i in range(NUM_TOKENS):
        prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=i)), dtype=torch.long)
        prefixes = prefixes.reshape(VOCAB**i, i)  # [V ** i, i]
        rows = torch.cat([prompt.expand(len(prefixes), -1), prefixes], dim=1)  # [V ** i, P + i]
        out = target.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            max_new_tokens=1,
            do_sample=True,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        step = out.scores[0].double().softmax(-1)  # [V ** i, V] p(t_{i+1} | prefix)
        # A row that drew EOS is finished: every later column holds the pad token.
        finished = (prefixes == EOS_ID).any(1)  # [V ** i]
        step[finished] = 0.0
        step[finished, PAD_ID] = 1.0
        law = (law[:, None] * step).reshape(-1)
    return law


def speculative_samples(
    target, prompt: torch.Tensor, spec: hf_specdec.SpecDecoder, **sampling
) -> torch.Tensor:  # [V ** NUM_TOKENS]
    """Counts of the first NUM_TOKENS generated tokens over NUM_SAMPLES rows of one seeded call."""
    inputs = {"input_ids": prompt.expand(NUM_SAMPLES, -1), "attention_mask": torch.ones(NUM_SAMPLES, prompt.shape[1])}
    out = spec_generate(target, inputs, spec, max_new_tokens=NUM_TOKENS, do_sample=True, **sampling)
    tokens = out[:, prompt.shape[1] : prompt.shape[1] + NUM_TOKENS]  # [N, n]
    index = (tokens * VOCAB ** torch.arange(NUM_TOKENS - 1, -1, -1)).sum(1)  # [N] row-major cell of (t1, .., tn)
    return torch.bincount(index, minlength=VOCAB**NUM_TOKENS).double()


def goodness_of_fit(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square p-value, total variation distance, impossible draws) of `counts` against `law`."""
    n = counts.sum()
    observed, expected = counts.flatten(), law.flatten() / law.sum() * n
    impossible = int(observed[expected == 0].sum())
    order = torch.argsort(expected)
    observed, expected = observed[order], expected[order]
    # Merge every cell expected below MIN_EXPECTED, and as many more of the smallest as the merged cell needs to
    # reach MIN_EXPECTED itself, into one cell.
    sparse = int((expected < MIN_EXPECTED).sum())
    filled = int(torch.searchsorted(torch.cumsum(expected, 0), torch.tensor(MIN_EXPECTED, dtype=expected.dtype))) + 1
    cut = min(max(sparse, filled), len(expected) - 2)
    observed = torch.cat([observed[:cut].sum(0, keepdim=True), observed[cut:]])
    expected = torch.cat([expected[:cut].sum(0, keepdim=True), expected[cut:]])
    p_value = float(chisquare(observed.numpy(), expected.numpy()).pvalue)
    tv = float((counts / n - law / law.sum()).abs().sum() / 2)
    return p_value, tv, impossible


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_tokens_follow_the_target_law(target, draft, name):
    config = CONFIGS[name]
    prompt = torch.tensor([PROMPTS[config["prompt"]]])
    sampling = config["sampling"]
    if config["method"] == "draft":
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=config["k"], seed=1234)
    elif config["method"] == "cross_tokenizer":
        target_tok, draft_tok, cross_draft = cross_tokenizer_draft(target)
        spec = hf_specdec.SpecDecoder(
            draft_model=cross_draft,
            draft_tokenizer=draft_tok,
            tokenizer=target_tok,
            num_speculative_tokens=config["k"],
            seed=1234,
        )
    elif config["method"] == "early_exit":  # the first of the target's two layers drafts
        spec = hf_specdec.SpecDecoder(early_exit_layers=1, num_speculative_tokens=config["k"], seed=1234)
    else:
        spec = hf_specdec.SpecDecoder(
            method="ngram", num_speculative_tokens=config["k"], prompt_lookup_max=3, seed=1234
        )
    law = exact_joint_law(target, prompt, **sampling)
    # Power: the same statistic rejects the law of a slightly different temperature.
    wrong = exact_joint_law(target, prompt, **{**sampling, "temperature": sampling["temperature"] * 1.15})
    # The default path, and the static-cache (CUDA-graph) path where it covers the method.
    caches = ("dynamic", "static") if config["method"] in ("draft", "ngram") else ("dynamic",)
    for cache in caches:
        counts = speculative_samples(target, prompt, spec, cache_implementation=cache, **sampling)
        stats = spec.last_stats
        # Step 0 verified k drafts on every row; the first was often accepted, often not.
        assert stats.drafted_per_position[config["k"] - 1] >= NUM_SAMPLES, stats
        assert 0.1 < stats.acceptance_rate < 0.9, stats
        assert 0.05 < stats.per_position_acceptance[0] < 0.95, stats
        p_value, tv, impossible = goodness_of_fit(counts, law)
        wrong_p, wrong_tv, _ = goodness_of_fit(counts, wrong)
        label = f"{name} ({cache} cache)"
        print(f"{label}: chi-square p={p_value:.3g} TV={tv:.4f}; temperature x1.15: p={wrong_p:.3g} TV={wrong_tv:.4f}")
        assert impossible == 0, f"{label}: {impossible} draws of pairs the target gives probability 0"
        assert p_value > P_VALUE_FLOOR, f"{label}: chi-square p={p_value:.3g}, TV={tv:.4f}"
        assert tv < 0.05, f"{label}: TV distance {tv:.4f} to the exact law"  # sampling noise alone: up to ~0.04
        assert wrong_p < 1e-6, f"{label}: cannot tell temperature x1.15 apart (p={wrong_p:.3g}, TV={wrong_tv:.4f})"
