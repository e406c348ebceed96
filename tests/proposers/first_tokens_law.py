"""The exact law of a call's first generated tokens, and a goodness-of-fit check of speculative samples against it.

A small-vocabulary target makes the joint table of (t1, .., tn) small enough to fill from its own logits; the
proposer tests sample many rows of the same prompt in one seeded call and compare (as tests/core/
test_sampling_distribution.py does, with fewer samples so that CI stays fast).
"""

from __future__ import annotations

import itertools

import torch
from conftest import EOS_ID, PAD_ID
from scipy.stats import chisquare


def exact_joint_law(target, prompt: torch.Tensor, num_tokens: int, temperature: float) -> torch.Tensor:  # [V ** n]
    """P(t1, .., tn) of plain sampling at `temperature` after `prompt` [1, P], from the target's logits."""
    vocab = target.config.get_text_config().vocab_size
    law = torch.ones(1, dtype=torch.double)
    for i in range(num_tokens):
        prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=i)), dtype=torch.long)
        rows = torch.cat([prompt.expand(len(prefixes), -1), prefixes.reshape(len(prefixes), i)], dim=1)
        with torch.no_grad():
            step = torch.softmax(target(rows).logits[:, -1].double() / temperature, dim=-1)  # [V ** i, V]
        finished = (prefixes == EOS_ID).any(1)  # rows that drew EOS hold padding afterwards
        step[finished] = 0.0
        step[finished, PAD_ID] = 1.0
        law = (law[:, None] * step).reshape(-1)
    return law


def check_first_tokens(out: torch.Tensor, prompt: torch.Tensor, law: torch.Tensor, num_tokens: int) -> None:
    """Assert that the first `num_tokens` generated tokens of the rows of `out` [N, L] follow `law` [V ** n]."""
    vocab = round(law.numel() ** (1 / num_tokens))
    tokens = out[:, prompt.shape[1] : prompt.shape[1] + num_tokens]  # [N, n]
    index = (tokens * vocab ** torch.arange(num_tokens - 1, -1, -1)).sum(1)
    counts = torch.bincount(index, minlength=vocab**num_tokens).double()
    samples = counts.sum()
    expected = law / law.sum() * samples
    assert int(counts[expected == 0].sum()) == 0, "draws the target gives probability 0"
    common = expected >= 5  # cells expected below 5 are merged into one
    observed = torch.cat([counts[common], counts[~common].sum()[None]])
    merged = torch.cat([expected[common], expected[~common].sum()[None]])
    p_value = chisquare(observed.numpy(), merged.numpy()).pvalue
    tv = float((counts / samples - law / law.sum()).abs().sum() / 2)
    assert p_value > 1e-3, f"chi-square p={p_value:.3g}, TV={tv:.4f}"
    assert tv < 0.08, f"TV distance {tv:.4f}"
