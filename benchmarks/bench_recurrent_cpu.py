"""CPU cost of speculation's pieces on a hybrid target: a one-token step, a verify of k + 1 tokens, and the rollback.

A random Qwen3.5 text model (8 layers: 6 gated delta-net + 2 full attention, hidden 256, fp32) behind hf_specdec's
`CacheView`, with a 128-token prompt per row. For B rows and k drafts it times (median of --repeats):

- `step1`: one forward of one token per row (plain decoding's step);
- `verify`: one forward of k + 1 tokens per row (it includes the snapshot of the recurrent states);
- `snapshot`: cloning every recurrent layer's conv and recurrent state (part of `verify`);
- `rollback_mixers` (hf_specdec's method): restore the snapshot and re-run only the recurrent mixers over the kept
  tokens' recorded inputs, one batch per kept count, one token at a time (`ragged`: rows keep 1..k+1 tokens,
  several groups; `chunked`: the kept tokens in one chunked mixer call per group instead);
- `rollback_refeed` (the alternative): restore the snapshot, crop attention back and re-feed the kept tokens
  through the whole model (exact only when every row keeps the same count: one forward);
- `verify_sequential` (the other alternative, per-position states): the k + 1 tokens fed one at a time, so that
  the state after every position exists and rollback is a pick.

Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_recurrent_cpu.py [--batch 1 8] [--k 4]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from hf_specdec.cache import CacheView
from hf_specdec.recurrent import STEPWISE_MAX_TOKENS


def make_model(layers: int, hidden: int) -> torch.nn.Module:
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


@torch.no_grad()
def measure(model: torch.nn.Module, batch_size: int, k: int, prompt: int, repeats: int) -> dict[str, float]:
    capacity = prompt + 4 * (k + 1)
    token_ids = torch.randint(3, model.config.vocab_size, (batch_size, capacity))  # [B, C]
    view = CacheView(model, batch_size, torch.zeros(batch_size, dtype=torch.long))
    view.forward(token_ids, torch.full((batch_size,), prompt))
    view.rollback(torch.full((batch_size,), prompt))  # everything kept: the snapshot is dropped
    base = torch.full((batch_size,), prompt)  # [B]
    width = torch.full((batch_size,), k + 1)  # [B]
    same = torch.full((batch_size,), (k + 1) // 2)  # [B] every row keeps about half: one group
    ragged = 1 + torch.arange(batch_size) % (k + 1)  # [B] rows keep 1 .. k+1 tokens: several groups
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:  # noqa: ANN001
        start = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - start)

    for _ in range(repeats):
        timed("step1", lambda: view.forward(token_ids, torch.ones(batch_size, dtype=torch.long)))
        view.rollback(base)  # restore (no re-run: every row keeps 0)
        timed("snapshot", lambda: [view.recurrent._layer_states(i, clone=True) for i in view.recurrent.mixers])
        timed("verify", lambda: view.forward(token_ids, width))
        timed("rollback_mixers", lambda: view.rollback(base + same))
        view.rollback(base)
        view.forward(token_ids, width)
        timed("rollback_mixers_ragged", lambda: view.rollback(base + ragged))
        view.rollback(base)
        view.forward(token_ids, width)
        view.recurrent.stepwise_max_tokens = 0  # the kept tokens in one chunked call per group
        timed("rollback_mixers_chunked", lambda: view.rollback(base + same))
        view.recurrent.stepwise_max_tokens = STEPWISE_MAX_TOKENS
        view.rollback(base)
        view.forward(token_ids, width)

        def refeed() -> None:
            view.rollback(base)  # snapshot back, attention columns cropped
            view.forward(token_ids, same)  # the kept tokens through the whole model
            view.rollback(base + same)  # all fed tokens kept: nothing to re-run

        timed("rollback_refeed", refeed)
        view.rollback(base)

        def sequential() -> None:
            for _ in range(k + 1):
                view.forward(token_ids, torch.ones(batch_size, dtype=torch.long))
                view.recurrent.fed.clear()  # per-position states: each one kept, nothing to re-run
                view.recurrent.snapshot = None

        timed("verify_sequential", sequential)
        view.rollback(base)
    return {name: median_ms(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    model = make_model(args.layers, args.hidden)
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads), transformers {transformers.__version__}; qwen3_5_text {args.layers} layers "
        f"({model.config.layer_types.count('linear_attention')} gated delta-net), hidden {args.hidden}, "
        f"prompt {args.prompt}, k={args.k}; median ms of {args.repeats}"
    )
    columns = [
        "step1", "verify", "snapshot", "rollback_mixers", "rollback_mixers_ragged", "rollback_mixers_chunked",
        "rollback_refeed",
        "verify_sequential",
    ]  # fmt: skip
    print("| B | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for batch_size in args.batch:
        result = measure(model, batch_size, args.k, args.prompt, args.repeats)
        print(f"| {batch_size} | " + " | ".join(f"{result[c]:.2f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
