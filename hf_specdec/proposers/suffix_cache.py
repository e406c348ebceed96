"""The global suffix tree of suffix decoding: earlier outputs, kept by a `SpecDecoder` across calls and threads.

`SuffixCache` holds one `SuffixTree` over the outputs of finished rows (each with the last `max_depth` tokens of
its prompt in front, so that a later answer's first tokens can match), in insertion order. It is bounded: past
`max_requests` outputs or `max_tokens` tokens the oldest are taken out again (exactly: the tree then equals one
built from the outputs kept). Every read and write holds its lock, so calls in several threads may share one
`SpecDecoder`. `cache_for(spec)` returns the cache a `SpecDecoder` keeps (made on first use, remade when its
suffix settings change).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from hf_specdec.proposers.suffix_tree import SuffixTree

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["SuffixCache", "cache_for"]


class SuffixCache:
    """
    The global tree over earlier outputs, bounded in outputs and tokens (oldest out first), safe under threads.

    Args:
        max_depth (`int`): The trees' depth D (`SpecDecoder.suffix_max_tree_depth`).
        max_requests (`int`): Outputs kept (`suffix_max_cached_requests`); 0 keeps none (the global tree is off).
        max_tokens (`int`): Tokens kept over all outputs (`suffix_max_cached_tokens`): the memory bound. The tree
            holds at most D nodes per token (about 50 bytes each); real text shares many of them.
    """

    not_step_state = True  # shared by every call of a SpecDecoder (`step_graph.state_owners` skips it)

    def __init__(self, max_depth: int, max_requests: int, max_tokens: int) -> None:
        self.max_depth = int(max_depth)
        self.max_requests = int(max_requests)
        self.max_tokens = int(max_tokens)
        self.lock = threading.Lock()
        self.tree = SuffixTree(self.max_depth)
        self.outputs: deque[np.ndarray] = deque()  # [n] int64 each, oldest first
        self.num_tokens = 0
        self.num_evicted = 0  # outputs taken out so far

    @property
    def enabled(self) -> bool:
        return self.max_requests > 0 and self.max_tokens > 0

    @property
    def num_requests(self) -> int:
        return len(self.outputs)

    def add(self, tokens: np.ndarray) -> None:
        """Keep one finished output (`tokens` [n] int64, prompt tail included), taking out the oldest past the bounds."""
        if not self.enabled or len(tokens) == 0:
            return
        tokens = np.ascontiguousarray(tokens[-self.max_tokens :], np.int64)  # one output never exceeds the bound
        with self.lock:
            self.tree.add(tokens)
            self.outputs.append(tokens)
            self.num_tokens += len(tokens)
            while len(self.outputs) > self.max_requests or self.num_tokens > self.max_tokens:
                oldest = self.outputs.popleft()
                self.tree.remove(oldest)
                self.num_tokens -= len(oldest)
                self.num_evicted += 1

    def clear(self) -> None:
        """Forget every output."""
        with self.lock:
            self.tree = SuffixTree(self.max_depth)
            self.outputs.clear()
            self.num_tokens = 0

    def settings(self) -> tuple[int, int, int]:
        return self.max_depth, self.max_requests, self.max_tokens

    def __repr__(self) -> str:
        return (
            f"SuffixCache(outputs={self.num_requests}, tokens={self.num_tokens}, nodes={self.tree.num_nodes}, "
            f"bytes={self.tree.nbytes}, max_depth={self.max_depth}, max_requests={self.max_requests}, "
            f"max_tokens={self.max_tokens})"
        )


_CREATE_LOCK = threading.Lock()


def cache_for(spec: SpecDecoder) -> SuffixCache:
    """The global tree `spec` keeps across calls (`spec.suffix_cache`), made on first use and made anew (empty)
    when its depth or bounds were changed since."""
    settings = (spec.suffix_max_tree_depth, spec.suffix_max_cached_requests, spec.suffix_max_cached_tokens)
    with _CREATE_LOCK:
        cache = spec.suffix_cache
        if cache is None or cache.settings() != settings:
            cache = spec.suffix_cache = SuffixCache(*settings)
    return cache
