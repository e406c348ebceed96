"""Proposers: the ways of drafting tokens, and the registry that builds the one a call names.

Each proposer module registers itself: `@register("method")` on a constructor `(spec, target, context) ->
Proposer` that runs the method's own checks (a method's static-cache port, in its own module, registers with
`static=True` and builds the calls on static caches). `build` finds the constructor of `spec.method`, importing this
package's modules by name on first use (so this file imports none of them, and no import circle can pass through
it). Adding a proposer is one new module here plus one test file; see docs/design.md, "Adding a proposer".
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_specdec.config import SpecDecoder
    from hf_specdec.proposers.base import Proposer

__all__ = ["ProposerContext", "build", "register"]


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer's constructor may need besides the `SpecDecoder` and the target."""

    tokenizer: Any = None  # the target's tokenizer (a draft with another tokenizer translates through text)
    encoder: Any = None  # the `EncoderState` of an encoder-decoder target (`hf_specdec.seq2seq`), or None
    static: bool = False  # the call runs on static caches

    def require_decoder_only(self, method: str, target: PreTrainedModel) -> None:
        """Refuse an encoder-decoder target for a method that drafts from a decoder-only target's states."""
        if self.encoder is not None:
            raise NotImplementedError(
                f"method={method!r} drafts for decoder-only targets only, not for {type(target).__name__}."
            )


Constructor = Callable[["SpecDecoder", "PreTrainedModel", ProposerContext], "Proposer"]

#: method -> [(when, static, constructor)]: the first whose `when(spec)` holds (None: always) builds the proposer;
#: entries with `static` only for calls on static caches (tried first there).
_REGISTRY: dict[str, list[tuple[Callable[[SpecDecoder], bool] | None, bool, Constructor]]] = {}
_discovered = False


def register(
    method: str, when: Callable[[SpecDecoder], bool] | None = None, static: bool = False
) -> Callable[[Constructor], Constructor]:
    """Decorator: `constructor` builds the proposer of `SpecDecoder(method=method)` (only when `when(spec)` holds,
    if given, and with `static` only for calls on static caches: constructors with a condition are tried before the
    method's plain one)."""

    def decorate(constructor: Constructor) -> Constructor:
        entries = _REGISTRY.setdefault(method, [])
        conditional = when is not None or static
        entries.insert(0 if conditional else len(entries), (when, static, constructor))
        return constructor

    return decorate


def _discover() -> None:
    """Import every module of this package once, so that each registers its methods."""
    global _discovered
    if not _discovered:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        _discovered = True


def build(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> Proposer:
    """The proposer `spec` describes, built and checked against `target` by its method's registered constructor."""
    _discover()
    for when, static, constructor in _REGISTRY.get(spec.method, ()):
        if (not static or context.static) and (when is None or when(spec)):
            return constructor(spec, target, context)
    raise ValueError(
        f"No proposer is registered for method={spec.method!r} (registered: {sorted(_REGISTRY)}): a proposer module in "
        "hf_specdec/proposers/ registers its method with @register(method)."
    )
