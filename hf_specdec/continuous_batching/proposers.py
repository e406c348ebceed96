"""Proposers for continuous batching: prompt lookup over each request's own tokens, and the interface they share.

A CB proposer works on transformers' `RequestState`s (token lists on the host, one per request, arriving and leaving
at any step) rather than on the padded tensors of `generate`. The draft model, which keeps its own paged KV cache,
lives in `draft_model.py`; the target's MTP layers, on the same machinery, in `mtp.py`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from hf_specdec.continuous_batching.compat import FutureRequestState, RequestState
from hf_specdec.continuous_batching.sampling import RowSampler
from hf_specdec.proposers.ngram_search import ngram_search


@dataclass
class Drafts:
    """One request's drafts for one step."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [n, V] float32 draft distributions, None for one-hot drafts


def sequence(state: RequestState) -> list[int]:
    """Every token of the request so far: prompt, then generated (the last one not yet in the target's KV)."""
    return state.initial_tokens + state.generated_tokens


class CBProposer(ABC):
    """Drafts for the decoding requests of one continuous-batching step."""

    #: True when drafts come with their distributions (a sampled draft model), needed for exact sampling.
    returns_probs: bool = False

    @abstractmethod
    def propose(self, states: list[RequestState], max_drafts: list[int], sampler: RowSampler) -> list[Drafts]:
        """Up to `max_drafts[i]` drafts for `states[i]` (0: none)."""

    @contextlib.contextmanager
    def watching(self, futures: list[FutureRequestState]) -> Iterator[None]:
        """Around the target's forward over `futures` (a drafter that reads the target's states keeps them here)."""
        yield

    def commit(self, state: RequestState, num_accepted: int) -> None:  # noqa: B027
        """`state`'s verify kept `num_accepted` of the drafts proposed for it (its tokens are already appended)."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """The request left (finished, failed, cancelled): free what the proposer kept for it."""

    def reset(self) -> None:  # noqa: B027
        """A new generation loop starts: forget every request."""


class NgramCBProposer(CBProposer):
    """Prompt lookup: the continuation of the most recent earlier match of the request's last n tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, states: list[RequestState], max_drafts: list[int], sampler: RowSampler) -> list[Drafts]:
        if not states or max(max_drafts, default=0) == 0:
            return [Drafts([]) for _ in states]
        rows = [sequence(s) for s in states]
        width = max(len(r) for r in rows)
        buffer = np.zeros((len(rows), width), dtype=np.int64)  # [B, L] right-padded
        for i, row in enumerate(rows):
            buffer[i, : len(row)] = row
        ends = np.array([len(r) for r in rows], dtype=np.int64)  # [B]
        k = max(max_drafts)
        drafts, counts, _ = ngram_search(
            buffer, np.zeros_like(ends), ends, np.array(max_drafts, dtype=np.int64), self.min_n, self.max_n, k
        )
        return [Drafts(drafts[i, : counts[i]].tolist()) for i in range(len(rows))]
