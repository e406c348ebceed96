"""An EAGLE-3 head with controlled acceptance for the GPU benchmarks: real costs, the synthetic draft's proposals.

`SyntheticEagle3Head` is hf_specdec's `Eagle3Head` shaped like a published head for an 8B Llama (one decoder layer
over 2H inputs, `fc` over three target states, a 32k draft vocabulary mapped onto the target's by `d2t`): every
forward runs the real layer over the real inputs (the target's states from the verify, its own static cache) and
every `logits` call the real `lm_head`, so a step costs what a trained head's costs. Random weights accept nothing,
so, like `bench_gpu_e2e.SyntheticDraft`, the head then proposes the target's own greedy continuation (the same
`next_token` table) with probability alpha, decided by the same seeded hash of (position, token): a draft model and
this head see the very same right and wrong drafts. The proposal travels from `forward` to `logits` in the first
three channels of the hidden state (base-128 digits, exact in bf16).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from hf_specdec.proposers.eagle3_head import Eagle3Head

DRAFT_VOCAB = 32_000  # published EAGLE-3 heads for Llama 3 (128k tokens) draft from 32k


class _Latest:
    """Where the embedding leaves the ids of its latest call: one object for the embedding's life, so that the
    head's modules keep what hf_specdec's kept-graph check reads (`model_guard`) from call to call."""

    ids: torch.Tensor | None = None


class RecordingEmbedding(nn.Embedding):
    """The target's embeddings (the same weight), remembering the token ids of their latest call (the ids of the
    tokens the head is fed next)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.latest = _Latest()

    @property
    def ids(self) -> torch.Tensor | None:
        return self.latest.ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, s] -> [B, s, H]
        self.latest.ids = ids
        return super().forward(ids)


class SyntheticEagle3Head(Eagle3Head):
    """A real EAGLE-3 head forward whose drafts are right with probability `alpha` (see the module docstring)."""

    alpha: float = 0.8
    next_token: torch.Tensor  # [P, V] int32: the target's greedy token after (position, token), or -1
    draft_id: torch.Tensor  # [V] int64: each target token's draft id, or -1 outside the draft vocabulary

    def forward(self, embeds, hidden, attention_mask, position_ids, cache=None, **attention_kwargs):  # noqa: ANN001, ANN201
        out = super().forward(embeds, hidden, attention_mask, position_ids, cache, **attention_kwargs)  # [B, s, H]
        tokens = self.embed_tokens.ids  # [B, s] the fed tokens, embedded just before this forward
        positions = (position_ids + 1).clamp(0, self.next_token.shape[0] - 1)  # [B, s] a token's own position
        truth = self.next_token[positions, tokens].long()  # [B, s] target id, or -1
        h = (positions * 1_000_003 + tokens) * 2_654_435_761 % (2**31)  # [B, s] SyntheticDraft's hash
        truth_id = self.draft_id[truth.clamp(min=0)]  # [B, s] its draft id, or -1
        right = (h.double() / 2**31 < self.alpha) & (truth >= 0) & (truth_id >= 0)
        proposal = torch.where(right, truth_id, (truth_id.clamp(min=0) + 1) % self.draft_vocab_size)  # [B, s]
        digits = torch.stack([proposal % 128, proposal // 128 % 128, proposal // 16_384], dim=-1)  # [B, s, 3]
        return torch.cat([digits.to(out.dtype), out[..., 3:]], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., Vd]
        real = super().logits(hidden)  # the real head's cost
        digits = hidden[..., :3].float().round().long()  # [..., 3]
        proposal = digits[..., 0] + 128 * digits[..., 1] + 16_384 * digits[..., 2]  # [...]
        return torch.full_like(real, -30.0).scatter_(-1, proposal[..., None], 30.0)


@torch.no_grad()
def build_synthetic_head(target, next_token: torch.Tensor, draft_vocab: int = DRAFT_VOCAB) -> SyntheticEagle3Head:  # noqa: ANN001
    """A head for `target` (its shape, its embeddings shared), drafting from a vocabulary that holds every token of
    `next_token` ([P, V] int32, `bench_gpu_e2e.teach_synthetic_draft`'s table) first, then the lowest other ids."""
    config = target.config
    layers, vocab = config.num_hidden_layers, config.vocab_size
    device, dtype = target.device, target.dtype
    layer = LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads, num_hidden_layers=1, vocab_size=vocab,
        rms_norm_eps=config.rms_norm_eps, rope_theta=getattr(config, "rope_theta", 500_000.0),
        max_position_embeddings=config.max_position_embeddings,
    )  # fmt: skip
    draft_vocab = min(draft_vocab, vocab)
    aux = [2, layers // 2, layers - 3] if layers >= 6 else [1, max(1, layers // 2), layers]
    torch.manual_seed(2)
    with torch.device(device):
        head = SyntheticEagle3Head(layer, draft_vocab, config.hidden_size, aux_layer_ids=aux)
    head.embed_tokens = RecordingEmbedding(vocab, config.hidden_size, _weight=target.get_input_embeddings().weight)
    used = torch.unique(next_token[next_token >= 0].long())  # [n] the target ids the table proposes
    others = torch.ones(vocab, dtype=torch.bool, device=used.device)
    others[used] = False
    chosen = torch.cat([used, others.nonzero().squeeze(1)])[:draft_vocab].sort().values  # [Vd] increasing ids
    head.d2t.copy_(chosen - torch.arange(draft_vocab, device=chosen.device))
    head.t2d.zero_()
    head.t2d[chosen] = True
    head.draft_id = torch.full((vocab,), -1, dtype=torch.long, device=device)
    head.draft_id[chosen] = torch.arange(draft_vocab, device=device)
    head.next_token = next_token
    return head.to(dtype=dtype).eval()
