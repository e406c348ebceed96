"""The target's MTP layers drafting in continuous batching: plain `generate_batch`'s tokens, drafts equal to
transformers' own MTP layer 0 over each committed prefix, the target's law when sampling, and the hidden-state
hand-off (`HiddenStash`) across chunks, rollbacks and prefix sharing.

Targets are the tiny GLM-4.5 (`glm4_moe`) of tests/proposers/test_mtp.py, whose MTP layers start from its decoder
layer (so drafts are often right). DeepSeek-V3's MLA attention is refused: transformers' continuous batching cannot
run it at all.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from cb_helpers import (
    cb_config,
    greedy_config,
    installed,  # noqa: F401 (the autouse fixture)
    plain_and_spec,
)
from transformers import GenerationConfig

import hf_specdec
from hf_specdec.continuous_batching.mtp import HiddenStash, MtpCBProposer
from hf_specdec.continuous_batching.proposers import sequence

sys.path.insert(0, str(Path(__file__).parent.parent / "proposers"))
from test_mtp import make_mtp_target, reference_drafts  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10], [9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27], [40, 41], [7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def glm():
    return make_mtp_target("glm4_moe")


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
def test_greedy_equals_plain_and_drafts_are_transformers_mtp(glm, schedule, monkeypatch):
    model, mtp = glm
    first_drafts: list[tuple[list[int], int]] = []
    propose = MtpCBProposer.propose

    def recording(self, states, max_drafts, sampler):
        out = propose(self, states, max_drafts, sampler)
        first_drafts.extend((sequence(s), d.token_ids[0]) for s, d in zip(states, out) if d.token_ids)
        return out

    monkeypatch.setattr(MtpCBProposer, "propose", recording)
    spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=3,
                                  num_speculative_tokens_schedule=schedule)  # fmt: skip
    plain, spec_out = plain_and_spec(model, PROMPTS, spec, greedy_config(max_new_tokens=24, eos_token_id=-1))
    assert spec_out == plain
    assert spec.last_stats.num_accepted_tokens > 0
    with torch.no_grad():  # every first draft is transformers' MTP layer 0 at the committed prefix's last token
        for tokens, draft in first_drafts:
            assert int(reference_drafts(model, mtp, torch.tensor(tokens))[0]) == draft


def test_chunked_prefill_small_budget_and_requests_that_wait(glm):
    """Prompts longer than the batch's token budget prefill in chunks (their hidden states arrive in pieces), and a
    small cache makes the scheduler leave requests out of steps (their newest entry is fed again)."""
    model, mtp = glm
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (int(n),), generator=g).tolist() for n in torch.randint(20, 70, (6,), generator=g)]
    spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=4)
    plain, spec_out = plain_and_spec(
        model, prompts, spec, greedy_config(max_new_tokens=20, eos_token_id=-1), max_batch_tokens=32, num_blocks=24
    )
    assert spec_out == plain
    assert spec.last_stats.num_draft_tokens > 0


def test_sampling_keeps_the_target_law():
    """3 000 requests of one prompt: (t1, t2) against the target's exact law (chi-square), as for the draft model
    in test_sampling.py, with a negative control."""
    from test_sampling import NUM_SAMPLES, NUM_TOKENS, PROMPT, SAMPLING, VOCAB, exact_law, p_value

    model, mtp = make_mtp_target("glm4_moe", seed=1, vocab=VOCAB)
    spec = hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp, num_speculative_tokens=2, seed=99,
                                  num_speculative_tokens_schedule="constant")  # fmt: skip
    gen = GenerationConfig(max_new_tokens=NUM_TOKENS + 1, do_sample=True, eos_token_id=2, pad_token_id=0, **SAMPLING)
    outputs = model.generate_batch([PROMPT] * NUM_SAMPLES, gen,
                                   continuous_batching_config=cb_config(num_blocks=512, max_batch_tokens=1024),
                                   spec_decoder=spec)  # fmt: skip
    assert all(o.error is None for o in outputs.values())
    cells = torch.tensor([(o.generated_tokens + [0])[:NUM_TOKENS] for o in outputs.values()])  # [N, 2]
    counts = torch.bincount(cells[:, 0] * VOCAB + cells[:, 1], minlength=VOCAB**NUM_TOKENS).double()
    assert spec.last_stats.num_draft_tokens > 0
    assert p_value(counts, exact_law(model, SAMPLING["temperature"])) > 1e-3
    assert p_value(counts, exact_law(model, 1.3)) < 1e-3


def test_hidden_stash_hands_off_rows_by_token_index():
    rows = torch.arange(10.0)[:, None].expand(10, 2)  # row i holds i: token index = value
    stash = HiddenStash(0, rows[:6])  # a prefill of tokens 0..5
    assert stash.take(0, 5)[:, 0].tolist() == [0, 1, 2, 3, 4]  # the catch-up feeds indices 1..5 with 0..4
    assert stash.start == 4  # the last one taken stays, for a request the scheduler leaves out
    assert stash.take(4, 1)[:, 0].tolist() == [4]
    stash.put(6, rows[6:9])  # a verify fed the newest token (6) and two drafts
    stash.put(7, rows[7:8] + 100)  # a later verify: from index 7 on, the old rows (rejected drafts) are replaced
    assert stash.take(5, 3)[:, 0].tolist() == [5, 6, 107]
    shared = HiddenStash(4, rows[4:6])  # prefix sharing: the target computed from index 4 on
    assert shared.take(0, 6)[:, 0].tolist() == [0, 0, 0, 0, 4, 5]
    shared.put(9, rows[9:])  # a gap is zeros
    assert shared.take(5, 5)[:, 0].tolist() == [5, 0, 0, 0, 9]
    shared.put(0, rows[:2])  # a re-prefill starts over
    assert (shared.start, shared.rows.shape[0]) == (0, 2)


def test_mla_targets_are_refused_before_any_work():
    model, mtp = make_mtp_target("deepseek_v3")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        model.generate_batch(PROMPTS[:2], greedy_config(), continuous_batching_config=cb_config(),
                             spec_decoder=hf_specdec.SpecDecoder(method="mtp", mtp_model=mtp))  # fmt: skip
