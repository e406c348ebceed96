"""`generate`'s stopping rules, applied token by token inside each row's accepted block.

Plain `generate` checks its `StoppingCriteriaList` after every token, on the whole `input_ids`.
A speculative step appends several tokens per row at once, so each new token is checked with the
row's prefix up to that token: EOS and max length vectorised, any other criterion (stop strings,
user criteria, max time) called once per distinct prefix length. A row stops at its first hit.
As in `generate`: with an EOS criterion a stopped row is finished and padded with `pad_token_id`;
without one, stopped rows keep generating real tokens until every row has stopped.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from hf_specdec.batch import RaggedBatch


class StopRules:
    """Stopping state of the rows of one call (the live rows, in batch order)."""

    def __init__(self, criteria: StoppingCriteriaList, pad_token_id: int | None, max_length: int, batch_size: int):
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.has_eos = any(hasattr(c, "eos_token_id") for c in criteria)
        eos = [c.eos_token_id for c in criteria if isinstance(c, EosTokenCriteria)]
        self.eos_token_ids = torch.cat([e.reshape(-1) for e in eos]) if eos else None  # [E]
        self.max_lengths = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        general = [c for c in criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
        self.general = StoppingCriteriaList(general)
        self.stopped = torch.zeros(batch_size, dtype=torch.bool)  # [B]
        # Longest stop length of any row so far (the final width without EOS); a device tensor: no host sync.
        self.max_stop_length = torch.zeros((), dtype=torch.long)
        if self.has_eos and pad_token_id is None:
            raise ValueError("An EOS stopping criterion needs a pad_token_id for finished rows; set pad_token_id.")

    def select_rows(self, keep: torch.Tensor) -> None:
        self.stopped = self.stopped[keep.to(self.stopped.device)]

    def apply(
        self,
        batch: RaggedBatch,
        num_emitted: torch.Tensor,  # [B]
        width: int,  # slots of the step's output (num_emitted <= width): static, no host sync
        hits: torch.Tensor | None = None,  # [B, w] criteria answers the exact path already got, or None
    ) -> torch.Tensor:  # [B] tokens to keep
        """Find each row's first stop among its `num_emitted` new tokens (already in the buffer)."""
        device = batch.device
        self.stopped = self.stopped.to(device)
        self.max_stop_length = self.max_stop_length.to(device)
        offsets = torch.arange(width, device=device)  # [w]
        fresh = (offsets < num_emitted[:, None]) & ~self.stopped[:, None]  # [B, w] new tokens still checked
        index = (batch.lengths[:, None] + offsets).clamp(max=batch.capacity - 1)  # [B, w]
        hit = torch.zeros_like(fresh)  # [B, w]: the row stops right after this token
        if hits is not None:  # the exact path called the whole criteria list, in order, on the full batch
            hit = hits[:, :width].to(device) & fresh
        elif self.eos_token_ids is not None:
            new_tokens = batch.token_ids.gather(1, index)
            hit |= torch.isin(new_tokens, self.eos_token_ids.to(device))
        if hits is None:
            for max_length in self.max_lengths:
                hit |= index + 1 >= max_length
        hit &= fresh
        if hits is None and len(self.general) > 0:
            hit |= self._general_hits(batch, fresh & ~_after_first(hit), index)
        any_hit = hit.any(1)
        first = hit.float().argmax(1)  # [B] offset of the first hit
        stop_lengths = torch.where(any_hit, batch.lengths + first + 1, 0)  # [B]
        if batch.batch_size:
            self.max_stop_length = torch.maximum(self.max_stop_length, stop_lengths.max())
        self.stopped = self.stopped | any_hit
        if self.has_eos:
            return torch.where(any_hit, first + 1, num_emitted)
        return num_emitted

    def _general_hits(self, batch: RaggedBatch, check: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Run the other criteria once per distinct prefix length over the (row, offset) pairs in `check`."""
        hit = torch.zeros_like(check)
        prefix = torch.where(check, index + 1, -1)  # [B, w] prefix length that ends with the token
        for length in torch.unique(prefix[check]).tolist():
            rows, cols = (prefix == length).nonzero(as_tuple=True)
            done = self.general(batch.token_ids[rows, :length], None)
            hit[rows, cols] = done.to(hit.device)
            # Rows that stopped here must not be stopped again later in their block: earliest hit wins anyway.
        return hit

    def done(self, batch: RaggedBatch) -> torch.Tensor:  # [B] rows that can leave the batch
        stopped = self.stopped.to(batch.device)
        if self.has_eos:
            return stopped
        # Without EOS, stopped rows keep generating until every row has stopped (as in generate).
        return stopped.all() & (batch.lengths >= self.max_stop_length.to(batch.device))

    def final_length(self, final_lengths: torch.Tensor, batch: RaggedBatch, live: bool) -> int:
        """Width of the output rows (prompt included), or max_length while it is not known yet."""
        if live and (self.has_eos or not bool(self.stopped.all())):
            return self.max_length
        if self.has_eos:
            return int(final_lengths.max().item())
        return int(self.max_stop_length)

    def pad_finished(
        self, block: torch.Tensor, final_lengths: torch.Tensor, start: int, live: dict[int, int]
    ) -> torch.Tensor:
        """Columns [start, start + width) of the output rows: finished rows get pad after their end."""
        if not self.has_eos:
            return block
        columns = start + torch.arange(block.shape[1], device=block.device)  # [n]
        past_end = columns[None, :] >= final_lengths.to(block.device)[:, None]  # [B_total, n]
        for row in live:
            past_end[row] = False
        return block.masked_fill(past_end, self.pad_token_id)


def _after_first(hit: torch.Tensor) -> torch.Tensor:  # [B, w] True strictly after each row's first hit
    return (hit.long().cumsum(1) - hit.long()) > 0
