"""The grid benchmark's figure (`plot`) and its budget (`estimate`): no GPU needed (`bench_gpu_grid.py` calls them).

`plot` draws every point of one or more result files: hf_specdec's ratio to compiled plain (the median as a bar, the
worst round as a tick), its S* (a diamond), and the issue's goals (0.95 everywhere; 1.6 at alpha 0.8, B <= 4 where
S* >= 2). `estimate` prints what each group should cost on an H100 from rough per-token costs (measured in earlier
runs at B = 1: plain eager about 30 ms a token at 8B, compiled plain 10 ms, a first compile of a shape 13 + 6 s), so
that a grid can be cut to its budget before it runs; a run records `group_seconds` to check it against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: rough H100 milliseconds per token at B = 1 (plain eager is launch-bound: it follows the layer count)
EAGER_MS = {"llama-1b": 8.0, "llama-3b": 16.0, "llama-8b": 30.0, "qwen3-1.7b": 14.0, "qwen3-4b": 18.0,
            "qwen3-8b": 33.0}  # fmt: skip
COMPILED_MS = {"llama-1b": 2.5, "llama-3b": 5.5, "llama-8b": 10.0, "qwen3-1.7b": 4.0, "qwen3-4b": 7.0,
               "qwen3-8b": 10.5}  # fmt: skip
#: seconds compiled plain spends compiling a new shape (its first and second call), first shape of a target / later
COMPILE_S = {"first": 19.0, "later": 12.0}
BUILD_S = 4.0  # building and preparing one target (random weights on the GPU)


def estimate(groups: list, rounds: int, eager_rounds: int, fresh_compile: bool = True) -> float:
    """Print the estimated H100 seconds of each group and their total; return the total. `fresh_compile`: compiled
    plain compiles every group anew (`bench_gpu_grid.py` without `--shared-compile`)."""
    total, seen, shapes = 0.0, set(), set()
    for g in groups:
        batch_factor = 1.0 + 0.01 * g.batch  # steps get dearer with the batch (B = 64: about 1.6x)
        compiled = COMPILED_MS[g.target] * batch_factor * g.answer / 1e3 + 0.05 * g.prompt / 1024
        eager = EAGER_MS[g.target] * batch_factor * g.answer / 1e3
        ours = [compiled / (1.5 if arm.alpha >= 0.7 else 0.95) for arm in g.arms]
        first_shape = g.target not in seen
        new_shape = (g.target, g.batch, g.prompt, g.answer) not in shapes  # shared: sampling reuses greedy's
        shapes.add((g.target, g.batch, g.prompt, g.answer))
        compile_s = COMPILE_S["first" if first_shape or (fresh_compile and new_shape) else "later"]
        seconds = (BUILD_S if first_shape else 0.0) + (fresh_compile or new_shape) * compile_s
        seconds += (rounds + 2) * compiled + (1 + eager_rounds) * eager + sum((rounds + 1) * o + 1.5 for o in ours)
        seconds += 2.0  # forward costs for S*
        seen.add(g.target)
        total += seconds
        print(f"{g.name:14s} {g.target:10s} B={g.batch:<3d} P={g.prompt:<5d} N={g.answer:<5d} "
              f"{len(g.arms)} point(s): ~{seconds:5.0f} s", flush=True)  # fmt: skip
    print(f"total ~{total:.0f} s ({total / 60:.1f} min) for {sum(len(g.arms) for g in groups)} points")
    return total


def plot(results: list[dict[str, Any]], out: Path) -> None:
    """One horizontal bar per point: ratio to compiled plain (median bar, min tick), S* diamond, goal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for result in results for group in result["groups"] for p in group["points"]]
    axes = sorted({p["axis"] for p in points})
    colours = {axis: plt.cm.tab20(i % 20) for i, axis in enumerate(axes)}
    fig, ax = plt.subplots(figsize=(13, 0.32 * len(points) + 1.8))
    y = list(range(len(points)))[::-1]
    ax.barh(y, [p["vs_compiled"]["median"] for p in points], color=[colours[p["axis"]] for p in points], alpha=0.8)
    ax.scatter([p["vs_compiled"]["min"] for p in points], y, marker="|", s=120, color="black", label="worst round")
    ax.scatter([p["s_star"] for p in points], y, marker="D", s=18, color="grey", label="S* (ideal, from forward costs)")
    ax.axvline(0.95, color="red", lw=0.8, ls="--", label="goal: 0.95x everywhere")
    ax.axvline(1.6, color="green", lw=0.8, ls=":", label="goal: 1.6x at alpha 0.8, B <= 4, S* >= 2")
    ax.axvline(1.0, color="grey", lw=0.5)
    labels = [f"{p['id']}  ({p['target']}, B={p['batch']}, P={p['prompt']}, N={p['answer']}"
              f"{', sampled' if p['sample'] else ''})" for p in points]  # fmt: skip
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel("hf_specdec (no flags) / compiled plain generate: tokens/s ratio (median bar, worst round tick)")
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color=colours[axis], alpha=0.8, label=axis) for axis in axes]
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"Grid (issue 38) on {results[0]['meta']['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
