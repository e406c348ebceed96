"""`CrossTokenizerProposer`: a draft model with another tokenizer (HF's universal assisted generation), batched.

Per step and row, the row's target tokens are decoded to text and re-encoded with the draft's tokenizer; the
draft's own `CacheView` keeps the longest prefix it already holds of that encoding (ragged rollback) and feeds
the rest, then drafts k tokens greedily (one batched forward per draft position). The drafted text, i.e. the
decoded draft tokens past the decoded re-encoding, is encoded with the target's tokenizer into at most k target
drafts. Greedy drafts are deterministic given the row, so they are one-hot proposals. With sampling, tokens
whose strings exist in both vocabularies are mapped one to one (HF's universal speculative decoding): the
draft's logits over those tokens become target-vocabulary logits (the others -inf), go through the call's
logits processors, and the draft samples from that q and returns it, so the rejection sampler keeps the
target's law exactly. Tokenizer work runs on the host, O(row length) per row and step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.placement import input_device
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.proposers.draft_model import draft_position_limit, output_vocab_size, sampling_exponentials
from hf_specdec.sampling.processors import StepSampling

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder


def check_tokenizers(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raise a clear error unless both tokenizers can decode and encode text."""
    for name, tok in (("tokenizer", target_tokenizer), ("assistant_tokenizer", draft_tokenizer)):
        if tok is None or not callable(tok) or not hasattr(tok, "batch_decode"):
            raise ValueError(
                f"A draft with another tokenizer needs both tokenizers (transformers tokenizers), but {name} is "
                f"{type(tok).__name__}: pass tokenizer=<the target's tokenizer> and assistant_tokenizer=<the draft's>."
            )


def draft_text_to_target_ids(
    target_tokenizer: Any, draft_tokenizer: Any, known: list[list[int]], drafted: list[list[int]]
) -> list[list[int]]:
    """Per row: target ids of the text that `drafted` (draft ids) adds after `known` (draft ids); [] when the
    decoded draft does not extend the decoded known text (a decode that rewrites earlier characters)."""
    before = draft_tokenizer.batch_decode(known, skip_special_tokens=True)
    after = draft_tokenizer.batch_decode([k + d for k, d in zip(known, drafted)], skip_special_tokens=True)
    texts = [a[len(b) :] if a.startswith(b) else "" for a, b in zip(after, before)]
    if not any(texts):
        return [[] for _ in texts]
    encoded = target_tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [ids if text else [] for ids, text in zip(encoded, texts)]


