"""Plots for docs/benchmarks.md from the JSON files the GPU benchmarks write (matplotlib, no GPU needed).

Run: `python benchmarks/plot_results.py docs/results/rejection_h100.json docs/results/e2e_h100.json --out docs`;
`python benchmarks/plot_results.py --compiled docs/results/compiled_h100_*_captured.json --out docs` for the
compiled static-cache path (`bench_gpu_compiled.py`); `--default docs/results/default_h100_b1.json ...` for the
no-flag default (`bench_gpu_default.py`); `--profile docs/results/profile_batched_h100.json` for the batched step
(`profile_batched_gpu.py`; the figure is named after the file); `--threads docs/results/threads_h100.json` for threads (`bench_threads_gpu.py`);
`--methods docs/results/sampling_h100_*.json docs/results/default_h100_ngram_reuse.json docs/results/mtp_h100.json`
for every method's captured step (issue 26); `--cb docs/results/cb_h100_graphs_estimate.json ...` for continuous
batching (`bench_cb_gpu.py`; each file one bar group, labelled by its name); `--routes docs/results/routes_h100_b1.json
docs/results/routes_h100_b16.json` for every route against plain eager (`bench_gpu_routes.py`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_rejection(data: dict, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, fmt in zip(axes, ("fp32", "bf16")):
        for k in sorted({r["k"] for r in data["rows"]}):
            rows = sorted((r for r in data["rows"] if r["format"] == fmt and r["k"] == k and r["V"] == 128_256),
                          key=lambda r: r["B"])  # fmt: skip
            ax.plot([r["B"] for r in rows], [r["x_floor_graph"] for r in rows], marker="o", label=f"k={k} (graph)")
            ax.plot([r["B"] for r in rows], [r["x_floor"] for r in rows], ls="--", alpha=0.5, label=f"k={k} (eager)")
        ax.axhline(1.5, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="batch B", title=f"{fmt}, V = 128 256")
    axes[0].set_ylabel("time / memory floor")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Triton rejection sampler on {data['meta']['gpu']}")
    fig.tight_layout()
    fig.savefig(out / "rejection_h100.png", dpi=110)


def plot_e2e(data: dict, out: Path) -> None:
    rows = data["batch1"]
    labels = [f"a={r['alpha']}\nk={r['k']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.28
    ax.bar([i - width for i in x], [r["ideal_speedup"] for r in rows], width, label="ideal S*")
    ax.bar(list(x), [r["speedup"] for r in rows], width, label="hf_specdec")
    ax.bar([i + width for i in x], [r["hf_stock_speedup"] for r in rows], width, label="HF stock assisted")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("speedup over plain generate")
    ax.set_title(f"Llama-3-8B shape, batch 1, synthetic acceptance, {data['meta']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "e2e_h100.png", dpi=110)


COMPILED_METHODS = {  # bench_gpu_compiled.py's columns, in plotting order
    "plain_eager": "plain eager",
    "plain_compiled": "plain compiled (baseline)",
    "ours_eager": "hf_specdec eager",
    "ours_compiled_per_forward_graphs": "hf_specdec static, a graph per forward",
    "ours_compiled": "hf_specdec static, whole step captured",
}


def plot_compiled(files: list[Path], out: Path) -> None:
    """Each setting's tokens per second over compiled plain decoding's, per method."""
    rows = [row for f in files for row in json.loads(f.read_text())["rows"]]
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(COMPILED_METHODS)
    for j, (key, label) in enumerate(COMPILED_METHODS.items()):
        xs = [i + (j - len(COMPILED_METHODS) / 2 + 0.5) * width for i, r in enumerate(rows) if key in r["tps"]]
        ys = [r["tps"][key] / r["tps"]["plain_compiled"] for r in rows if key in r["tps"]]
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["setting"].replace(" alpha", "\nalpha") for r in rows], fontsize=8)
    ax.set_ylabel("tokens/s over compiled plain")
    ax.set_title("8B-shaped Llama, synthetic-alpha draft, static cache, H100")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "compiled_h100.png", dpi=110)


def plot_default(files: list[Path], out: Path) -> None:
    """`bench_gpu_default.py`: tokens/s of each route per setting (median of the rounds), and the default's ratio
    to compiled plain (minimum over the rounds, the figure the goals are about)."""
    rows = [row for f in files for row in json.loads(f.read_text())["rows"]]
    names = {"plain_eager": "plain eager", "plain_compiled": "plain compiled (static)",
             "ours_default": "hf_specdec, no flags", "ours_no_reuse": "hf_specdec, no flags, graph reuse off",
             "ours_dynamic": "hf_specdec, dynamic"}  # fmt: skip
    routes = [route for route in names if all(route in r["tps_median"] for r in rows)]
    labels = [names[route] for route in routes]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(routes)
    for i, (route, label) in enumerate(zip(routes, labels)):
        xs = [j + (i - (len(routes) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r["tps_median"][route] / r["tps_median"]["plain_compiled"] for r in rows], width, label=label)
    for j, r in enumerate(rows):
        low = r["ratios"]["ours_default_vs_plain_compiled"]["min"]
        ax.annotate(f"min {low:.2f}x", (j + 0.5 * width, r["tps_median"]["ours_default"] / r["tps_median"]["plain_compiled"]),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["setting"].replace(", answer in the prompt", "\n(answer in prompt)")
                                     .replace(" sampling", "\nsampling") for r in rows], fontsize=8)  # fmt: skip
    ax.set_ylabel("tokens/s / compiled plain's")
    ax.set_title("hf_specdec with no flags on an H100 (8B-shaped bf16 Llama, 124M synthetic draft, 64 new tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "default_h100.png", dpi=110)


def plot_profile(data: dict, out: Path, name: str) -> None:
    """`profile_batched_gpu.py`: tokens/s per batch size, and a captured step's device time by kernel class."""
    rows = sorted(data["rows"], key=lambda r: r["batch"])
    batches = [r["batch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for route, label in (("plain_eager", "plain eager"), ("plain_compiled", "plain compiled (static)"),
                         ("ours_default", "hf_specdec, no flags"),
                         ("ours_default_ungrouped", "hf_specdec, no flags, key-value heads copied"),
                         ("ours_k4", "hf_specdec, k = 4")):  # fmt: skip
        if all(route in r["tps_median"] for r in rows):
            left.plot(batches, [r["tps_median"][route] for r in rows], marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="throughput (captured steps)")
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    for kind in ("gemm", "attention", "other"):
        per_step = [r["kernels"]["by_class_us"].get(kind, 0.0) / 1e3 / r["k4"]["steps"] for r in rows]
        right.bar([str(b) for b in batches], per_step, bottom=bottom, label=kind)
        bottom = [a + b for a, b in zip(bottom, per_step)]
    right.set(xlabel="batch", ylabel="device ms per step (k = 4)", title="where a step's device time goes")
    right.legend(fontsize=8)
    fig.suptitle("The batched step on an H100 (8B-shaped bf16 Llama, 124M synthetic draft, alpha = 0.8)")
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)


