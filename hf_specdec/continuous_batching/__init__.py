"""Speculative decoding inside transformers' continuous batching (`generate_batch`, `init_continuous_batching`,
the context manager, paged `generate` and `transformers serve`): see docs/design.md, "Continuous batching".

The names below are imported on first use, so that importing the package costs nothing until it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_specdec.continuous_batching.manager import SpecContinuousBatchingManager, init_spec_continuous_batching

_EXPORTS = {
    "SpecContinuousBatchingManager": "hf_specdec.continuous_batching.manager",
    "init_spec_continuous_batching": "hf_specdec.continuous_batching.manager",
}

__all__ = ["SpecContinuousBatchingManager", "init_spec_continuous_batching"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_specdec.continuous_batching' has no attribute {name!r}")
