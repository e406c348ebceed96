"""Benchmark: suffix decoding vs plain greedy and prompt lookup on SmolLM2-135M (CPU), two workloads.

- ``agent``: a multi-turn workload where later requests repeat or edit earlier outputs (15 requests): a code-edit
  conversation (write a function, add a docstring, add type hints, rename it: each turn's history holds the earlier
  answers), four independent tool calls that share a JSON shape, an email edited over four turns, and an agent that
  retries three earlier requests in fresh conversations (the same task again, as after a failed tool call).
- ``specbench``: Spec-Bench's first turns as single chat messages, one prompt per category per round (each round
  takes the next prompt of each category, so no round repeats an earlier request).

Every method runs each request once per round, interleaved (the order rotates per turn), in one process; no
library state is reset between rounds: the suffix `SpecDecoder` keeps its global tree for the whole run, and the
adaptive schedule its costs and statistics (so in the agent workload, rounds after the first repeat requests the
global tree has seen: round 0 is the cold workload). Greedy outputs must equal plain's (checked). Each method gets
untimed warm-up calls on distinct other prompts first, until the adaptive schedule has timed every verify width it
calibrates (three times each: until then every call after a drafting one times a few more, inside its steps).
Speedup of a round = plain's total seconds / the method's, in wall time and in CPU time of the process
(`time.process_time`: on a machine shared with other work, wall time varies 2x between identical calls, CPU time
a few percent); the summary gives every round, their median and minimum.

Run: `OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_suffix_smollm.py --workload agent --rounds 3 --out a.json`
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
import transformers

import hf_specdec

#: (session, user message, keep the session's history, max new tokens)
AGENT_TURNS: list[tuple[str, str, bool, int]] = [
    ("code-edit", "Write a Python function named average that returns the average of a list of numbers.", True, 96),
    ("code-edit", "Add a docstring to the function. Return the full code.", True, 96),
    ("code-edit", "Add type hints to the function. Return the full code.", True, 96),
    ("code-edit", "Rename the function to mean. Return the full code.", True, 96),
    ("tool-calls", 'Call the weather tool for Paris. Reply with JSON only, like {"tool": "weather", "city": "..."}.', False, 32),
    ("tool-calls", 'Call the weather tool for London. Reply with JSON only, like {"tool": "weather", "city": "..."}.', False, 32),
    ("tool-calls", 'Call the weather tool for Tokyo. Reply with JSON only, like {"tool": "weather", "city": "..."}.', False, 32),
    ("tool-calls", 'Call the weather tool for Berlin. Reply with JSON only, like {"tool": "weather", "city": "..."}.', False, 32),
    ("email-edit", "Write a short email to the team announcing that the quarterly planning meeting is on Tuesday at 10 am in room 4B.", True, 96),
    ("email-edit", "Change the day of the meeting to Thursday. Return the full email.", True, 96),
    ("email-edit", "Add a sentence asking everyone to bring their budget estimates. Return the full email.", True, 96),
    ("email-edit", "Sign the email as Maria. Return the full email.", True, 96),
    ("agent-retry", "Write a Python function named average that returns the average of a list of numbers.", False, 96),
    ("agent-retry", "Write a short email to the team announcing that the quarterly planning meeting is on Tuesday at 10 am in room 4B.", False, 96),
    ("agent-retry", 'Call the weather tool for Paris. Reply with JSON only, like {"tool": "weather", "city": "..."}.', False, 32),
]  # fmt: skip

SPEC_BENCH = "/work/shared/bench/specbench_dev.jsonl"
#: Untimed warm-up requests, all different (the same request again would be a repeat, which suffix decoding drafts
#: perfectly: its acceptance statistics would then start out trusting every draft); half copy text, so that drafts
#: happen and the adaptive schedule goes on timing verify widths (it times a few per call after drafting steps).
WARM_UP = [
    "Name three colors.", "Repeat exactly: the cat sat on the mat and the dog sat on the log.",
    "What is 2 + 2?", "Repeat exactly: one, two, three, four, five, six, seven, eight.",
    "Say hello in French.", "Copy this line: import numpy as np; x = np.zeros(10); print(x.sum())",
    "Name a fruit.", "Repeat exactly: red, green, blue, yellow, purple, orange, black.",
    "What day comes after Monday?", "Copy this line: def add(a, b): return a + b",
    "Name two animals.", "Repeat exactly: Monday, Tuesday, Wednesday, Thursday, Friday.",
    "What is the capital of Italy?", "Copy this sentence: The meeting is on Friday at noon in room 12.",
    "Give a synonym for happy.", "Repeat exactly: apples, pears, plums, cherries, grapes, lemons.",
    "Count to five.", "Copy this line: for i in range(10): print(i * i)",
    "Name a planet.", "Repeat exactly: north, south, east, west, up, down, left, right.",
    "What color is the sky?", "Copy this sentence: Please send the report to Anna by Thursday evening.",
    "Name a musical instrument.", "Repeat exactly: January, February, March, April, May, June.",
    "What is water made of?", "Copy this line: total = sum(values) / len(values)",
    "Name a season.", "Repeat exactly: alpha, beta, gamma, delta, epsilon, zeta, eta.",
    "Spell the word cat.", "Copy this sentence: The train leaves at seven and arrives at nine.",
    "Name a vegetable.", "Repeat exactly: cat, dog, cow, pig, hen, fox, owl, bee.",
]  # fmt: skip


def calibrated(model, spec) -> bool:  # noqa: ANN001
    """Whether the adaptive schedule has timed every width it calibrates for `spec` at batch size 1 (reads the
    schedule's per-model memory: calibration otherwise goes on in the timed calls that follow a drafting one)."""
    from hf_specdec import adaptive

    widths = adaptive.calibration_widths(spec.num_speculative_tokens)
    memory = adaptive._MEMORY.get(model)
    return memory is not None and any(
        batch == 1 and costs.complete(widths) and name.startswith(spec.method)
        for (name, batch), costs in memory.costs.items()
    )


def specbench_rounds(rounds: int) -> list[list[tuple[str, str, bool, int]]]:
    """Round r: the r-th first turn of each Spec-Bench category (a fresh request per category and round)."""
    by_category: dict[str, list[str]] = {}
    with open(SPEC_BENCH, encoding="utf-8") as fh:
        for line in fh:
            item = json.loads(line)
            by_category.setdefault(item["category"], []).append(item["turns"][0])
    return [[(cat, texts[r], False, 64) for cat, texts in by_category.items()] for r in range(rounds)]


def make_specs(k: int | None) -> dict[str, Any]:
    """One SpecDecoder per method for the whole run (what a user keeps); k None: each method's default."""
    return {
        "ngram": hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=k),
        "ngram-k24": hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=24),
        "suffix": hf_specdec.SpecDecoder(method="suffix", num_speculative_tokens=k),
    }


