"""`DraftBudgets`: the loop's dealings with its k schedule — it asks for each step's per-row draft budgets and tells
what the target accepted.

The loop owns one per call (`SpeculativeLoop.budgets`); the proposer never sees the schedule, only the budgets it
is given (`Top1Proposer.propose`). A step's budget per row is the smallest of the loop's room before
`max_length`, the schedule's choice and the proposer's position limit (applied by `Top1Proposer`).

On static caches a schedule that decides on the host (`plans_on_host`: the adaptive schedule) plans each step
before its device work (`plan`): the rows' budgets go to the device in place (a captured step reads them there),
and the step drafts at width k or not at all. What that step proposed and accepted stays on the device until the
step's one host read is behind it (`after_step`), then the schedule learns it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers.base import Proposal
from hf_specdec.schedules import SpeculationSchedule

__all__ = ["DraftBudgets"]


class DraftBudgets:
    """One call's draft budgets from its schedule (`None`: every row may draft k every step)."""

    def __init__(self, schedule: SpeculationSchedule | None, static: bool) -> None:
        self.schedule = schedule
        self.static = static
        #: a planned step's draft width (0: no row drafts, else k), or None when steps are not planned
        self.planned_width: int | None = None
        self.planned_budgets: torch.Tensor | None = None  # [B] on the device, written in place (graphs read it)
        self.last_num_draft_tokens: torch.Tensor | None = None  # [B] drafts of the latest proposal
        self.last_num_accepted: torch.Tensor | None = None  # [B] what a planned step accepted
        self.last_draft_keys: torch.Tensor | None = None  # [B] keys of a planned step's drafts (prompt lookup)
        self.plain_streak = 0  # planned steps in a row (this one included) in which no row drafts (host)

    @property
    def plans_on_host(self) -> bool:
        """Whether a static step's budgets are known before its device work (no schedule, or one that plans)."""
        return self.schedule is None or getattr(self.schedule, "plans_on_host", False)

    @property
    def trim(self) -> Callable[[Proposal], torch.Tensor] | None:
        """The schedule's cut of a proposal after drafting (unplanned steps with a schedule), or None."""
        return self.schedule.trim if self.schedule is not None and self.planned_width is None else None

    def start(self, batch: RaggedBatch) -> None:
        if self.schedule is not None:
            self.schedule.start(batch.batch_size, batch.device)

    def calibrate(self, time_verify: Callable[[int], float]) -> None:
        if self.schedule is not None:
            self.schedule.calibrate(time_verify)

    def plan(self, batch: RaggedBatch, k: int) -> int:
        """A static step's draft width, decided on the host before its device work: 0 (no row drafts) or k."""
        if self.schedule is None:
            return k
        budgets = self.schedule.host_budgets(batch)  # [B] (host)
        if self.planned_budgets is None:
            self.planned_budgets = budgets.to(batch.device)
        else:
            self.planned_budgets.copy_(budgets)  # in place: the graphs read it there
        self.planned_width = k if bool((budgets > 0).any()) else 0
        self.plain_streak = 0 if self.planned_width else self.plain_streak + 1
        return self.planned_width

    def restart_timing(self) -> None:
        """The host work since `plan` (the proposer's catch-up) is not the step's own cost."""
        if self.schedule is not None:
            self.schedule.restart_timing()

    def budgets(self, batch: RaggedBatch, room: torch.Tensor) -> torch.Tensor:  # [B]
        """Drafts each row may have this step: the loop's `room` ([B]) and the schedule's choice."""
        if self.schedule is None:
            return room
        planned = self.planned_budgets if self.planned_width is not None else None
        return torch.minimum(room, planned if planned is not None else self.schedule.budgets(batch))

    def host_budgets(self, batch: RaggedBatch, host_room: np.ndarray) -> np.ndarray | None:  # [B]
        """The budgets of an unplanned dynamic step, on the host, when the schedule decides there (`host_room`: the
        drafts that fit before max_length): the loop reads nothing for them. None when it decides on the device."""
        if self.schedule is None:
            return host_room
        chosen = self.schedule.host_budgets(batch) if self.planned_width is None else None  # [B] host tensor
        return None if chosen is None else np.minimum(host_room, chosen.numpy())

    def proposed(self, proposal: Proposal) -> None:
        """The step's proposal (after every cut): what the schedule learns from once the step is accepted."""
        self.last_num_draft_tokens = proposal.num_draft_tokens
        if proposal.draft_keys is not None and self.planned_width is not None:
            self.last_draft_keys = proposal.draft_keys  # the schedule reads them after the step

    def accepted(self, num_accepted: torch.Tensor, host: tuple[np.ndarray, np.ndarray] | None = None) -> None:  # [B]
        """What the target accepted of the step's drafts: learned now, or after the step when it was planned.
        `host`: the step's drafts and accepted counts as its one read brought them (a schedule that learns on the
        host takes those)."""
        if self.schedule is None or self.last_num_draft_tokens is None:
            return
        if self.planned_width is not None:  # a planned step: the schedule reads it after the step (no sync)
            self.last_num_accepted = num_accepted
        elif host is not None and self.schedule.observes_on_host:
            self.schedule.observe(torch.from_numpy(host[0]), torch.from_numpy(host[1]))
        else:
            self.schedule.observe(self.last_num_draft_tokens, num_accepted)

    def after_step(self, measured: bool = True, steps: int = 1) -> None:
        """The step is done (its host read behind it); `measured`: it took what such steps take from now on;
        `steps`: a planned block of that many plain steps (`SpeculativeLoop.plain_block`)."""
        if self.schedule is not None and not measured:
            self.schedule.discard_timing()
        if self.schedule is not None and steps > 1:
            self.schedule.ran_plain_steps(steps)
        if self.planned_width is not None and self.last_num_accepted is not None:
            self.schedule.observe(self.last_num_draft_tokens, self.last_num_accepted, self.last_draft_keys)

    def select_rows(self, keep: torch.Tensor, host_keep: np.ndarray | None = None) -> None:
        if self.schedule is not None:
            on_host = host_keep is not None and self.schedule.observes_on_host
            self.schedule.select_rows(torch.from_numpy(host_keep) if on_host else keep)
        self.last_num_draft_tokens = None

    def finish(self) -> None:
        """After the call's last step: the schedule keeps what it learned (HF's persistent "heuristic")."""
        if self.schedule is not None:
            self.schedule.finish()
