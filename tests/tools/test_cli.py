"""Tests of the ``hf-specdec`` CLI on tiny random models: argument errors, ``bench --tiny`` and ``generate``.

Commands run in-process through `hf_specdec.tools.cli.main` (no subprocess start-up per test); one test runs the
installed console script to check the entry point.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_specdec.tools.benchmarking import parse_methods
from hf_specdec.tools.cli import main
from hf_specdec.tools.prompts import read_prompts

PROMPTS = [
    {"question_id": 1, "category": "code", "turns": ["def add(a, b):\n    return a + b\n\nRename add to plus.", "x"]},
    {"question_id": 2, "category": "code", "turns": ["import torch\nfrom transformers import AutoModelForCausalLM"]},
    {"question_id": 3, "category": "chat", "prompt": "Write a short story about a robot."},
]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    return path


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run the CLI expecting a usage error (exit code 2); return what it printed on stderr."""
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_help_lists_commands(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "generate", "bench"):
        assert command in out
    for command in ("demo", "generate", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--max-new-tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate", "--tiny", "--prompt", "hi", "-k", "0"], "1..32"),
        (["generate", "--tiny", "--prompt", "hi", "-k", "40"], "1..32"),
        (["generate", "--tiny", "--prompt", "hi", "-k", "five"], "must be an integer"),
        (["generate", "--tiny"], "--prompt"),
        (["generate", "--tiny", "--prompt", "hi", "--temperature", "0.7"], "add --do-sample"),
        (["generate", "--tiny", "--prompt", "hi", "--do-sample", "--temperature", "0"], "must be > 0"),
        (["generate", "--tiny", "--prompt", "hi", "--do-sample", "--top-p", "1.5"], "(0, 1]"),
        (["generate", "--prompt", "hi"], "pass --model"),
        (["generate", "--tiny", "--prompt", "hi", "--method", "beam"], "invalid choice"),
        (["generate", "--tiny", "--prompt", "hi", "--method", "ngram", "--draft", "tiny"], "drop --method"),
        (["generate", "--model", "smollm2", "--draft", "tiny", "--prompt", "hi"], "--draft tiny only fits"),
        (["bench", "--tiny", "--prompts", "p.jsonl", "--out", "o.json", "--methods", "plain,magic"], "unknown method"),
        (["bench", "--prompts", "p.jsonl", "--out", "o.json", "--methods", "draft"], "--draft"),
        (["bench", "--tiny", "--out", "o.json"], "--prompts"),
        (["bench", "--tiny", "--prompts", "p.jsonl", "--out", "o.json", "--batch-size", "0"], "--batch-size"),
    ],
)
def test_argument_errors_say_what_to_pass(capsys: pytest.CaptureFixture, argv: list[str], expected: str) -> None:
    assert expected in _error(capsys, argv)


def test_missing_prompt_file_and_category(capsys: pytest.CaptureFixture, prompts_file: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "r.json")
    err = _error(capsys, ["bench", "--tiny", "--prompts", str(tmp_path / "nope.jsonl"), "--out", out])
    assert "does not exist" in err
    err = _error(capsys, ["bench", "--tiny", "--prompts", str(prompts_file), "--out", out, "--categories", "poetry"])
    assert "poetry" in err and "chat,code" in err


def test_read_prompts_formats_and_limit(prompts_file: Path, tmp_path: Path) -> None:
    prompts = read_prompts(prompts_file)
    assert [p.category for p in prompts] == ["code", "code", "chat"]
    assert prompts[0].text.startswith("def add")  # first turn of Spec-Bench's `turns`
    assert prompts[2].text == "Write a short story about a robot."
    assert [p.question_id for p in read_prompts(prompts_file, limit=1)] == [1, 3]
    assert [p.question_id for p in read_prompts(prompts_file, categories=["chat"])] == [3]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="neither a 'prompt'"):
        read_prompts(bad)


def test_parse_methods() -> None:
    assert parse_methods("ngram", has_draft=False) == ["plain", "ngram"]
    assert parse_methods("plain,hf-stock,ngram,draft", has_draft=True) == [
        "plain",
        "hf-ngram",
        "hf-draft",
        "ngram",
        "draft",
    ]
    assert parse_methods("hf-stock", has_draft=False) == ["plain", "hf-ngram"]
    with pytest.raises(ValueError, match="need a draft model"):
        parse_methods("draft", has_draft=False)


