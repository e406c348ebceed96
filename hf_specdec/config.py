"""`SpecDecoder`: what to speculate with (method, draft, k, n-gram sizes, seed), validated up front.

A `SpecDecoder` is a plain `@dataclass(kw_only=True)`: validated in `__post_init__`, turned into
a dict and back with `to_dict` / `from_dict` (model objects excluded), and reused across calls.
After each `generate` call it holds that call's `SpecDecodeStats` in `last_stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hf_specdec.metrics import SpecDecodeStats

METHODS = ("draft", "ngram")
MAX_SPECULATIVE_TOKENS = 32


@dataclass(kw_only=True)
class SpecDecoder:
    """Configuration of speculative decoding for `model.generate`.

    Args:
        method (`str`, *optional*):
            `"draft"` (a smaller causal LM sharing the target's tokenizer) or `"ngram"` (prompt lookup in
            the row's own tokens). Defaults to `"draft"` when `draft_model` is given, else `"ngram"`.
        draft_model (`PreTrainedModel`, *optional*):
            The draft model for `method="draft"`. It must have the target's vocabulary and sit on the
            target's device.
        num_speculative_tokens (`int`, defaults to 5):
            Draft tokens per step, k, in 1..32.
        prompt_lookup_min (`int`, defaults to 1), prompt_lookup_max (`int`, defaults to 4):
            The n-gram sizes searched by `method="ngram"`, longest first.
        seed (`int`, *optional*):
            Seed of the sampling draws. Row i of a batch uses `seed + i`, so a row's output depends only
            on its seed and its prompt. Without a seed, seeds are drawn from torch's global generator
            (so `torch.manual_seed` makes runs reproducible).
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Needed for `stop_strings`; `generate` does not forward its `tokenizer` to custom decoders.
        streamer (`BaseStreamer`, *optional*):
            Receives the tokens like `generate(streamer=...)` would.
    """

    method: str | None = None
    draft_model: Any = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    seed: int | None = None
    tokenizer: Any = None
    streamer: Any = None
    last_stats: SpecDecodeStats | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft" if self.draft_model is not None else "ngram"
        if self.method not in METHODS:
            raise ValueError(f"SpecDecoder(method={self.method!r}) is not a known method: pass one of {METHODS}.")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError(
                "SpecDecoder(method='draft') needs a draft model: pass draft_model=AutoModelForCausalLM..., "
                "or use method='ngram' for prompt lookup without a draft."
            )
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(
                f"SpecDecoder(method={self.method!r}) was also given a draft_model, which that method would ignore: "
                "drop draft_model, or use method='draft'."
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}: "
                "typical values are 3-8 (more only pays when nearly every draft is accepted)."
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not isinstance(lo, int) or not isinstance(hi, int) or lo < 1 or hi < lo:
            raise ValueError(
                f"prompt_lookup_min/prompt_lookup_max must be ints with 1 <= min <= max, got min={lo!r}, max={hi!r}."
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}.")

    def to_dict(self) -> dict[str, Any]:
        """The serialisable settings (model, tokenizer and streamer objects are left out)."""
        skip = {"draft_model", "tokenizer", "streamer", "last_stats"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    @classmethod
    def from_dict(cls, data: dict[str, Any], **objects: Any) -> "SpecDecoder":
        """Inverse of `to_dict`; pass `draft_model=`, `tokenizer=`, `streamer=` as keyword arguments."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"SpecDecoder.from_dict got unknown keys {sorted(unknown)}; known keys: {sorted(known)}.")
        return cls(**data, **objects)
