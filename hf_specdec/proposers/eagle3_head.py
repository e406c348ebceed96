"""`Eagle3Head` and `load_draft_head`: an EAGLE-3 draft head read from either published checkpoint layout.

An EAGLE-3 head is one decoder layer on top of the target: `fc` projects three of the target's hidden states (the
inputs of decoder layers `aux_layer_ids`, concatenated) to the hidden size; the layer's attention reads
`[input_layernorm(embedding) ‖ hidden_norm(hidden)]` (2H wide) and adds to `hidden`; `lm_head(norm(.))` scores a
reduced draft vocabulary, mapped to the target's by `d2t` (target id = draft id + d2t[draft id]). Two layouts:
the EAGLE authors' (SafeAILab/EAGLE `eagle/model/cnets.py`: a Llama config plus `draft_vocab_size`, keys `midlayer.*`)
and vllm-project/speculators' (`models/eagle3`: `speculators_model_type: "eagle3"`, `transformer_layer_config`,
`eagle_aux_hidden_state_layer_ids`, keys `layers.0.*`). The module is built from transformers' Llama pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from hf_specdec import compat

__all__ = ["Eagle3Head", "is_eagle3_head", "load_draft_head"]

LAYOUTS = ("eagle", "speculators")


class Eagle3Layer(nn.Module):
    """The head's decoder layer: Llama's, with q/k/v projections reading 2H (embedding and hidden side by side)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        bias = bool(getattr(config, "attention_bias", False))
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.self_attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (build it with `load_draft_head`).

    Args:
        config (`LlamaConfig`): The decoder layer's config (`vocab_size` is the target's vocabulary).
        draft_vocab_size (`int`): Rows of `lm_head`.
        target_hidden_size (`int`): Hidden size of the target's states that `fc` reads (3 of them).
        aux_layer_ids (`list[int]`, *optional*): Target decoder layers whose inputs the head reads; None: EAGLE-3's
            default `[2, L // 2, L - 3]` for a target of L layers.
        norm_before_residual (`bool`): speculators' option: the residual is `hidden_norm(hidden)` instead of `hidden`.
        own_embeddings (`bool`): The checkpoint carries `embed_tokens`; otherwise the target's embeddings are used.
        layout (`str`): The layout it was read from (`"eagle"` or `"speculators"`).
    """

    def __init__(
        self,
        config: LlamaConfig,
        draft_vocab_size: int,
        target_hidden_size: int,
        aux_layer_ids: list[int] | None = None,
        norm_before_residual: bool = False,
        own_embeddings: bool = False,
        layout: str = "eagle",
    ) -> None:
        super().__init__()
        config._attn_implementation = "sdpa"
        self.config = config
        self.layout = layout
        self.draft_vocab_size = draft_vocab_size
        self.target_hidden_size = target_hidden_size
        self.aux_layer_ids = None if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
        self.norm_before_residual = norm_before_residual
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embeddings else None
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # [Vd] target id - draft id
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))  # [V] in the draft vocabulary

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def layer_ids_for(self, num_target_layers: int) -> list[int]:
        """The target decoder layers whose inputs the head reads, for a target of `num_target_layers` layers."""
        if self.aux_layer_ids is not None:
            return list(self.aux_layer_ids)
        return [2, num_target_layers // 2, num_target_layers - 3]

    def draft_to_target(self) -> torch.Tensor:  # [Vd] the target id of each draft id
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(
        self,
        embeds: torch.Tensor,  # [B, s, H] the embeddings of the tokens fed
        hidden: torch.Tensor,  # [B, s, H] fc(target states) for context slots, the head's own output for drafts
        attention_mask: torch.Tensor | None,  # [B, 1, s, W + s] bool (sdpa) or additive (eager), or None: causal
        position_ids: torch.Tensor,  # [B, s]
        cache: Any = None,  # a DynamicCache or StaticCache with one layer, or None
        **attention_kwargs: Any,  # passed to the attention function (hf_specdec's grouped attention on static caches)
    ) -> torch.Tensor:  # [B, s, H] the layer's output (before `norm`)
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        states = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)  # [B, s, 2H]
        position_embeddings = self.rotary_emb(states, position_ids)
        kwargs = {} if cache is None else compat.cache_kwargs(layer.self_attn, cache)
        attended, _ = layer.self_attn(
            hidden_states=states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
            **attention_kwargs,
        )
        hidden = residual + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., Vd]
        """Draft-vocabulary logits of the layer's output."""
        return self.lm_head(self.norm(hidden))


def is_eagle3_head(obj: object) -> bool:
    return isinstance(obj, Eagle3Head)