def run_one(model, tokenizer, messages: list[dict], method: str, specs: dict, max_new_tokens: int) -> dict:  # noqa: ANN001
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None
    )
    if method != "plain":
        kwargs.update(custom_generate=hf_specdec.generate, spec_decoder=specs[method])
    with torch.inference_mode():
        start, cpu_start = time.perf_counter(), time.process_time()
        out = model.generate(**enc, **kwargs)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    stats = specs[method].last_stats if method != "plain" else None
    return {
        "tokens": new,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "prompt_tokens": enc["input_ids"].shape[1],
        "prompt_ids": enc["input_ids"][0].tolist(),
        "acceptance": stats.acceptance_rate if stats else None,
        "accepted": stats.num_accepted_tokens if stats else 0,
    }


def run_round(model, tokenizer, turns, methods: list[str], specs: dict, round_index: int) -> list[dict]:  # noqa: ANN001
    """Each turn of `turns` with every method (order rotated by round); histories grow from plain's answers."""
    histories: dict[str, list[dict]] = {}
    records = []
    for t, (session, user, keep, max_new) in enumerate(turns):
        messages = (
            [*histories.get(session, []), {"role": "user", "content": user}]
            if keep
            else [{"role": "user", "content": user}]
        )
        shift = (round_index + t) % len(methods)
        results = {}
        for method in methods[shift:] + methods[:shift]:
            results[method] = run_one(model, tokenizer, messages, method, specs, max_new)
        answer = tokenizer.decode(results["plain"]["tokens"], skip_special_tokens=True)
        if keep:
            histories[session] = [*messages, {"role": "assistant", "content": answer}]
        for method, res in results.items():
            records.append({
                "round": round_index, "turn": t, "session": session, "method": method,
                "new_tokens": len(res["tokens"]), "seconds": res["seconds"], "cpu_seconds": res["cpu_seconds"],
                "prompt_tokens": res["prompt_tokens"],
                "tokens": res["tokens"] if method == "plain" else None,  # for offline replays
                "prompt_ids": res["prompt_ids"] if method == "plain" else None,
                "acceptance": res["acceptance"], "identical": res["tokens"] == results["plain"]["tokens"],
            })  # fmt: skip
        line = "  ".join(f"{m} {r['seconds']:.1f}s ({r['cpu_seconds']:.1f}s cpu)" for m, r in results.items())
        print(f"round {round_index} turn {t} [{session}] {len(results['plain']['tokens'])} tok: {line}", flush=True)
    return records


