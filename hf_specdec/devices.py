"""Indices on the device of the tensor they index: caches of a model spread over several devices.

The loop's bookkeeping (token buffer, column maps, row indices) lives on the batch's device, but a model placed with
accelerate's `device_map` keeps each layer's cache on that layer's device (layers 0-15 on cuda:0, 16-31 on cuda:1),
and a tensor indexed by an index on another GPU fails ("indices should be either on cpu or on the same device as
the indexed tensor"). `PerDevice` carries one index to each device it is used on, once per operation (no copy where
the devices agree, so a model on one device pays nothing); `select_cache_rows` keeps rows of every cache layer on its
own device. Every row selection, gather and scatter on cache tensors goes through these.
"""

from __future__ import annotations

import torch

from hf_specdec.compat import is_recurrent_layer


class PerDevice:
    """One index tensor, copied at most once to each device that uses it."""

    def __init__(self, index: torch.Tensor) -> None:
        self._copies: dict[torch.device, torch.Tensor] = {index.device: index}
        self.index = index

    def on(self, device: torch.device) -> torch.Tensor:
        """The index on `device` (the tensor itself when it is already there)."""
        copy = self._copies.get(device)
        if copy is None:
            # Between two GPUs the copy is ordered on their streams (no host sync); to or from the host it waits.
            between_gpus = device.type != "cpu" and self.index.device.type != "cpu"
            copy = self._copies[device] = self.index.to(device, non_blocking=between_gpus)
        return copy

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor[index]` (rows along dim 0), with the index on the tensor's device."""
        return tensor[self.on(tensor.device)]


def layer_device(layer: object) -> torch.device | None:
    """The device of a cache layer's keys (None before its first write)."""
    keys = getattr(layer, "keys", None)
    return keys.device if isinstance(keys, torch.Tensor) else None


def cache_layers(cache: object) -> list:
    """Every layer of a cache: a `DynamicCache`'s / `StaticCache`'s, or both halves of an `EncoderDecoderCache`."""
    halves = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    if any(half is not None for half in halves):
        return [layer for half in halves if half is not None for layer in half.layers]
    return list(cache.layers)


def select_cache_rows(cache: object, keep: torch.Tensor | PerDevice) -> None:
    """Keep rows `keep` ([B'] indices) of every attention layer of `cache`, each indexed on its own device
    (transformers' `batch_select_indices` indexes every layer with the index as given). Recurrent layers are left
    to `hf_specdec.recurrent`."""
    keep = keep if isinstance(keep, PerDevice) else PerDevice(keep)
    for layer in cache_layers(cache):
        if is_recurrent_layer(layer):
            continue
        device = layer_device(layer)
        layer.batch_select_indices(keep.on(device) if device is not None else keep.index)