def load_draft_head(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Eagle3Head:
    """Load an EAGLE-3 draft head from a local directory with `config.json` and `model.safetensors` (or
    `pytorch_model.bin`), in the EAGLE authors' layout or the speculators layout.

    Args:
        path (`str` or `Path`): The directory.
        dtype (`torch.dtype`, *optional*): Weights' dtype; defaults to float32 on the CPU, the checkpoint's elsewhere.
        device (`str` or `torch.device`, defaults to `"cpu"`): Where the head goes (the target's device).

    Returns:
        `Eagle3Head` in eval mode; pass it as `SpecDecoder(draft_head=head)` or, after `hf_specdec.install()`, as
        `model.generate(..., assistant_model=head)`.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"load_draft_head({str(path)!r}): no config.json there. Pass a local directory holding an EAGLE-3 head's "
            "config.json and model.safetensors (or pytorch_model.bin); download a Hub head first with "
            "huggingface_hub.snapshot_download(repo_id)."
        )
    raw = json.loads(config_file.read_text())
    weights = _read_weights(directory)
    if raw.get("speculators_model_type") is not None:
        head = _build_speculators(raw, weights, path)
    else:
        head = _build_eagle(raw, weights, path)
    _load_state(head, weights, path)
    if dtype is None:
        floating = [t.dtype for t in weights.values() if t.is_floating_point()]
        dtype = torch.float32 if torch.device(device).type == "cpu" or not floating else floating[0]
    return head.to(device=device, dtype=dtype).eval()


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    safetensors_file = directory / "model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = directory / "pytorch_model.bin"
    if bin_file.is_file():
        return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    raise ValueError(
        f"load_draft_head({str(directory)!r}): neither model.safetensors nor pytorch_model.bin is there (sharded heads "
        "are not supported): put the head's single weights file next to its config.json."
    )


def _build_eagle(raw: dict[str, Any], weights: dict[str, torch.Tensor], path: str | Path) -> Eagle3Head:
    """The EAGLE authors' layout: config.json is the layer's Llama config plus `draft_vocab_size`."""
    if "midlayer.self_attn.q_proj.weight" not in weights:
        raise ValueError(
            f"load_draft_head({str(path)!r}): config.json has no speculators_model_type and the weights have no "
            f"midlayer.* keys (found e.g. {sorted(weights)[:4]}): this is not an EAGLE-3 head in the EAGLE authors' "
            "layout or the speculators layout. EAGLE-1/2 heads (no fc over three states) are not supported."
        )
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "eagle_config", "draft_vocab_size")}
    config = LlamaConfig(**fields)
    config.num_hidden_layers = 1
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return _new_head(config, raw.get("draft_vocab_size"), raw.get("target_hidden_size"), aux, False, weights, "eagle")


def _build_speculators(raw: dict[str, Any], weights: dict[str, torch.Tensor], path: str | Path) -> Eagle3Head:
    """The speculators layout: `transformer_layer_config` holds the layer's config, weights are `layers.0.*`."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(
            f"load_draft_head({str(path)!r}): speculators_model_type={kind!r}; only 'eagle3' heads are supported."
        )
    layer_config = dict(raw.get("transformer_layer_config") or {})
    if layer_config.get("model_type", "llama") != "llama":
        raise ValueError(
            f"load_draft_head({str(path)!r}): transformer_layer_config.model_type={layer_config['model_type']!r}; "
            "only Llama-style head layers are supported."
        )
    layer_config.pop("model_type", None)
    config = LlamaConfig(**layer_config)
    config.num_hidden_layers = 1
    if any(key.startswith("layers.1.") for key in weights):
        raise ValueError(f"load_draft_head({str(path)!r}): heads with more than one decoder layer are not supported.")
    for key in [k for k in weights if k.startswith("layers.0.")]:
        weights["midlayer." + key[len("layers.0.") :]] = weights.pop(key)
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    norm_first = bool(raw.get("norm_before_residual", False))
    return _new_head(
        config, raw.get("draft_vocab_size"), raw.get("target_hidden_size"), aux, norm_first, weights, "speculators"
    )


def _new_head(
    config: LlamaConfig,
    draft_vocab_size: int | None,
    target_hidden_size: int | None,
    aux: list[int] | None,
    norm_before_residual: bool,
    weights: dict[str, torch.Tensor],
    layout: str,
) -> Eagle3Head:
    draft_vocab_size = int(draft_vocab_size or weights["lm_head.weight"].shape[0])
    if aux is not None and len(aux) != 3:
        raise ValueError(f"An EAGLE-3 head reads three target layers, but its config names {list(aux)}.")
    return Eagle3Head(
        config,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=int(target_hidden_size or config.hidden_size),
        aux_layer_ids=aux,
        norm_before_residual=norm_before_residual,
        own_embeddings="embed_tokens.weight" in weights,
        layout=layout,
    )


def _load_state(head: Eagle3Head, weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Copy the checkpoint into the head: every key the head has must be there (d2t/t2d may be absent when the draft
    vocabulary is the target's), with its shape; unknown keys are refused."""
    state = head.state_dict()
    optional = {"d2t", "t2d"} if head.draft_vocab_size == head.config.vocab_size else set()
    missing = sorted(set(state) - set(weights) - optional)
    unknown = sorted(set(weights) - set(state) - {"verifier_lm_head.weight"})
    if missing or unknown:
        raise ValueError(
            f"load_draft_head({str(path)!r}): the weights do not match an EAGLE-3 head of this config (missing "
            f"{missing[:6]}, unexpected {unknown[:6]}): check that config.json belongs to this model.safetensors."
        )
    for key, tensor in state.items():
        if key in weights and weights[key].shape != tensor.shape:
            raise ValueError(
                f"load_draft_head({str(path)!r}): {key} has shape {tuple(weights[key].shape)} but the config implies "
                f"{tuple(tensor.shape)}: check hidden_size, draft_vocab_size and vocab_size in config.json."
            )
    head.load_state_dict({k: v for k, v in weights.items() if k in state}, strict=False)
    if int(head.t2d.sum()) != head.draft_vocab_size and "t2d" in weights:
        raise ValueError(
            f"load_draft_head({str(path)!r}): t2d marks {int(head.t2d.sum())} target tokens but draft_vocab_size is "
            f"{head.draft_vocab_size}: the maps do not belong to this head."
        )
    target_ids = head.draft_to_target()
    if target_ids.min() < 0 or target_ids.max() >= head.config.vocab_size:
        raise ValueError(
            f"load_draft_head({str(path)!r}): d2t maps draft ids outside the vocabulary 0..{head.config.vocab_size - 1}."
        )
