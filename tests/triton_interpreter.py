"""Triton kernels on the CPU for the tests: the Triton interpreter here, or a fresh process that has it.

TRITON_INTERPRET=1 works only if it is set before `triton` is first imported (triton.language's own jitted helpers
are built at import; `import hf_specdec` pulls triton in through torch._dynamo). Importing this module first thing
in a kernel test file sets it when it still can. Where another module imported triton first, `interpreted` skips
the file's tests here and `rerun_interpreted` (the file's one `in_subprocess` test) runs the file again in a fresh
interpreter with it: that is what a full `pytest tests` run does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`
pytest.importorskip("triton")

from hf_specdec.sampling.kernels import triton_interprets  # noqa: E402

IN_PROCESS = triton_interprets()
interpreted = pytest.mark.skipif(
    not IN_PROCESS,
    reason="covered in a subprocess instead (another test imported triton first, without its CPU interpreter; the "
    "file's in-subprocess test runs these there)",
)
in_subprocess = pytest.mark.skipif(IN_PROCESS, reason="the interpreter is on in this process: the tests ran here")
REPO = Path(__file__).resolve().parents[1]


def rerun_interpreted(test_file: str, timeout: int) -> None:
    """Run `test_file` in a fresh pytest process with TRITON_INTERPRET=1; assert that it passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]
