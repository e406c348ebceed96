"""Every script in examples/ runs end to end with ``--tiny`` (tiny random models, no checkpoint)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
EXAMPLES = sorted(p.name for p in EXAMPLES_DIR.glob("*.py") if not p.name.startswith("_"))
EXPECTED = {
    "draft_model.py": "identical to plain generate: True",
    "prompt_lookup_code_edit.py": "identical: True",
    "batched_pipeline.py": "mean accepted length",
    "streaming_chat.py": "mean accepted length",
    "sampling_with_seed.py": "same seed, same text: True",
}


def test_every_example_is_covered() -> None:
    assert sorted(EXPECTED) == EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_tiny(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / name), "--tiny", "--max-new-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES_DIR,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert EXPECTED[name] in proc.stdout, proc.stdout[-2000:]
