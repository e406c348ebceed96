"""`EarlyExitProposer`: LayerSkip self-speculation, the target's first N layers plus its LM head draft.

This is HF's `assistant_early_exit=N` (`EarlyExitCandidateGenerator`), batched. Like HF, each draft forward runs
the target with `config.num_hidden_layers` set to N for the duration of the call (the decoder loops over
`self.layers[: config.num_hidden_layers]`, then applies its final norm and head), and the draft keeps its own
N-layer `DynamicCache` through a `CacheView`, exactly as `DraftModelProposer` does for a separate draft. A
separate cache costs the draft's prefill over N layers but keeps the two caches independent: the target's
verify and rollback never depend on what the draft has seen, so exactness needs no new argument (see
docs/design.md "Early exit" for why we do not share the first N layers' KV as the LayerSkip paper does). On static
caches the draft's cache is an N-layer `StaticCache` (`_StaticEarlyExitView`) and its steps are captured like a draft
model's; its forwards stay eager (a compiled forward would guard on, and recompile for, the truncated config).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_specdec import compat
from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.placement import input_device
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.draft_model import DraftModelProposer, confidence_threshold
from hf_specdec.static_cache import StaticCacheView, StaticPlan

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder


def check_early_exit(model: PreTrainedModel, num_layers: int) -> None:
    """Raise a clear error when `model` cannot draft with its first `num_layers` layers."""
    total = getattr(_base_config(model), "num_hidden_layers", None)
    if not isinstance(total, int):
        raise NotImplementedError(
            f"{type(model).__name__} has no config.num_hidden_layers, which early exit sets to truncate the model: "
            "use a draft model or prompt lookup instead."
        )
    if not 1 <= num_layers < total:
        raise ValueError(
            f"assistant_early_exit={num_layers} must be in 1..{total - 1} for {type(model).__name__}, which has "
            f"{total} layers: the draft runs the first N layers, so N must leave at least one layer out."
        )
    # Probe with one token: a model whose forward ignores config.num_hidden_layers would draft with every layer.
    probe = DynamicCache()
    with torch.no_grad(), truncated(model, num_layers):
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=input_device(model)),  # not `meta` when offloaded
            use_cache=True,
            **compat.cache_kwargs(model, probe),
        )
    if len(probe.layers) != num_layers:
        raise _ignores_truncation(model, len(probe.layers), num_layers)


def _ignores_truncation(model: PreTrainedModel, ran: int, asked: int) -> NotImplementedError:
    return NotImplementedError(
        f"{type(model).__name__} ignores config.num_hidden_layers in its forward (it ran {ran} layers, not {asked}), "
        "so it cannot exit early: use a draft model or prompt lookup instead."
    )


def _base_config(model: PreTrainedModel):  # noqa: ANN202
    base = getattr(model, model.base_model_prefix, model)
    return base.config


@contextlib.contextmanager
def truncated(model: PreTrainedModel, num_layers: int) -> Iterator[None]:
    """Run `model` with only its first `num_layers` decoder layers (HF's early-exit switch), restored afterwards."""
    config = _base_config(model)
    original = config.num_hidden_layers
    config.num_hidden_layers = num_layers
    try:
        yield
    finally:
        config.num_hidden_layers = original


class _EarlyExitView(CacheView):
    """A `CacheView` whose forwards run the first `num_layers` layers of the model only."""

    def __init__(self, model: PreTrainedModel, batch_size: int, pad_lengths: torch.Tensor, num_layers: int) -> None:
        super().__init__(model, batch_size, pad_lengths)
        self.num_layers = num_layers

    def forward(self, token_ids, num_new, logits_to_keep=None, host_num_new=None):  # noqa: ANN001, ANN201
        with truncated(self.model, self.num_layers):
            logits = super().forward(token_ids, num_new, logits_to_keep, host_num_new)
        if len(self.cache.layers) != self.num_layers:
            raise _ignores_truncation(self.model, len(self.cache.layers), self.num_layers)
        return logits


class _StaticEarlyExitView(StaticCacheView):
    """A `StaticCacheView` over the model's first `num_layers` layers: an N-layer static cache, truncated forwards."""

    def __init__(
        self, model: PreTrainedModel, batch_size: int, pad_lengths: torch.Tensor, plan: StaticPlan, num_layers: int
    ) -> None:
        super().__init__(model, batch_size, pad_lengths, plan)
        self.num_layers = num_layers
        self.cache.layers = self.cache.layers[:num_layers]  # the draft never writes the others
        self.compiled_call = None  # eager (captured with the step on a GPU): compiled code would guard on the config

    def forward(self, token_ids, num_new, logits_to_keep=None, width=None, eager=False):  # noqa: ANN001, ANN201
        with truncated(self.model, self.num_layers):
            return super().forward(token_ids, num_new, logits_to_keep, width, eager)


class EarlyExitProposer(DraftModelProposer):
    """The target's first `num_layers` layers and its head draft k tokens per row; batched, own N-layer cache."""

    def __init__(self, model: PreTrainedModel, num_layers: int, num_speculative_tokens: int, confidence_threshold=None):  # noqa: ANN001
        check_early_exit(model, num_layers)
        super().__init__(model, num_speculative_tokens, confidence_threshold)
        self.num_layers = num_layers

    def new_view(self, batch: RaggedBatch) -> CacheView:
        if self.static is not None:
            return _StaticEarlyExitView(
                self.draft_model, batch.batch_size, batch.pad_lengths, self.static, self.num_layers
            )
        return _EarlyExitView(self.draft_model, batch.batch_size, batch.pad_lengths, self.num_layers)


@register("early_exit")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> EarlyExitProposer:
    """`method="early_exit"`: the target's first `early_exit_layers` layers draft."""
    return EarlyExitProposer(target, spec.early_exit_layers, spec.max_speculative_tokens, confidence_threshold(spec))
