"""Benchmark: the Triton rejection sampler against the memory floor, the torch reference and an HF-style loop.

For B x k x V and two input formats — fp32 (target scores and draft probabilities in float32) and bf16 (target
logits and draft probabilities in bfloat16) — it times one verification step of a batch (random rows with draft
probabilities, ragged draft lengths) and prints, per case: µs per call (CUDA events, median of
`triton.testing.do_bench`), achieved GB/s over the floor's bytes, the ratio to the floor, and the speedups over
the torch reference (`rejection_sample_reference`, vectorised) and over an HF-style loop (one row and one position
at a time, like transformers' `_speculative_sampling`, measured only where it finishes quickly).

The floor is the bytes a sampler must read once — every target position [B, k+1, V] (a position's softmax needs
its whole row), the draft distribution and the exponentials at the one position per row where the residual is
sampled ([B, V] each) — divided by the device-to-device copy bandwidth measured in the same run (bytes read +
written). Reading all of draft_probs [B, k, V] is not required: only q(d_j) and one row of q are.

Run (GPU): `PYTHONPATH=. python benchmarks/bench_rejection.py --out rejection.json`
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
import triton
from triton.testing import do_bench

from hf_specdec.sampling import random as rnd
from hf_specdec.sampling.kernels import rejection_sample_triton
from hf_specdec.sampling.reference import rejection_sample_reference

BATCHES = (1, 8, 64, 256)
KS = (1, 4, 8)
VOCABS = (32_000, 128_256, 151_936)
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(256 * 2**20, device=device)  # 1 GiB of fp32
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def make_inputs(B: int, k: int, V: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """Random rows with draft probabilities close to the target's: long accepted runs and rejections."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(B, k + 1, V, device=device, generator=g) * 3.0  # [B, k+1, V]
    q = torch.softmax(logits[:, :k] + 0.5 * torch.randn(B, k, V, device=device, generator=g), dim=-1)  # [B, k, V]
    seeds = torch.arange(B, dtype=torch.int64, device=device) + seed
    drafts = torch.stack(
        [(q[:, j] / rnd.exponential(seeds, 0, rnd.STREAM_DRAFT + j, V)).argmax(-1) for j in range(k)], dim=1
    )  # [B, k] d_j ~ q_j
    return dict(
        target_logits=logits.to(dtype),
        draft_token_ids=drafts,
        num_draft_tokens=torch.randint(0, k + 1, (B,), device=device, generator=g),
        draft_probs=q.to(dtype),
        is_greedy=torch.zeros(B, dtype=torch.bool, device=device),
        uniforms=rnd.uniform(seeds, 0, rnd.STREAM_ACCEPT, k),
        exponentials=rnd.exponential(seeds, 0, rnd.STREAM_RESIDUAL, V),
    )


def hf_style_loop(inputs: dict) -> list[list[int]]:
    """One row and one position at a time, as a per-sequence sampler written in plain torch would do it."""
    logits, q, drafts = inputs["target_logits"], inputs["draft_probs"], inputs["draft_token_ids"]
    out = []
    for i in range(logits.shape[0]):
        n = int(inputs["num_draft_tokens"][i])
        row = []
        for j in range(n + 1):
            p = torch.softmax(logits[i, j].float(), dim=-1)  # [V]
            if j == n:
                row.append(int(torch.multinomial(p, 1)))
                break
            d = int(drafts[i, j])
            qd = float(q[i, j, d])
            if float(inputs["uniforms"][i, j]) * qd < float(p[d]):
                row.append(d)
                continue
            residual = (p - q[i, j].float()).clamp_min(0)  # [V]
            row.append(int(torch.multinomial(residual / residual.sum(), 1)))
            break
        out.append(row)
    return out


def tune(bandwidth: float) -> None:
    """Device time of the key case (B=64, k=4, V=128256) over the kernels' launch knobs."""
    device = torch.device("cuda")
    for fmt, dtype in FORMATS.items():
        inputs = make_inputs(64, 4, 128_256, dtype, device)
        floor_us = floor_bytes(inputs) / bandwidth * 1e6
        results = []
        for s1 in (None, 4, 8, 16, 32):
            for s2 in (None, 8, 32, 64):
                for bs in (1024, 2048, 4096):
                    knobs = dict(num_splits=(s1, s2), block_stats=bs, block_race=min(bs, 2048))
                    ms = graph_time_ms(inputs, **knobs)
                    results.append((ms * 1e3, knobs))
        results.sort(key=lambda r: r[0])
        default = graph_time_ms(inputs) * 1e3
        print(f"TUNE {fmt}: floor {floor_us:.1f} us, default {default:.1f} us; best:")
        for us, knobs in results[:5]:
            print(f"  {us:7.1f} us ({us / floor_us:.2f}x floor) {knobs}")


