"""`generate`'s stopping rules, applied token by token inside each row's accepted block.

Plain `generate` checks its `StoppingCriteriaList` after every token, on the whole `input_ids`.
A speculative step appends several tokens per row at once, so each new token is checked with the
row's prefix up to that token: EOS, max length and stop strings vectorised on the device (so a captured step holds
them). Any other criterion (`max_time`, your own) is the host's (`host_criteria.HostCriteria`): called after the
step's host read, once per length on the caller's whole batch, as plain calls it. A row stops at its first hit.
As in `generate`: with an EOS criterion a stopped row is finished and padded with `pad_token_id`;
without one, stopped rows keep generating real tokens until every row has stopped.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from hf_specdec.batch import RaggedBatch
from hf_specdec.host_criteria import HostCriteria


class StopRules:
    """Stopping state of the rows of one call (the live rows, in batch order)."""

    #: numbers of one call that captured steps never read (they read `length_limit`): not part of a graph signature
    PER_CALL = ("max_length",)

    def __init__(
        self,
        criteria: StoppingCriteriaList,
        pad_token_id: int | None,
        max_length: int,
        batch_size: int,
        prompt_width: int,
        host_calls: bool = True,  # False: the exact path calls the whole list itself (`hf_specdec.exact`)
    ):
        check_criteria(criteria)
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.has_eos = any(hasattr(c, "eos_token_id") for c in criteria)
        # Matched by exact type, as the processors are: a subclass may answer otherwise, so the host calls it.
        eos = [c.eos_token_id for c in criteria if type(c) is EosTokenCriteria]
        self.eos_token_ids = torch.cat([e.reshape(-1) for e in eos]) if eos else None  # [E]
        self.max_lengths = [c.max_length for c in criteria if type(c) is MaxLengthCriteria]
        #: the max-length rule as captured steps read it: a tensor (0-d, the least of `max_lengths`), so that kept
        #: graphs serve calls of any length that fit their buffers (`graph_reuse`)
        self.length_limit = torch.tensor(min(self.max_lengths)) if self.max_lengths else None
        #: stop strings, checked on the device: transformers' criterion reads only the last `maximum_token_len` ids
        self.stop_strings = [c for c in criteria if type(c) is StopStringCriteria]
        device_rules = (EosTokenCriteria, MaxLengthCriteria, StopStringCriteria)
        self.general = StoppingCriteriaList([c for c in criteria if type(c) not in device_rules])
        self.stopped = torch.zeros(batch_size, dtype=torch.bool)  # [B]
        self.stop_lengths = torch.zeros(batch_size, dtype=torch.long)  # [B] each row's first stop (0: none yet)
        # Longest stop length of any row so far (the final width without EOS); a device tensor: no host sync.
        self.max_stop_length = torch.zeros((), dtype=torch.long)
        if self.has_eos and pad_token_id is None:
            raise ValueError("An EOS stopping criterion needs a pad_token_id for finished rows; set pad_token_id.")
        #: the criteria only the host can answer, called after each step's host read (None: there are none)
        self.host = None
        if len(self.general) and host_calls:
            self.host = HostCriteria(self.general, rows=batch_size, prompt_width=prompt_width, max_length=max_length,
                                     has_eos=self.has_eos, pad_token_id=pad_token_id)  # fmt: skip

    def select_rows(self, keep: torch.Tensor) -> None:
        self.stopped = self.stopped[keep.to(self.stopped.device)]
        self.stop_lengths = self.stop_lengths[keep.to(self.stop_lengths.device)]

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
        self.stop_lengths = self.stop_lengths.to(device)
        self.max_stop_length = self.max_stop_length.to(device)
        if self.length_limit is not None:
            self.length_limit = self.length_limit.to(device)
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
            if self.length_limit is not None:
                hit |= index + 1 >= self.length_limit
            for criterion in self.stop_strings:
                hit |= _stop_string_hits(criterion, batch.token_ids, index)
        hit &= fresh
        any_hit = hit.any(1)
        first = hit.float().argmax(1)  # [B] offset of the first hit
        self._note_stops(any_hit, torch.where(any_hit, batch.lengths + first + 1, 0))
        if self.has_eos:
            return torch.where(any_hit, first + 1, num_emitted)
        return num_emitted

    def apply_newest(self, batch: RaggedBatch, new_ids: torch.Tensor) -> None:  # new_ids: [B]
        """`apply` for a step in which every row emitted one token, at buffer index `lengths` (a plain step on a
        dynamic batch, where no row has stopped with an EOS criterion and a stopped row keeps its tokens without
        one): each row keeps it, and a stop there is the row's first. The max-length rule is checked on the host's
        copy of the lengths (device work only on the step that reaches it)."""
        device = batch.device
        lengths = batch.lengths[:, None]  # [B, 1] the new token's buffer index
        hit = None  # [B]
        if self.eos_token_ids is not None:
            hit = torch.isin(new_ids, self.eos_token_ids.to(device))
        for max_length in self.max_lengths:
            if batch.host_lengths is None or np.any(batch.host_lengths + 1 >= max_length):
                reached = batch.lengths + 1 >= max_length
                hit = reached if hit is None else hit | reached
        for criterion in self.stop_strings:
            found = _stop_string_hits(criterion, batch.token_ids, lengths)[:, 0]
            hit = found if hit is None else hit | found
        if hit is None:
            return
        hit &= ~self.stopped.to(device)
        self._note_stops(hit, torch.where(hit, batch.lengths + 1, 0))

    def _note_stops(self, hit: torch.Tensor, stop_lengths: torch.Tensor) -> None:
        """Rows `hit` ([B] bool, none stopped before) stop at `stop_lengths` ([B], 0 elsewhere)."""
        device = hit.device
        if not self.has_eos and len(stop_lengths):  # the final width without EOS: the longest stop (no sync)
            self.max_stop_length = torch.maximum(self.max_stop_length.to(device), stop_lengths.max())
        self.stop_lengths = torch.where(hit, stop_lengths, self.stop_lengths.to(device))
        self.stopped = self.stopped.to(device) | hit

    def stop_strings_key(self) -> tuple:
        """What identifies the stop strings' token tables (the graphs a call keeps read them: `graph_reuse`)."""
        return tuple(
            (c.maximum_token_len, hashlib.sha1(c.embedding_vec.cpu().numpy().tobytes()).hexdigest())
            for c in self.stop_strings
        )

    def done(self, batch: RaggedBatch) -> torch.Tensor:  # [B] rows that can leave the batch
        stopped = self.stopped.to(batch.device)
        if self.has_eos:
            return stopped
        # Without EOS, stopped rows keep generating until every row has stopped (as in generate).
        return stopped.all() & (batch.lengths >= self.max_stop_length.to(batch.device))

    def final_length(self, final_lengths: torch.Tensor, batch: RaggedBatch, live: bool) -> int:
        """Width of the output rows (prompt included), or max_length while it is not known yet."""
        if self.host is not None and not self.has_eos:  # the host criteria had the last word on every row's stop
            return self.host.final_width if self.host.finished else self.max_length
        if live and (self.has_eos or not bool(self.stopped.all())):
            return self.max_length
        if self.has_eos:
            return int(final_lengths.max().item())
        return int(self.max_stop_length)

    def confirmed_width(self) -> int:
        """Columns that no stop decision can still cut: all of them unless host criteria are still to be called."""
        return self.max_length if self.host is None or self.host.finished else self.host.called

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