def speedups(records: list[dict], method: str, key: str, keep=lambda r: True) -> list[float]:  # noqa: ANN001
    """Per round: plain's total `key` seconds over `method`'s, on the records `keep` selects."""
    out = []
    for rnd in sorted({r["round"] for r in records}):
        mine = [r for r in records if r["round"] == rnd and keep(r)]
        plain = sum(r[key] for r in mine if r["method"] == "plain")
        ours = sum(r[key] for r in mine if r["method"] == method)
        out.append(plain / ours)
    return out


def summarize(records: list[dict], methods: list[str]) -> dict:
    out: dict[str, Any] = {"per_round": {}, "per_session": {}}
    for method in methods[1:]:
        wall, cpu = speedups(records, method, "seconds"), speedups(records, method, "cpu_seconds")
        out["per_round"][method] = {
            "wall": wall, "cpu": cpu, "cpu_median": statistics.median(cpu), "cpu_min": min(cpu),
            "wall_median": statistics.median(wall), "wall_min": min(wall),
            "identical": all(r["identical"] for r in records if r["method"] == method),
        }  # fmt: skip
        out["per_session"][method] = {
            session: speedups(records, method, "cpu_seconds", lambda r, s=session: r["session"] == s)
            for session in dict.fromkeys(r["session"] for r in records)
        }
    plain = [r for r in records if r["method"] == "plain"]
    out["plain_tokens_per_s"] = sum(r["new_tokens"] for r in plain) / sum(r["seconds"] for r in plain)
    out["plain_tokens_per_cpu_s"] = sum(r["new_tokens"] for r in plain) / sum(r["cpu_seconds"] for r in plain)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["agent", "specbench"], default="agent")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: each method's own)")
    parser.add_argument("--methods", default="plain,ngram,ngram-k24,suffix", help="plain first; ngram-k24: k = 24")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from hf_specdec.tools.smollm import load_smollm2

    model, tokenizer = load_smollm2()
    methods = args.methods.split(",")
    specs = make_specs(args.k)
    for method in methods[1:]:  # untimed, until the adaptive schedule has timed every verify width it times
        for text in WARM_UP:  # distinct requests: a repeated one would teach suffix decoding that drafts never miss
            if calibrated(model, specs[method]):
                break
            run_one(model, tokenizer, [{"role": "user", "content": text}], method, specs, 24)
        print(f"warm-up of {method}: calibrated={calibrated(model, specs[method])}", flush=True)
    rounds = [AGENT_TURNS] * args.rounds if args.workload == "agent" else specbench_rounds(args.rounds)
    records = []
    for index, turns in enumerate(rounds):
        records += run_round(model, tokenizer, turns, methods, specs, index)
        print(json.dumps(summarize(records, methods)["per_round"]), flush=True)
    summary = summarize(records, methods)
    result = {
        "workload": args.workload, "k": args.k, "threads": args.threads, "machine": platform.platform(),
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "command": " ".join(sys.argv), "summary": summary, "records": records,
        "suffix_cache": repr(specs["suffix"].suffix_cache),
    }  # fmt: skip
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
