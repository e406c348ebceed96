"""Models for the grid benchmark (`bench_gpu_grid.py`): random-weight targets and synthetic drafts of real shapes.

Targets are shaped like Llama 3.x (1B, 3B for the 4B class, 8B; vocabulary 128 256) and Qwen3 (1.7B, 4B, 8B;
vocabulary 151 936; explicit head_dim 128), drafts from 2 to 28 layers in the target's layout. Weights are random,
made on the device; `make_decisive` gives a target a clear greedy rule (next token = `perm[current token]`), so a
`synthetic draft` can be right with a controlled probability alpha: it runs its real forward (its real cost), then
proposes `perm[token]` where a seeded hash of (position, token) falls below alpha, else a wrong token. Alpha is a
0-d tensor the forward reads, so a captured graph reads it too; each alpha gets its own draft object
(`with_alpha`: a shallow copy sharing the weights), as a user with a good and a useless draft has two models.

`forward_seconds` times one forward of a width over a static cache of some context, replayed as a CUDA graph where
it can be captured (what a captured step pays for it), else eagerly; `ideal_speedup` turns those costs into S*.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, StaticCache

LAYOUTS = {"llama": (LlamaConfig, LlamaForCausalLM, 128_256), "qwen3": (Qwen3Config, Qwen3ForCausalLM, 151_936)}

#: target name -> (layout, config kwargs). Untied heads everywhere (`make_decisive` writes the head); a tied head
#: costs the same per step.
TARGETS = {
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64)),
    "llama-3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                               num_attention_heads=24, num_key_value_heads=8, head_dim=128)),
    "llama-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)),
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
}  # fmt: skip

#: draft name -> config kwargs (in the target's layout and vocabulary)
DRAFTS = {
    "d2": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    ),  # fmt: skip
    "d4": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    ),  # the 124M-shaped draft of the tuned set-up  # fmt: skip
    "d16": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),  # Llama-3.2-1B-shaped  # fmt: skip
    "d28": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),  # Qwen3-0.6B-shaped  # fmt: skip
}

#: `--dry-run`: every model this small (layouts, layer counts up to 4 and explicit head_dim kept), on the CPU
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_VOCAB = 1024


class Setup:
    """Where and how models are built: the GPU in bf16, or (`tiny()`) tiny models on the CPU for a dry run."""

    device = "cuda"
    dtype = torch.bfloat16
    tiny = False

    @classmethod
    def use_tiny(cls) -> None:
        cls.device, cls.dtype, cls.tiny = "cpu", torch.float32, True


def sync() -> None:
    if Setup.device == "cuda":
        torch.cuda.synchronize()


def timed(fn):  # noqa: ANN001, ANN201
    """(seconds, result) of `fn()`, the device synchronized before and after."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


class GcPauses:
    """The garbage collector's pauses while installed (`with GcPauses() as pauses:`): each pause (ms, `pauses_ms`)
    and their sum since the last `take()`. In a process holding 8B models, kept graphs and dynamo's caches, one
    collection paused a call for 312 ms (670 ms against 312 ms for its neighbours): a round's ratio can carry it."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._since_take = 0.0
        self._started: float | None = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            ms = (time.perf_counter() - self._started) * 1e3
            self.pauses_ms.append(round(ms, 2))
            self._since_take += ms
            self._started = None

    def take(self) -> float:
        """Milliseconds paused since the last `take()`."""
        ms, self._since_take = self._since_take, 0.0
        return round(ms, 2)


def vocab_size(layout: str) -> int:
    return TINY_VOCAB if Setup.tiny else LAYOUTS[layout][2]


def _config(layout: str, shape: dict, max_positions: int):  # noqa: ANN202
    config_cls = LAYOUTS[layout][0]
    shape = dict(shape)
    if Setup.tiny:
        shape.update(TINY, num_hidden_layers=min(shape["num_hidden_layers"], 4))
    return config_cls(vocab_size=vocab_size(layout), max_position_embeddings=max_positions, rope_theta=500_000.0,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False, **shape)  # fmt: skip


def build(layout: str, shape: dict, seed: int, cls: type | None = None, max_positions: int = 8192) -> PreTrainedModel:
    """A random-weight model of `shape` on `Setup.device` (no EOS: every row generates its whole answer)."""
    config = _config(layout, shape, max_positions)
    cls = cls or LAYOUTS[layout][1]
    torch.manual_seed(seed)
    with torch.device(Setup.device):
        model = cls._from_config(config, attn_implementation="sdpa", dtype=Setup.dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def make_decisive(model: PreTrainedModel, seed: int = 0) -> torch.Tensor:  # [V] the rule: next = rule[current]
    """Give a random target one clear greedy choice, `rule[current token]`, with a wide logit margin (as
    `bench_gpu_e2e.make_decisive`, for any layout with `o_proj` / `down_proj`): the embeddings are scaled up and the
    layers' output projections down, so the residual stream stays near the token's embedding, and the head is made
    of permuted embeddings. Every layer still runs: the costs stay real. Returns the rule."""
    vocab = model.config.vocab_size
    model.model.embed_tokens.weight.mul_(50.0)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(1e-3)
        layer.mlp.down_proj.weight.mul_(1e-3)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).to(Setup.device)
    embed = model.model.embed_tokens.weight
    model.lm_head.weight.index_copy_(0, perm, embed / embed.norm(dim=1, keepdim=True).clamp_min(1e-3) * 4.0)
    return perm


_SYNTHETIC: dict[type, type] = {}


def synthetic_class(base: type) -> type:
    """`base` (a causal LM class) whose logits are replaced by a one-hot proposal, right with probability alpha."""
    if base in _SYNTHETIC:
        return _SYNTHETIC[base]

    class SyntheticDraft(base):
        rule: torch.Tensor  # [V] the target's next token after each token
        alpha_t: torch.Tensor  # 0-d float64: the chance a proposal is right (read by captured graphs too)

        def forward(self, input_ids=None, position_ids=None, cache_position=None, **kwargs):  # noqa: ANN001, ANN201
            out = super().forward(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                                  **kwargs)  # fmt: skip
            width = out.logits.shape[1]
            positions = position_ids if position_ids is not None else cache_position[None].expand_as(input_ids)
            pos = positions[:, -width:]  # [B, w]
            tok = input_ids[:, -width:]  # [B, w]
            truth = self.rule[tok]  # [B, w]
            h = (pos * 1_000_003 + tok) * 2_654_435_761 % (2**31)  # [B, w] seeded hash of (position, token)
            right = h.double() / 2**31 < self.alpha_t
            proposal = torch.where(right, truth, (truth + 1) % self.rule.shape[0])  # [B, w]
            logits = torch.full_like(out.logits, -30.0)
            out.logits = logits.scatter_(-1, proposal[..., None], 30.0)
            return out

    SyntheticDraft.__name__ = SyntheticDraft.__qualname__ = f"Synthetic{base.__name__}"
    _SYNTHETIC[base] = SyntheticDraft
    return SyntheticDraft


def build_draft(layout: str, name: str, rule: torch.Tensor, seed: int = 1) -> PreTrainedModel:
    """A synthetic draft of shape `DRAFTS[name]` proposing the target's `rule`; its alpha is set by `with_alpha`."""
    draft = build(layout, DRAFTS[name], seed, cls=synthetic_class(LAYOUTS[layout][1]))
    draft.rule = rule
    return draft


