"""Benchmark on one GPU: MTP speculation (the target's own multi-token-prediction layer) in the captured step.

The target is a GLM-4.5-architecture model (`glm4_moe`) shaped like an 8B Llama (hidden 4096, 32 layers, 32 heads,
8 key-value heads, MLP 14336) with every layer dense (`first_k_dense_replace` = all layers) and one MTP layer (a small mixture of experts, as
transformers builds it), bf16,
random weights made decisive as in `bench_gpu_e2e.make_decisive` (next token = a permutation of the current one).
Its MTP layer is set to predict the same rule (its projection passes the token's embedding through, its block's
output projections are scaled down), so drafts are accepted and every layer still runs at its real cost.

Routes, timed in the same process and interleaved: plain eager `generate`, plain compiled `generate
(cache_implementation="static")`, hf_specdec MTP with no flags (static caches, whole steps captured), the same with
steps uncaptured (`HF_SPECDEC_CAPTURE_STEPS=0`: each forward launched from the host), and the dynamic path
(`cache_implementation="dynamic"`). Each with a constant k = 3 (the one layer cycles), after a warm-up round; fresh
`SpecDecoder`s each round; min and median of the per-round ratios; whether outputs equal plain's.

Run (GPU): `PYTHONPATH=. python benchmarks/bench_mtp_gpu.py --out mtp.json` (`--tiny` for a CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

import hf_specdec
from benchmarks import bench_gpu_e2e as e2e

K = 3


@torch.no_grad()
def build_target() -> tuple[torch.nn.Module, MtpModel]:
    shape = e2e.TARGET_SHAPE
    layers = shape["num_hidden_layers"]
    config = AutoConfig.for_model(
        "glm4_moe", vocab_size=e2e.VOCAB, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=layers, num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        first_k_dense_replace=layers + 1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        num_nextn_predict_layers=1, max_position_embeddings=8192, bos_token_id=1, eos_token_id=None, pad_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(e2e.DEVICE):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.device(e2e.DEVICE):  # built first: its initialisation would redraw the head it shares
        mtp = MtpModel(model, 1).to(torch.bfloat16).eval()
    e2e.make_decisive(model)
    hidden = config.hidden_size
    for name, tensor in [*mtp.named_parameters(), *mtp.named_buffers()]:  # the experts and router come uninitialised
        if "experts" in name or "gate" in name:
            tensor.zero_() if "bias" in name else tensor.normal_(0.0, config.initializer_range)
    for layer in mtp.layers:  # predicts what the target predicts: the token's own embedding decides
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))
        for name, parameter in layer.mtp_block.named_parameters():  # attention and MLP (or experts) outputs
            if "o_proj" in name or "down_proj" in name:
                parameter.mul_(1e-3)
    return model, mtp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a dry run of the script")
    args = parser.parse_args()
    if args.tiny:
        e2e.use_tiny_shapes()
        e2e.VOCAB = 512
    target, mtp = build_target()
    results: dict = {"meta": dict(gpu=e2e.device_name(), torch=torch.__version__,
                                  transformers=transformers.__version__, python=platform.python_version(), k=K,
                                  new_tokens=args.new_tokens, command=" ".join(sys.argv)), "rows": []}  # fmt: skip
    for batch in args.batches:
        inputs = e2e.prompts(batch, args.prompt_len, ragged=batch > 1)
        gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
        specs: dict[str, hf_specdec.SpecDecoder] = {}

        def ours(route: str):  # noqa: ANN202
            def call() -> torch.Tensor:
                spec = specs[route] = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=K,
                                                             num_speculative_tokens_schedule="constant")  # fmt: skip
                extra = {"cache_implementation": "dynamic"} if route == "ours_dynamic" else {}
                if route == "ours_uncaptured":
                    os.environ["HF_SPECDEC_CAPTURE_STEPS"] = "0"
                try:
                    return target.generate(**inputs, **gen, **extra, custom_generate=hf_specdec.generate,
                                           spec_decoder=spec)  # fmt: skip
                finally:
                    os.environ.pop("HF_SPECDEC_CAPTURE_STEPS", None)

            return call

        fns = {"plain_eager": lambda: target.generate(**inputs, **gen),
               "plain_compiled": lambda: target.generate(**inputs, **gen, cache_implementation="static"),
               "ours_captured": ours("ours_captured"), "ours_uncaptured": ours("ours_uncaptured"),
               "ours_dynamic": ours("ours_dynamic")}  # fmt: skip
        seconds: dict[str, list[float]] = {key: [] for key in fns}
        with torch.no_grad():
            reference = {key: fn() for key, fn in fns.items()}  # warm-up round (compiles plain static)
            fns["plain_compiled"]()  # its second call compiles again (10x slower in every H100 run)
            identical = {key: bool(torch.equal(out, reference["plain_eager"])) for key, out in reference.items()}
            for _ in range(args.rounds):
                for key, fn in fns.items():
                    e2e.sync()
                    start = time.perf_counter()
                    fn()
                    e2e.sync()
                    seconds[key].append(time.perf_counter() - start)
        ratios = {
            f"{ours}_vs_{base}": [b / o for b, o in zip(seconds[base], seconds[ours])]
            for ours in ("ours_captured", "ours_uncaptured", "ours_dynamic")
            for base in ("plain_eager", "plain_compiled")
        }
        ratios["captured_vs_uncaptured"] = [u / c for u, c in zip(seconds["ours_uncaptured"], seconds["ours_captured"])]
        stats = specs["ours_captured"].last_stats
        row = dict(batch=batch, tps_median={k: batch * args.new_tokens / statistics.median(v) for k, v in seconds.items()},
                   seconds=seconds, ratios={k: dict(min=min(v), median=statistics.median(v)) for k, v in ratios.items()},
                   identical_to_plain_eager=identical, mean_accepted_length=stats.mean_accepted_length,
                   steps=stats.num_steps, replays=stats.num_graph_replays)  # fmt: skip
        print(json.dumps({k: row[k] for k in ("batch", "tps_median", "ratios", "identical_to_plain_eager",
                                               "mean_accepted_length", "replays")}), flush=True)  # fmt: skip
        results["rows"].append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