class CrossTokenizerProposer(Proposer):
    """Drafts with a causal LM whose tokenizer differs from the target's, translating through text."""

    def __init__(
        self, draft_model: PreTrainedModel, target_tokenizer: Any, draft_tokenizer: Any, num_speculative_tokens: int
    ) -> None:
        check_tokenizers(target_tokenizer, draft_tokenizer)
        if draft_model.config.is_encoder_decoder:
            raise ValueError(f"The draft model {type(draft_model).__name__} is an encoder-decoder; use a causal LM.")
        self.draft_model = draft_model
        self.target_tokenizer = target_tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_limit = draft_position_limit(draft_model)  # in draft tokens, so kept here, not by Top1Proposer
        self.view: CacheView | None = None
        self.draft_ids = torch.zeros(0, 0, dtype=torch.long)  # [B, C'] each row's draft-token ids, left-aligned
        self.draft_lengths = torch.zeros(0, dtype=torch.long)  # [B] valid ids per row

    def attach(self, target: PreTrainedModel) -> None:
        # The maps index the batch's tokens, which are on the target's input device (the draft may run elsewhere:
        # its CacheView moves what it feeds it). `prefill` moves them if the batch is elsewhere.
        self._map_vocabularies(output_vocab_size(target), input_device(target))

    def _map_vocabularies(self, target_vocab: int, device: torch.device) -> None:
        """Tokens with the same string in both vocabularies: draft ids [M], target ids [M], target -> draft [V]."""
        draft_vocab = output_vocab_size(self.draft_model)
        target_ids = self.target_tokenizer.get_vocab()
        pairs = [
            (a, target_ids[piece])
            for piece, a in self.draft_tokenizer.get_vocab().items()
            if piece in target_ids and a < draft_vocab and target_ids[piece] < target_vocab
        ]
        pairs.sort()
        self.mapped_draft = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=device)  # [M]
        self.mapped_target = torch.tensor([t for _, t in pairs], dtype=torch.long, device=device)  # [M]
        self.target_to_draft = torch.full((target_vocab,), -1, dtype=torch.long, device=device)  # [V]
        self.target_to_draft[self.mapped_target] = self.mapped_draft
        self.target_vocab = target_vocab

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        device = batch.device
        if self.mapped_draft.device != device:
            self.mapped_draft, self.mapped_target = self.mapped_draft.to(device), self.mapped_target.to(device)
            self.target_to_draft = self.target_to_draft.to(device)
        self.view = CacheView(
            self.draft_model, batch.batch_size, torch.zeros(batch.batch_size, dtype=torch.long, device=device)
        )
        self.draft_ids = torch.zeros(batch.batch_size, 0, dtype=torch.long, device=device)
        self.draft_lengths = torch.zeros(batch.batch_size, dtype=torch.long, device=device)

    def _reencode(self, batch: RaggedBatch, rows: list[int]) -> list[list[int]]:
        """The draft tokenizer's ids of each row's text (target tokens decoded, special tokens dropped)."""
        target_rows = [batch.token_ids[i, int(batch.pad_lengths[i]) : int(batch.lengths[i])].tolist() for i in rows]
        texts = self.target_tokenizer.batch_decode(target_rows, skip_special_tokens=True)
        return self.draft_tokenizer(texts, add_special_tokens=True)["input_ids"]

    def _store(self, rows: list[int], encoded: list[list[int]], width: int) -> None:
        """Write the re-encoded rows into the draft-id buffer (grown to `width`) and roll the draft cache back to the
        longest prefix it holds of each; rows not listed keep nothing new."""
        assert self.view is not None
        batch_size = self.draft_ids.shape[0]
        if width > self.draft_ids.shape[1]:
            grow = self.draft_ids.new_zeros(batch_size, width - self.draft_ids.shape[1])
            self.draft_ids = torch.cat([self.draft_ids, grow], 1)
        keep = self.view.cached_lengths.clone()  # [B]
        for i, ids in zip(rows, encoded):
            new = torch.tensor(ids, dtype=torch.long, device=self.draft_ids.device)
            old = self.draft_ids[i, : int(keep[i])]
            n = min(len(old), len(new) - 1)  # the newest id is always fed again: its logits draft the next token
            same = int((old[:n] == new[:n]).long().cumprod(0).sum()) if n > 0 else 0
            keep[i] = same
            self.draft_ids[i, : len(ids)] = new
            self.draft_lengths[i] = len(ids)
        self.view.rollback(keep)

    def propose(
        self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling, width: int | None = None
    ) -> Proposal:
        assert self.view is not None, "prefill() must run before propose()"
        budget = max_draft_tokens.clone()  # [B] target drafts per row
        rows = budget.nonzero().squeeze(1).tolist()
        if not rows:
            return Proposal.empty(batch.batch_size, batch.device)
        encoded = self._reencode(batch, rows)
        k = int(budget.max().item())
        if self.draft_limit is not None:  # the draft never sees a position past its limit
            room = {i: self.draft_limit - 1 - len(ids) for i, ids in zip(rows, encoded)}
            budget[rows] = torch.tensor([max(0, min(int(budget[i]), room[i])) for i in rows], device=budget.device)
            rows_ok = [(i, ids) for i, ids in zip(rows, encoded) if budget[i] > 0]
            rows, encoded = [i for i, _ in rows_ok], [ids for _, ids in rows_ok]
            if not rows:
                return Proposal.empty(batch.batch_size, batch.device)
        self._store(rows, encoded, max(len(ids) for ids in encoded) + k + 1)
        drafting_rows = torch.zeros(batch.batch_size, dtype=torch.bool, device=batch.device)
        drafting_rows[rows] = True
        if sampling.do_sample and self.mapped_target.numel():  # no shared token: one-hot text drafts (exact too)
            return self._sample_mapped(batch, drafting_rows & (budget > 0), budget, k, sampling)
        lengths = self.draft_lengths.clone()  # [B]
        index = torch.arange(batch.batch_size, device=batch.device)
        for j in range(k):
            drafting = drafting_rows & (budget > j)  # [B]
            num_new = torch.where(drafting, lengths - self.view.cached_lengths, 0)  # [B]
            logits = self.view.forward(self.draft_ids, num_new)  # [B, w, V_draft]
            tokens = logits[index, (num_new - 1).clamp(min=0)].argmax(-1)  # [B] greedy: a one-hot proposal
            at = lengths.clamp(max=self.draft_ids.shape[1] - 1)
            self.draft_ids[index, at] = torch.where(drafting, tokens, self.draft_ids[index, at])
            lengths = lengths + drafting.long()
        # One host read of the rows' draft tokens and lengths and budgets (the translation is host work).
        ids_host = self.draft_ids[rows].tolist()
        starts, ends, budgets = torch.stack([self.draft_lengths[rows], lengths[rows], budget[rows]]).tolist()
        known = [row[:start] for row, start in zip(ids_host, starts)]
        drafted = [row[start:end] for row, start, end in zip(ids_host, starts, ends)]
        translated = draft_text_to_target_ids(self.target_tokenizer, self.draft_tokenizer, known, drafted)
        clipped = [ids[:limit] for ids, limit in zip(translated, budgets)]
        width = max((len(ids) for ids in clipped), default=0)
        host_ids = torch.full((batch.batch_size, width), -1, dtype=torch.long)  # [B, k'] built on the host
        for i, ids in zip(rows, clipped):
            host_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        draft_token_ids = host_ids.to(batch.device)  # one copy to the device
        return Proposal(draft_token_ids=draft_token_ids, num_draft_tokens=(draft_token_ids >= 0).sum(1))

    def _sample_mapped(
        self,
        batch: RaggedBatch,
        alive: torch.Tensor,  # [B] rows that draft
        budget: torch.Tensor,  # [B] drafts per row
        k: int,
        sampling: StepSampling,
    ) -> Proposal:
        """Sample up to k drafts per row over the shared tokens, returning the target-vocabulary q they came from."""
        assert self.view is not None
        rows = torch.arange(batch.batch_size, device=batch.device)
        lengths = self.draft_lengths.clone()  # [B] draft ids per row, drafts included
        target_lengths = batch.lengths.clone()  # [B] target tokens per row, drafts included
        draft_token_ids = torch.full((batch.batch_size, k), -1, dtype=torch.long, device=batch.device)  # [B, k]
        draft_probs = []
        for j in range(k):
            drafting = alive & (budget > j)  # [B]
            num_new = torch.where(drafting, lengths - self.view.cached_lengths, 0)  # [B]
            logits = self.view.forward(self.draft_ids, num_new)[rows, (num_new - 1).clamp(min=0)]  # [B, V_draft]
            mapped = logits.new_full((batch.batch_size, self.target_vocab), float("-inf"))  # [B, V]
            mapped[:, self.mapped_target] = logits[:, self.mapped_draft]
            scores = sampling.process(batch.token_ids, target_lengths[:, None], drafting[:, None], mapped[:, None])[
                :, 0
            ]
            drafting = drafting & torch.isfinite(scores).any(-1)  # a row whose processors left no shared token stops
            probs = torch.where(drafting[:, None], torch.softmax(scores, dim=-1).nan_to_num(0.0), 0.0)  # [B, V]
            tokens = (probs / sampling_exponentials(sampling, j, self.target_vocab)).argmax(-1)  # [B] target ids
            at = target_lengths.clamp(max=batch.capacity - 1)
            batch.token_ids[rows, at] = torch.where(drafting, tokens, batch.token_ids[rows, at])
            at = lengths.clamp(max=self.draft_ids.shape[1] - 1)
            self.draft_ids[rows, at] = torch.where(drafting, self.target_to_draft[tokens], self.draft_ids[rows, at])
            draft_token_ids[:, j] = torch.where(drafting, tokens, -1)
            draft_probs.append(probs)
            lengths, target_lengths = lengths + drafting.long(), target_lengths + drafting.long()
            alive = alive & drafting
        num_draft = (draft_token_ids >= 0).sum(1)  # [B]
        width = int(num_draft.max().item())
        probs = torch.stack(draft_probs, dim=1)[:, :width]  # [B, k', V]
        return Proposal(draft_token_ids=draft_token_ids[:, :width], num_draft_tokens=num_draft, draft_probs=probs)

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.view is not None:
            self.view.select_rows(keep)
        self.draft_ids = self.draft_ids[keep]
        self.draft_lengths = self.draft_lengths[keep]


@register("draft", when=lambda spec: spec.draft_tokenizer is not None)
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> CrossTokenizerProposer:
    """`method="draft"` with a `draft_tokenizer`: decoder-only targets only."""
    if context.encoder is not None:
        raise NotImplementedError(
            "A draft with another tokenizer is not supported for encoder-decoder targets: use a draft sharing "
            "the target's tokenizer, or prompt_lookup_num_tokens."
        )
    return CrossTokenizerProposer(
        spec.draft_model, context.tokenizer, spec.draft_tokenizer, spec.max_speculative_tokens
    )