def test_bench_tiny_writes_json_and_png(capsys: pytest.CaptureFixture, prompts_file: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "results.json", tmp_path / "plots" / "speedup.png"
    argv = ["bench", "--tiny", "--prompts", str(prompts_file), "--methods", "plain,hf-stock,ngram,draft",
            "--max-new-tokens", "12", "--batch-size", "2", "--out", str(out), "--plot", str(png), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "overall" in printed and "speedup" in printed

    results = json.loads(out.read_text())
    methods = ["plain", "hf-ngram", "hf-draft", "ngram", "draft"]
    assert results["config"]["methods"] == methods
    assert set(results["summary"]["categories"]) == {"code", "chat"}
    overall = results["summary"]["overall"]
    assert set(overall) == set(methods)
    assert overall["plain"]["speedup"] == pytest.approx(1.0)
    for m in ("ngram", "draft"):
        assert 0.0 <= overall[m]["acceptance_rate"] <= 1.0
        assert overall[m]["mean_accepted_length"] >= 1.0
        assert overall[m]["identical_to_plain"] == 1.0  # greedy speculative decoding is exact
    for m in methods:
        assert overall[m]["num_prompts"] == 3
        assert overall[m]["tokens_per_target_forward"] > 0
    assert len(results["batches"]) == 2 * len(methods)  # code (2 prompts, one batch) + chat (1 prompt)

    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (450, 1000)


def test_generate_batch_file_tiny_matches_plain(
    capsys: pytest.CaptureFixture, prompts_file: Path, tmp_path: Path
) -> None:
    outs = {}
    for method in ("plain", "ngram", "draft"):
        path = tmp_path / f"{method}.jsonl"
        argv = ["generate", "--tiny", "--method", method, "--prompts", str(prompts_file), "--batch-size", "2",
                "--max-new-tokens", "10", "-k", "3", "--out", str(path)]  # fmt: skip
        assert main(argv) == 0
        printed = capsys.readouterr().out
        assert f"[{method}, k=3] 3 prompt(s)" in printed
        outs[method] = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["question_id"] for r in outs[method]] == [1, 2, 3]
        assert all(1 <= r["new_tokens"] <= 10 for r in outs[method])
    assert [r["completion"] for r in outs["ngram"]] == [r["completion"] for r in outs["plain"]]
    assert [r["completion"] for r in outs["draft"]] == [r["completion"] for r in outs["plain"]]


def test_generate_sampling_with_seed_is_reproducible(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    texts = []
    for i in range(2):
        path = tmp_path / f"s{i}.jsonl"
        argv = ["generate", "--tiny", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--do-sample",
                "--temperature", "0.9", "--top-p", "0.9", "--seed", "3", "--out", str(path)]  # fmt: skip
        assert main(argv) == 0
        texts.append(json.loads(path.read_text())["completion"])
    capsys.readouterr()
    assert texts[0] == texts[1]


def test_mtp_on_a_model_without_mtp_layers_is_reported_clearly(capsys: pytest.CaptureFixture) -> None:
    """--method mtp needs a target with MTP layers; the tiny Llama has none: a message naming the alternatives."""
    code = main(["generate", "--tiny", "--method", "mtp", "--prompt", "hi", "--max-new-tokens", "4"])
    assert code == 2
    err = capsys.readouterr().err
    assert "num_mtp_layers" in err and "method='draft'" in err and "method='ngram'" in err


def test_console_script_entry_point() -> None:
    exe = shutil.which("hf-specdec")
    cmd = [exe] if exe else [sys.executable, "-m", "hf_specdec.tools.cli"]
    proc = subprocess.run([*cmd, "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--prompts FILE.jsonl" in proc.stdout


def test_help_imports_neither_torch_nor_transformers() -> None:
    """`hf-specdec --help` stays fast: parsing arguments never imports torch or transformers (lazy imports)."""
    code = (
        "import sys\nfrom hf_specdec.tools.cli import build_parser\nbuild_parser().format_help()\n"
        "import hf_specdec\nheavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\nprint(heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
