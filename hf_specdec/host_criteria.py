"""Stopping criteria only the host can answer (`max_time`, your own), called exactly as plain `generate` calls them.

Plain `generate` calls its criteria after every token on the caller's whole batch: `input_ids [B, L]` for L = prompt
width + 1, + 2, ... while any row is unfinished (finished rows padded when there is an EOS criterion). Speculative rows
run ahead of one another, so the call at length L is made once every row that can still change holds L tokens: after
each step's one host read the loop says what the rows hold (`observe`), and `advance` makes every call that became
possible, in order, each on plain's batch, and reports where rows stopped. The loop then drops what a stopped row
generated past its stop (with EOS) or keeps it as plain does (without). No call sees a token plain would not show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList

if TYPE_CHECKING:
    from hf_specdec.batch import RaggedBatch
    from hf_specdec.continuation import CacheHandoff


class LoopRows(Protocol):
    """What the host criteria read and end of the loop (`SpeculativeLoop` has it); a protocol, so that this module
    does not import the loop that uses it."""

    batch: RaggedBatch  # the rows in the batch (on static caches frozen rows stay in it)
    sequences: torch.Tensor  # [B_total, max_length] rows as they were when they ended
    final_lengths: torch.Tensor  # [B_total] each row's output length
    frozen_rows: set[int]  # batch indices of the rows a static batch froze
    max_length: int
    handoff: CacheHandoff | None  # the cache handed back to the caller (dynamic cache), or None
    score_buffer: torch.Tensor | None  # [B_total, T, V] output scores, or None
    logit_buffer: torch.Tensor | None


class HostStop(NamedTuple):
    """A row that the host criteria finished: the caller's `row`, at `length` tokens (its output ends there when the
    call has an EOS criterion); `live` when the loop had not ended the row yet (it must end it now)."""

    row: int
    length: int
    live: bool


class HostCriteria:
    """The call's host-side criteria and the state of their calls: which length was called last, where rows ended."""

    #: host bookkeeping that no captured step reads (`step_graph.state_owners` and `graph_reuse` skip it)
    not_step_state = True

    def __init__(
        self,
        criteria: StoppingCriteriaList,
        *,
        rows: int,  # the caller's batch size (num_return_sequences included)
        prompt_width: int,
        max_length: int,
        has_eos: bool,
        pad_token_id: int | None,
    ) -> None:
        # `max_time` answers from the clock alone, the same for every row: read on the host, no tensor made.
        self.clocks = [c for c in criteria if type(c) is MaxTimeCriteria]
        self.criteria = StoppingCriteriaList([c for c in criteria if type(c) is not MaxTimeCriteria])
        self.max_length = max_length
        self.has_eos = has_eos
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0
        self.called = prompt_width  # the width of the latest call's input_ids (none yet: the prompt's)
        self.known = [prompt_width] * rows  # tokens each caller row holds (the loop's lengths at its latest read)
        #: the length at which each row finished (its EOS, stop string, max length or a host criterion), None: not yet
        self.ends: list[int | None] = [None] * rows
        self.finished = False  # every row finished: plain decoding's loop ended after the latest call
        self.final_width: int | None = None  # that call's width: the output's width without EOS
        self._ends_on_device: torch.Tensor | None = None  # [B_total] for padding finished rows (EOS)

    def observe(self, row_ids: list[int], lengths: list[int], ends: list[int | None]) -> None:
        """What the loop's rows hold after a step: tokens (`lengths`), and where the device rules (EOS, stop strings,
        max length) finished them (None: not yet)."""
        for row, length, end in zip(row_ids, lengths, ends):
            self.known[row] = length
            if length >= self.max_length:
                end = self.max_length if end is None else min(end, self.max_length)
            self._end(row, end)

    def _end(self, row: int, end: int | None) -> None:
        if end is not None and (self.ends[row] is None or end < self.ends[row]):
            self.ends[row] = end
            self._ends_on_device = None

    def horizon(self) -> int:
        """The longest input every call can be made with now: rows finished under an EOS criterion show their tokens
        then padding, any other row only the tokens it holds."""
        open_rows = [k for k, e in zip(self.known, self.ends) if not (self.has_eos and e is not None)]
        return min([self.max_length, *open_rows])

    def settle(
        self, loop: LoopRows, row_ids: list[int], lengths: list[int], stops: list[int], ending: dict[int, int]
    ) -> dict[int, int]:
        """After a step's host read of the batch rows' caller ids, lengths and first stops (`StopRules.stop_lengths`,
        0: none): make the calls that became possible. Returns `ending` (batch index -> final length of the rows the
        device rules ended now) with the rows the criteria end added or cut short; rows that had ended already and
        are stopped earlier keep only their tokens up to the stop (`final_lengths`, the handed-back cache)."""
        if self.has_eos:  # a row's output ends where the device rules finished it
            self.observe(row_ids, lengths, [lengths[i] if i in ending else None for i in range(len(row_ids))])
        else:  # rows go on after their first stop: it is the one the criteria must know
            self.observe(row_ids, lengths, [s if s > 0 else None for s in stops])
        batch_index = {row: i for i, row in enumerate(row_ids)}
        for stop in self.advance(lambda width: caller_rows(loop, width)):
            if not self.has_eos:
                continue  # without EOS rows keep generating after their stop, as in plain generate
            i = batch_index.get(stop.row)
            if stop.live or i in ending:
                ending[i] = stop.length
            else:  # ended earlier (frozen, or left the batch): it keeps only its tokens up to this stop
                loop.final_lengths[stop.row] = stop.length
                if loop.handoff is not None:
                    loop.handoff.cut(stop.row, stop.length)
            for buffer in (loop.score_buffer, loop.logit_buffer):  # scores after the end: a finished row's (zero)
                if buffer is not None:
                    buffer[stop.row, stop.length - loop.batch.prompt_width :] = 0
        if self.finished:  # plain decoding's loop ends here: every row is done (without EOS, at its final width)
            width = loop.max_length if self.has_eos else self.final_width
            ending = {i: min(ending.get(i, lengths[i]), width) for i in range(len(row_ids))
                      if i in ending or i not in loop.frozen_rows}  # fmt: skip
        return ending

    def advance(self, caller_rows: Callable[[int], torch.Tensor]) -> list[HostStop]:
        """Make every call whose input is known, in order; `caller_rows(width)` gives the caller's rows `[B, width]`
        as they are now. Returns the rows that the criteria finished (earlier than any device rule did)."""
        stops: list[HostStop] = []
        width = self.horizon()
        if self.finished or width <= self.called:
            return stops
        rows = caller_rows(width) if len(self.criteria) else None  # [B_total, width]; max_time alone reads none
        for length in range(self.called + 1, width + 1):
            answers = self._answers(rows, length)
            self.called = length
            for row, done in enumerate(answers):
                end = self.ends[row]
                if done and (end is None or end > length):  # unfinished before this call (plain ORs it in)
                    stops.append(HostStop(row, length, live=end is None))
                    self._end(row, length)
            if all(end is not None and end <= length for end in self.ends):
                self.finished, self.final_width = True, length
                break
        return stops

    def _answers(self, rows: torch.Tensor | None, length: int) -> list[bool]:  # rows [B_total, >= length]
        """The criteria's answer for every caller row at input width `length`."""
        answers = [False] * len(self.ends)
        if rows is not None:  # called even when the clock already says stop: plain calls every criterion
            input_ids = self._input_ids(rows, length)  # [B_total, length], a fresh tensor, as plain's is each step
            # The criteria's own answer, read once per call (as plain reads `unfinished_sequences` once per token);
            # the step's device work was read just before, so this waits for nothing but the criteria's own work.
            answers = self.criteria(input_ids, None).tolist()
        if any(time.time() - c.initial_timestamp > c.max_time for c in self.clocks):
            answers = [True] * len(self.ends)
        return answers

    def _input_ids(self, rows: torch.Tensor, length: int) -> torch.Tensor:  # [B_total, length]
        if not self.has_eos:
            return rows[:, :length].clone()
        if self._ends_on_device is None:
            ends = [self.max_length + 1 if e is None else e for e in self.ends]
            self._ends_on_device = torch.tensor(ends, device=rows.device)  # [B_total]
        columns = torch.arange(length, device=rows.device)  # [L]
        return torch.where(columns < self._ends_on_device[:, None], rows[:, :length], self.pad_token_id)


def caller_rows(loop: LoopRows, width: int) -> torch.Tensor:  # [B_total, width]
    """The caller's rows as they are now: those in the batch from its buffer, the others as they left it."""
    rows = loop.sequences[:, :width].clone()
    rows[loop.batch.row_ids] = loop.batch.token_ids[:, :width]
    return rows
