"""Plot `bench_suffix_smollm.py` results: speedup over plain (CPU time) per method, per session and round.

Left: the agent/edit workload, each session's speedup in round 0 (cold: every request new) and the median of the
later rounds (the same requests again), and the whole round. Right: Spec-Bench, each category's speedup over the
rounds, and each round's overall.

Run: `python benchmarks/plot_suffix.py agent.json specbench.json docs/suffix_smollm_cpu.png`
"""

from __future__ import annotations

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def session_speedups(records: list[dict], method: str, rounds: list[int]) -> dict[str, float]:
    """Plain's CPU seconds over `method`'s, per session (and "whole round"), summed over `rounds`."""
    out = {}
    sessions = [*dict.fromkeys(r["session"] for r in records), "whole round"]
    for session in sessions:
        mine = [r for r in records if r["round"] in rounds and session in (r["session"], "whole round")]
        plain = sum(r["cpu_seconds"] for r in mine if r["method"] == "plain")
        ours = sum(r["cpu_seconds"] for r in mine if r["method"] == method)
        out[session] = plain / ours if ours else 0.0
    return out


def bars(ax, groups: dict[str, dict[str, float]], title: str) -> None:  # noqa: ANN001
    labels = list(next(iter(groups.values())))
    width = 0.8 / len(groups)
    for i, (name, values) in enumerate(groups.items()):
        xs = [x + (i - (len(groups) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, [values[label] for label in labels], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain (CPU time)")
    ax.set_title(title)
    ax.legend(fontsize=8)


def main() -> None:
    agent, specbench, out = sys.argv[1:4]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=100)
    data = json.load(open(agent, encoding="utf-8"))
    records = data["records"]
    rounds = sorted({r["round"] for r in records})
    methods = [m for m in dict.fromkeys(r["method"] for r in records) if m != "plain"]
    groups = {}
    for method in methods:
        groups[f"{method}, round 0 (new)"] = session_speedups(records, method, rounds[:1])
        later = [session_speedups(records, method, [r]) for r in rounds[1:]]
        if later:
            groups[f"{method}, later rounds (median)"] = {k: statistics.median(x[k] for x in later) for k in later[0]}
    bars(left, groups, "Agent / edit workload, SmolLM2-135M, CPU")
    data = json.load(open(specbench, encoding="utf-8"))
    records = data["records"]
    methods = [m for m in dict.fromkeys(r["method"] for r in records) if m != "plain"]
    groups = {}
    for method in methods:
        by_category = session_speedups(records, method, sorted({r["round"] for r in records}))
        groups[method] = by_category
    bars(right, groups, "Spec-Bench (1 prompt per category per round, all rounds)")
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
