"""The demo's timing, table, overall row and verdict on a tiny model (fast), and the tools' thread choice.

The real demo on SmolLM2 is in tests/tools/test_smollm.py (slow marker).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer

from hf_specdec.tools import threads
from hf_specdec.tools.demo import DemoRow, overall, run_demo, verdict
from hf_specdec.tools.prompts import Prompt


def row(name: str, plain_s: float, spec_s: float, tokens: int = 10, identical: bool = True) -> DemoRow:
    return DemoRow(name, True, tokens, plain_s, spec_s, 0.5, 2.0, identical)


def test_overall_weighs_prompts_by_their_time_and_the_verdict_says_faster_or_slower():
    rows = [row("a", 2.0, 1.0), row("b", 1.0, 1.0)]
    total = overall(rows)
    assert total.speedup == pytest.approx(1.5) and total.new_tokens == 20 and total.identical
    assert (
        verdict(rows) == "hf_specdec was 1.50x faster than plain decoding overall, outputs identical. Best: a (2.00x)."
    )
    slower = [row("a", 1.0, 1.25)]
    assert verdict(slower).startswith("hf_specdec was 1.25x slower than plain decoding overall")
    assert "OUTPUTS DIFFER" in verdict([row("a", 1.0, 1.0, identical=False)])


def test_run_demo_on_a_tiny_model_prints_table_overall_and_verdict(tmp_path: Path, capsys: pytest.CaptureFixture):
    model, tokenizer = make_model("llama", seed=0), make_tokenizer()
    prompts = [Prompt("a b c a b c a b c a b", "copy", copies=True), Prompt("hello there", "chat", copies=False)]
    out_json = tmp_path / "demo.json"
    rows = run_demo(
        max_new_tokens=8, k=3, repeats=2, model=model, tokenizer=tokenizer, prompts=prompts, json_path=str(out_json)
    )
    assert [r.prompt for r in rows] == ["copy", "chat"] and all(r.identical for r in rows)
    assert all(r.plain_s > 0 and r.spec_s > 0 and r.new_tokens == 8 for r in rows)
    text = capsys.readouterr().out
    assert "medians of 2 interleaved runs" in text and "overall" in text and "copies input" in text
    assert "than plain decoding overall, outputs identical" in text and "below 1.00x means slower" in text
    assert "plain generate (not streamed), run 2/2" in text  # the status line (a plain line off a terminal)
    saved = json.loads(out_json.read_text())
    assert saved["verdict"] in text and len(saved["rows"]) == 2 and saved["settings"]["schedule"] == "adaptive"
    assert saved["overall"]["speedup"] == pytest.approx(sum(r.plain_s for r in rows) / sum(r.spec_s for r in rows))


def test_configure_threads_keeps_a_request_and_warns_past_the_free_cores(monkeypatch: pytest.MonkeyPatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "free_cores", lambda: (2, 1, 1.4))
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert threads.configure_threads(2).startswith("torch threads: 2 (--threads). Warning: only 1 of 2 cores")
        assert torch.get_num_threads() == 2
        line = threads.configure_threads(None)  # no request: at most the free cores
        assert torch.get_num_threads() == 1 and line.startswith("torch threads: 1 (2 cores, load 1.4)")
    finally:
        torch.set_num_threads(before)


def test_suffix_rows_run_a_conversation_and_a_repeated_request(capsys: pytest.CaptureFixture):
    """The demo's suffix-decoding rows: a second turn (the first answer generated before, untimed) and a request made
    again; outputs equal plain's, the rows are labelled, and the repeat is drafted from the kept tree."""
    from hf_specdec.tools import benchmarking

    model, tokenizer = make_model("llama", seed=0), make_tokenizer()
    prompts = [
        Prompt("a b c d e f g", "second", copies=True, history=("c d e f g a b",), method="suffix", kind="reuses"),
        Prompt("h i j k l m n", "again", copies=True, method="suffix", repeat=True, kind="asked before"),
    ]
    benchmarking.SUFFIX_SPECS.clear()
    rows = run_demo(  # a constant k: the adaptive schedule's choices depend on this machine's timings
        max_new_tokens=12,
        k=3,
        schedule="constant",
        repeats=2,
        model=model,
        tokenizer=tokenizer,
        prompts=prompts,
        stream=False,
    )
    assert [r.prompt for r in rows] == ["second [suffix]", "again [suffix]"] and all(r.identical for r in rows)
    assert rows[1].acceptance_rate > 0.5  # its answer is in the global tree
    text = capsys.readouterr().out
    assert "below 1.00x means slower" in text
    assert "[suffix] rows: suffix decoding keeps a tree of earlier answers" in text and "asked before" in text
    (spec,) = benchmarking.SUFFIX_SPECS.values()
    assert spec.suffix_cache.num_requests >= 6  # warm-ups, the first turn, the first request, the timed runs
