"""`SpecDecoder(on_step=...)`: every step's kept tokens per row and how each came (accepted, recovered, bonus)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

import hf_specdec
from hf_specdec.metrics import StepRecord


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_the_records_rebuild_the_output_and_count_the_accepted_drafts(method):
    target = make_model("llama", seed=0)
    inputs = make_prompts(3, seed=3)
    records: list[StepRecord] = []
    kwargs = {"draft_model": make_noisy_copy(target, 0.05)} if method == "draft" else {"method": "ngram"}
    spec = hf_specdec.SpecDecoder(num_speculative_tokens=4, on_step=records.append, **kwargs)
    out = spec_generate(target, inputs, spec, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(out, target.generate(**inputs, max_new_tokens=20, do_sample=False, eos_token_id=None))
    width = inputs["input_ids"].shape[1]
    rebuilt = {row: [] for row in range(3)}
    kinds = {"accepted": 0, "recovered": 0, "bonus": 0, "plain": 0}
    for record in records:
        for i, row in enumerate(record.row_ids):
            rebuilt[row] += record.tokens[i]
            for kind in record.kinds(i):
                kinds[kind] += 1
    assert [rebuilt[row] for row in range(3)] == out[:, width:].tolist()
    assert kinds["accepted"] <= spec.last_stats.num_accepted_tokens  # the last step may be cut by max_new_tokens
    assert kinds["accepted"] > 0 and kinds["recovered"] > 0 and sum(kinds.values()) == 3 * 20


def test_kinds_name_the_targets_own_token():
    record = StepRecord(
        row_ids=[0, 1, 2], tokens=[[5, 6, 7], [8, 9], [4]], num_drafts=[2, 3, 0], num_accepted=[2, 1, 0]
    )
    assert record.kinds(0) == ["accepted", "accepted", "bonus"]
    assert record.kinds(1) == ["accepted", "recovered"]
    assert record.kinds(2) == ["plain"]  # a step without drafts: a plain decoding step


def test_on_step_must_be_callable():
    with pytest.raises(ValueError, match="on_step"):
        hf_specdec.SpecDecoder(on_step="print")
