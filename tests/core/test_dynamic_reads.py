"""The eager dynamic-cache step reads the device from the host once (issue 39), counted by `tests/device_reads.py`:
only reads of tensors a GPU run would hold on the device count (`item`, `tolist`, `bool`, `cpu`, `nonzero`, ...).

The one read, after the commit, brings every row's kept tokens, accepted and verified drafts and whether it is done
(and prompt lookup's newest tokens); forward widths, crops and the schedule's choices follow from it on the host.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate
from device_reads import count_step_reads

import hf_specdec

SETTINGS = {
    "draft": dict(draft_model="noisy"),
    "draft-constant": dict(draft_model="noisy", num_speculative_tokens_schedule="constant"),
    "useless-draft": dict(draft_model="random"),
    "ngram": dict(method="ngram"),
    "ngram-constant": dict(method="ngram", num_speculative_tokens_schedule="constant"),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_dynamic_step_reads_the_device_once(setting):
    target = make_model("llama", seed=0)
    kwargs = dict(SETTINGS[setting])
    if "draft_model" in kwargs:
        kwargs["draft_model"] = make_noisy_copy(target, 0.01) if kwargs["draft_model"] == "noisy" else make_model(
            "llama", seed=5)  # fmt: skip
    spec = hf_specdec.SpecDecoder(**kwargs)
    inputs = make_prompts(4, seed=3, min_len=4, max_len=16)
    gen = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
    expected = target.generate(**inputs, **gen)
    spec_generate(target, inputs, spec, **gen)  # the adaptive schedule calibrates in a model's first call
    models = [target, *(m for m in vars(spec).values() if isinstance(m, torch.nn.Module))]
    with count_step_reads(models, inputs) as (counter, steps):
        out = spec_generate(target, inputs, spec, **gen)
    assert torch.equal(out, expected)
    assert steps[0] > 3
    assert [reads for reads in counter.per_step if len(reads) != 1] == []
