"""Grouped-query attention without copying the key-value heads, for hf_specdec's own forwards.

transformers' SDPA attention cannot pass an explicit mask together with `enable_gqa` on CUDA (PyTorch would fall
back to its math kernel), so for a query wider than one token it copies every key-value head `n_rep` times
(`repeat_kv`) over the whole cache, in every layer and every forward. hf_specdec always passes an explicit 4-D mask
(its caches have holes), and on a static cache that copy runs over every allocated column: on an H100 at batch 128
the copies were a quarter of a captured step (docs/benchmarks.md, "Profile of the batched step").

The same attention, without the copy: the `n_rep` query heads that share a key-value head become `n_rep` blocks of
one longer query, [B, H, w, D] -> [B, H_kv, n_rep * w, D], and the mask is tiled to match, [B, 1, w, L] ->
[B, 1, n_rep * w, L]. Each query row still sees exactly its own keys under its own mask row; the copy moves from the
[B, H, L, D] keys and values to the [B, H, w, D] queries (w is k + 1, L the cache length). Only queries at most
`MAX_QUERY_WIDTH` wide are folded (a step's forwards); a prefill keeps transformers' path (on an H100 at B = 32 a
call whose prefill was folded was slower than one whose prefill was not: docs/benchmarks.md).

transformers looks attention functions up by name (`AttentionInterface`, public API): `install()` registers a
wrapper under "sdpa" that runs the grouped form only when a forward passes `hf_specdec_grouped_attention=True`
(hf_specdec's static-cache forwards do) and calls the function it replaced, unchanged, otherwise. Every other
caller of a model, in this process or thread, gets transformers' own SDPA attention, bit for bit.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel

#: The forward keyword that asks for the grouped form (it reaches the attention function through **kwargs).
KWARG = "hf_specdec_grouped_attention"

#: The widest query folded: a step's forwards (k + 1 wide) gain, a prefill's long queries keep transformers' path.
MAX_QUERY_WIDTH = 16

_INSTALL_LOCK = threading.Lock()


def forward_kwargs(model: PreTrainedModel) -> dict[str, bool]:
    """What hf_specdec's forwards of `model` pass to get grouped attention: `{KWARG: True}` for an SDPA model with
    grouped key-value heads whose forward takes **kwargs (through which transformers hands keywords to its attention
    functions), else nothing. Installs the wrapper on first use."""
    config = model.config.get_text_config()
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    grouped = isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads < heads
    if model.config._attn_implementation != "sdpa" or not grouped or not _takes_kwargs(model):
        return {}
    install()
    return {KWARG: True}


def install() -> None:
    """Register the wrapper under "sdpa" (once; it keeps the function it replaces and calls it for everyone else)."""
    with _INSTALL_LOCK:
        current = AttentionInterface()["sdpa"]  # the class-wide entry (no instance overrides)
        if getattr(current, "hf_specdec_fallback", None) is None:
            AttentionInterface.register("sdpa", _wrap(current))


def _wrap(fallback: Callable) -> Callable:
    def sdpa_attention(
        module: torch.nn.Module,
        query: torch.Tensor,  # [B, H, w, D]
        key: torch.Tensor,  # [B, H_kv, L, D]
        value: torch.Tensor,  # [B, H_kv, L, Dv]
        attention_mask: torch.Tensor | None,  # [B or 1, 1, w, L] bool or additive
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if kwargs.pop(KWARG, False) and _groupable(query, key, attention_mask, dropout, kwargs):
            return grouped_sdpa(query, key, value, attention_mask, scaling), None
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    sdpa_attention.hf_specdec_fallback = fallback
    return sdpa_attention


def _groupable(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, dropout: float, kwargs: dict) -> bool:
    """Whether the grouped form computes what transformers' SDPA attention would: an explicit mask shared by the
    heads, grouped heads, and none of what that function treats specially (position bias, softcap, weights)."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dim() == 4
        and mask.shape[1] == 1
        and query.shape[2] <= MAX_QUERY_WIDTH
        and query.shape[1] > key.shape[1]
        and query.shape[1] % key.shape[1] == 0
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )


def grouped_sdpa(
    query: torch.Tensor,  # [B, H, w, D]
    key: torch.Tensor,  # [B, H_kv, L, D]
    value: torch.Tensor,  # [B, H_kv, L, Dv]
    mask: torch.Tensor,  # [B or 1, 1, w, L'] with L' >= L (transformers' masks may be wider than the keys)
    scale: float | None,
) -> torch.Tensor:  # [B, w, H, Dv], as transformers' attention functions return it
    batch, heads, width, _ = query.shape
    kv_heads = key.shape[1]
    n_rep = heads // kv_heads
    # Head h = g * n_rep + r (transformers' repeat_kv order) becomes query rows r * w .. r * w + w - 1 of group g.
    grouped_query = query.reshape(batch, kv_heads, n_rep * width, query.shape[-1])  # [B, H_kv, n_rep * w, D]
    grouped_mask = mask[..., : key.shape[2]].repeat(1, 1, n_rep, 1)  # [B or 1, 1, n_rep * w, L]
    output = torch.nn.functional.scaled_dot_product_attention(
        grouped_query, key, value, attn_mask=grouped_mask, scale=scale
    )  # [B, H_kv, n_rep * w, Dv]
    return output.reshape(batch, heads, width, value.shape[-1]).transpose(1, 2).contiguous()


def _takes_kwargs(model: PreTrainedModel) -> bool:
    """Whether `model.forward` takes **kwargs (the way a keyword reaches transformers' attention functions)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