def _stop_string_hits(
    criterion: StopStringCriteria,
    token_ids: torch.Tensor,  # [B, C]
    index: torch.Tensor,  # [B, w] buffer column of each new token
) -> torch.Tensor:  # [B, w] a stop string ends at this token
    """The criterion on every (row, new token) at once: it reads only the last `maximum_token_len` ids of its
    input, so each token's window of that many columns ending at it is that input. Columns before the buffer's
    start get the criterion's own id for "no such token" (the last row of its table), which no stop string holds,
    as a shorter input would."""
    span = criterion.maximum_token_len
    at = index[..., None] - torch.arange(span - 1, -1, -1, device=index.device)  # [B, w, M]
    window = token_ids.gather(1, at.clamp(min=0).flatten(1)).view(at.shape)  # [B, w, M]
    window = torch.where(at >= 0, window, criterion.embedding_vec.shape[0] - 1)
    return criterion(window.flatten(0, 1), None).view(index.shape).to(index.device)  # [B, w]


def check_criteria(criteria: StoppingCriteriaList) -> None:
    """Refuse, before any model work, criteria that no speculative call can give what they read."""
    for criterion in criteria:
        if type(criterion).__name__ == "ConfidenceCriteria":
            raise NotImplementedError(
                "ConfidenceCriteria reads the scores of an assistant model's own draft loop (transformers builds it "
                "for assistant_confidence_threshold); criteria get scores=None here, as in plain generate without "
                "output_scores. Drop it from stopping_criteria, or use SpecDecoder(draft_confidence_threshold=...)."
            )
