"""`hf_specdec.draft_budgets.DraftBudgets`: the loop asks its schedule for budgets and tells it what was accepted."""

from __future__ import annotations

import torch

from hf_specdec.batch import RaggedBatch
from hf_specdec.draft_budgets import DraftBudgets
from hf_specdec.proposers.base import Proposal
from hf_specdec.schedules import SpeculationSchedule


class Recording(SpeculationSchedule):
    """Plans on the host from a list of per-row budgets; records what it observes."""

    plans_on_host = True

    def __init__(self, max_k: int, plans: list[list[int]]) -> None:
        super().__init__(max_k)
        self.plans = plans
        self.observed: list[tuple[list[int], list[int]]] = []

    def host_budgets(self, batch: RaggedBatch) -> torch.Tensor:
        return torch.tensor(self.plans.pop(0))

    def budgets(self, batch: RaggedBatch) -> torch.Tensor:
        return torch.tensor([1, 0])

    def observe(self, num_draft_tokens, num_accepted, draft_keys=None) -> None:  # noqa: ANN001
        self.observed.append((num_draft_tokens.tolist(), num_accepted.tolist()))


def _batch() -> RaggedBatch:
    return RaggedBatch(torch.zeros(2, 8, dtype=torch.long), torch.full((2,), 4), torch.zeros(2, dtype=torch.long),
                       torch.arange(2), 4)  # fmt: skip


def test_planned_steps_write_budgets_in_place_and_learn_after_the_step():
    schedule = Recording(4, plans=[[2, 0], [0, 0], [4, 1]])
    budgets = DraftBudgets(schedule, static=True)
    batch, room = _batch(), torch.tensor([4, 4])
    assert budgets.plan(batch, k=4) == 4
    home = budgets.planned_budgets  # the tensor a captured step reads
    assert budgets.budgets(batch, room).tolist() == [2, 0] and budgets.trim is None
    budgets.proposed(Proposal(torch.zeros(2, 4, dtype=torch.long), torch.tensor([2, 0])))
    budgets.accepted(torch.tensor([1, 0]))
    assert schedule.observed == []  # a planned step is learned after its host read
    budgets.after_step()
    assert schedule.observed == [([2, 0], [1, 0])]
    assert budgets.plan(batch, k=4) == 0  # no row drafts: the plain step
    assert budgets.plan(batch, k=4) == 4 and budgets.planned_budgets is home and home.tolist() == [4, 1]


def test_unplanned_steps_ask_the_schedule_and_learn_at_once():
    schedule = Recording(4, plans=[])
    budgets = DraftBudgets(schedule, static=False)
    batch = _batch()
    assert budgets.budgets(batch, torch.tensor([0, 4])).tolist() == [0, 0]  # the room and the schedule
    assert budgets.trim == schedule.trim
    budgets.proposed(Proposal(torch.zeros(2, 1, dtype=torch.long), torch.tensor([1, 0])))
    budgets.accepted(torch.tensor([1, 0]))
    assert schedule.observed == [([1, 0], [1, 0])]


def test_without_a_schedule_every_row_may_draft_its_room():
    budgets = DraftBudgets(None, static=True)
    assert budgets.plans_on_host and budgets.plan(_batch(), k=3) == 3 and budgets.planned_width is None
    assert budgets.budgets(_batch(), torch.tensor([3, 1])).tolist() == [3, 1]
    budgets.accepted(torch.tensor([0, 0]))  # nothing to tell
    budgets.after_step()
