"""The speculative decoding loop: propose → verify → accept → commit → roll back, batched and ragged.

One step drafts up to k tokens per row, verifies all rows in one target forward, lets the
rejection sampler accept a prefix of each row's drafts plus one recovered or bonus token, commits
those tokens with `generate`'s own stopping rules applied token by token, and rolls every cache
back to what the sequences hold. Finished rows leave the batch. `run_speculative_loop` returns
the token rows as plain `generate` would lay them out, plus the per-token scores if asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.continuation import CacheHandoff
from hf_specdec.metrics import SpecDecodeStats
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.sampling.rejection import rejection_sample
from hf_specdec.stopping import StopRules


@dataclass
class LoopOutput:
    sequences: torch.Tensor  # [B, L] token ids laid out like plain generate's
    scores: tuple[torch.Tensor, ...] | None  # one [B, V] per generated column (processed scores)
    logits: tuple[torch.Tensor, ...] | None  # one [B, V] per generated column (raw logits)
    past_key_values: object | None = None  # the cache plain generate would leave (when a CacheHandoff asks)


class SpeculativeLoop:
    """State and steps of one speculative `generate` call."""

    def __init__(
        self,
        model: PreTrainedModel,
        proposer: Proposer,
        batch: RaggedBatch,
        sampling: StepSampling,
        stop_rules: StopRules,
        num_speculative_tokens: int,
        max_length: int,
        streamer: object | None,
        output_scores: bool,
        output_logits: bool,
        handoff: CacheHandoff | None = None,
        view_factory: Callable[[PreTrainedModel, RaggedBatch], CacheView] | None = None,
    ) -> None:
        self.model = model
        self.proposer = proposer
        self.batch = batch
        self.sampling = sampling
        self.stop_rules = stop_rules
        self.k = num_speculative_tokens
        self.max_length = max_length
        self.streamer = streamer
        self.stats = SpecDecodeStats()
        # An encoder-decoder target's view also feeds the encoder output (`hf_specdec.seq2seq`).
        self.target = (
            view_factory(model, batch) if view_factory else CacheView(model, batch.batch_size, batch.pad_lengths)
        )
        self.handoff = handoff  # adopts a filled past_key_values; keeps leaving rows' caches to hand back
        if handoff is not None:
            handoff.adopt(self.target)
        self.prefilled = False
        total = batch.batch_size
        device = batch.device
        self.sequences = batch.token_ids[:, :max_length].clone()  # [B_total, max_length] final rows
        self.final_lengths = batch.lengths.clone()  # [B_total] length of each row when it left
        self.streamed = batch.prompt_width
        vocab = None
        self.score_buffer = self.logit_buffer = None
        if output_scores or output_logits:
            from hf_specdec.proposers.draft_model import output_vocab_size

            vocab = output_vocab_size(model)
            shape = (total, max_length - batch.prompt_width, vocab)
            self.score_buffer = torch.zeros(shape, device=device) if output_scores else None
            self.logit_buffer = torch.zeros(shape, device=device) if output_logits else None

    # --- the step ----------------------------------------------------------------------------------

    def run(self) -> LoopOutput:
        start = time.perf_counter()
        self.proposer.attach(self.model)
        try:
            self.proposer.prefill(self.batch, self.sampling)
            self.step()  # step 0: its verify is the target's prefill, as in plain generate and HF's assisted loop
            if self.batch.batch_size:
                self.proposer.calibrate(self.time_verify)
            while self.batch.batch_size > 0:
                self.step()
        finally:
            self.proposer.detach()
        self.stats.wall_time_s = time.perf_counter() - start
        return self.finish()

    def time_verify(self, width: int) -> float:
        """Seconds one target forward of `width` tokens per row takes right now; the forward is then undone.

        It feeds whatever the scratch space past each row's tokens holds (its cost does not depend on the ids)
        and rolls the cache back, so the sequences, the caches and the stats are as before.
        """
        num_new = torch.full((self.batch.batch_size,), width, dtype=torch.long, device=self.batch.device)
        synchronize = torch.cuda.synchronize if self.batch.device.type == "cuda" else (lambda: None)
        synchronize()
        start = time.perf_counter()
        self.target.forward(self.batch.token_ids, num_new)
        synchronize()
        seconds = time.perf_counter() - start
        self.target.rollback(self.batch.lengths - 1)
        return seconds

    def step(self) -> None:
        proposal = self.propose()
        target_logits = self.verify(proposal)  # [B, w, V]
        scores = self.score(proposal, target_logits)
        output_ids = self.accept(proposal, scores)  # [B, w]
        num_kept, num_accepted = self.commit(proposal, output_ids, scores, target_logits)
        self.rollback(num_accepted)
        self.retire_finished()
        self.sampling.step += 1

    def propose(self) -> Proposal:
        room = self.max_length - self.batch.lengths - 1  # [B] drafts that still fit before max_length
        max_draft = room.clamp(min=0, max=self.k)  # [B]
        proposal = self.proposer.propose(self.batch, max_draft, self.sampling)
        # Drafts go into the scratch space after each row's tokens: processors and stops read them.
        width = proposal.draft_token_ids.shape[1]
        if width:
            rows = torch.arange(self.batch.batch_size, device=self.batch.device)[:, None]
            columns = (self.batch.lengths[:, None] + torch.arange(width, device=self.batch.device)).clamp(
                max=self.batch.capacity - 1
            )  # [B, k]
            drafted = proposal.draft_token_ids >= 0
            self.batch.token_ids[rows, columns] = torch.where(
                drafted, proposal.draft_token_ids, self.batch.token_ids[rows, columns]
            )
        return proposal

    def verify(self, proposal: Proposal) -> torch.Tensor:  # [B, 1 + k, V]
        """One target forward over each row's unseen tokens and its drafts; logits of [last token, drafts].

        The target has seen every token but each row's newest one, except at step 0, where it has seen nothing:
        that verify is the prefill, so the first tokens cost no forward of their own.
        """
        unseen = self.batch.lengths - self.target.cached_lengths  # [B] 1, or the whole row at step 0
        keep = None  # after step 0 every fed slot is [newest token, drafts]: keep them all (no host sync)
        if not self.prefilled:  # step 0: of the prefill (all the prompt a filled cache lacks) keep [last, drafts]
            keep = 1 + int(proposal.num_draft_tokens.max().item())
            self.prefilled = True
        return self.target.forward(self.batch.token_ids, unseen + proposal.num_draft_tokens, logits_to_keep=keep)

    def score(self, proposal: Proposal, target_logits: torch.Tensor) -> torch.Tensor:  # [B, 1 + k, V]
        width = target_logits.shape[1]
        offsets = torch.arange(width, device=target_logits.device)  # [w]
        prefix_lengths = self.batch.lengths[:, None] + offsets  # [B, w]
        valid = offsets <= proposal.num_draft_tokens[:, None]  # [B, w]
        return self.sampling.process(self.batch.token_ids, prefix_lengths, valid, target_logits)

    def accept(self, proposal: Proposal, scores: torch.Tensor) -> torch.Tensor:  # [B, 1 + k]
        batch_size, width, vocab = scores.shape
        device = scores.device
        if self.sampling.do_sample:
            uniforms = self.sampling.draw_uniforms(width - 1)  # [B, k]
            exponentials = self.sampling.draw_exponentials(row_random.STREAM_RESIDUAL, vocab)  # [B, V]
        else:
            uniforms = torch.zeros(batch_size, width - 1, device=device)
            exponentials = torch.ones(batch_size, 1, device=device).expand(batch_size, vocab)
        is_greedy = torch.full((batch_size,), not self.sampling.do_sample, device=device)
        draft_probs = proposal.draft_probs if self.sampling.do_sample else None
        return rejection_sample(
            scores,
            proposal.draft_token_ids,
            proposal.num_draft_tokens,
            draft_probs,
            is_greedy,
            uniforms,
            exponentials,
        )

    def commit(
        self,
        proposal: Proposal,
        output_ids: torch.Tensor,  # [B, w]
        scores: torch.Tensor,  # [B, w, V]
        target_logits: torch.Tensor,  # [B, w, V]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each row's emitted tokens, cut at the first stop, and update the stats."""
        batch = self.batch
        num_emitted = (output_ids >= 0).sum(1)  # [B]
        num_accepted = num_emitted - 1
        width = output_ids.shape[1]
        rows = torch.arange(batch.batch_size, device=batch.device)[:, None]
        columns = (batch.lengths[:, None] + torch.arange(width, device=batch.device)).clamp(max=batch.capacity - 1)
        emitted = output_ids >= 0
        batch.token_ids[rows, columns] = torch.where(emitted, output_ids, batch.token_ids[rows, columns])
        num_kept = self.stop_rules.apply(batch, num_emitted)  # [B]
        self.record_outputs(num_kept, scores, target_logits)
        batch.lengths = batch.lengths + num_kept
        self.stats.record_step(proposal.num_draft_tokens, num_accepted)
        self.stats.num_generated_tokens += int(num_kept.sum().item())
        return num_kept, num_accepted

    def rollback(self, num_accepted: torch.Tensor) -> None:
        # The target holds every token but each row's newest one, which the next verify feeds.
        self.target.rollback(self.batch.lengths - 1)
        self.proposer.commit(self.batch, num_accepted)

    # --- bookkeeping -------------------------------------------------------------------------------

    def record_outputs(self, num_kept: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> None:
        if self.score_buffer is None and self.logit_buffer is None:
            return
        batch = self.batch
        width = scores.shape[1]
        offsets = torch.arange(width, device=scores.device)
        rows, cols = (offsets < num_kept[:, None]).nonzero(as_tuple=True)
        targets = batch.lengths[rows] + cols - batch.prompt_width
        for buffer, values in ((self.score_buffer, scores), (self.logit_buffer, logits)):
            if buffer is not None:
                buffer[batch.row_ids[rows], targets] = values[rows, cols]

    def retire_finished(self) -> None:
        """Rows that are done leave the batch (their tokens are copied out first); stream what is final."""
        batch = self.batch
        done = self.stop_rules.done(batch) | (batch.lengths >= self.max_length)  # [B]
        if done.any():
            leaving = done.nonzero().squeeze(1)
            for i in leaving.tolist():
                row, length = int(batch.row_ids[i]), int(batch.lengths[i])
                self.sequences[row, :length] = batch.token_ids[i, :length]
                self.final_lengths[row] = length
            if self.handoff is not None:
                self.handoff.stash(self.target, leaving, batch.row_ids[leaving])
            keep = (~done).nonzero().squeeze(1)
            batch.select_rows(keep)
            self.target.select_rows(keep)
            self.proposer.select_rows(keep)
            self.sampling.select_rows(keep)
            self.stop_rules.select_rows(keep)
        self.stream()

    def stream(self) -> None:
        """Send the columns that no row can still change to the streamer, one [B] column at a time."""
        if self.streamer is None:
            return
        final_length = self.stop_rules.final_length(self.final_lengths, self.batch)
        safe = int(self.batch.lengths.min().item()) if self.batch.batch_size else final_length
        safe = min(safe, final_length)
        if safe <= self.streamed:
            return
        live = {int(r): i for i, r in enumerate(self.batch.row_ids.tolist())}
        block = self.sequences[:, self.streamed : safe].clone()  # [B_total, n]
        for row, i in live.items():
            block[row] = self.batch.token_ids[i, self.streamed : safe]
        block = self.stop_rules.pad_finished(block, self.final_lengths, self.streamed, live)
        for column in block.cpu().unbind(1):
            self.streamer.put(column)
        self.streamed = safe

    def finish(self) -> LoopOutput:
        final_length = self.stop_rules.final_length(self.final_lengths, self.batch)
        sequences = self.sequences[:, :final_length]
        sequences = self.stop_rules.pad_finished(sequences, self.final_lengths, 0, {})
        if self.streamer is not None:
            self.stream()
            self.streamer.end()
        generated = final_length - self.batch.prompt_width
        scores = logits = None
        if self.score_buffer is not None:
            scores = tuple(self.score_buffer[:, :generated].unbind(1))
        if self.logit_buffer is not None:
            logits = tuple(self.logit_buffer[:, :generated].unbind(1))
        cache = self.handoff.hand_back(self.model, sequences) if self.handoff is not None else None
        return LoopOutput(sequences=sequences, scores=scores, logits=logits, past_key_values=cache)
