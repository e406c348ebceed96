"""HF logits processors applied to every verified (or drafted) position with that position's prefix.

`generate` prepares a `LogitsProcessorList` for one token per row. Speculation scores k+1 positions
per row at once, and rows have different lengths, so each position (i, j) must see exactly the
`input_ids` plain decoding would have had there: row i's buffer up to its own prefix length.
This vectorised path is only for the processors on an explicit allow-list (`PURE_PROCESSORS`: stateless,
each position a pure function of its own prefix and scores). Those that never read `input_ids`
(temperature, top-k, top-p, min-p, ...) run once on all positions, and so do those with a device form
(`prefix_processors.py`: repetition penalty, no-repeat n-gram, bad words, minimum lengths, forced tokens, sequence
bias, the exponential length penalty): every allow-listed processor has one today. One without would run once per
distinct prefix length, which reads the lengths on the host (`per_prefix`). Any other processor makes the call take
the exact path (`hf_specdec.exact`).
`StepSampling` carries the processors, greedy/sampling, and the per-row seeds for one call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.generation import logits_process as lp
from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.prefix_processors import DeviceForm, device_form


def _classes(*names: str) -> frozenset[type]:
    """The named classes of `transformers.generation.logits_process` that this transformers version has."""
    return frozenset(getattr(lp, name) for name in names if hasattr(lp, name))


#: Processors whose output depends on the scores only, never on input_ids: safe to batch over positions.
PREFIX_FREE_PROCESSORS = _classes(
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TopHLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
    "SuppressTokensLogitsProcessor",
)

#: The allow-list of the vectorised path: each read in transformers' source to keep no state across calls (or only
#: a lazily built constant) and to give row i the same output whatever the other rows are, so scoring any set of
#: (row, prefix) pairs at once equals plain decoding's calls. Matched by exact type: a subclass may add state.
PURE_PROCESSORS = PREFIX_FREE_PROCESSORS | _classes(
    "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    "SuppressTokensAtBeginLogitsProcessor",
)

#: Processors refused before any model work: each runs a model with a cache of its own on every call.
UNSUPPORTED_PROCESSORS = _classes("UnbatchedClassifierFreeGuidanceLogitsProcessor")


def check_processors(processors: LogitsProcessorList) -> None:
    """Raise for processors that the exact path cannot reproduce either."""
    for processor in processors:
        if type(processor) in UNSUPPORTED_PROCESSORS:
            raise NotImplementedError(
                f"{type(processor).__name__} is not supported by hf_specdec (it runs a model with a cache of its own "
                "on every call, which speculation cannot replay): generate without speculation for this call."
            )


def is_pure(processor: object) -> bool:
    """Whether `processor` is on the vectorised path's allow-list (`PURE_PROCESSORS`)."""
    return type(processor) in PURE_PROCESSORS


@dataclass
class StepSampling:
    """Everything that turns logits into tokens for one `generate` call: processors, mode, seeds."""

    processors: LogitsProcessorList
    do_sample: bool
    seeds: torch.Tensor  # [B] int64, one per row of the current batch
    #: the step of every draw: a 0-d int64 device counter (`advance` moves it inside the step's device work, so a
    #: captured CUDA graph replays the draws of each step, not those of the step it was captured at)
    step: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_processors(self.processors)
        # Processors off the allow-list make the loop score target positions on the exact path (hf_specdec.exact);
        # `process` (the drafts' q, and the fast path) then applies only the allow-listed ones: any q is exact.
        self.exact = not all(is_pure(p) for p in self.processors)
        self.pure = LogitsProcessorList([p for p in self.processors if is_pure(p)])
        self.row_ids = torch.arange(self.seeds.shape[0], device=self.seeds.device)  # [B] caller's row of each row
        #: each allow-listed processor's device form (None: prefix-free, or none exists)
        self.forms: list[DeviceForm | None] = [
            None if type(p) in PREFIX_FREE_PROCESSORS else device_form(p, self.row_ids) for p in self.pure
        ]
        #: the processors without either form: they run once per distinct prefix length, read on the host
        self.per_prefix = [
            p for p, f in zip(self.pure, self.forms) if f is None and type(p) not in PREFIX_FREE_PROCESSORS
        ]
        if self.step is None:
            self.step = torch.zeros((), dtype=torch.int64, device=self.seeds.device)  # []
        # Only processors with per-row state need a copy sliced to the rows they score (see `processors_for_rows`).
        self.has_row_state = any(_has_row_state(p) for p in self.processors)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.seeds = self.seeds[keep]
        self.row_ids = self.row_ids[keep.to(self.row_ids.device)]
        for form in self.forms:
            if form is not None:
                form.select_rows(keep.to(self.row_ids.device))

    def process(
        self,
        token_ids: torch.Tensor,  # [B, C] buffer; position (i, j) sees token_ids[i, :prefix_lengths[i, j]]
        prefix_lengths: torch.Tensor,  # [B, w]
        valid: torch.Tensor,  # [B, w] bool: positions whose scores are needed
        logits: torch.Tensor,  # [B, w, V] float32
    ) -> torch.Tensor:  # [B, w, V] processed scores (garbage where not valid)
        """Apply the allow-listed processors to every valid position with its own prefix (all of them unless exact)."""
        if len(self.pure) == 0:
            return logits
        batch_size, width, vocab = logits.shape
        if not self.per_prefix:  # all positions at once, no host read (a captured step holds this)
            dummy_ids = token_ids[:1, :1].expand(batch_size * width, 1)  # [B*w, 1], never read
            scores = logits  # [B, w, V]
            for processor, form in zip(self.pure, self.forms):
                if form is not None:
                    scores = form(token_ids, prefix_lengths, scores)
                else:
                    flat = processor(dummy_ids, scores.reshape(batch_size * width, vocab))  # [B*w, V]
                    scores = flat.reshape(batch_size, width, vocab)
            return scores
        scores = logits.clone()
        lengths = torch.where(valid, prefix_lengths, -1)
        for length in torch.unique(lengths[valid]).tolist():
            rows, cols = (lengths == length).nonzero(as_tuple=True)
            processors = self.pure
            if self.has_row_state:
                processors = processors_for_rows(processors, self.row_ids[rows.to(self.row_ids.device)])
            scores[rows, cols] = processors(token_ids[rows, :length], logits[rows, cols])
        return scores

    def advance(self) -> None:
        """The step's draws are taken: the next step draws anew (in place, device work only)."""
        self.step.add_(1)

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
