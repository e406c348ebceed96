"""`VerifyCapture`: what the target's latest forward (a verify, or the prefill) computed, read through hooks.

Proposers that draft from the target's own states (Gemma 4 assistants read its keys and values and its last
hidden state; DFlash reads the hidden states of some decoder layers) take them from the forward the loop runs
anyway, never from an extra one. Hooks on the target's decoder record the forward's attention masks (the
explicit masks with holes that `hf_specdec.cache.CacheView` builds, or None for one row without holes), its
cache object, its input width and its outputs; they live only while the `generate` call runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_specdec import compat
from hf_specdec.proposers.base import Proposer


class VerifyCapture:
    """Records, for the target's latest forward, its masks, cache, width, last hidden state and chosen layers' outputs.

    Args:
        target (`PreTrainedModel`): The model being decoded; hooks go on `target.get_decoder()`.
        layer_ids (`list[int]`): Decoder layers whose outputs to keep (DFlash's `target_layer_ids`).
        keep_last_hidden (`bool`): Keep the decoder's output (after its final norm).
        cache_layers (`list[int]`): Cache layers whose keys and values to keep as the forward left them (before
            the loop rolls the cache back).
        device (`torch.device`, *optional*): Where to keep the hidden states (a target spread over devices computes
            its layers on several: the drafter reads them on the batch's device). Keys and values stay where they are.
        keep_inputs (`bool`): Keep the forward's masks and cache object. A drafter that reads only layer outputs
            (EAGLE-3) passes False, so that no reference to a forward's mask or cache outlives its step (captured
            steps: `hf_specdec.graph_reuse` adopts only state every call has between steps).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        layer_ids: list[int] = (),
        keep_last_hidden: bool = True,
        cache_layers: list[int] = (),
        device: torch.device | None = None,
        keep_inputs: bool = True,
    ) -> None:
        self.decoder = target.get_decoder()
        self.device = device
        self.keep_inputs = keep_inputs
        self.layer_ids = list(layer_ids)
        self.keep_last_hidden = keep_last_hidden
        self.attention_mask: Any = None  # dict of [B, 1, w, W] masks (bool or additive), a tensor, or None
        self.cache: Any = None  # the forward's Cache object (its layers hold the forward's keys after it)
        self.width = 0  # w: slots the forward fed per row
        self.last_hidden: torch.Tensor | None = None  # [B, w', H] (w' = w, or fewer when logits_to_keep sliced)
        self.layer_outputs: dict[int, torch.Tensor] = {}  # layer id -> [B, w, H]
        self.cache_layers = list(cache_layers)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # cache layer -> keys, values [B, h, W, D]
        self.count = 0  # forwards seen
        self._handles: list[Any] = []
        self._owner: int | None = None  # the thread whose forwards the hooks record (`attach`)

    def attach(self) -> None:
        self.detach()
        self._owner = threading.get_ident()  # the hooks record only this thread's forwards: the model may be shared
        self._handles.append(self.decoder.register_forward_pre_hook(self._before, with_kwargs=True))
        if self.keep_last_hidden or self.cache_layers:
            self._handles.append(self.decoder.register_forward_hook(self._after))
        for layer_id in self.layer_ids:
            hook = self._layer_hook(layer_id)
            self._handles.append(self.decoder.layers[layer_id].register_forward_hook(hook))

    def detach(self) -> None:
        """Remove the hooks and drop what they kept (the call's tensors)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.forget()

    def forget(self) -> None:
        """Drop what the latest forward left (a proposer read it): no tensor of a step outlives it, so a later call
        with the same shapes can adopt this call's captured graphs (`hf_specdec.graph_reuse`)."""
        self.attention_mask = self.cache = self.last_hidden = None
        self.layer_outputs, self.kv = {}, {}

    def _mine(self) -> bool:
        """Whether the running forward is this call's (not another thread's call on the same model)."""
        return threading.get_ident() == self._owner

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._mine():
            return
        if self.keep_inputs:
            self.attention_mask = kwargs.get("attention_mask")
            self.cache = compat.get_cache(kwargs)
        fed = kwargs.get("input_ids")
        if fed is None:
            fed = kwargs.get("inputs_embeds")
        if fed is None and args:
            fed = args[0]
        self.width = int(fed.shape[1]) if fed is not None else 0
        self.layer_outputs = {}
        self.count += 1

    def _after(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self._mine():
            return
        hidden = getattr(output, "last_hidden_state", None)
        self.last_hidden = self._home(hidden if hidden is not None else output[0])
        # Rollback replaces a layer's tensors (crop slices, compaction gathers) and never writes into them.
        self.kv = {i: (self.cache.layers[i].keys, self.cache.layers[i].values) for i in self.cache_layers}

    def _layer_hook(self, layer_id: int):  # noqa: ANN202
        def keep(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not self._mine():
                return
            self.layer_outputs[layer_id] = self._home(output if isinstance(output, torch.Tensor) else output[0])

        return keep

    def _home(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` on `self.device` (no copy when it is there, or when no device was given)."""
        return hidden if self.device is None or hidden.device == self.device else hidden.to(self.device)


def allowed_keys(
    mask: torch.Tensor,  # [B, 1, w, W] bool (True = may attend) or additive float (0 = may attend)
    query_slot: torch.Tensor,  # [B] int64: the fed slot whose view to take, 0..w-1
) -> torch.Tensor:  # [B, W] bool
    """The keys one query of each row could attend to in a forward's explicit mask."""
    rows = torch.arange(mask.shape[0], device=mask.device)
    picked = mask[rows, 0, query_slot.to(mask.device)]  # [B, W]
    return picked if picked.dtype == torch.bool else picked == 0


class TargetStateDrafter(Proposer):
    """A proposer fed the target's states from the loop's own forwards (`self.capture`, a `VerifyCapture`): the
    hooks go on when the call starts and come off, dropping what they kept, when it ends; drafts come with their
    probabilities (Gemma 4 assistants, DFlash, EAGLE-3)."""

    returns_probs = True
    capture: VerifyCapture

    def attach(self, target: PreTrainedModel) -> None:
        self.capture.attach()

    def calibrate(self, time_verify: Callable[[int], float]) -> None:
        """The schedule's timing forwards ran the target: what they left is no verify's (and must not outlive them)."""
        self.capture.forget()

    def detach(self) -> None:
        self.capture.detach()