def with_alpha(draft: PreTrainedModel, alpha: float) -> PreTrainedModel:
    """A new draft object sharing `draft`'s weights, right with probability `alpha` (a model of its own for
    hf_specdec: its own serial, kept graphs and learned costs, as a user's second draft would have)."""
    clone = copy.copy(draft)  # the parameter and module tables are shared, not copied
    clone.alpha_t = torch.tensor(float(alpha), dtype=torch.float64, device=Setup.device)
    return clone


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random prompts; at B > 1 ragged (lengths in [length / 2, length], left-padded), as a served batch is."""
    g = torch.Generator().manual_seed(seed * 1000 + batch)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g) if batch > 1 else torch.full((1,), length)
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, length - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, length - n :] = 1
    return {"input_ids": ids.to(Setup.device), "attention_mask": mask.to(Setup.device)}


@torch.no_grad()
def forward_seconds(
    model: PreTrainedModel, batch: int, context: int, width: int, replays: int = 20
) -> tuple[float, bool]:
    """Seconds of one forward of `width` new tokens per row over a static cache holding `context` tokens, and whether
    it was timed as a replayed CUDA graph (else eagerly: on the CPU, or when the capture failed)."""
    length = context + width
    cache = StaticCache(config=model.config, max_cache_len=length)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), device=Setup.device)
    model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1,
          cache_position=torch.arange(context, device=Setup.device))  # fmt: skip
    positions = torch.arange(context, length, device=Setup.device)  # [w]
    visible = torch.arange(length, device=Setup.device)[None, :] <= positions[:, None]  # [w, L]
    inputs = dict(input_ids=ids[:, context:], position_ids=positions[None].expand(batch, -1), cache_position=positions,
                  attention_mask=visible[None, None].expand(batch, 1, -1, -1), past_key_values=cache, use_cache=True)  # fmt: skip

    counters = [layer.cumulative_length for layer in cache.layers if getattr(layer, "is_initialized", False)]
    offset = torch.tensor(context, device=Setup.device)

    def step() -> None:  # writes the same columns every time (the layers' write offsets go back first)
        torch._foreach_copy_(counters, [offset] * len(counters))
        model(**inputs)

    if Setup.device == "cuda":
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(3):
                graph.replay()
            sync()
            start = time.perf_counter()
            for _ in range(replays):
                graph.replay()
            sync()
            return (time.perf_counter() - start) / replays, True
        except Exception:  # noqa: BLE001 - not capturable here: time it eagerly
            sync()
    step()
    sync()
    start = time.perf_counter()
    for _ in range(max(3, replays // 4)):
        step()
    sync()
    return (time.perf_counter() - start) / max(3, replays // 4), False


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a drafting step emits on average with k drafts each right with probability alpha (independently)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def ideal_speedup(alpha: float, k: int, costs: dict[str, float]) -> dict[str, float]:
    """S* of a captured step drafting k (the draft's first forward 2 wide, the others 1, then a (k + 1)-wide verify)
    against a plain step (one 1-wide target forward): expected tokens per step / (step cost / plain step cost). The
    adaptive schedule may decode plainly, so what it can reach is max(1, S*)."""
    step = costs["draft_w2"] + (k - 1) * costs["draft_w1"] + costs["target_verify"]
    drafting = expected_tokens(alpha, k) * costs["target_w1"] / step
    return {"s_star_drafting": drafting, "s_star": max(1.0, drafting)}
