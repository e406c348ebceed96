"""A probe, not a benchmark: the one-token attention of a captured plain step at long contexts, per SDPA backend.

transformers 5.24's eager `sdpa_attention_forward` packs a one-token query of a grouped-query model into rows per
key/value head (`pack_gqa`: [B, H, 1, D] -> [B, KVH, H / KVH, D], keys not repeated), where compiled code repeats the
keys instead (`repeat_kv`, fused by inductor) and keeps one query row per head. The grid's P = 4 096 profile showed
cuDNN's kernel at 104 us per layer and step for the first against 31 us for the second. This times both layouts,
each SDPA backend alone, replayed as CUDA graphs, at the 8B Llama's shapes (32 heads, 8 key/value heads, head_dim
128, bf16) with a boolean mask as transformers passes it.

Run (GPU): `PYTHONPATH=. python benchmarks/probe_decode_attention_gpu.py [out.json]`.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, DIM = 32, 8, 128
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def replayed_us(fn, iterations: int = 50) -> float:  # noqa: ANN001
    """Microseconds per call of `fn`, captured `iterations` times in one CUDA graph and replayed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iterations):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * iterations)


def layouts(batch: int, keys: int, width: int) -> dict[str, tuple]:
    """(query, key, value, mask) per layout, as transformers' eager and compiled paths pass them."""
    device, dtype = "cuda", torch.bfloat16
    q = torch.randn(batch, HEADS, width, DIM, device=device, dtype=dtype)
    k = torch.randn(batch, KV_HEADS, keys, DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(batch, 1, width, keys, device=device, dtype=torch.bool)
    mask[..., keys * 3 // 4 :] = False  # the static cache's unused tail
    rep = HEADS // KV_HEADS
    out = {"repeat_kv": (q, k, v, mask)}  # the keys are repeated inside the timed call, as eager code does
    if width == 1:
        out["pack_gqa"] = (q.reshape(batch, KV_HEADS, rep, DIM), k, v, mask)
    return out


def attention(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if layout == "repeat_kv":
        rep = HEADS // KV_HEADS
        b, h, n, d = k.shape
        k = k[:, :, None].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)
        v = v[:, :, None].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main() -> None:
    rows = []
    for batch in (1, 16):
        for keys in (512, 4352):
            for width in (1, 6):
                for layout, (q, k, v, mask) in layouts(batch, keys, width).items():
                    for name, backend in BACKENDS.items():
                        try:
                            with sdpa_kernel([backend]):
                                us = replayed_us(lambda: attention(layout, q, k, v, mask))
                        except RuntimeError as error:  # this backend refuses these inputs
                            us = None
                            print(f"  {name} refused: {str(error)[:80]}")
                        row = dict(batch=batch, keys=keys, width=width, layout=layout, backend=name, us=us)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, command=" ".join(sys.argv))
        with open(sys.argv[1], "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
