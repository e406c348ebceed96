"""The exact path: logits processors and stopping criteria called exactly as plain `generate` calls them.

Plain `generate` calls its processors and criteria once per token, in sequence order, on the caller's whole
batch (finished rows padded). A stateful processor (SynthID's watermark keeps per-row n-gram context and a
call count) relies on that. When a call has any processor off the vectorised path's allow-list, the loop runs
in lockstep (every live row holds the same number of tokens) and `ExactPath.accept` walks a verified block
position by position: call the processors on the full batch, accept or reject every row's draft there, call the
criteria on the full batch, and go on only while every row accepted and none stopped. So each call sees exactly
plain decoding's inputs, and none is ever made for a position that is later thrown away: no state needs a
snapshot or a rollback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.sampling.rejection import rejection_sample

if TYPE_CHECKING:
    from hf_specdec.batch import RaggedBatch
    from hf_specdec.proposers.base import Proposal
    from hf_specdec.stopping import StopRules


def needs_exact_path(sampling: StepSampling) -> bool:
    """Whether any processor of the call is off the allow-list (matched by exact type). Stopping criteria never need
    this path: the host calls those plain `generate` would call, on its whole batch, in order
    (`hf_specdec.host_criteria`); on this path it calls them itself, in lockstep."""
    return sampling.exact


class LoopRows(Protocol):
    """What the exact path reads of the loop (`SpeculativeLoop` has it): the live rows, the rows that left, and the
    call's sampling state and stop rules. A protocol, so that this module does not import the loop that uses it."""

    batch: RaggedBatch  # the live rows
    sequences: torch.Tensor  # [B_total, max_length] rows as they left the batch
    final_lengths: torch.Tensor  # [B_total] length of each row when it left
    sampling: StepSampling
    stop_rules: StopRules


class ExactPath:
    """Scores, accepts and stops one verified block position by position, on the caller's full batch."""

    def __init__(
        self, processors: LogitsProcessorList, criteria: StoppingCriteriaList, pad_token_id: int | None
    ) -> None:
        self.processors = processors
        self.criteria = criteria
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0

    def full_view(self, loop: LoopRows, width: int) -> torch.Tensor:  # [B_total, L + width]
        """The caller's batch as plain `generate` holds it, with `width` scratch columns for the block's tokens.

        Live rows (all of length L in lockstep) come from the batch, finished rows from the loop's final rows,
        padded after their end as plain `generate` pads them.
        """
        batch = loop.batch
        lengths = batch.lengths.tolist()  # one host read: the block's length, and the lockstep invariant
        length = lengths[0]
        if any(n != length for n in lengths):
            raise AssertionError(f"the exact path needs rows in lockstep, got lengths {lengths}")
        total = loop.sequences.shape[0]
        view = torch.full((total, length + width), self.pad_token_id, dtype=torch.long, device=batch.device)
        done = min(length, loop.sequences.shape[1])
        columns = torch.arange(done, device=batch.device)  # [L]
        ended = columns[None, :] < loop.final_lengths.to(batch.device)[:, None]  # [B_total, L]
        view[:, :done] = torch.where(ended, loop.sequences[:, :done], self.pad_token_id)
        view[batch.row_ids, :length] = batch.token_ids[:, :length]
        return view

    def accept(
        self,
        loop: LoopRows,
        proposal: Proposal,
        target_logits: torch.Tensor,  # [B, w, V] raw logits of [last token, drafts]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # output ids [B, w], scores [B, w, V], stop hits [B, w]
        """Accept a prefix of the block that is the same for every row; call processors and criteria on it only."""
        batch, sampling = loop.batch, loop.sampling
        batch_size, width, vocab = target_logits.shape
        device = target_logits.device
        length = int(batch.lengths[0]) if batch_size else 0
        view = self.full_view(loop, width)  # [B_total, L + w]
        rows = batch.row_ids  # [B] the caller's row of each live row
        output_ids = torch.full((batch_size, width), -1, dtype=torch.long, device=device)  # [B, w]
        scores = torch.zeros_like(target_logits)  # [B, w, V]
        hits = torch.zeros(batch_size, width, dtype=torch.bool, device=device)  # [B, w]
        if sampling.do_sample:
            uniforms = sampling.draw_uniforms(width - 1)  # [B, w - 1]
            exponentials = sampling.draw_exponentials(row_random.STREAM_RESIDUAL, vocab)  # [B, V]
        else:
            uniforms = torch.zeros(batch_size, width - 1, device=device)
            exponentials = torch.ones(batch_size, 1, device=device).expand(batch_size, vocab)
        is_greedy = torch.full((batch_size,), not sampling.do_sample, device=device)
        drafts = torch.cat([proposal.draft_token_ids, torch.full_like(output_ids[:, :1], -1)], dim=1)  # [B, w]
        no_draft = torch.full_like(output_ids[:, :1], -1)  # [B, 1]
        stopped = loop.stop_rules.stopped.to(device)  # [B] rows that stopped earlier (no EOS: still live)
        for j in range(width):
            full_scores = target_logits.new_zeros(view.shape[0], vocab)  # [B_total, V]: finished rows get zeros
            full_scores[rows] = target_logits[:, j]
            processed = self.processors(view[:, : length + j], full_scores)  # [B_total, V]
            scores[:, j] = processed[rows]
            has_draft = proposal.num_draft_tokens > j  # [B]
            pair = torch.stack([scores[:, j], torch.zeros_like(scores[:, j])], dim=1)  # [B, 2, V]; slot 1 unused
            out = rejection_sample(
                pair,
                torch.where(has_draft[:, None], drafts[:, j : j + 1], no_draft),
                has_draft.long(),
                proposal.draft_probs[:, j : j + 1] if proposal.draft_probs is not None and j < width - 1 else None,
                is_greedy,
                uniforms[:, j : j + 1] if j < width - 1 else torch.zeros(batch_size, 1, device=device),
                exponentials,
            )  # [B, 2]: [draft, bonus] when the draft was accepted, else [recovered or bonus, -1]
            accepted = has_draft & (out[:, 1] >= 0)  # [B]
            output_ids[:, j] = out[:, 0]
            view[rows, length + j] = out[:, 0]
            done = self.criteria(view[:, : length + j + 1], None).to(device)  # [B_total]; plain passes None too
            hits[:, j] = done[rows]
            if not bool(accepted.all()) or bool((hits[:, j] & ~stopped).any()):
                break
        return output_ids, scores, hits
