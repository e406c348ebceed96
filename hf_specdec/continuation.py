"""Continuing from a caller's filled `DynamicCache`, and handing back the cache plain `generate` would leave.

`CacheHandoff` adopts the caller's `past_key_values` (a chat loop that keeps its cache): its columns hold the
tokens at buffer indices 0..W0-1 of every row (left padding as holes), so the target's `CacheView` starts from
them and the first verify feeds only the rest. Rows that finish leave the batch with their cache rows stashed;
at the end every row is laid out like plain decoding's cache: one column per token of the returned sequences
but the last (the EOS and padding of rows that finished early are fed, as plain decoding feeds them), no holes,
sliding-window layers cut to their window. That content is written into the caller's cache object in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hf_specdec import compat
from hf_specdec.cache import CacheView
from hf_specdec.compat import DUMMY_LAYER
from hf_specdec.devices import PerDevice

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder


def check_continuation_cache(cache: object, input_ids: torch.Tensor) -> int:
    """The number of tokens the caller's cache already holds (W0); raise a clear error if it cannot be continued."""
    if not isinstance(cache, DynamicCache):
        raise NotImplementedError(
            f"hf_specdec continues only a DynamicCache, got past_key_values of type {type(cache).__name__}: pass "
            "a transformers.DynamicCache (or none)."
        )
    if getattr(cache, "offloading", False):
        raise NotImplementedError("hf_specdec does not continue an offloaded DynamicCache: pass DynamicCache().")
    for i, layer in enumerate(cache.layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, DUMMY_LAYER):
            raise NotImplementedError(
                f"Layer {i} of the past_key_values is a {type(layer).__name__}; hf_specdec continues caches of "
                "DynamicLayer / DynamicSlidingWindowLayer layers only: generate without speculation for this model."
            )
    layers = _kv_layers(cache)
    past = cache.get_seq_length()
    if past == 0:
        return 0
    if any(not layer.is_initialized for layer in layers):
        raise ValueError(
            "The past_key_values has layers that were never filled: pass the cache an earlier call filled."
        )
    batch_size, width = input_ids.shape
    rows = {layer.keys.shape[0] for layer in layers}
    if rows != {batch_size}:
        raise ValueError(
            f"The past_key_values holds {', '.join(map(str, sorted(rows)))} rows but input_ids has {batch_size}: continue a cache with the "
            "batch it was filled with."
        )
    if past >= width:
        raise ValueError(
            f"The past_key_values already holds {past} tokens but input_ids has only {width}: pass the whole "
            "conversation so far (the earlier output plus the new turn) as input_ids, as plain generate expects."
        )
    return past


def _kv_layers(cache: DynamicCache) -> list:
    """The layers that hold keys and values (not the DummyLayers of KV-shared layers, which come last)."""
    return [layer for layer in cache.layers if DUMMY_LAYER is None or not isinstance(layer, DUMMY_LAYER)]


@dataclass
class _Stash:
    row_ids: torch.Tensor  # [b] the rows' indices in the caller's batch
    column_index: torch.Tensor  # [b, W] buffer index per cache column, -1 = hole
    cached_lengths: torch.Tensor  # [b]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [b, H, W, D]


class CacheHandoff:
    """Adopts the caller's cache into the target's `CacheView` and writes the final cache back into it."""

    def __init__(self, cache: DynamicCache, past_length: int) -> None:
        self.cache = cache
        self.past_length = past_length
        self.stashes: list[_Stash] = []
        self.pad_lengths: torch.Tensor | None = None  # [B_total]

    def adopt(self, view: CacheView) -> None:
        """Start `view` (fresh, all rows) from the caller's cache: column j holds buffer index j (pads are holes)."""
        self.pad_lengths = view.pad_lengths.clone()
        past = self.past_length
        if past == 0:
            return
        for layer_idx, layer in enumerate(_kv_layers(self.cache)):
            keys, values = layer.keys, layer.values  # [B, H, n, D]: a sliding layer keeps only its last n columns
            missing = past - keys.shape[2]
            if missing:
                keys = torch.nn.functional.pad(keys, (0, 0, missing, 0))  # zeros stand for columns out of the window
                values = torch.nn.functional.pad(values, (0, 0, missing, 0))
            view.cache.update(keys, values, layer_idx)
        index = torch.arange(past, device=view.pad_lengths.device)  # [W0]
        view.column_index = torch.where(index[None] >= view.pad_lengths[:, None], index[None], -1)  # [B, W0]
        view.cached_lengths = torch.full_like(view.cached_lengths, past)
        view.host = None  # the host's copy is read again when next needed (`CacheView.host_columns`)

    def stash(self, view: CacheView, rows: torch.Tensor, row_ids: torch.Tensor) -> None:
        """Keep the cache rows `rows` ([b] indices into the live batch) of rows about to leave the batch (each layer's
        on its own device)."""
        leaving = PerDevice(rows)
        layers = [(leaving.rows(lay.keys), leaving.rows(lay.values)) for lay in view.cache.layers if lay.is_initialized]
        self.stashes.append(_Stash(row_ids.clone(), view.column_index[rows], view.cached_lengths[rows], layers))

    def cut(self, row_id: int, length: int) -> None:
        """Caller row `row_id` (stashed) ends at `length` tokens (a host criterion stopped it after it left): hand
        back only its columns before that; `hand_back` feeds the padding after it, as plain decoding does."""
        for stash in self.stashes:
            cut = stash.cached_lengths.clamp(max=length)
            stash.cached_lengths = torch.where(stash.row_ids.to(cut.device) == row_id, cut, stash.cached_lengths)

    def hand_back(self, model: PreTrainedModel, sequences: torch.Tensor) -> DynamicCache:  # sequences [B_total, F]
        """Write into the caller's cache what plain decoding's cache holds after producing `sequences`; return it."""
        width = sequences.shape[1] - 1  # plain decoding never feeds the last token
        order = PerDevice(torch.cat([s.row_ids for s in self.stashes]).argsort())  # each layer's on its device
        column_index = order.rows(_cat_padded([s.column_index for s in self.stashes], -1))  # [B, W]
        cached = order.rows(torch.cat([s.cached_lengths for s in self.stashes])).clamp(max=width)  # [B]
        layers = [
            (
                order.rows(_cat_padded([s.layers[i][0] for s in self.stashes], 0)),
                order.rows(_cat_padded([s.layers[i][1] for s in self.stashes], 0)),
            )
            for i in range(len(self.stashes[0].layers))
        ]
        column_index = PerDevice(torch.where(column_index < cached[:, None], column_index, -1))
        aligned = [(_align(k, column_index, width), _align(v, column_index, width)) for k, v in layers]
        if bool((cached < width).any()):  # rows that finished early: feed their EOS and padding, as plain decoding does
            aligned = _feed_rest(model, sequences, self.pad_lengths, cached, aligned, width)
        shared = self.cache.layers[len(aligned) :]  # KV-shared layers' DummyLayers stay as they are
        self.cache.layers = [_filled_like(self.cache, i, k, v) for i, (k, v) in enumerate(aligned)] + shared
        return self.cache


