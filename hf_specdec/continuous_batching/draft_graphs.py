"""The draft's forwards in continuous batching, padded to a few shapes and replayed as CUDA graphs.

An eager forward of a small draft over a ragged batch is bound by the host: on an H100 a 4-layer draft forward took
6.4 ms at 16 requests, a sixth of the 32-layer target's verify, and a step runs up to k of them. Transformers' own
continuous batching captures its forwards the same way (`ContinuousBatchingIOs` with `use_padding=True`): the
query is padded to a multiple of `q_padding_interval_size`, the padded query tokens write to the cache's trash
slot and the attention mask hides the padded keys, so one graph serves every batch of its padded shape; the graph
key is transformers' own (`graph_key`). The KV read is padded by at most a quarter (`kv_bucket`), not to
transformers' 16k-token interval: an SDPA draft attends to every padded key, and with that interval the captured
forwards at 16 requests were as slow as eager ones (6.7 ms on an H100, most of it attention over padding).

A key's first forward runs eagerly (it also warms up what the first forward of a shape sets up); its second is
captured, then every later one replays. Forwards wider than `MAX_CAPTURED_TOKENS` (a long prompt's catch-up, the
catch-ups of many requests) stay eager. At most `MAX_GRAPHS` graphs are kept, the least recently replayed one
dropped for a new one (each keeps its activations and logits in its own memory pool, outside the paged cache's
budget). A capture that CUDA refuses turns capturing off for the proposer, with one warning.

Exactness does not depend on the graphs: drafts are proposals the target verifies, so a draft model that changed
since its graphs were captured would cost acceptance, not correct tokens. The graphs are still dropped when the
draft's fingerprint (`model_guard`) changes between generation loops, so that a changed draft drafts as itself.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from hf_specdec import model_guard, step_graph
from hf_specdec.continuous_batching.compat import (
    ContinuousBatchingIOs,
    graph_key,
    pad_max_lengths_for_graphs,
    pad_to_interval,
)
from hf_specdec.locks import CAPTURE_LOCK

#: The widest padded query a draft forward is captured at: the one-token forwards of up to 256 requests and the
#: catch-ups after a verify (k + 1 tokens a request) of ~50.
MAX_CAPTURED_TOKENS = 256
#: The most graphs kept per proposer.
MAX_GRAPHS = 24
#: The smallest step between padded KV sizes.
MIN_KV_STEP = 256


def kv_bucket(max_kv: int, limit: int) -> int:
    """`max_kv` padded up to a multiple of a quarter of its power of two (at least `MIN_KV_STEP`), at most `limit`."""
    if max_kv <= 0:
        return 0
    step = max(MIN_KV_STEP, 1 << max(0, max_kv.bit_length() - 3))
    return min(-(-max_kv // step) * step, limit)


class DraftGraphs:
    """Captured forwards of one drafter over its `ContinuousBatchingIOs` (one per `DraftModelCBProposer`)."""

    def __init__(
        self,
        ios: ContinuousBatchingIOs,
        q_interval: int,
        max_batch_tokens: int,
        max_tokens_read: int,
        model: torch.nn.Module,
    ) -> None:
        self.ios = ios
        self.q_interval = q_interval
        self.max_batch_tokens = max_batch_tokens
        self.max_tokens_read = max_tokens_read
        self.model = model
        self.enabled = True
        self.graphs: OrderedDict[Hashable, tuple[object, torch.Tensor]] = OrderedDict()  # key -> (graph, output [S, V])
        self.seen: set[Hashable] = set()  # keys run eagerly once
        self.replays = 0
        self._fingerprint = model_guard.fingerprint([model])
        pad_max_lengths_for_graphs(ios)

    @classmethod
    def for_device(cls, device: torch.device, **kwargs: object) -> DraftGraphs | None:
        """Graphs where the project captures steps (`step_graph.GRAPHS.device_type`: CUDA, or the CPU emulation)."""
        return cls(**kwargs) if torch.device(device).type == step_graph.GRAPHS.device_type else None

    def padded(self, num_q: int, max_kv: int) -> tuple[int, int] | None:
        """The padded (query, KV read) sizes of a forward, or None where it runs eagerly."""
        if not self.enabled:
            return None
        q = pad_to_interval(num_q, self.q_interval, self.max_batch_tokens)
        if q > MAX_CAPTURED_TOKENS:
            return None
        return q, kv_bucket(max_kv, self.max_tokens_read)

    def run(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:  # [S, V], valid until the next forward
        """`forward` over the padded inputs `ios` holds now: replayed, captured, or eager (see the module's doc)."""
        key = graph_key(self.ios)
        kept = self.graphs.get(key)
        if kept is not None:
            self.graphs.move_to_end(key)
            kept[0].replay()
            self.replays += 1
            return kept[1]
        if key not in self.seen:
            self.seen.add(key)
            return forward()
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        graph = step_graph.GRAPHS.new()
        try:
            with CAPTURE_LOCK, step_graph.no_garbage_collection(), step_graph.GRAPHS.capture(graph):
                output = forward()
        except Exception as error:  # noqa: BLE001 - whatever CUDA graphs refuse: this drafter runs eagerly
            self.enabled = False
            warnings.warn(
                f"The draft's forwards in continuous batching run eagerly: capturing one failed ({type(error).__name__}: "
                f"{error}). Outputs are the same; drafting is slower.",
                stacklevel=2,
            )
            return forward()
        self.graphs[key] = (graph, output)
        graph.replay()  # a capture computes nothing
        self.replays += 1
        return output

    def check_model(self) -> None:
        """Drop the graphs if the draft changed since they were captured (a new generation loop starts)."""
        now = model_guard.fingerprint([self.model])
        if now.difference(self._fingerprint, [self.model]) is not None:
            self.graphs.clear()
            self.seen.clear()
        self._fingerprint = now
