"""Compiled plain `generate`, the speed-minded user's baseline, as a process that runs nothing else gets it.

`generate(cache_implementation="static")` builds a new `StaticCache` every call (transformers 5.24,
`_prepare_static_cache`), and torch's CUDA graph trees record the compiled forward with that cache's tensors as static
inputs (their addresses are baked in). In a process that runs only compiled plain, each call's cache lands where the
last call's freed one was, and the recorded graphs replay. A benchmark that interleaves other GPU work between its
calls (hf_specdec's calls, their kept graphs) moves the allocator: the new cache gets other addresses, and torch
re-records ("static input data pointer changed", which counts toward no re-record limit). Measured on an H200: at
B = 64, 6.2-6.8 s a call interleaved after other shapes, against 1.1-1.2 s when the same group ran first in its
process; 1 764 re-recordings over two groups. Ratios against that baseline flatter us.

So the benchmarks give compiled plain a `StaticCache` of its own per shape, reset before each call: the same compiled
forward, the same graphs, at the addresses a process running only compiled plain would keep. `flag_call` is the
plain `cache_implementation="static"` call, for comparing the two.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache

from hf_specdec import compat


class CompiledPlain:
    """`model.generate` with a static cache kept per (batch, length), so transformers compiles and torch's CUDA graphs
    replay at fixed addresses. Call it like `generate`: `CompiledPlain(model)(**inputs, max_new_tokens=64)`."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.caches: dict[tuple[int, int], StaticCache] = {}

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        ids = kwargs["input_ids"]  # [B, P]
        key = (ids.shape[0], ids.shape[1] + kwargs["max_new_tokens"])
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = StaticCache(config=self.model.config, max_cache_len=key[1])
        cache.reset()  # zeroes in place: the addresses stay
        return self.model.generate(**kwargs, **{compat.CACHE_ARGUMENT: cache})


def flag_call(model: PreTrainedModel, **kwargs: Any) -> torch.Tensor:
    """Compiled plain as `cache_implementation="static"` makes it: a new cache per call."""
    return model.generate(**kwargs, cache_implementation="static")