def plot_threads(data: dict, out: Path) -> None:
    """`bench_threads_gpu.py`: tokens/s of the same 24 requests one at a time and from 8 threads, per turn."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("one_at_a_time", "one at a time"), ("threads", "8 threads")):
        values = data["tokens_per_s"][key]
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set(xlabel="turn", ylabel="tokens/s", ylim=(0, None),
           title=f"24 requests, {len(data['errors'])} errors, {data['wrong_outputs']} wrong outputs")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "threads_h100.png", dpi=110)


def _clean(per_round: list[float], compiled_tps: list[float]) -> list[float]:
    """The rounds whose compiled plain call did not compile again (above a third of its fastest round)."""
    return [r for r, tps in zip(per_round, compiled_tps) if tps >= max(compiled_tps) / 3]


def plot_methods(default_files: list[Path], mtp_files: list[Path], out: Path) -> None:
    """Issue 26: every method's no-flag call (its steps captured) against compiled plain, each clean round a dot
    (`bench_gpu_default.py` sampling and prompt-lookup rows, `bench_mtp_gpu.py`)."""
    bars: list[tuple[str, list[float]]] = []
    for f in default_files:
        for row in json.loads(f.read_text())["rows"]:
            rounds = _clean(row["ratios"]["ours_default_vs_plain_compiled"]["rounds"], row["tps"]["plain_compiled"])
            label = (
                row["setting"]
                .replace(", answer in the prompt", "\n(answer in prompt)")
                .replace(" sampling", "\nsampling")
            )
            bars.append((f"{label}\n[{f.stem}]", rounds))
    for f in mtp_files:
        for row in json.loads(f.read_text())["rows"]:
            seconds = row["seconds"]
            compiled_tps = [1 / t for t in seconds["plain_compiled"]]
            per_round = [c / o for c, o in zip(seconds["plain_compiled"], seconds["ours_captured"])]
            bars.append((f"B={row['batch']} MTP (1 layer, k = 3)\n[{f.stem}]", _clean(per_round, compiled_tps)))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(bars)), 4.8))
    for j, (_, rounds) in enumerate(bars):
        ax.bar(j, min(rounds), 0.6, color="tab:blue", alpha=0.6)
        ax.scatter([j] * len(rounds), rounds, color="black", zorder=3, s=12)
        ax.annotate(f"{min(rounds):.2f}-{max(rounds):.2f}x", (j, max(rounds)), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("tokens/s / compiled plain's (bar: minimum)")
    ax.set_title("Every method's captured step on an H100, no flags (8B-shaped bf16 targets, 64 new tokens)")
    fig.tight_layout()
    fig.savefig(out / "methods_h100.png", dpi=110)


def plot_cb(files: list[Path], out: Path) -> None:
    """Speculative CB over plain CB on the same kernels, per (workload, requests): median and worst round."""
    runs = {f.stem: json.loads(f.read_text()) for f in files}
    settings = sorted({(r["workload"], r["concurrency"]) for d in runs.values() for r in d["results"]})
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(runs)
    for i, (name, data) in enumerate(runs.items()):
        rows = {(r["workload"], r["concurrency"]): r for r in data["results"]}
        xs = [j + (i - (len(runs) - 1) / 2) * width for j, s in enumerate(settings) if s in rows]
        med = [rows[s]["speedup_vs_plain_same_kernel"] for s in settings if s in rows]
        worst = [rows[s]["speedup_vs_plain_same_kernel_min"] for s in settings if s in rows]
        ax.bar(xs, med, width, label=name.removeprefix("cb_h100_"))
        ax.scatter(xs, worst, marker="_", s=200, color="black", zorder=3, label="worst round" if i == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(settings)), [f"{w}\n{n} requests" for w, n in settings], fontsize=8)
    ax.set_ylabel("tokens/s over plain CB (same kernels)")
    device = next(iter(runs.values()))["meta"]["device"]
    ax.set_title(f"Speculative continuous batching, 8B-shaped target, 256-token answers, {device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "cb_h100.png", dpi=110)


def plot_routes(files: list[Path], out: Path) -> None:
    """Every route over plain eager generate with the same arguments (bench_gpu_routes.py): per group, the median
    of the rounds as a bar and the worst round as a tick."""
    groups = [g for f in files for g in json.loads(f.read_text())["groups"]]
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 4.2), sharey=True, squeeze=False)
    for ax, group in zip(axes[0], groups):
        rows = {k: r for k, r in group["rows"].items() if "identical" in r}
        ratios = [next(v for key, v in r.items() if key.startswith("vs_plain_eager")) for r in rows.values()]
        xs = range(len(rows))
        ax.bar(xs, [v["median"] for v in ratios], color=["tab:orange" if "uncaptured" in k or "dynamic" in k
                                                         else "tab:blue" for k in rows])  # fmt: skip
        ax.scatter(xs, [v["min"] for v in ratios], marker="_", s=150, color="black", zorder=3)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs), list(rows), rotation=70, fontsize=7)
        ax.set_title(group["group"], fontsize=9)
    axes[0][0].set_ylabel("tokens/s over plain eager, same arguments\n(bar: median, tick: worst round)")
    fig.suptitle("Every route on an H100 (8B-shaped target, 64 new tokens; orange: uncaptured or dynamic path)")
    fig.tight_layout()
    fig.savefig(out / "routes_h100.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rejection", nargs="?")
    parser.add_argument("e2e", nargs="?")
    parser.add_argument("--compiled", nargs="+", type=Path, default=[])
    parser.add_argument("--default", nargs="+", type=Path, default=[], help="bench_gpu_default.py JSON files")
    parser.add_argument("--profile", type=Path, help="profile_batched_gpu.py JSON file")
    parser.add_argument("--threads", type=Path, help="bench_threads_gpu.py JSON file")
    parser.add_argument(
        "--methods",
        nargs="+",
        type=Path,
        default=[],
        help="bench_gpu_default.py and bench_mtp_gpu.py JSON files (names with 'mtp' are MTP runs)",
    )
    parser.add_argument("--cb", nargs="+", type=Path, default=[], help="bench_cb_gpu.py JSON files")
    parser.add_argument("--routes", nargs="+", type=Path, default=[], help="bench_gpu_routes.py JSON files")
    parser.add_argument("--out", default="docs")
    args = parser.parse_args()
    out = Path(args.out)
    if args.rejection:
        plot_rejection(json.loads(Path(args.rejection).read_text()), out)
    if args.e2e:
        plot_e2e(json.loads(Path(args.e2e).read_text()), out)
    if args.compiled:
        plot_compiled(args.compiled, out)
    if args.default:
        plot_default(args.default, out)
    if args.profile:
        plot_profile(json.loads(args.profile.read_text()), out, args.profile.stem + ".png")
    if args.threads:
        plot_threads(json.loads(args.threads.read_text()), out)
    if args.cb:
        plot_cb(args.cb, out)
    if args.routes:
        plot_routes(args.routes, out)
    if args.methods:
        mtp = [f for f in args.methods if "mtp" in f.stem]
        plot_methods([f for f in args.methods if f not in mtp], mtp, out)


if __name__ == "__main__":
    main()
