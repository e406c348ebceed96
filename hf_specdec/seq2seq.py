"""Encoder-decoder targets: the decoder's cache over ragged rows, fed the encoder output `generate` computed.

`generate` runs the encoder once and hands its output to `custom_generate` (`encoder_outputs`, plus the encoder's
`attention_mask`); the speculative loop only decodes. `Seq2SeqCacheView` is a `CacheView` whose forwards call the
decoder with that encoder output, an `EncoderDecoderCache` (the cross-attention half is filled once and only
follows row selection; the self-attention half follows the column map) and explicit 4-D decoder masks and
position ids. A draft shares the target's encoder output: a decoder-only draft with cross-attention
(distil-whisper's `WhisperForCausalLM`), or a smaller encoder-decoder whose decoder reads the same encoder states.
Decoders without a position-ids input but with an absolute position table that takes `position_ids` (BART,
mBART, Marian, Pegasus) get each row's positions through a forward hook on that table (`RowPositions`); others
(T5's relative bias, M2M100) cannot skip holes, so they are accepted at batch 1 only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from hf_specdec import compat
from hf_specdec.cache import CacheView
from hf_specdec.devices import PerDevice


@dataclass
class EncoderState:
    """The encoder output every decoder forward cross-attends to, for the live rows."""

    hidden: torch.Tensor  # [B, S, H] the encoder's last hidden state
    mask: torch.Tensor | None  # [B, S] the encoder's attention mask, or None

    def select_rows(self, keep: torch.Tensor | PerDevice) -> EncoderState:
        keep = keep if isinstance(keep, PerDevice) else PerDevice(keep)  # the encoder's output may sit elsewhere
        return EncoderState(keep.rows(self.hidden), keep.rows(self.mask) if self.mask is not None else None)


def encoder_state(model_kwargs: dict[str, Any]) -> EncoderState:
    """The encoder output that `generate` prepared for an encoder-decoder call."""
    outputs = model_kwargs.get("encoder_outputs")
    if outputs is None:
        raise ValueError("An encoder-decoder call reached hf_specdec without encoder_outputs: call model.generate.")
    hidden = outputs[0] if isinstance(outputs, (tuple, list)) else outputs.last_hidden_state
    return EncoderState(hidden, model_kwargs.get("attention_mask"))


def takes_position_ids(model: PreTrainedModel) -> bool:
    """Whether the model's decoder takes explicit position ids (needed to skip holes in the cache)."""
    params = inspect.signature(model.forward).parameters
    if model.config.is_encoder_decoder:
        return "decoder_position_ids" in params
    # decoder-only with cross-attention (WhisperForCausalLM) passes **kwargs to a decoder that takes position_ids
    decoder = getattr(getattr(model, "model", None), "decoder", None)
    return decoder is not None and "position_ids" in inspect.signature(decoder.forward).parameters


