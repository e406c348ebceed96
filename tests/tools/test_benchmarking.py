"""Benchmark method variants: ``ngram-k<N>`` (a fixed k) and ``<method>-adaptive`` (the adaptive k schedule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_specdec.tools.benchmarking import parse_methods, spec_variant
from hf_specdec.tools.cli import main


def test_spec_variants_parse():
    assert spec_variant("ngram") == ("ngram", None, "adaptive")  # the library's default
    assert spec_variant("ngram-heuristic") == ("ngram", None, "heuristic")
    assert spec_variant("ngram-k8") == ("ngram", 8, "constant")
    assert spec_variant("draft-adaptive") == ("draft", None, "adaptive")
    for bad in ("ngram-k0", "ngram-k33", "ngram-fast", "beam-k2"):
        assert spec_variant(bad) is None
    assert parse_methods("hf-stock,ngram-k2,ngram-adaptive", has_draft=False) == [
        "plain", "hf-ngram", "ngram-k2", "ngram-adaptive"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="ngram-k4"):
        parse_methods("ngram-k99", has_draft=False)
    with pytest.raises(ValueError, match="need a draft model"):
        parse_methods("draft-adaptive", has_draft=False)


def test_bench_tiny_runs_fixed_k_and_adaptive_variants(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "prompt": "a b a b a b a b"}) + "\n")
    out = tmp_path / "results.json"
    methods = "plain,ngram-k2,ngram-k8,ngram-adaptive"
    argv = ["bench", "--tiny", "--prompts", str(prompts), "--methods", methods, "--max-new-tokens", "8",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    overall = json.loads(out.read_text())["summary"]["overall"]
    assert list(overall) == methods.split(",")
    for m in methods.split(",")[1:]:
        assert overall[m]["identical_to_plain"] == 1.0
