"""HF logits processors applied to every verified (or drafted) position with that position's prefix.

`generate` prepares a `LogitsProcessorList` for one token per row. Speculation scores k+1 positions
per row at once, and rows have different lengths, so each position (i, j) must see exactly the
`input_ids` plain decoding would have had there: row i's buffer up to its own prefix length.
Processors that never read `input_ids` (temperature, top-k, top-p, min-p, ...) run once on all
positions; the others run once per distinct prefix length, on the rows that share it.
`StepSampling` carries the processors, greedy/sampling, and the per-row seeds for one call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from hf_specdec.sampling import random as row_random

#: Processors whose output depends on the scores only, never on input_ids: safe to batch over positions.
PREFIX_FREE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
)

#: Processors that depend on the row's index in the batch or run models of their own.
UNSUPPORTED_PROCESSORS = (PrefixConstrainedLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor)


def check_processors(processors: LogitsProcessorList) -> None:
    """Raise for processors that cannot be applied per position of a ragged batch."""
    for processor in processors:
        if isinstance(processor, UNSUPPORTED_PROCESSORS):
            raise NotImplementedError(
                f"{type(processor).__name__} is not supported by hf_specdec (it depends on the row's batch index or "
                "runs a model of its own): generate without speculation for this call."
            )


@dataclass
class StepSampling:
    """Everything that turns logits into tokens for one `generate` call: processors, mode, seeds."""

    processors: LogitsProcessorList
    do_sample: bool
    seeds: torch.Tensor  # [B] int64, one per row of the current batch
    step: int = 0

    def __post_init__(self) -> None:
        check_processors(self.processors)
        self.prefix_free = all(isinstance(p, PREFIX_FREE_PROCESSORS) for p in self.processors)
        self.row_ids = torch.arange(self.seeds.shape[0], device=self.seeds.device)  # [B] caller's row of each row
        # Only processors with per-row state need a copy sliced to the rows they score (see `processors_for_rows`).
        self.has_row_state = any(_has_row_state(p) for p in self.processors)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.seeds = self.seeds[keep]
        self.row_ids = self.row_ids[keep.to(self.row_ids.device)]

    def process(
        self,
        token_ids: torch.Tensor,  # [B, C] buffer; position (i, j) sees token_ids[i, :prefix_lengths[i, j]]
        prefix_lengths: torch.Tensor,  # [B, w]
        valid: torch.Tensor,  # [B, w] bool: positions whose scores are needed
        logits: torch.Tensor,  # [B, w, V] float32
    ) -> torch.Tensor:  # [B, w, V] processed scores (garbage where not valid)
        """Apply the processors to every valid position with its own prefix."""
        if len(self.processors) == 0:
            return logits
        batch_size, width, vocab = logits.shape
        if self.prefix_free:
            flat = logits.reshape(batch_size * width, vocab)
            dummy_ids = token_ids[:1, :1].expand(flat.shape[0], 1)  # [B*w, 1], never read
            return self.processors(dummy_ids, flat).reshape(batch_size, width, vocab)
        scores = logits.clone()
        lengths = torch.where(valid, prefix_lengths, -1)
        for length in torch.unique(lengths[valid]).tolist():
            rows, cols = (lengths == length).nonzero(as_tuple=True)
            processors = self.processors
            if self.has_row_state:
                processors = processors_for_rows(processors, self.row_ids[rows.to(self.row_ids.device)])
            scores[rows, cols] = processors(token_ids[rows, :length], logits[rows, cols])
        return scores

    def draw_uniforms(self, num: int) -> torch.Tensor:  # [B, num]
        return row_random.uniform(self.seeds, self.step, row_random.STREAM_ACCEPT, num)

    def draw_exponentials(self, stream: int, num: int) -> torch.Tensor:  # [B, num]
        return row_random.exponential(self.seeds, self.step, stream, num)


def processors_for_rows(processors: LogitsProcessorList, row_ids: torch.Tensor) -> LogitsProcessorList:
    """`processors` for a subset of the caller's rows (`row_ids` [n]): per-row state is sliced to those rows.

    `generate` gives `RepetitionPenaltyLogitsProcessor` a per-row `prompt_ignore_length` [B_total] (the left
    padding); called on n rows it needs those rows' entries.
    """
    sliced = []
    for processor in processors:
        if _has_row_state(processor):
            ignore = processor.prompt_ignore_length
            processor = copy.copy(processor)
            processor.prompt_ignore_length = ignore[row_ids.to(ignore.device)]
        sliced.append(processor)
    return LogitsProcessorList(sliced)


def _has_row_state(processor: object) -> bool:
    """Whether `processor` holds one entry per caller row (today: repetition penalty's prompt_ignore_length)."""
    ignore = getattr(processor, "prompt_ignore_length", None)
    return isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor)
