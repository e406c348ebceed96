"""Benchmark: suffix decoding's host cost per row and step, with a global tree of up to 100k+ tokens (CPU).

The global tree is filled with earlier "outputs": Spec-Bench turns tokenized with SmolLM2's tokenizer (real text,
about 73k tokens), then Zipf-distributed synthetic text with copied spans up to `--tokens`. Rows are Spec-Bench
prompts; each step `SuffixProposer.propose` drafts k for every row, a random prefix of each row's drafts plus one
token is "accepted" (the row's next tokens come from a continuation half copied from the corpus, so global matches
happen), and `commit` appends them to the row's tree. The time of propose + commit per step over B is the cost per
row and step (median of steps after a warm-up; wall time and the process's CPU time, which a busy machine inflates
less). Also reported: nodes and bytes of the tree, insert cost per token,
and what adding one output costs when the cache is full (insert + evicting the oldest).

Run: `OMP_NUM_THREADS=1 python benchmarks/bench_suffix_cpu.py --out suffix_cpu.json`
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numba
import numpy as np
import torch
import transformers

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.suffix import SuffixProposer
from hf_specdec.proposers.suffix_cache import SuffixCache

VOCAB = 49152
SPEC_BENCH = "/work/shared/bench/specbench_dev.jsonl"


def real_texts(tokenizer) -> list[np.ndarray]:  # noqa: ANN001
    texts = []
    with open(SPEC_BENCH, encoding="utf-8") as fh:
        for line in fh:
            texts += json.loads(line)["turns"]
    return [np.array(tokenizer(t)["input_ids"], np.int64) for t in texts]


def synthetic(rng: np.random.Generator, length: int, pool: np.ndarray) -> np.ndarray:
    """Zipf-distributed tokens with spans of 8-64 copied from `pool` (earlier text) now and then."""
    out = np.minimum(rng.zipf(1.2, length), VOCAB - 1).astype(np.int64)
    pos = 0
    while pos < length - 64:
        span = int(rng.integers(8, 65))
        if rng.random() < 0.3 and len(pool) > span:
            src = int(rng.integers(0, len(pool) - span))
            out[pos : pos + span] = pool[src : src + span]
        pos += span
    return out


def build_cache(outputs: list[np.ndarray], tokens: int, depth: int) -> tuple[SuffixCache, float]:
    """A cache holding at least `tokens` tokens of `outputs` (cycled through synthetic text); seconds per token."""
    cache = SuffixCache(depth, max_requests=10**9, max_tokens=10**9)
    rng = np.random.default_rng(0)
    pool = np.concatenate(outputs)
    added, i, start = 0, 0, time.perf_counter()
    while added < tokens:
        out = outputs[i] if i < len(outputs) else synthetic(rng, int(rng.integers(100, 600)), pool)
        cache.add(out[: tokens - added] if added + len(out) > tokens else out)
        added += min(len(out), tokens - added)
        i += 1
    return cache, (time.perf_counter() - start) / max(added, 1)


def step_cost(
    cache: SuffixCache, prompts: list[np.ndarray], corpus: list[np.ndarray], batch_size: int, k: int, steps: int
) -> dict:
    """Median seconds of propose + commit per step, and drafts per step, for `batch_size` rows."""
    rng = np.random.default_rng(1)
    rows = [prompts[i % len(prompts)][:1024] for i in range(batch_size)]
    # Each row continues with its own text: half copied from the corpus (earlier outputs), half fresh.
    continuations = []
    for _ in rows:
        src = corpus[int(rng.integers(0, len(corpus)))]
        continuations.append(np.concatenate([src[:200], rng.integers(0, VOCAB, 400)]))
    width = max(len(r) for r in rows)
    capacity = width + steps * (k + 1) + k + 2
    token_ids = torch.zeros(batch_size, capacity, dtype=torch.long)
    pads = []
    for i, row in enumerate(rows):
        token_ids[i, width - len(row) : width] = torch.from_numpy(row)
        pads.append(width - len(row))
    batch = RaggedBatch(
        token_ids=token_ids,
        lengths=torch.full((batch_size,), width, dtype=torch.long),
        pad_lengths=torch.tensor(pads),
        row_ids=torch.arange(batch_size),
        prompt_width=width,
    )
    proposer = SuffixProposer(k, max_depth=cache.max_depth, cache=cache)
    proposer.prefill(batch, None)
    budgets = torch.full((batch_size,), k, dtype=torch.long)
    times, cpu_times, drafted = [], [], []
    fed = [0] * batch_size
    for step in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        proposal = proposer.propose(batch, budgets, None)
        propose_s, propose_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        counts = proposal.num_draft_tokens.tolist()
        for i in range(batch_size):  # accept a random prefix of the drafts plus one token: the row's next tokens
            n = int(rng.integers(0, counts[i] + 1)) + 1
            n = min(n, len(continuations[i]) - fed[i])
            length = int(batch.lengths[i])
            batch.token_ids[i, length : length + n] = torch.from_numpy(continuations[i][fed[i] : fed[i] + n])
            batch.lengths[i] = length + n
            fed[i] += n
        start, cpu_start = time.perf_counter(), time.process_time()
        proposer.commit(batch, torch.zeros(batch_size, dtype=torch.long))
        commit_s, commit_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if step >= 3:
            times.append(propose_s + commit_s)
            cpu_times.append(propose_cpu + commit_cpu)
            drafted.append(sum(counts) / batch_size)
    proposer.detach()
    return {
        "batch_size": batch_size,
        "us_per_row_step": 1e6 * statistics.median(times) / batch_size,
        "cpu_us_per_row_step": 1e6 * statistics.median(cpu_times) / batch_size,
        "us_per_step": 1e6 * statistics.median(times),
        "drafts_per_row_step": statistics.fmean(drafted),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="0,10000,100000,300000", help="global tree sizes (comma list)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from hf_specdec.tools.smollm import load_smollm2

    _, tokenizer = load_smollm2()
    texts = real_texts(tokenizer)
    prompts = sorted(texts, key=len, reverse=True)[:64]  # the long ones (summaries, articles)
    results = {
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numba": numba.__version__,
        "k": args.k,
        "depth": args.depth,
        "rows": [],
    }
    for tokens in [int(t) for t in args.tokens.split(",")]:
        cache, insert_s = build_cache(texts, tokens, args.depth)
        row = {
            "global_tokens": cache.num_tokens,
            "nodes": cache.tree.num_nodes,
            "nodes_per_token": cache.tree.num_nodes / max(cache.num_tokens, 1),
            "megabytes": cache.tree.nbytes / 2**20,
            "insert_us_per_token": 1e6 * insert_s,
        }
        if tokens:  # a full cache: one more output of 500 tokens, evicting as many
            cache.max_tokens = cache.num_tokens
            extra = synthetic(np.random.default_rng(2), 500, np.concatenate(texts))
            start = time.perf_counter()
            cache.add(extra)
            row["add_with_eviction_ms"] = 1e3 * (time.perf_counter() - start)
        enabled = cache if tokens else SuffixCache(args.depth, 0, 0)
        row["steps"] = [
            step_cost(enabled, prompts, texts, int(b), args.k, args.steps) for b in args.batch_sizes.split(",")
        ]
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
