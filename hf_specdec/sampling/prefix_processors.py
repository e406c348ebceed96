"""Device forms of the logits processors that read each position's prefix: fixed shapes, no host read.

transformers' processors take the `input_ids` of one token per row. Speculation scores every (row, position)
with its own prefix (`StepSampling.process`), and calling a prefix-reading processor once per distinct prefix
length reads those lengths on the host: a captured step (one CUDA graph) cannot. These forms score all positions
at once over the step's token buffer `[B, C]` and each position's prefix length, with the same arithmetic as
transformers' processor on that prefix (tests/sampling/test_prefix_processors.py holds them equal on random
prefixes, padding and ignored prompt columns included). Covered: repetition penalty, no-repeat n-gram, bad words,
minimum length and minimum new tokens, forced BOS and EOS, suppress-at-begin, sequence bias (its float sums added in
transformers' order) and the exponential length penalty (its power taken by Python, as transformers takes it).

Each form keeps its per-row and device state as tensor attributes (hf_specdec objects reachable from the loop), so
a captured step reads them at fixed addresses and graph reuse copies a later call's values in; what it bakes in
besides (penalties, lengths, the bad words) is its `key()`, part of the kept graphs' signature.
"""

from __future__ import annotations

import torch
from transformers.generation import logits_process as lp

from hf_specdec import compat


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

    def key(self) -> tuple:
        return ("repetition_penalty", self.penalty)

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

    def key(self) -> tuple:
        return ("no_repeat_ngram", self.ngram_size)

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

    def key(self) -> tuple:
        return ("min_length", self.skip, self.minimum)

    def select_rows(self, keep: torch.Tensor) -> None:
        pass


