"""Scores, draws and the rejection sampler for a continuous batch: one row per verified position.

transformers' CB samples one token per request from `logits_indices` (one row each). A verify needs the target's
scores at all k + 1 positions of a request, processed with that request's own processor arguments (temperature,
top-k, top-p: `ContinuousBatchingLogitsProcessorList`), then the project's rejection sampler
(`hf_specdec.sampling.rejection`) with counter-based draws keyed by (request seed, request step): a request's draws
never depend on which other requests share its batches.

Only processors that read nothing but the scores are allowed while speculating (a processor reading the token
history, e.g. a repetition penalty, would see CB's one-token `input_ids`): `check_processors` refuses the others
before any model work.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_specdec.continuous_batching.compat import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
    FutureRequestState,
    RequestState,
)
from hf_specdec.sampling.random import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, exponential, uniform
from hf_specdec.sampling.rejection import rejection_sample

#: Processors that read the scores only (no token history), so each verified position can be processed alone.
SCORE_ONLY_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def check_processors(processors: ContinuousBatchingLogitsProcessorList) -> None:
    """Refuse logits processors that read the token history: CB hands them one token per request, not a prefix."""
    for processor in processors.logits_processor:
        if isinstance(processor, (ContinuousBatchingLogitsProcessor, *SCORE_ONLY_PROCESSORS)):
            continue
        raise ValueError(
            f"Speculative continuous batching cannot apply the logits processor {type(processor).__name__}: it reads "
            "the token history, which continuous batching does not pass per verified position. Drop the generation "
            "option that creates it (e.g. repetition_penalty, no_repeat_ngram_size, min_new_tokens) or decode "
            "without spec_decoder."
        )


def request_seed(base_seed: int, request_id: str) -> int:
    """A request's seed: the manager's base seed mixed with a hash of the request id (stable across runs)."""
    return (base_seed + zlib.crc32(request_id.encode()) * 0x9E3779B1) % (2**63)


@dataclass
class RowSampler:
    """How a step turns scores into tokens: the processors, greedy or not, and the per-request seeds."""

    processors: ContinuousBatchingLogitsProcessorList
    do_sample: bool
    base_seed: int

    def request_args(self, states: list[RequestState], device: torch.device) -> torch.Tensor:
        """The processors' per-request arguments, one column per state: `[tensors_required, R]` int32."""
        args = torch.empty((self.processors.tensors_required, max(1, len(states))), dtype=torch.int32, device=device)
        if self.processors.tensors_required:
            futures = [FutureRequestState(s, True, {}, 1) for s in states]
            self.processors.fill_defaults(args)
            self.processors.prepare_tensor_args(futures, args)
        return args

    def scores(
        self,
        logits: torch.Tensor,  # [N, V]
        input_ids: torch.Tensor,  # [N] the token at each scored position
        args: torch.Tensor,  # [tensors_required, N] one column per row
    ) -> torch.Tensor:  # [N, V] float32
        logits = logits.float()
        if not self.processors.do_processing:
            return logits
        return self.processors(input_ids, logits, args)

    def seeds(self, states: list[RequestState], device: torch.device) -> torch.Tensor:  # [R] int64
        return torch.tensor(
            [request_seed(self.base_seed, s.request_id) for s in states], dtype=torch.long, device=device
        )

    def draft_tokens(
        self,
        scores: torch.Tensor,  # [R, V] processed draft scores
        states: list[RequestState],
        position: int,  # draft position j (0-based) in this step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [R] int64, [R, V] float32 or None
        """Greedy: the argmax (one-hot drafts). Sampling: a draw from softmax(scores) and that distribution."""
        if not self.do_sample:
            return scores.argmax(dim=-1), None
        probs = torch.softmax(scores, dim=-1)  # [R, V]
        steps = torch.tensor([s.generated_len() for s in states], dtype=torch.long, device=scores.device)
        draws = torch.stack(
            [
                exponential(seed[None], step, STREAM_DRAFT + position, scores.shape[-1])[0]
                for seed, step in zip(self.seeds(states, scores.device), steps)
            ]
        )  # [R, V]
        return (probs / draws).argmax(dim=-1), probs

    def verify(
        self,
        target_scores: torch.Tensor,  # [B, k+1, V] processed
        draft_token_ids: torch.Tensor,  # [B, k]
        num_draft_tokens: torch.Tensor,  # [B]
        draft_probs: torch.Tensor | None,  # [B, k, V]
        states: list[RequestState],
    ) -> list[list[int]]:
        """Accepted drafts then one recovered or bonus token, per request (the rejection sampler's contract)."""
        batch, width, vocab = target_scores.shape
        device = target_scores.device
        is_greedy = torch.full((batch,), not self.do_sample, dtype=torch.bool, device=device)
        if self.do_sample:
            seeds = self.seeds(states, device)
            uniforms = torch.cat(
                [uniform(seed[None], s.generated_len(), STREAM_ACCEPT, width - 1) for seed, s in zip(seeds, states)]
            )  # [B, k]
            exponentials = torch.cat(
                [exponential(seed[None], s.generated_len(), STREAM_RESIDUAL, vocab) for seed, s in zip(seeds, states)]
            )  # [B, V]
        else:
            uniforms = torch.zeros((batch, width - 1), dtype=torch.float32, device=device)
            exponentials = torch.ones((batch, vocab), dtype=torch.float32, device=device)
        out = rejection_sample(
            target_scores,
            draft_token_ids,
            num_draft_tokens,
            draft_probs,
            is_greedy,
            uniforms,
            exponentials,
            check_values=False,
            all_greedy=not self.do_sample,
        )  # [B, k+1]
        return [[t for t in row if t >= 0] for row in out.tolist()]