def position_table(model: PreTrainedModel) -> torch.nn.Module | None:
    """The decoder's absolute position table if it takes `position_ids` (BART, Marian, ...), else None."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    table = getattr(decoder, "embed_positions", None)
    if not isinstance(table, torch.nn.Module):
        return None
    return table if "position_ids" in inspect.signature(table.forward).parameters else None


def positions_supported(model: PreTrainedModel) -> bool:
    """Whether each row can get its own decoder positions (so the cache may hold holes)."""
    return takes_position_ids(model) or position_table(model) is not None


class RowPositions:
    """A forward hook on a decoder's position table: its output becomes each row's own positions' embeddings.

    Such decoders compute one position range from the cache width for all rows; the hook calls the table once per
    row with that row's position ids (the table's own lookup, so the values are exactly what plain decoding adds).
    """

    def __init__(self, table: torch.nn.Module) -> None:
        self.table = table
        self.position_ids: torch.Tensor | None = None  # [B, w] for the forward under way
        self.fired = False

    def __call__(self, module, args, kwargs, output):  # noqa: ANN001, ANN204
        position_ids = self.position_ids.to(output.device)  # where the table ran (a decoder spread over devices)
        rows = [module.forward(*args, **{**kwargs, "position_ids": ids}) for ids in position_ids]
        width, hidden = self.position_ids.shape[1], rows[0].shape[-1]
        self.fired = True
        return torch.stack([r.reshape(width, hidden) for r in rows])  # [B, w, H]

    def run(self, forward, position_ids: torch.Tensor):  # noqa: ANN001, ANN201
        self.position_ids, self.fired = position_ids, False
        handle = self.table.register_forward_hook(self, with_kwargs=True)
        try:
            outputs = forward()
        finally:
            handle.remove()
        if not self.fired:
            raise NotImplementedError(
                f"The decoder's position table ({type(self.table).__name__}) was not called as hf_specdec expects, "
                "so per-row positions cannot be set: speculate at batch 1 for this model."
            )
        return outputs


def check_seq2seq_target(model: PreTrainedModel, batch_size: int, spec_method: str) -> None:
    """Raise a clear error for encoder-decoder calls this package cannot run exactly."""
    if spec_method not in ("draft", "ngram"):
        raise NotImplementedError(
            f"method={spec_method!r} is not supported for encoder-decoder targets ({type(model).__name__}): use an "
            "assistant_model (a smaller model reading the same encoder output) or prompt_lookup_num_tokens."
        )
    if batch_size > 1 and not positions_supported(model):
        raise NotImplementedError(
            f"{type(model).__name__}'s decoder takes no position ids, which hf_specdec needs to keep ragged rows "
            f"exact, so it speculates at batch 1 only (got {batch_size} rows): generate row by row, or without "
            "speculation. Whisper, BART, mBART, Marian and Pegasus are supported at any batch size."
        )


def check_seq2seq_draft(target: PreTrainedModel, draft: PreTrainedModel, hidden: int) -> None:
    """The draft must cross-attend to the target's encoder output as it is (no encoder of its own runs)."""
    config = draft.config
    has_cross = (
        config.is_encoder_decoder
        or getattr(config, "add_cross_attention", False)
        or hasattr(getattr(getattr(draft, "model", None), "decoder", None), "layers")
    )
    width = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
    if not has_cross or width != hidden:
        raise ValueError(
            f"The draft {type(draft).__name__} must read the target's encoder output (width {hidden}) through "
            f"cross-attention, but it has {'width ' + str(width) if has_cross else 'no cross-attention'}: use a "
            "smaller decoder trained on the same encoder (e.g. distil-whisper's WhisperForCausalLM, or a Whisper "
            "with the target's encoder), or prompt_lookup_num_tokens."
        )


class Seq2SeqCacheView(CacheView):
    """A decoder's `CacheView` over ragged rows, cross-attending to a fixed encoder output."""

    def __init__(self, model: PreTrainedModel, batch_size: int, pad_lengths: torch.Tensor, encoder: EncoderState):
        super().__init__(model, batch_size, pad_lengths)
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.encoder = encoder
        self.position_ids = takes_position_ids(model)
        table = None if self.position_ids else position_table(model)
        self.row_positions = RowPositions(table) if table is not None and not self.aligned else None
        if not self.position_ids and self.row_positions is None and not self.aligned:
            raise NotImplementedError(f"{type(model).__name__} takes no position ids: batch 1 without padding only.")

    def run_model(self, input_ids, mask, position_ids, logits_to_keep):  # noqa: ANN001, ANN201
        if self.row_positions is not None:
            return self.row_positions.run(
                lambda: self._run(input_ids, mask, position_ids, logits_to_keep), position_ids
            )
        return self._run(input_ids, mask, position_ids, logits_to_keep)

    def _run(self, input_ids, mask, position_ids, logits_to_keep):  # noqa: ANN001, ANN202
        home = input_ids.device
        input_ids, mask, position_ids = self.to_model(input_ids, mask, position_ids)
        positions = {}
        if self.model.config.is_encoder_decoder:
            if self.position_ids:
                positions["decoder_position_ids"] = position_ids
            outputs = self.model(
                decoder_input_ids=input_ids,
                decoder_attention_mask=mask,
                encoder_outputs=(self.encoder.hidden,),
                attention_mask=self.encoder.mask,
                **compat.cache_kwargs(self.model, self.cache),
                use_cache=True,
                **positions,
            )
        else:
            if self.position_ids:
                positions["position_ids"] = position_ids
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                encoder_outputs=self.encoder.hidden,
                **compat.cache_kwargs(self.model, self.cache),
                use_cache=True,
                **positions,
            )
        logits = outputs.logits.to(home)  # [B, w, V] on the batch's device
        if isinstance(logits_to_keep, torch.Tensor):  # these slots (transformers' meaning of a tensor)
            return logits[:, logits_to_keep.to(logits.device)]
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    def kv_layers(self) -> list:
        return self.cache.self_attention_cache.layers

    def select_rows(self, keep: torch.Tensor, host_keep: np.ndarray | None = None) -> None:
        super().select_rows(keep, host_keep)
        self.encoder = self.encoder.select_rows(keep)


def view_factory(encoder: EncoderState | None):  # noqa: ANN201
    """The CacheView factory of an encoder-decoder call (None without an encoder: the loop's plain CacheView)."""
    if encoder is None:
        return None
    return lambda model, batch: Seq2SeqCacheView(model, batch.batch_size, batch.pad_lengths, encoder)
