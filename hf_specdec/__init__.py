"""hf_specdec: exact, batched speculative decoding inside Hugging Face `model.generate`.

spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=5)
out = model.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec)
spec.last_stats  # SpecDecodeStats of that call
"""

from hf_specdec.config import SpecDecoder
from hf_specdec.generation import SpecDecodeOutput, generate, install, is_installed, uninstall
from hf_specdec.metrics import SpecDecodeStats

__all__ = [
    "SpecDecodeOutput",
    "SpecDecodeStats",
    "SpecDecoder",
    "generate",
    "install",
    "is_installed",
    "uninstall",
]

__version__ = "0.1.0"