def floor_bytes(inputs: dict) -> int:
    """Target positions 0..n_i of every row, plus one row of q and of the exponentials per row."""
    B, _, V = inputs["target_logits"].shape
    size = inputs["target_logits"].element_size()
    positions = int((inputs["num_draft_tokens"] + 1).sum())
    return positions * V * size + B * V * inputs["draft_probs"].element_size() + B * V * 4


def graph_time_ms(inputs: dict, **knobs) -> float:
    """Device time of one call: the call captured in a CUDA graph, replays timed (no host launch overhead)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            rejection_sample_triton(**inputs, **knobs)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rejection_sample_triton(**inputs, **knobs)
    return do_bench(graph.replay, rep=200, return_mode="median")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = []
    for fmt in args.formats:
        for V in args.vocabs:
            for B in args.batches:
                for k in args.ks:
                    inputs = make_inputs(B, k, V, FORMATS[fmt], device)
                    out = rejection_sample_triton(**inputs)
                    assert torch.equal(out, rejection_sample_reference(**inputs)), (fmt, B, k, V)
                    t_triton = do_bench(lambda: rejection_sample_triton(**inputs), rep=200, return_mode="median")
                    t_graph = graph_time_ms(inputs)
                    t_torch = do_bench(lambda: rejection_sample_reference(**inputs), rep=200, return_mode="median")
                    t_loop = None
                    if B * k <= args.max_loop_work:
                        t_loop = do_bench(lambda: hf_style_loop(inputs), warmup=5, rep=50, return_mode="median")
                    floor_s = floor_bytes(inputs) / bandwidth
                    row = dict(
                        format=fmt, B=B, k=k, V=V, us_triton=t_triton * 1e3, us_graph=t_graph * 1e3, us_torch=t_torch * 1e3,
                        us_hf_loop=None if t_loop is None else t_loop * 1e3, us_floor=floor_s * 1e6,
                        gbps=floor_bytes(inputs) / (t_graph * 1e-3) / 1e9,
                        x_floor=t_triton * 1e-3 / floor_s, x_floor_graph=t_graph * 1e-3 / floor_s, speedup_vs_torch=t_torch / t_triton,
                        speedup_vs_hf_loop=None if t_loop is None else t_loop / t_triton,
                    )  # fmt: skip
                    rows.append(row)
                    loop = f"{row['speedup_vs_hf_loop']:9.1f}x" if t_loop is not None else "        -"
                    print(
                        f"{fmt} B={B:4d} k={k} V={V:6d}: {row['us_triton']:7.1f} us (graph {row['us_graph']:7.1f})  "
                        f"{row['gbps']:5.0f} GB/s  {row['x_floor']:6.2f}x floor (graph {row['x_floor_graph']:5.2f}x)  vs torch {row['speedup_vs_torch']:6.1f}x  vs loop {loop}",
                        flush=True,
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--vocabs", nargs="+", type=int, default=list(VOCABS))
    parser.add_argument("--max-loop-work", type=int, default=256, help="time the HF-style loop only for B*k <= this")
    parser.add_argument("--tune", action="store_true", help="only sweep the launch knobs on the key case")
    args = parser.parse_args()
    if args.tune:
        tune(copy_bandwidth(torch.device("cuda")))
        return
    rows = run(args)
    key = [r for r in rows if (r["B"], r["k"], r["V"]) == (64, 4, 128_256)]
    for r in key:
        print(f"KEY {r['format']} B=64 k=4 V=128256: {r['us_triton']:.1f} us ({r['us_graph']:.1f} in a graph), "
              f"floor {r['us_floor']:.1f} us: {r['x_floor']:.2f}x ({r['x_floor_graph']:.2f}x in a graph), "
              f"{r['speedup_vs_torch']:.1f}x torch, loop {r['speedup_vs_hf_loop']}")  # fmt: skip
    print("median x_floor over all cases:", statistics.median(r["x_floor"] for r in rows))
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    python=platform.python_version())  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
