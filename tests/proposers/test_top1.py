"""Top1Proposer: per-row draft budgets, a learned-position draft that must never see a position past its limit,
rows that skip steps and catch up, and the merge of a sub-batch's proposal."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_prompts, spec_generate

import hf_specdec
from hf_specdec.batch import RaggedBatch
from hf_specdec.generation import build_proposer
from hf_specdec.proposers.ngram import NgramProposer
from hf_specdec.proposers.top1 import Top1Proposer, length_budget
from hf_specdec.schedules import SpeculationSchedule

DRAFT_POSITIONS = 64


@pytest.fixture(scope="module")
def gpt2_pair():
    """A 512-position GPT-2 target and a 64-position GPT-2 draft holding the target's weights (high acceptance)."""
    target = make_model("gpt2", seed=0)
    draft = make_model("gpt2", seed=0, n_positions=DRAFT_POSITIONS)
    state = {k: v[:DRAFT_POSITIONS] if k.endswith("wpe.weight") else v for k, v in target.state_dict().items()}
    draft.load_state_dict(state)
    return target, draft


class PositionGuard:
    """A forward pre-hook on the draft's position embedding: records every position id it is fed."""

    def __init__(self, draft: torch.nn.Module) -> None:
        self.max_position = -1
        self.calls = 0
        self.handle = draft.transformer.wpe.register_forward_pre_hook(self.check)

    def check(self, module: torch.nn.Module, args: tuple) -> None:
        self.calls += 1
        self.max_position = max(self.max_position, int(args[0].max()))
        assert int(args[0].max()) < DRAFT_POSITIONS, f"draft fed position {int(args[0].max())}"

    def __enter__(self) -> PositionGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def _prompts(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, 96, (n,), generator=g)
        mask[i, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def test_the_draft_really_crashes_past_its_limit(gpt2_pair):
    """The guard below is meaningful: a 64-position draft cannot take position 64."""
    _, draft = gpt2_pair
    with pytest.raises(IndexError):
        draft(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[DRAFT_POSITIONS]]))


@pytest.mark.parametrize("lengths", [[50], [20, 58, 70], [70, 40]])
def test_greedy_equality_across_the_draft_limit(gpt2_pair, lengths):
    """Prompts before, at and past the draft's limit, crossing it mid-generation, in one batch."""
    target, draft = gpt2_pair
    inputs = _prompts(lengths, seed=len(lengths))
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **kwargs)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=5)
    with PositionGuard(draft) as guard:
        out = spec_generate(target, inputs, spec, **kwargs)
    assert torch.equal(out, expected)
    assert guard.calls > 0 and guard.max_position < DRAFT_POSITIONS
    stats = spec.last_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.9, stats
    # Rows past the limit decoded one token per step: fewer drafting row-steps than row-steps.
    assert stats.num_drafting_row_steps < stats.num_row_steps


def test_rows_past_the_limit_only_cost_nothing(gpt2_pair):
    """A batch whose every row is already past the limit never calls the draft at all."""
    target, draft = gpt2_pair
    inputs = _prompts([80, 66], seed=3)
    expected = target.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=4)
    with PositionGuard(draft) as guard:
        out = spec_generate(target, inputs, spec, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(out, expected)
    assert guard.calls == 0
    assert spec.last_stats.num_draft_tokens == 0


def test_length_budget_keeps_seq_len_plus_drafts_below_the_limit():
    seq = torch.tensor([10, 58, 62, 63, 64, 90])
    assert length_budget(seq, 64).tolist() == [53, 5, 1, 0, 0, 0]
    assert length_budget(seq, None) is None


def test_max_draft_len_stops_speculation_for_long_rows(llama):
    inputs = make_prompts(3, seed=2, min_len=4, max_len=12)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = llama.generate(**inputs, **kwargs)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4, max_draft_len=16)
    proposer = build_proposer(spec, llama)
    assert isinstance(proposer, Top1Proposer) and proposer.limit == 16
    batch = RaggedBatch(
        token_ids=torch.zeros(3, 40, dtype=torch.long),
        lengths=torch.tensor([10, 14, 20]),
        pad_lengths=torch.tensor([0, 2, 0]),
        row_ids=torch.arange(3),
        prompt_width=8,
    )
    assert proposer.budgets(batch, torch.full((3,), 4)).tolist() == [4, 3, 0]
    out = spec_generate(llama, inputs, spec, **kwargs)
    assert torch.equal(out, expected)


def test_sub_batch_merge_pads_rows_that_do_not_speculate():
    """The stateless n-gram proposer runs on the speculating rows only; the others get -1 and 0 drafts."""
    motif = torch.tensor([5, 6, 7, 8])
    token_ids = torch.zeros(3, 32, dtype=torch.long)
    for i in range(3):
        token_ids[i, :16] = motif.repeat(4)
    batch = RaggedBatch(token_ids, torch.full((3,), 16), torch.zeros(3, dtype=torch.long), torch.arange(3), 16)
    top1 = Top1Proposer(NgramProposer(4))
    proposal = top1.propose(batch, torch.tensor([4, 0, 2]), sampling=None)
    assert proposal.num_draft_tokens.tolist() == [4, 0, 2]
    assert proposal.draft_token_ids.tolist() == [[5, 6, 7, 8], [-1, -1, -1, -1], [5, 6, -1, -1]]
    none = top1.propose(batch, torch.zeros(3, dtype=torch.long), sampling=None)
    assert none.draft_token_ids.shape == (3, 0)


class EveryThirdStep(SpeculationSchedule):
    """Row i may draft only on steps where step % 3 == i % 3: rows skip two steps out of three."""

    def start(self, batch_size: int, device: torch.device) -> None:
        self.step, self.rows = 0, torch.arange(batch_size, device=device)

    def budgets(self, batch: RaggedBatch) -> torch.Tensor:
        self.step += 1
        return torch.where(self.rows % 3 == self.step % 3, self.max_k, 0)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.rows = self.rows[keep]


def test_draft_cache_catches_up_after_skipped_steps(llama, monkeypatch):
    """The target as its own draft accepts everything only if the draft saw every skipped token in order."""
    import hf_specdec.plan as plan

    def skipping_schedule(spec_, *args, **kwargs):
        return EveryThirdStep(spec_.num_speculative_tokens)

    monkeypatch.setattr(plan, "build_schedule", skipping_schedule)
    inputs = make_prompts(4, seed=9)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
    expected = llama.generate(**inputs, **kwargs)
    spec = hf_specdec.SpecDecoder(draft_model=llama, num_speculative_tokens=3)
    out = spec_generate(llama, inputs, spec, **kwargs)
    assert torch.equal(out, expected)
    stats = spec.last_stats
    assert stats.acceptance_rate >= 0.98, stats
    assert 0 < stats.num_drafting_row_steps < stats.num_row_steps / 2, stats
