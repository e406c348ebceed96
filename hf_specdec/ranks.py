"""Tensor-parallel targets: every rank makes the same host decisions, so every rank runs the same forwards.

A target loaded with transformers' `tp_plan` runs one process per rank, and each of its forwards holds collectives
that wait for the same forward on every other rank. Token choices agree by themselves: the logits are replicated
after the last collective and the draft model runs whole on every rank. Two host inputs do not:

- per-row seeds drawn from torch's global generator (`SpecDecoder(seed=None)`), which each process seeds itself;
- the adaptive schedule's step costs, timed per rank with the wall clock. Ranks whose costs differ can choose
  differently (one drafts, another decodes plainly), and then call the target with different widths or replay
  different graphs: the collectives wait for each other forever or mix shapes.

`RankAgreement` makes rank 0's values everyone's: the seeds once per call, the cost table each time the schedule
decides (a few floats; with NCCL one small broadcast through the GPU, made on the host before the step's device
work, while the GPU is idle after the previous step's read).
"""

from __future__ import annotations

import torch

from hf_specdec import compat
from hf_specdec.placement import input_device


class RankAgreement:
    """Broadcasts host values from the first rank of a tensor-parallel group to the others."""

    def __init__(self, group: object, device: torch.device) -> None:
        import torch.distributed as dist

        self.group = group
        self.source = dist.get_process_group_ranks(group)[0]  # the global rank of the group's first rank
        # gloo moves host tensors; NCCL (and the like) only the accelerator's
        self.device = torch.device("cpu") if dist.get_backend(group) == "gloo" else device

    def agree(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (a host tensor) as the group's first rank has it, on every rank (a host tensor)."""
        import torch.distributed as dist

        shared = values.to(self.device, copy=True)
        dist.broadcast(shared, src=self.source, group=self.group)
        return shared.to(values.device)


def rank_agreement(model: torch.nn.Module) -> RankAgreement | None:
    """The agreement of `model`'s tensor-parallel ranks, or None for a model without tensor parallelism."""
    group = compat.tensor_parallel_group(model)
    return None if group is None else RankAgreement(group, input_device(model))
