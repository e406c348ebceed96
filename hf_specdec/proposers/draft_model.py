"""`DraftModelProposer`: a smaller HF causal LM with the target's vocabulary drafts k tokens per row.

The draft keeps its own KV cache (`CacheView`) over the same ragged batch. Each step it first feeds
what it has not seen yet (the target's last token, plus the last draft after a full accept: 1 or 2
tokens per row, ragged), then one token per draft position, all rows in one forward each. Greedy
calls take the draft's argmax (one-hot drafts); sampling calls sample from the draft's processed
distribution q and return q, as exact speculative sampling needs.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling


def output_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the model's output embedding, i.e. the size of the logits' last dimension."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.shape[0]
    return model.config.get_text_config().vocab_size


def check_draft_model(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Raise a clear error when the draft cannot serve this target."""
    if draft.config.is_encoder_decoder:
        raise ValueError(f"The draft model {type(draft).__name__} is an encoder-decoder; use a decoder-only draft.")
    target_vocab, draft_vocab = output_vocab_size(target), output_vocab_size(draft)
    if target_vocab != draft_vocab:
        raise ValueError(
            f"The draft's vocabulary ({draft_vocab} logits) differs from the target's ({target_vocab}): the draft must "
            "share the target's tokenizer (e.g. a smaller model of the same family), or use method='ngram'."
        )
    if draft.device != target.device:
        raise ValueError(
            f"The draft model is on {draft.device} but the target is on {target.device}: move it first with "
            f"draft_model.to({str(target.device)!r})."
        )


class DraftModelProposer(Proposer):
    """Drafts with a small causal LM; batched over rows, one forward per draft position."""

    def __init__(self, draft_model: PreTrainedModel, num_speculative_tokens: int) -> None:
        self.draft_model = draft_model
        self.num_speculative_tokens = num_speculative_tokens
        self.view: CacheView | None = None

    @property
    def returns_probs(self) -> bool:  # type: ignore[override]
        return True

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        self.view = CacheView(self.draft_model, batch.batch_size, batch.pad_lengths)
        if batch.prompt_width > 1:
            self.view.forward(batch.token_ids, batch.lengths - 1, logits_to_keep=1)

    def propose(self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling) -> Proposal:
        assert self.view is not None, "prefill() must run before propose()"
        k = int(max_draft_tokens.max().item()) if batch.batch_size else 0
        if k == 0:
            return Proposal.empty(batch.batch_size, batch.device)
        rows = torch.arange(batch.batch_size, device=batch.device)
        draft_ids = torch.full((batch.batch_size, k), -1, dtype=torch.long, device=batch.device)  # [B, k]
        draft_probs: list[torch.Tensor] = []
        lengths = batch.lengths.clone()  # [B] tokens known per row, drafts included
        for j in range(k):
            drafting = max_draft_tokens > j  # [B]
            num_new = torch.where(drafting, lengths - self.view.cached_lengths, 0)  # [B]
            logits = self.view.forward(batch.token_ids, num_new)  # [B, w, V]
            last = logits[rows, (num_new - 1).clamp(min=0)]  # [B, V]
            scores = sampling.process(batch.token_ids, lengths[:, None], drafting[:, None], last[:, None])[:, 0]
            if sampling.do_sample:
                probs = torch.softmax(scores, dim=-1)  # [B, V]
                race = sampling_exponentials(sampling, j, probs.shape[-1])  # [B, V]
                tokens = (probs / race).argmax(dim=-1)  # [B]
                draft_probs.append(probs)
            else:
                tokens = scores.argmax(dim=-1)  # [B]
            tokens = torch.where(drafting, tokens, -1)
            draft_ids[:, j] = tokens
            write_at = lengths.clamp(max=batch.capacity - 1)
            batch.token_ids[rows, write_at] = torch.where(drafting, tokens, batch.token_ids[rows, write_at])
            lengths = lengths + drafting.long()
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, k, V]
        return Proposal(draft_token_ids=draft_ids, num_draft_tokens=max_draft_tokens.clone(), draft_probs=probs)

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        assert self.view is not None
        # The newest token of each row (recovered or bonus) was never seen by the draft.
        self.view.rollback(batch.lengths - 1)

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.view is not None:
            self.view.select_rows(keep)


def sampling_exponentials(sampling: StepSampling, position: int, vocab: int) -> torch.Tensor:  # [B, V]
    """The Exp(1) draws of the exponential race that samples draft position `position`."""
    return sampling.draw_exponentials(row_random.STREAM_DRAFT + position, vocab)
