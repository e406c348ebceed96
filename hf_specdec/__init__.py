"""hf_specdec: exact, batched speculative decoding inside Hugging Face `model.generate`.

spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=5)
out = model.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec)
spec.last_stats  # SpecDecodeStats of that call

The names below are imported on first use (PEP 562), so that `import hf_specdec.tools.cli` (the console script)
does not pay for torch and transformers before it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder
    from hf_specdec.generation import SpecDecodeOutput, generate
    from hf_specdec.graph_reuse import forget_graphs
    from hf_specdec.metrics import SpecDecodeStats
    from hf_specdec.proposers.eagle3_head import load_draft_head
    from hf_specdec.routing import install, is_installed, uninstall

_EXPORTS = {
    "SpecDecodeOutput": "hf_specdec.generation",
    "SpecDecodeStats": "hf_specdec.metrics",
    "SpecDecoder": "hf_specdec.config",
    "forget_graphs": "hf_specdec.graph_reuse",
    "generate": "hf_specdec.generation",
    "install": "hf_specdec.routing",
    "load_draft_head": "hf_specdec.proposers.eagle3_head",
    "is_installed": "hf_specdec.routing",
    "uninstall": "hf_specdec.routing",
}

__all__ = [
    "SpecDecodeOutput",
    "SpecDecodeStats",
    "SpecDecoder",
    "forget_graphs",
    "generate",
    "install",
    "is_installed",
    "load_draft_head",
    "uninstall",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_specdec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
