"""How many threads torch uses in the tools: a deliberate choice, said out loud.

On a small, shared machine torch's default (one thread per core) can make decoding several times slower when other
work holds some of the cores: measured on a busy 2-core VM, plain SmolLM2 decoding ran 8x slower with 2 threads than
with 1. `configure_threads` keeps what the user asked for (`--threads`, or `OMP_NUM_THREADS` in the environment) and
otherwise uses at most the cores that are free now (cores minus the 1-minute load average), and returns the line the
tools print about it.
"""

from __future__ import annotations

import os

__all__ = ["configure_threads", "free_cores"]


def free_cores() -> tuple[int, int, float]:
    """(cores this process may use, of which free now, the 1-minute load average)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return cores, max(1, min(cores, round(cores - load))), load


def configure_threads(requested: int | None = None) -> str:
    """Set torch's thread count (see the module doc) and return a line that says what was chosen and why."""
    import torch

    cores, free, load = free_cores()
    if requested is not None:
        torch.set_num_threads(requested)
        line = f"torch threads: {requested} (--threads)"
    elif os.environ.get("OMP_NUM_THREADS"):
        line = f"torch threads: {torch.get_num_threads()} (OMP_NUM_THREADS)"
    else:
        torch.set_num_threads(min(torch.get_num_threads(), free))
        return (
            f"torch threads: {torch.get_num_threads()} ({cores} cores, load {load:.1f}); set --threads N or "
            "OMP_NUM_THREADS=N to choose"
        )
    if torch.get_num_threads() > free:
        line += (
            f". Warning: only {free} of {cores} cores are free (load {load:.1f}); more threads than free cores can "
            "make decoding several times slower"
        )
    return line
