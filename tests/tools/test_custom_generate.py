"""The `custom_generate` repository in `hub/`: transformers loads it from a local folder and runs hf_specdec.

`model.generate(custom_generate=<folder>, trust_remote_code=True, spec_decoder=...)` goes through transformers'
own loader (`GenerationMixin.load_custom_generate`: the file check, the `requirements.txt` check, the import of
`custom_generate/generate.py`), and the output equals plain greedy `generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_model, make_prompts

import hf_specdec

REPOSITORY = Path(__file__).resolve().parents[2] / "hub"


def test_the_repository_runs_hf_specdec_and_equals_plain_generate() -> None:
    model = make_model("llama", seed=0)
    inputs = make_prompts(2, seed=3)  # left-padded, ragged
    expected = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=4)
    out = model.generate(
        **inputs,
        max_new_tokens=12,
        do_sample=False,
        custom_generate=str(REPOSITORY),
        trust_remote_code=True,
        spec_decoder=spec,
    )
    assert torch.equal(out, expected)
    assert spec.last_stats is not None and spec.last_stats.num_steps > 0  # hf_specdec's loop ran


def test_the_repository_needs_trust_remote_code() -> None:
    model = make_model("llama", seed=0)
    with pytest.raises(ValueError, match="trust_remote_code"):
        model.generate(**make_prompts(1), max_new_tokens=2, custom_generate=str(REPOSITORY), trust_remote_code=False)


def test_the_repository_holds_no_copy_of_the_library() -> None:
    source = (REPOSITORY / "custom_generate" / "generate.py").read_text()
    assert "import hf_specdec" in source and len(source.splitlines()) < 30
    assert (REPOSITORY / "custom_generate" / "requirements.txt").read_text().split() == ["hf_specdec"]
    assert "custom_generate" in (REPOSITORY / "README.md").read_text().split("---")[1]  # the card's tags