def _cat_padded(tensors: list[torch.Tensor], fill: float) -> torch.Tensor:
    """Concatenate along dim 0 tensors whose column dim (the last for 2-D, dim 2 for 4-D) differ: pad on the right."""
    dim = 1 if tensors[0].ndim == 2 else 2
    width = max(t.shape[dim] for t in tensors)
    padded = []
    for t in tensors:
        pad = [0, 0] * (t.ndim - 1 - dim) + [0, width - t.shape[dim]]
        padded.append(torch.nn.functional.pad(t, pad, value=fill))
    return torch.cat(padded)


def _align(
    states: torch.Tensor,  # [B, H, W, D] cache columns in any order, with holes
    column_index: PerDevice,  # [B, W] buffer index held by each column, -1 = hole
    width: int,
) -> torch.Tensor:  # [B, H, width, D]: column j holds buffer index j (zeros where nothing is cached)
    batch, heads, _, dim = states.shape
    columns = column_index.on(states.device)  # the layer's device
    target = torch.where(columns >= 0, columns, width)  # holes go to a dump column
    out = states.new_zeros(batch, heads, width + 1, dim)
    index = target[:, None, :, None].expand(-1, heads, -1, dim)
    return out.scatter(2, index, states)[:, :, :width]


def _feed_rest(
    model: PreTrainedModel,
    sequences: torch.Tensor,  # [B, F]
    pad_lengths: torch.Tensor,  # [B]
    cached: torch.Tensor,  # [B] buffer indices 0..cached-1 are in `aligned`
    aligned: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [B, H, width, D]
    width: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    view = CacheView(model, sequences.shape[0], pad_lengths)
    have = int(cached.max().item())
    for layer_idx, (keys, values) in enumerate(aligned):
        view.cache.update(keys[:, :, :have], values[:, :, :have], layer_idx)
    index = torch.arange(have, device=sequences.device)[None]  # [1, have]
    real = (index >= pad_lengths[:, None]) & (index < cached[:, None])
    view.column_index = torch.where(real, index, -1)  # [B, have]
    view.cached_lengths = cached.clone()
    view.aligned = view.aligned and bool((cached == have).all())
    view.forward(sequences, width - cached, logits_to_keep=1)
    column_index = PerDevice(view.column_index)
    return [
        (_align(lay.keys, column_index, width), _align(lay.values, column_index, width)) for lay in view.cache.layers
    ]


def _filled_like(cache: DynamicCache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A fresh layer of the type the caller's cache has at `layer_idx` (full by default), holding keys/values."""
    old = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    layer = (
        DynamicSlidingWindowLayer(sliding_window=old.sliding_window)
        if isinstance(old, DynamicSlidingWindowLayer)
        else DynamicLayer()
    )
    layer.update(keys, values)  # a sliding layer keeps its last window - 1 columns, like plain decoding's
    return layer


def build_handoff(
    model: PreTrainedModel, spec: SpecDecoder, input_ids: torch.Tensor, config: GenerationConfig, cache: Any
) -> CacheHandoff | None:
    """The cache handoff of this call: adopt a filled `past_key_values`, and fill the caller's cache (or the one a
    `return_dict_in_generate` output carries) like plain decoding; None when nobody will see the cache."""
    if model.config.is_encoder_decoder:
        if cache is not None and cache.get_seq_length() > 0:
            raise NotImplementedError(
                "Continuing a filled past_key_values is supported for decoder-only targets only: pass the whole "
                f"decoder prompt to {type(model).__name__} without past_key_values."
            )
        return None  # the returned output carries no cache (the EncoderDecoderCache is not handed back)
    if cache is None:
        if not config.return_dict_in_generate:
            return None
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    past = check_continuation_cache(cache, input_ids)
    if past and spec.method in ("mtp", "gemma4_assistant", "dflash", "eagle3"):
        raise NotImplementedError(
            f"method={spec.method!r} cannot continue a filled past_key_values (it drafts from the target's states "
            "of the forward that filled it, which hf_specdec did not see): pass the full conversation without "
            "past_key_values, or use a draft model or prompt lookup."
        )
    # generate creates a cache of its own when the caller passed none; fill it only when the output returns it.
    # (Filling it took 5% of a call at batch 4 on the CPU: rows that finished early are fed their padding.)
    if not past and not config.return_dict_in_generate and not compat.caller_passed_cache(cache):
        return None
    return CacheHandoff(cache, past)
