"""Device forms of the logits processors that read each position's prefix: fixed shapes, no host read.

transformers' processors take the `input_ids` of one token per row. Speculation scores every (row, position)
with its own prefix (`StepSampling.process`), and calling a prefix-reading processor once per distinct prefix
length reads those lengths on the host: a captured step (one CUDA graph) cannot. These forms score all positions
at once over the step's token buffer `[B, C]` and each position's prefix length, with the same arithmetic as
transformers' processor on that prefix (tests/sampling/test_prefix_processors.py holds them equal on random
prefixes, padding and ignored prompt columns included). Covered: repetition penalty, no-repeat n-gram, minimum
length and minimum new tokens. Any other prefix-reading processor keeps the per-prefix path (uncaptured).

Each form keeps its per-row and device state as tensor attributes (hf_specdec objects reachable from the loop), so
a captured step reads them at fixed addresses and graph reuse copies a later call's values in.
"""

from __future__ import annotations

import torch
from transformers.generation import logits_process as lp


class RepetitionPenalty:
    """`RepetitionPenaltyLogitsProcessor`: every token id in the prefix (past `prompt_ignore_length`) is penalised
    once: score * penalty where negative, score / penalty otherwise."""

    def __init__(self, processor: lp.RepetitionPenaltyLogitsProcessor, row_ids: torch.Tensor) -> None:
        self.penalty = float(processor.penalty)
        ignore = getattr(processor, "prompt_ignore_length", None)  # None, an int, or one per caller row
        if isinstance(ignore, torch.Tensor):
            self.ignore = ignore.to(row_ids.device)[row_ids]  # [B] columns of each row not penalised
        else:
            self.ignore = torch.full_like(row_ids, ignore or 0)  # [B]

    def __call__(self, token_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        batch_size, width, vocab = scores.shape
        cols = torch.arange(token_ids.shape[1], device=token_ids.device)  # [C]
        seen = (cols < prefix_lengths[..., None]) & (cols >= self.ignore[:, None, None])  # [B, w, C]
        # Ids past the output vocabulary (an embedding larger than the head) go to a spare column, as transformers does.
        ids = torch.where(seen, token_ids.clamp(max=vocab)[:, None, :], vocab)  # [B, w, C]
        present = torch.zeros(batch_size, width, vocab + 1, dtype=torch.bool, device=scores.device)
        present = present.scatter_(2, ids, True)[..., :vocab]  # [B, w, V]
        return torch.where(present, torch.where(scores < 0, scores * self.penalty, scores / self.penalty), scores)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.ignore = self.ignore[keep.to(self.ignore.device)]


class NoRepeatNGram:
    """`NoRepeatNGramLogitsProcessor`: a token is banned where it would complete an n-gram that the prefix already
    holds, i.e. it follows an earlier occurrence of the prefix's last n - 1 tokens (every window lying wholly
    inside the prefix)."""

    def __init__(self, processor: lp.NoRepeatNGramLogitsProcessor, row_ids: torch.Tensor) -> None:
        self.ngram_size = int(processor.ngram_size)

    def __call__(self, token_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        batch_size, width, vocab = scores.shape
        n, capacity = self.ngram_size, token_ids.shape[1]
        starts = torch.arange(capacity, device=token_ids.device)  # [C] window starts
        match = (starts + n - 1) < prefix_lengths[..., None]  # [B, w, C] windows inside the prefix
        for i in range(n - 1):
            shifted = torch.nn.functional.pad(token_ids[:, i:], (0, i), value=-1)  # [B, C] token at start + i
            at = (prefix_lengths - n + 1 + i).clamp(0, capacity - 1)  # [B, w] (clamped: positions not scored)
            tail = token_ids.gather(1, at)  # [B, w] the prefix's last n - 1 tokens, i-th of them
            match &= shifted[:, None, :] == tail[..., None]
        last = torch.nn.functional.pad(token_ids[:, n - 1 :], (0, n - 1), value=0)  # [B, C] a window's last token
        ids = torch.where(match, last.clamp(max=vocab)[:, None, :], vocab)  # [B, w, C]
        banned = torch.zeros(batch_size, width, vocab + 1, dtype=torch.bool, device=scores.device)
        banned = banned.scatter_(2, ids, True)[..., :vocab]  # [B, w, V]
        return scores.masked_fill(banned, -float("inf"))

    def select_rows(self, keep: torch.Tensor) -> None:
        pass


class MinLength:
    """`MinLengthLogitsProcessor` and `MinNewTokensLengthLogitsProcessor`: the EOS ids score -inf while the prefix
    (less the skipped prompt columns) is shorter than the minimum."""

    def __init__(self, processor: lp.LogitsProcessor, row_ids: torch.Tensor) -> None:
        if isinstance(processor, lp.MinNewTokensLengthLogitsProcessor):
            self.skip, self.minimum = int(processor.prompt_length_to_skip), int(processor.min_new_tokens)
        else:
            self.skip, self.minimum = 0, int(processor.min_length)
        self.eos = torch.as_tensor(processor.eos_token_id).reshape(-1).to(row_ids.device, copy=True)  # [E]

    def __call__(self, token_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        is_eos = torch.isin(torch.arange(vocab, device=scores.device), self.eos)  # [V]
        short = (prefix_lengths - self.skip < self.minimum)[..., None]  # [B, w, 1]
        return torch.where(short & is_eos, -float("inf"), scores)

    def select_rows(self, keep: torch.Tensor) -> None:
        pass


DeviceForm = RepetitionPenalty | NoRepeatNGram | MinLength

_FORMS: dict[str, type] = {
    "RepetitionPenaltyLogitsProcessor": RepetitionPenalty,
    "NoRepeatNGramLogitsProcessor": NoRepeatNGram,
    "MinLengthLogitsProcessor": MinLength,
    "MinNewTokensLengthLogitsProcessor": MinLength,
}


def device_form(processor: object, row_ids: torch.Tensor) -> DeviceForm | None:
    """The device form of a prefix-reading processor (matched by exact type), or None if it has none."""
    form = _FORMS.get(type(processor).__name__)
    if form is None or type(processor) is not getattr(lp, type(processor).__name__, None):
        return None
    return form(processor, row_ids)
