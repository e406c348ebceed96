"""`hf-specdec serve MODEL [--draft ID | --method ngram | --method mtp]`: transformers' OpenAI-compatible server (continuous
batching) with every request speculated.

transformers' serve app creates its continuous-batching manager itself (`model.init_continuous_batching(...)`), so
the server's model manager tags each model it loads with a default `SpecDecoder`
(`hf_specdec.continuous_batching.entry.set_default_spec`); after `hf_specdec.install()` that manager is then a
`SpecContinuousBatchingManager`. Endpoints, streaming and concurrency are transformers' own (`/v1/completions`,
`/v1/chat/completions`, ...). Needs `pip install 'hf_specdec[serve]'` (fastapi, uvicorn, pydantic, openai).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from hf_specdec.config import SpecDecoder


def check_serve_available() -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError(
            "hf-specdec serve needs transformers' serving dependencies (fastapi, uvicorn, pydantic, openai): "
            "pip install 'hf_specdec[serve]'."
        )


def spec_factory(method: str, draft: str | None, k: int, schedule: str) -> Callable[[Any], SpecDecoder]:
    """What each loaded model speculates with: prompt lookup, the target's MTP layers (loaded from its checkpoint),
    or a draft loaded next to the target."""
    if draft is not None and method != "draft":
        raise ValueError(f"--draft {draft!r} was given with --method {method}: drop one (a draft implies draft).")
    if method == "draft" and draft is None:
        raise ValueError("--method draft needs --draft MODEL_ID (a small model sharing the target's tokenizer).")
    if method not in ("ngram", "draft", "mtp"):
        raise ValueError(f"--method must be 'ngram', 'draft' or 'mtp' for serving, got {method!r}.")

    def make(model: Any) -> SpecDecoder:
        schedule_kw = dict(num_speculative_tokens=k, num_speculative_tokens_schedule=schedule)
        if method in ("ngram", "mtp"):
            return SpecDecoder(method=method, **schedule_kw)
        from transformers import AutoModelForCausalLM

        draft_model = AutoModelForCausalLM.from_pretrained(
            draft, dtype=model.dtype, device_map=model.device, attn_implementation=model.config._attn_implementation
        )
        return SpecDecoder(draft_model=draft_model.eval(), **schedule_kw)

    return make


@contextlib.contextmanager
def _speculating_model_manager(make_spec: Callable[[Any], SpecDecoder]) -> Iterator[None]:
    """While transformers' `Serve` is built, its `ModelManager` is one that tags each model it loads."""
    from transformers.cli.serving import model_manager as module

    from hf_specdec.continuous_batching.entry import DEFAULT_SPEC_ATTRIBUTE, set_default_spec

    base = module.ModelManager

    class SpeculatingModelManager(base):
        def load_model_and_processor(self, *args: Any, **kwargs: Any):  # noqa: ANN202
            model, processor = super().load_model_and_processor(*args, **kwargs)
            if getattr(model, DEFAULT_SPEC_ATTRIBUTE, None) is None:
                set_default_spec(model, make_spec(model))
            return model, processor

    module.ModelManager = SpeculatingModelManager
    try:
        yield
    finally:
        module.ModelManager = base


def start_server(
    model_id: str,
    *,
    method: str = "ngram",
    draft: str | None = None,
    k: int = 4,
    schedule: str = "adaptive",
    host: str = "localhost",
    port: int = 8000,
    device: str = "auto",
    dtype: str = "auto",
    cb_page_size: int | None = None,
    cb_num_blocks: int | None = None,
    cb_max_batch_tokens: int | None = None,
    block: bool = True,
) -> Any:
    """Serve `model_id` with speculative continuous batching. `block=False` returns transformers' `Serve` object with
    the server running in a thread (stop it with `.kill_server()`)."""
    check_serve_available()
    make_spec = spec_factory(method, draft, k, schedule)
    from transformers.cli.serve import Serve

    import hf_specdec

    hf_specdec.install()
    with _speculating_model_manager(make_spec):
        server = Serve(
            force_model=model_id,
            continuous_batching=True,
            device=device,
            dtype=dtype,
            host=host,
            port=port,
            cb_block_size=cb_page_size,
            cb_num_blocks=cb_num_blocks,
            cb_max_batch_tokens=cb_max_batch_tokens,
            non_blocking=True,
        )
    if block:
        server._thread.join()
    return server
