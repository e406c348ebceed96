"""`hf-specdec serve`: transformers' OpenAI-compatible app with speculative continuous batching answers two
streaming requests at once (a real HTTP client on localhost) with plain `generate_batch`'s tokens."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from conftest import make_model, make_word_tokenizer

pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import hf_specdec  # noqa: E402
from hf_specdec.continuous_batching.manager import SpecContinuousBatchingManager  # noqa: E402

WORDS = [f"w{i}" for i in range(93)]  # ids 3..95: the tiny models' 96-token vocabulary
PROMPTS = ["w5 w6 w7 w5 w6 w7 w5 w6", "w9 w10 w11 w12 w9 w10"]
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def stream_completion(port: int, prompt: str, out: dict) -> None:
    """POST /v1/completions with stream=True; collect the text of every SSE chunk."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
    texts = []
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"http://localhost:{port}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                texts.extend(choice.get("text") or "" for choice in chunk.get("choices", []))
    out[prompt] = "".join(texts)


def test_two_streaming_requests_at_once_give_plain_tokens(tmp_path):
    model = make_model("llama", seed=0)
    tokenizer = make_word_tokenizer(WORDS)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    from hf_specdec.tools.serve import start_server

    port = free_port()
    was_installed = hf_specdec.is_installed()
    # The target as its own draft: every draft is accepted, so a streamed output carries several tokens
    server = start_server(str(tmp_path), method="draft", draft=str(tmp_path), k=3, port=port, device="cpu",
                          dtype="float32", cb_page_size=16, cb_num_blocks=64, cb_max_batch_tokens=256,
                          block=False)  # fmt: skip
    try:
        answers: dict[str, str] = {}
        threads = [threading.Thread(target=stream_completion, args=(port, p, answers)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a streaming request did not finish"
        cb = server._generation_state._cb_manager._cb
        assert isinstance(cb, SpecContinuousBatchingManager)
        assert cb.spec_stats.accepted > 0
    finally:
        server.kill_server()
        if not was_installed:
            hf_specdec.uninstall()
    # Plain continuous batching of the same prompts (greedy), decoded like the server decodes
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    gen = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0)
    plain = model.generate_batch(ids, gen, continuous_batching_config=ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=256))  # fmt: skip
    for i, prompt in enumerate(PROMPTS):
        expected = tokenizer.decode(plain[f"req_{i}"].generated_tokens, skip_special_tokens=True)
        assert len(expected.split()) >= MAX_TOKENS // 2  # the comparison is not vacuous
        assert answers[prompt].split() == expected.split()


def test_serve_options_are_checked_before_loading():
    from hf_specdec.tools.cli import main
    from hf_specdec.tools.serve import spec_factory

    with pytest.raises(ValueError, match="needs --draft"):
        spec_factory("draft", None, 4, "adaptive")
    with pytest.raises(ValueError, match="drop one"):
        spec_factory("ngram", "some/draft", 4, "adaptive")
    with pytest.raises(ValueError, match="'ngram', 'draft' or 'mtp'"):
        spec_factory("eagle3", None, 4, "adaptive")
    spec = spec_factory("mtp", None, 3, "constant")(None)  # the MTP layers load from the target at its first call
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 3)
    assert main(["serve", "unused-model", "--method", "draft"]) == 2
