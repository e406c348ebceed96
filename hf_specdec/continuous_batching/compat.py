"""transformers' continuous-batching internals that hf_specdec's speculative CB relies on, gathered in one place.

Everything private we touch in `transformers.generation.continuous_batching` is imported or named here, so that a
transformers release that moves one breaks in this module only. Written against transformers 5.24; 5.17 (and any
release before 5.24) has another cache layer (`cache_manager.py`, block allocation inside the scheduler) and is
refused with `check_transformers_version`.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging import version
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
    ContinuousMixin,
)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.requests import (
    TMP_TOKEN_ID,
    FutureRequestState,
    RequestState,
    RequestStatus,
)
from transformers.generation.continuous_batching.scheduler import Scheduler
from transformers.generation.continuous_batching.utils import pad_to_interval

__all__ = [
    "MIN_TRANSFORMERS",
    "TMP_TOKEN_ID",
    "ContinuousBatchProcessor",
    "ContinuousBatchingConfig",
    "ContinuousBatchingIOs",
    "ContinuousBatchingLogitsProcessor",
    "ContinuousBatchingLogitsProcessorList",
    "ContinuousBatchingManager",
    "ContinuousMixin",
    "FutureRequestState",
    "PagedAttentionCache",
    "RequestState",
    "RequestStatus",
    "Scheduler",
    "check_transformers_version",
    "continuous_api",
    "graph_key",
    "new_draft_ios",
    "new_tokens_left",
    "pad_max_lengths_for_graphs",
    "pad_to_interval",
]

#: The first transformers release whose continuous batching this package speculates in.
MIN_TRANSFORMERS = "5.24.0"


def check_transformers_version(found: str | None = None) -> None:
    """Refuse transformers releases (`found`, default the installed one) whose continuous-batching internals differ
    from the ones this package subclasses."""
    found = transformers.__version__ if found is None else found
    if version.parse(found).release < version.parse(MIN_TRANSFORMERS).release:
        raise RuntimeError(
            f"Speculative continuous batching needs transformers >= {MIN_TRANSFORMERS}, found {found}"
            " (its paged cache and scheduler differ before 5.24): `pip install -U 'transformers>=5.24'`, or use "
            "`model.generate(..., spec_decoder=spec)` without continuous batching."
        )


def new_tokens_left(state: RequestState) -> int:
    """Tokens the request may still generate (`RequestState._new_tokens_limit`, a huge int without a limit)."""
    return state._new_tokens_limit - state.generated_len()


def new_draft_ios(
    cache: PagedAttentionCache, config: Any, cb_config: ContinuousBatchingConfig, device: Any, dtype: Any
) -> ContinuousBatchingIOs:
    """A fresh set of static input tensors over the draft model's own paged cache (no logits processors)."""
    from transformers.generation.logits_process import LogitsProcessorList

    return ContinuousBatchingIOs(
        cache=cache,
        config=config,
        continuous_batching_config=cb_config,
        device=device,
        model_dtype=dtype,
        logit_processor=ContinuousBatchingLogitsProcessorList(LogitsProcessorList()),
    )


def graph_key(ios: ContinuousBatchingIOs) -> tuple[int, ...]:
    """The key transformers files a captured forward under: the padded query and KV sizes, the padded max lengths."""
    return ios._get_graph_key()


def pad_max_lengths_for_graphs(ios: ContinuousBatchingIOs) -> None:
    """Make `ios.get_model_kwargs(use_padding=True)` pad `max_length_k` to a power of two, as it does for transformers'
    own captured forwards (a Python number a captured forward keeps, and part of its key)."""
    ios.use_cuda_graph_varlen = True


def new_paged_cache(config: Any, cb_config: ContinuousBatchingConfig, device: Any, dtype: Any, helper: Any) -> Any:
    """A `PagedAttentionCache` for a draft model, sized by `cb_config` (num_blocks and max_batch_tokens set)."""
    return PagedAttentionCache(
        config=config, continuous_batching_config=cb_config, device=device, distributed_helper=helper, dtype=dtype
    )


def attention_groups(config: Any) -> list[str]:
    """The attention groups (`full_attention`, `sliding_attention`) transformers' paged cache makes for `config`."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    return list(group_layers_by_attn_type(config))


def kv_bytes_per_token(config: Any, dtype: Any) -> int:
    """Bytes of keys and values one token takes in a paged cache for `config` (all layers)."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    return 2 * config.num_hidden_layers * find_num_key_value_heads(config) * find_head_dim(config) * dtype.itemsize