class BadWords:
    """`NoBadWordsLogitsProcessor`: a bad word of one token is always banned; one of m tokens bans its last token
    where the prefix ends with its first m - 1 (scores + a bias of 0 or -inf, as transformers adds it)."""

    def __init__(self, processor: lp.NoBadWordsLogitsProcessor, row_ids: torch.Tensor) -> None:
        words = [tuple(int(t) for t in word) for word in processor.sequence_bias]  # EOS-only words already dropped
        self.words = tuple(sorted(words))
        self.largest_id = max(max(word) for word in words)
        device = row_ids.device
        self.single = torch.tensor([w[0] for w in words if len(w) == 1], dtype=torch.long, device=device)  # [S]
        by_length: dict[int, list[tuple[int, ...]]] = {}
        for word in words:
            if len(word) > 1:
                by_length.setdefault(len(word) - 1, []).append(word)
        #: per length m - 1 of the words' prefixes: (prefixes [G, m - 1], last tokens [G])
        self.groups = [
            (torch.tensor([w[:-1] for w in group], device=device), torch.tensor([w[-1] for w in group], device=device))
            for group in by_length.values()
        ]

    def __call__(self, token_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        batch_size, width, vocab = scores.shape
        if self.largest_id >= vocab:
            raise ValueError(
                f"The model vocabulary size is {vocab}, but bad_words_ids holds token {self.largest_id}: every id "
                f"must be below {vocab}."
            )
        capacity = token_ids.shape[1]
        banned = torch.zeros(batch_size, width, vocab + 1, dtype=torch.bool, device=scores.device)
        banned[..., self.single] = True
        for prefixes, last in self.groups:  # [G, m], [G]
            m = prefixes.shape[1]
            cols = prefix_lengths[..., None] - m + torch.arange(m, device=token_ids.device)  # [B, w, m]
            tail = token_ids.gather(1, cols.clamp(0, capacity - 1).flatten(1)).view(cols.shape)  # [B, w, m]
            match = (tail[:, :, None, :] == prefixes).all(-1) & (prefix_lengths >= m)[..., None]  # [B, w, G]
            banned.scatter_(2, torch.where(match, last, vocab), True)
        bias = torch.zeros_like(scores).masked_fill_(banned[..., :vocab], -float("inf"))  # [B, w, V]
        return scores + bias

    def key(self) -> tuple:
        return ("bad_words", self.words)

    def select_rows(self, keep: torch.Tensor) -> None:
        pass


class ForcedToken:
    """`ForcedBOSTokenLogitsProcessor`, `ForcedEOSTokenLogitsProcessor` and
    `SuppressTokensAtBeginLogitsProcessor`: at one prefix length (1; max_length - 1; the begin index) the scores of
    every other token (forced) or of the given tokens (suppressed) become -inf, the forced ones 0."""

    def __init__(self, processor: lp.LogitsProcessor, row_ids: torch.Tensor) -> None:
        device = row_ids.device
        self.suppress = isinstance(processor, lp.SuppressTokensAtBeginLogitsProcessor)
        if self.suppress:
            self.at, tokens = int(processor.begin_index), processor.begin_suppress_tokens
        elif isinstance(processor, lp.ForcedBOSTokenLogitsProcessor):
            self.at, tokens = 1, processor.bos_token_id
        else:
            self.at, tokens = int(processor.max_length) - 1, processor.eos_token_id
        self.tokens = torch.as_tensor(tokens).reshape(-1).to(device, copy=True)  # [T]

    def __call__(self, token_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        listed = torch.isin(torch.arange(scores.shape[-1], device=scores.device), self.tokens)  # [V]
        here = (prefix_lengths == self.at)[..., None]  # [B, w, 1]
        if self.suppress:
            return torch.where(here & listed, -float("inf"), scores)
        forced = torch.where(listed, 0.0, -float("inf")).to(scores.dtype)  # [V]
        return torch.where(here, forced, scores)

    def key(self) -> tuple:
        return ("forced", self.suppress, self.at)

    def select_rows(self, keep: torch.Tensor) -> None:
        pass


class SequenceBias:
    """`SequenceBiasLogitsProcessor`: a one-token sequence's bias always applies; a longer one's goes to its last
    token where the prefix ends with the rest. Float sums depend on their order, so each token's biases are added one
    by one in the order transformers adds them (`compat.sequence_bias_groups_by_length`): in rounds, round r adding
    every token's r-th bias (no token twice in a round), into zeros plus the one-token biases, then to the scores."""

    def __init__(self, processor: lp.SequenceBiasLogitsProcessor, row_ids: torch.Tensor) -> None:
        items = [(tuple(int(t) for t in sequence), float(bias)) for sequence, bias in processor.sequence_bias.items()]
        self.items = tuple(items)
        self.largest_id = max(t for sequence, _ in items for t in sequence)
        grouped = compat.sequence_bias_groups_by_length()
        self.context = 0 if grouped else 1  # input tokens needed beyond a sequence's prefix to match it
        longer = [(sequence, bias) for sequence, bias in items if len(sequence) > 1]
        if grouped:  # by prefix length, in order of each length's first sequence (a stable sort keeps dict order)
            first = {}
            for sequence, _ in longer:
                first.setdefault(len(sequence), len(first))
            longer.sort(key=lambda item: first[len(item[0])])
        device = row_ids.device
        singles = [(sequence[0], bias) for sequence, bias in items if len(sequence) == 1]
        self.single_ids = torch.tensor([t for t, _ in singles], dtype=torch.long, device=device)  # [S1]
        self.single_biases = torch.tensor([b for _, b in singles], dtype=torch.float, device=device)  # [S1]
        self.biases = torch.tensor([b for _, b in longer], dtype=torch.float, device=device)  # [S] in adding order
        #: per prefix length m: (prefixes [G, m], their sequences' places in the adding order [G])
        by_length: dict[int, list[int]] = {}
        for place, (sequence, _) in enumerate(longer):
            by_length.setdefault(len(sequence) - 1, []).append(place)
        self.groups = [
            (torch.tensor([longer[p][0][:-1] for p in places], device=device), torch.tensor(places, device=device))
            for places in by_length.values()
        ]
        #: round r: (places [n_r], last tokens [n_r]) of every token's r-th biased sequence
        rounds: list[list[int]] = []
        seen: dict[int, int] = {}
        for place, (sequence, _) in enumerate(longer):
            r = seen[sequence[-1]] = seen.get(sequence[-1], -1) + 1
            rounds.extend([] for _ in range(r + 1 - len(rounds)))
            rounds[r].append(place)
        self.rounds = [
            (torch.tensor(places, device=device), torch.tensor([longer[p][0][-1] for p in places], device=device))
            for places in rounds
        ]

    def __call__(self, token_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        batch_size, width, vocab = scores.shape
        if self.largest_id >= vocab:
            raise ValueError(
                f"The model vocabulary size is {vocab}, but sequence_bias holds token {self.largest_id}: every id "
                f"must be below {vocab}."
            )
        one_token = torch.zeros(vocab, dtype=torch.float, device=scores.device)  # [V]
        one_token[self.single_ids] = self.single_biases
        bias = torch.zeros_like(scores) + one_token  # [B, w, V]
        if len(self.biases):
            capacity = token_ids.shape[1]
            match = torch.zeros(batch_size, width, len(self.biases), dtype=torch.bool, device=scores.device)
            for prefixes, places in self.groups:  # [G, m], [G]
                m = prefixes.shape[1]
                cols = prefix_lengths[..., None] - m + torch.arange(m, device=token_ids.device)  # [B, w, m]
                tail = token_ids.gather(1, cols.clamp(0, capacity - 1).flatten(1)).view(cols.shape)  # [B, w, m]
                fits = (prefix_lengths >= m + self.context)[..., None]  # [B, w, 1]
                match[..., places] = (tail[:, :, None, :] == prefixes).all(-1) & fits  # [B, w, G]
            values = torch.where(match, self.biases, 0.0).to(bias.dtype)  # [B, w, S]
            for places, last in self.rounds:  # one bias per token per round: each sum is transformers' order
                bias.scatter_add_(2, last.expand(batch_size, width, -1), values[..., places])
        return scores + bias

    def key(self) -> tuple:
        return ("sequence_bias", self.items)

    def select_rows(self, keep: torch.Tensor) -> None:
        pass


class ExponentialDecay:
    """`ExponentialDecayLengthPenalty`: at a prefix of L tokens past `regulation_start`, each EOS score s gets
    |s| * (factor^(L - start) - 1) added (0 where s is not finite, on transformers that mask it:
    `compat.exponential_penalty_skips_non_finite`). The power is Python's, in double, rounded to float32 as
    transformers' scalar multiply rounds it: one table entry per prefix length, made on the host once per call. (A
    power past the double range makes transformers raise OverflowError at that length; the table holds inf.)"""

    def __init__(self, processor: lp.ExponentialDecayLengthPenalty, row_ids: torch.Tensor) -> None:
        self.start = int(processor.regulation_start)
        self.factor = float(processor.regulation_factor)
        self.eos = torch.as_tensor(processor.eos_token_id).reshape(-1).to(row_ids.device, copy=True)  # [E]
        self.skip_non_finite = compat.exponential_penalty_skips_non_finite()
        self.table: torch.Tensor | None = None  # [C + 1] factor^(L - start) - 1 per prefix length L (made at step 0)

    def _power(self, length: int) -> float:
        try:
            return pow(self.factor, length - self.start) - 1
        except OverflowError:
            return float("inf")

    def __call__(self, token_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        capacity = token_ids.shape[1]
        if self.table is None or self.table.shape[0] <= capacity:
            powers = [self._power(n) if n > self.start else 0.0 for n in range(capacity + 1)]
            self.table = torch.tensor(powers, dtype=torch.float, device=scores.device)  # [C + 1]
        factors = self.table[prefix_lengths.clamp(0, capacity)]  # [B, w]
        eos_scores = scores[..., self.eos]  # [B, w, E]
        penalty = eos_scores.abs() * factors[..., None]  # [B, w, E]
        if self.skip_non_finite:
            penalty = penalty.masked_fill(~torch.isfinite(eos_scores), 0.0)
        penalties = torch.zeros_like(scores)  # [B, w, V]
        penalties[..., self.eos] = penalty
        return torch.where((prefix_lengths > self.start)[..., None], scores + penalties, scores)

    def key(self) -> tuple:
        return ("exponential_decay", self.start, self.factor, self.skip_non_finite)

    def select_rows(self, keep: torch.Tensor) -> None:
        pass


DeviceForm = RepetitionPenalty | NoRepeatNGram | MinLength | BadWords | ForcedToken | SequenceBias | ExponentialDecay

_FORMS: dict[str, type] = {
    "RepetitionPenaltyLogitsProcessor": RepetitionPenalty,
    "NoRepeatNGramLogitsProcessor": NoRepeatNGram,
    "MinLengthLogitsProcessor": MinLength,
    "MinNewTokensLengthLogitsProcessor": MinLength,
    "NoBadWordsLogitsProcessor": BadWords,
    "ForcedBOSTokenLogitsProcessor": ForcedToken,
    "ForcedEOSTokenLogitsProcessor": ForcedToken,
    "SuppressTokensAtBeginLogitsProcessor": ForcedToken,
    "SequenceBiasLogitsProcessor": SequenceBias,
    "ExponentialDecayLengthPenalty": ExponentialDecay,
}


def device_form(processor: object, row_ids: torch.Tensor) -> DeviceForm | None:
    """The device form of a prefix-reading processor (matched by exact type), or None if it has none."""
    form = _FORMS.get(type(processor).__name__)
    if form is None or type(processor) is not getattr(lp, type(processor).__name__, None):
        return None
    return form(processor, row_ids)
