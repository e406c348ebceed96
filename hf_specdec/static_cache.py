"""A model's preallocated HF `StaticCache` over a ragged batch: fixed shapes for CUDA graphs.

`StaticCacheView` keeps `CacheView`'s column map (which buffer index each cache column holds, -1 for a hole) but
on transformers' own `StaticCache`, allocated once per call: every forward writes `width` columns for all rows at
one shared write offset, a device tensor (no host sync), with a mask over the whole static length. Rollback turns
rejected columns into holes and moves the offset back to the end of the longest row; nothing is reallocated. When
the host's bound on the offset says the next write may not fit, the offset is read once and, if needed, each
row's real columns are gathered to the left in place (compaction). Sliding-window layers get full-length static
layers: the window is applied by the mask, in tokens (HF's static sliding layer is a ring buffer in columns,
which a column map with holes cannot use). A hybrid's recurrent layers stay transformers' own `linear_attention`
layers (no columns: compaction leaves them alone); `RecurrentRollback` rolls them back as on the dynamic path, and
their forwards run eagerly (never compiled or captured). `StaticPlan` is the call's static-cache description that
the views, the proposers and the loop share (`cache_route.static_plan` builds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from hf_specdec import compat, grouped_attention
from hf_specdec.cache import CacheView
from hf_specdec.devices import PerDevice
from hf_specdec.recurrent import RecurrentRollback


@dataclass
class StaticPlan:
    """How a call runs on static caches: their column count and the compiled forward of each model (or None)."""

    k: int  # drafts per step: every verify after the prefill has width 1 + k (or 1 when nobody drafts)
    max_columns: int  # static cache length: max_length + k + 1 + room for holes between compactions
    compiled_call: Callable[[PreTrainedModel], Callable | None]  # model -> its compiled __call__, or None (eager)
    compile_time_s: float = 0.0  # seconds spent in forwards that compiled or captured a new graph
    num_compactions: int = 0
    views: list = field(default_factory=list)  # the call's StaticCacheViews (target, draft), in creation order
    #: the forwards may run inside one captured CUDA graph per step (a GPU, and compiling allowed)
    can_capture: bool = False
    #: the loop captures its steps (`hf_specdec.step_graph`): forwards are compiled without graphs of their own
    capture_steps: bool = False
    #: the target or the draft is a hybrid: steps are never planned or captured (the recurrent rollback's hooks and
    #: data-dependent re-runs cannot live in a CUDA graph), and hybrid forwards are never compiled
    hybrid: bool = False


def build_static_cache(model: PreTrainedModel, max_cache_len: int) -> StaticCache:
    """transformers' `StaticCache` for `model` with full-length layers only (sliding windows come from the mask);
    a hybrid's recurrent layers are transformers' own `linear_attention` layers, as `StaticCache` builds them."""
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    cache.layers = [
        StaticLayer(max_cache_len=max_cache_len) if isinstance(layer, StaticSlidingWindowLayer) else layer
        for layer in cache.layers
    ]
    return cache


class StaticCacheView(CacheView):
    """One model's `StaticCache` plus the column map; every forward writes `width` columns at a shared offset."""

    def __init__(
        self,
        model: PreTrainedModel,
        batch_size: int,
        pad_lengths: torch.Tensor,  # [B]
        plan: StaticPlan,
    ) -> None:
        super().__init__(model, batch_size, pad_lengths)
        device = pad_lengths.device
        max_columns = plan.max_columns
        self.plan = plan
        plan.views.append(self)
        self.cache = build_static_cache(model, max_columns)
        if self.recurrent is not None:  # a hybrid: roll back the static cache's recurrent layers
            self.recurrent = RecurrentRollback(model, self.cache)
        self.max_columns = max_columns
        self.aligned = False  # always an explicit mask over the whole static length: one shape per width
        self.column_index = torch.full((batch_size, max_columns), -1, dtype=torch.long, device=device)  # [B, L]
        self.columns = torch.arange(max_columns, device=device)  # [L]
        self.offset = torch.zeros((), dtype=torch.long, device=device)  # next column to write, all rows
        self.offset_bound = 0  # host-side upper bound of `offset`: read it only when a write might not fit
        self.prefilled = False
        self.compiled_call = plan.compiled_call(model)  # every forward after the first (the prefill runs eagerly)
        # Attention over the whole static length every forward: without copying grouped key-value heads.
        self.forward_kwargs = grouped_attention.forward_kwargs(model)

    @property
    def width(self) -> int:
        """0 before the first forward (the prefill), else the columns written so far at most."""
        return self.offset_bound if self.prefilled else 0

    def forward(
        self,
        token_ids: torch.Tensor,  # [B, C] the batch's token buffer
        num_new: torch.Tensor,  # [B] tokens to feed per row, from cached_lengths[i] on
        logits_to_keep: int | None = None,
        width: int | None = None,  # fixed slot count (a CUDA graph per width); None: max(num_new) (host sync)
        eager: bool = False,  # the model's own forward even where a compiled one exists (a width that is not a step's)
    ) -> torch.Tensor:  # [B, width, V] float32 logits of the fed slots
        if width is None:
            width = int(num_new.max().item())
        device = token_ids.device
        offsets = torch.arange(width, device=device)  # [w]
        index = self.cached_lengths[:, None] + offsets  # [B, w] buffer index of each slot
        valid = offsets < num_new[:, None]  # [B, w]
        input_ids = torch.where(valid, token_ids.gather(1, index.clamp(max=token_ids.shape[1] - 1)), 0)  # [B, w]
        real = valid & (index >= self.pad_lengths[:, None])
        position_ids = torch.where(valid, (index - self.pad_lengths[:, None]).clamp(min=0), 0)  # [B, w]
        mask = self.write_columns(index, valid, real)
        if self.recurrent is not None:  # recurrent layers: 2-D padding mask, snapshot and recorded inputs (eager)
            padding = real.long()  # [B, w] all ones where nothing is padded: exact, and no host read to find out
            if isinstance(mask, dict):
                mask["linear_attention"] = padding
            self.recurrent.start_forward(self.cached_lengths, valid, padding)
        call = self.model if eager or not self.prefilled or self.compiled_call is None else self.compiled_call
        compiled_before = 0
        own_graph = call is not self.model and not self.plan.capture_steps  # a compiled call with its own CUDA graph
        if own_graph:
            torch.compiler.cudagraph_mark_step_begin()
        if call is not self.model:
            compiled_before, start = compat.num_compiled_graphs(), time.perf_counter()
        try:
            logits = self.run_model(input_ids, mask, position_ids, logits_to_keep or 0, call)
        finally:
            if self.recurrent is not None:
                self.recurrent.end_forward()
        if call is not self.model and compat.num_compiled_graphs() != compiled_before:  # this call compiled
            torch.cuda.synchronize(token_ids.device)
            self.plan.compile_time_s += time.perf_counter() - start
        # A graph's outputs are overwritten by its next replay: keep a copy.
        logits = logits.float() if logits.dtype != torch.float32 or not own_graph else logits.clone()
        self.advance(width)
        self.cached_lengths = self.cached_lengths + num_new
        return logits

    def write_columns(
        self,
        index: torch.Tensor,  # [B, w] buffer index of each fed slot
        valid: torch.Tensor,  # [B, w] the slot is fed
        real: torch.Tensor,  # [B, w] the slot's key is kept (not padding)
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Columns [offset, offset + w) take the slots' buffer indices (-1: a hole), every layer's write offset
        moves there, and the slots' mask over the whole static length is returned (the cache compacts first when
        w more columns might not fit)."""
        write = self.claim_columns(torch.where(real, index, -1))
        return self._attention_mask(torch.where(valid, index, -1), self.column_index, write)

    def claim_columns(self, columns: torch.Tensor) -> torch.Tensor:  # [w] the columns written
        """Columns [offset, offset + w) take `columns` ([B, w]: buffer indices, -1 for holes) and every layer's write
        offset moves there (the cache compacts first when w more columns might not fit)."""
        if self.offset_bound + columns.shape[1] > self.max_columns:
            self.make_room(columns.shape[1])
        write = self.offset + torch.arange(columns.shape[1], device=columns.device)  # [w]
        self.column_index.index_copy_(1, write, columns)
        # The write offset of every layer: one fused device copy per device the layers sit on (no host sync; one
        # launch for all layers of a model on one device).
        counters: dict[torch.device, list[torch.Tensor]] = {}
        for layer in self.cache.layers:
            if _holds_keys(layer):
                counters.setdefault(layer.cumulative_length.device, []).append(layer.cumulative_length)
        offset = PerDevice(self.offset)
        for device, on_device in counters.items():
            torch._foreach_copy_(on_device, [offset.on(device)] * len(on_device))
        return write

    def advance(self, width: int) -> None:
        """After a forward of `width` slots: the next one writes after them."""
        self.offset = self.offset + width
        self.offset_bound += width
        self.prefilled = True

    def rollback(self, cached_lengths: torch.Tensor) -> None:
        """Keep only buffer indices < cached_lengths[i] ([B]); the offset moves back to the longest row's end."""
        self.cached_lengths = torch.minimum(self.cached_lengths, cached_lengths)
        keep = (self.column_index >= 0) & (self.column_index < self.cached_lengths[:, None])  # [B, L]
        self.column_index.masked_fill_(~keep, -1)
        if self.recurrent is not None:
            self.recurrent.rollback(self.cached_lengths)
        self.offset = ((self.columns + 1) * keep.any(0)).max()  # last used column + 1, or 0

    def make_room(self, width: int) -> None:
        """Read the true offset (one host sync); compact in place when `width` more columns would not fit."""
        self.offset_bound = int(self.offset.item())
        if self.offset_bound + width <= self.max_columns:
            return
        keep = self.column_index >= 0  # [B, L]
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # [B, L] real columns first
        self.column_index.copy_(self.column_index.gather(1, order))
        order_on = PerDevice(order[:, None, :, None])  # [B, 1, L, 1] on each layer's device
        for layer in self.cache.layers:
            if not _holds_keys(layer):
                continue
            for states in (layer.keys, layer.values):
                index = order_on.on(states.device).expand(-1, states.shape[1], -1, states.shape[3])
                states.copy_(states.gather(2, index))
        self.offset_bound = int(keep.sum(1).max().item())
        self.offset = torch.full_like(self.offset, self.offset_bound)
        self.plan.num_compactions += 1
        if self.offset_bound + width > self.max_columns:
            raise RuntimeError(
                f"hf_specdec's static cache of {self.max_columns} columns cannot take {width} more after compaction "
                f"({self.offset_bound} in use): this is a bug, please report it with the generate arguments."
            )

    def select_rows(self, keep: torch.Tensor) -> None:
        raise NotImplementedError("rows never leave a static batch: they stay, masked, until the call ends")


def _holds_keys(layer: object) -> bool:
    """Whether a cache layer holds keys (not before its first write, nor a KV-shared layer's `DummyLayer`)."""
    return bool(getattr(layer, "is_initialized", False)) and getattr(layer, "keys", None) is not None
