"""The README's quickstart runs as written (on the offline SmolLM2), and its first two commands are the main job
and the tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_starts_with_the_demo_and_the_tests() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).strip().splitlines()
    assert len(first_block) == 2 and first_block[0].endswith("hf-specdec demo") and "scripts/test.sh" in first_block[1]


@pytest.mark.slow
def test_the_quickstart_runs_as_written() -> None:
    from hf_specdec.tools.smollm import INSTALL_HINT, is_smollm2_available

    if not is_smollm2_available():
        pytest.skip(f"SmolLM2 not installed: {INSTALL_HINT}")
    import hf_specdec

    text = README.read_text()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    try:
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 -- the README's own code
    finally:
        hf_specdec.uninstall()
    assert namespace["spec"].last_stats.num_steps > 0
    assert len(namespace["texts"]) == 2
