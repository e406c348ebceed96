"""A model's HF KV cache over a ragged batch: which token each cache column holds, masks, rollback.

`CacheView` owns one model's `DynamicCache` for the rows of a `RaggedBatch`. Every cache column of
row i holds the token at some buffer index of that row, or nothing (a hole: left padding, a
rejected draft, an unused verify slot). From that map it builds the 4-D attention masks and
position ids itself, so rows can hold holes anywhere and attention (sliding windows included)
still sees exactly the tokens that plain decoding would. Rolling back a rejected draft turns its
column into a hole; trailing all-hole columns are cropped, and when holes dominate the cache is
compacted. The cache always covers a prefix of each row: buffer indices [0, cached_lengths[i]).
ALiBi models that derive key positions from the 2-D mask (BLOOM, Falcon `alibi=True`) get the 2-D mask of the map
instead: a row's real columns hold its buffer indices in order, so `cumsum(mask) - 1` is each key's plain position.
A hybrid model's recurrent layers have no columns: `hf_specdec.recurrent` rolls their states back.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from hf_specdec import compat, first_shapes
from hf_specdec.compat import crop_cache, is_recurrent_layer
from hf_specdec.devices import PerDevice, select_cache_rows
from hf_specdec.host_columns import HostColumns
from hf_specdec.model_support import alibi_from_mask, check_attention_implementation
from hf_specdec.placement import input_device
from hf_specdec.recurrent import RecurrentRollback, is_hybrid

#: Compact when holes exceed this share of the cache columns (and the cache is at least this wide).
COMPACT_HOLE_SHARE = 0.5
COMPACT_MIN_COLUMNS = 64


class CacheView:
    """One model's DynamicCache plus the map from cache columns to buffer indices, per row."""

    def __init__(self, model: PreTrainedModel, batch_size: int, pad_lengths: torch.Tensor) -> None:
        check_attention_implementation(model)
        self.model = model
        self.cache = DynamicCache()
        self.recurrent: RecurrentRollback | None = None
        if is_hybrid(model):  # recurrent layers need transformers' own layer classes; attention layers stay plain
            self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))
            self.cache.layers = [x if is_recurrent_layer(x) else DynamicLayer() for x in self.cache.layers]
            self.recurrent = RecurrentRollback(model, self.cache)
        device = pad_lengths.device
        #: where the model embeds its input: ids, masks and positions go there, logits come back to the batch's
        #: device (a draft placed elsewhere than the target; accelerate's hooks do the rest for spread models)
        self.model_device = input_device(model)
        self.pad_lengths = pad_lengths.clone()  # [B]
        self.column_index = torch.empty(batch_size, 0, dtype=torch.long, device=device)  # [B, W], -1 = hole
        self.cached_lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        #: the host's copy of cached_lengths and each row's newest real column (dynamic caches, without recurrent
        #: layers): forwards and rollbacks told the host numbers read nothing; None until `host_columns` reads them
        self.host: HostColumns | None = None
        if self.recurrent is None and type(self).rollback is CacheView.rollback:
            self.host = HostColumns.empty(self.pad_lengths.cpu().numpy().astype(np.int64))
        # Column j holds buffer index j (one row, no padding): holes can never appear, rollback only crops.
        self.aligned = batch_size == 1 and not bool(self.pad_lengths.any())
        config = model.config.get_text_config()
        self.layer_types = getattr(config, "layer_types", None)
        self.sliding_window = getattr(config, "sliding_window", None)
        self.chunk_size = getattr(config, "attention_chunk_size", None)  # Llama 4's chunked attention layers
        self.mask_dtype = model.dtype
        self.eager = config._attn_implementation == "eager"
        self.alibi_mask = alibi_from_mask(model)  # a 2-D mask of real columns instead of 4-D masks
        self.forward_kwargs: dict[str, object] = {}  # what every forward passes besides inputs, mask and cache

    @property
    def width(self) -> int:
        return self.column_index.shape[1]

    def forward(
        self,
        token_ids: torch.Tensor,  # [B, C] the batch's token buffer
        num_new: torch.Tensor,  # [B] tokens to feed per row, from cached_lengths[i] on
        logits_to_keep: int | torch.Tensor | None = None,  # the last n slots, or these slots ([n]), as in transformers
        host_num_new: np.ndarray | None = None,  # [B] num_new as the host knows it (then nothing is read)
    ) -> torch.Tensor:  # [B, w, V] float32 logits of the fed positions (w = max(num_new))
        """Feed each row's next `num_new[i]` tokens through the model, appending them to the cache."""
        batch_size = token_ids.shape[0]
        device = token_ids.device
        if host_num_new is not None:
            width = int(np.max(host_num_new)) if batch_size else 0
        else:
            width = int(num_new.max().item()) if batch_size else 0
        first_shapes.note(self.model, (batch_size, width), self.model_device)  # a GPU's first run: not timed
        offsets = torch.arange(width, device=device)  # [w]
        index = self.cached_lengths[:, None] + offsets  # [B, w] buffer index of each fed slot
        valid = offsets < num_new[:, None]  # [B, w]
        safe_index = index.clamp(max=token_ids.shape[1] - 1)
        input_ids = torch.where(valid, token_ids.gather(1, safe_index), 0)  # [B, w]
        real = valid & (index >= self.pad_lengths[:, None])  # left padding stays a hole
        new_columns = torch.where(real, index, -1)  # [B, w]
        # Unused slots get position 0: a row fed nothing may sit past a learned-position model's limit.
        position_ids = torch.where(valid, (index - self.pad_lengths[:, None]).clamp(min=0), 0)  # [B, w]
        keys = torch.cat([self.column_index, new_columns], dim=1)  # [B, W + w]
        queries = torch.where(valid, index, -1)  # [B, w]
        # A single row without holes is laid out exactly like plain decoding's cache: let the model build its own
        # causal mask (no explicit mask keeps sdpa on its GQA-native, flash-capable path).
        mask = None if self.aligned and width > 0 else self._attention_mask(queries, keys)
        if self.recurrent is not None:  # recurrent layers take a 2-D padding mask: left padding stays out of the state
            # (a row with every slot real is multiplied by ones: exact, and no host read to find out)
            padding = None if self.aligned else real.long()  # [B, w]
            if isinstance(mask, dict):
                mask["linear_attention"] = padding
            self.recurrent.start_forward(self.cached_lengths, valid, padding)
        try:
            logits = self.run_model(input_ids, mask, position_ids, logits_to_keep if logits_to_keep is not None else 0)
        finally:
            if self.recurrent is not None:
                self.recurrent.end_forward()
        if self.host is not None and host_num_new is not None:
            self.host.fed(self.width, host_num_new)
        else:
            self.host = None  # lost track: `host_columns` reads it when it is next needed
        self.column_index = keys
        self.cached_lengths = self.cached_lengths + num_new
        return logits.float()

    def forward_newest(self, token_ids: torch.Tensor, keep: bool = True) -> torch.Tensor | None:  # [B, 1, V] or None
        """Feed each row's newest token (the buffer index at its cached length), as a plain decoding step does. The
        host's copy of the columns says that every such token is real (past the left padding), so the slots,
        positions and mask take a handful of operations where `forward` builds room for drafts. `keep`: nothing fed
        here is rolled back (a plain step), so nothing is logged for a rollback; otherwise (a draft's one-token
        forward) it is logged as `forward` logs it. None when the host has no copy (call `forward`)."""
        host = self.host
        if host is None or type(self).forward is not CacheView.forward or not np.all(host.cached >= host.pad):
            return None
        first_shapes.note(self.model, (token_ids.shape[0], 1), self.model_device)
        index = self.cached_lengths[:, None]  # [B, 1] buffer index of each row's newest token
        input_ids = token_ids.gather(1, index)  # [B, 1]
        position_ids = index - self.pad_lengths[:, None]  # [B, 1]
        keys = torch.cat([self.column_index, index], dim=1)  # [B, W + 1]
        mask = None if self.aligned else self._attention_mask(index, keys, all_real=True)
        logits = self.run_model(input_ids, mask, position_ids, 0)
        if keep:
            host.kept_newest(self.width)
        else:
            host.fed(self.width, np.ones_like(host.cached))
        self.column_index = keys
        self.cached_lengths = self.cached_lengths + 1
        return logits.float()

    def run_model(
        self,
        input_ids: torch.Tensor,  # [B, w]
        mask: torch.Tensor | dict[str, torch.Tensor] | None,
        position_ids: torch.Tensor,  # [B, w]
        logits_to_keep: int | torch.Tensor,
        call: object = None,  # the model's compiled __call__ (static caches on a GPU), or None for the model
    ) -> torch.Tensor:  # [B, w or logits_to_keep, V]
        """One forward of the model over the cache (encoder-decoder views pass their encoder states here)."""
        home = input_ids.device
        input_ids, mask, position_ids = self.to_model(input_ids, mask, position_ids)
        logits = (call or self.model)(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            **compat.cache_kwargs(self.model, self.cache),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **self.forward_kwargs,
        ).logits
        return logits.to(home)  # [B, w, V] on the batch's device (no copy when the model runs there)

    def to_model(self, *inputs: object) -> list:
        """`inputs` (tensors, dicts of masks, None) on the device the model embeds on; as they are when already
        there (a model on the batch's device: no copy)."""
        device = self.model_device

        def moved(value: object) -> object:
            if isinstance(value, torch.Tensor) and value.device != device:
                return value.to(device)
            if isinstance(value, dict):
                return {name: moved(v) for name, v in value.items()}
            return value

        return [moved(value) for value in inputs]

    def kv_layers(self) -> list:
        """The cache layers whose columns follow `column_index` (an encoder-decoder's self-attention layers)."""
        return self.cache.layers

    def _attention_mask(
        self,
        queries: torch.Tensor,  # [B, w] buffer index of each query, -1 for unused slots
        keys: torch.Tensor,  # [B, W] buffer index held by each cache column, -1 for holes
        own_columns: torch.Tensor | None = None,  # [w] the column each query writes; default: the last w
        all_real: bool = False,  # every query is a real token whose own column is a key: no slot needs its own
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Explicit masks [B, 1, w, W]: a query sees the real keys at or before its own index.

        ALiBi models that build their bias from `cumsum(mask) - 1` get the 2-D mask [B, W] of real columns instead: a
        row's real columns hold its buffer indices in increasing order (appended in order, compaction is stable), so
        the cumsum counts exactly the row's earlier tokens (its plain position), and the model's own causal mask over
        columns sees exactly the real keys at or before each query."""
        if self.alibi_mask:
            return (keys >= 0).long()  # [B, W]
        q = queries[:, :, None]  # [B, w, 1]
        k = keys[:, None, :]  # [B, 1, W]
        allowed = (k >= 0) & (k <= q)  # [B, w, W]
        if not all_real:
            allowed &= q >= 0
        masks = {"full_attention": allowed}
        if self.sliding_window is not None:
            masks["sliding_attention"] = allowed & (q - k < self.sliding_window)
        if self.chunk_size is not None:  # a query sees the keys of its own chunk of positions (as HF's overlay)
            pad = self.pad_lengths[:, None, None]
            masks["chunked_attention"] = allowed & ((q - pad) // self.chunk_size == (k - pad) // self.chunk_size)
        if not all_real:  # every query sees at least its own column, so that unused slots never produce NaNs
            width = queries.shape[1]
            if own_columns is None:
                own_columns = keys.shape[1] - width + torch.arange(width, device=keys.device)
            own = torch.arange(keys.shape[1], device=keys.device)[None, None, :] == own_columns[None, :, None]  # [1,w,W]
            masks = {name: mask | own for name, mask in masks.items()}
        masks = {name: self._to_model_format(m[:, None]) for name, m in masks.items()}
        if self.layer_types is not None:
            return {name: masks.get(name) for name in set(self.layer_types)}  # linear_attention: set by forward
        return masks["sliding_attention" if self.sliding_window is not None else "full_attention"]

    def _to_model_format(self, allowed: torch.Tensor) -> torch.Tensor:
        if not self.eager:
            return allowed
        blocked = torch.finfo(self.mask_dtype).min
        return torch.zeros(allowed.shape, dtype=self.mask_dtype, device=allowed.device).masked_fill(~allowed, blocked)

    def rollback(self, cached_lengths: torch.Tensor, host_cached: np.ndarray | None = None) -> None:
        """Keep only buffer indices < cached_lengths[i] ([B]) of each row; crop or compact the holes. With
        `host_cached` (the same lengths, on the host) the crop and compaction widths come from `host`: no read."""
        host = self.host_columns() if host_cached is not None else None
        dropped = host.rolled_back(host_cached) if host is not None else None
        if dropped is None:  # no host copy, or a rollback past the latest forward: read the columns
            self._rollback_read(cached_lengths)
            return
        keep = None
        if dropped:
            self.cached_lengths = torch.minimum(self.cached_lengths, cached_lengths)
            keep = (self.column_index >= 0) & (self.column_index < self.cached_lengths[:, None])  # [B, W]
            self.column_index = torch.where(keep, self.column_index, -1)
        new_width = host.width()
        if new_width < self.width:
            crop_cache(self.cache, new_width - self.width)
            self.column_index = self.column_index[:, :new_width]
        holes = 1.0 - host.real().sum() / max(len(host.cached) * self.width, 1)
        if self.width >= COMPACT_MIN_COLUMNS and holes > COMPACT_HOLE_SHARE:
            self.compact(self.column_index >= 0)
            host.compacted(self.width)

    def _rollback_read(self, cached_lengths: torch.Tensor) -> None:
        """`rollback` without the host's copy: the widths are read from the device (and the copy is dropped)."""
        self.host = None
        self.cached_lengths = torch.minimum(self.cached_lengths, cached_lengths)
        if self.recurrent is not None:
            self.recurrent.rollback(self.cached_lengths)
        keep = (self.column_index >= 0) & (self.column_index < self.cached_lengths[:, None])  # [B, W]
        self.column_index = torch.where(keep, self.column_index, -1)
        used = keep.any(0).nonzero()
        new_width = int(used.max().item()) + 1 if used.numel() else 0
        if new_width < self.width:
            crop_cache(self.cache, new_width - self.width)
            self.column_index = self.column_index[:, :new_width]
            keep = keep[:, :new_width]
        if self.width >= COMPACT_MIN_COLUMNS and (~keep).float().mean().item() > COMPACT_HOLE_SHARE:
            self.compact(keep)

    def host_columns(self) -> HostColumns | None:
        """The host's copy of each row's cached length and newest real column, read from the device (one read)
        when lost; None for views whose rollback is not this one (recurrent layers, static caches)."""
        if self.host is None and self.recurrent is None and type(self).rollback is CacheView.rollback:
            columns = torch.arange(self.width, device=self.column_index.device)  # [W]
            last = torch.where(self.column_index >= 0, columns, -1).amax(1) if self.width else -torch.ones_like(
                self.cached_lengths)  # fmt: skip
            cached, last, pad = torch.stack([self.cached_lengths, last, self.pad_lengths]).cpu().numpy()
            self.host = HostColumns(
                cached=cached.astype(np.int64), last=last.astype(np.int64), pad=pad.astype(np.int64)
            )
        return self.host

    def compact(self, keep: torch.Tensor) -> None:
        """Gather each row's real columns to the right end of a narrower cache (holes move left)."""
        if self.host is not None:  # the most real columns of any row, as the host knows them
            new_width = int(self.host.real().max())
        else:
            new_width = int(keep.sum(1).max().item())
        order = torch.sort(keep.to(torch.int8), dim=1, stable=True).indices[:, self.width - new_width :]  # [B, W']
        self.column_index = self.column_index.gather(1, order)
        index = PerDevice(order[:, None, :, None])  # [B, 1, W', 1], on each layer's device
        for layer in self.kv_layers():
            if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
                continue
            on = index.on(layer.keys.device)
            layer.keys = layer.keys.gather(2, on.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, on.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))

    def select_rows(self, keep: torch.Tensor, host_keep: np.ndarray | None = None) -> None:
        """Keep only rows `keep` ([B'] indices) in the cache and the maps (each layer indexed on its own device);
        `host_keep`: the same indices on the host (else the host's copy is read again when next needed)."""
        rows = PerDevice(keep)
        select_cache_rows(self.cache, rows)
        if self.recurrent is not None:  # transformers' recurrent layers cannot select rows: `hf_specdec.recurrent` does
            self.recurrent.select_rows(rows)
        self.column_index = self.column_index[keep]
        self.cached_lengths = self.cached_lengths[keep]
        self.pad_lengths = self.pad_lengths[keep]
        self.host = self.host.select(host_keep) if self.host is not None and host_keep is not None else None
