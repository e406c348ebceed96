"""`SpecContinuousBatchingManager`: transformers' `ContinuousBatchingManager` that speculates for every request.

It is a subclass, so everything that takes a manager takes it: `generate_batch`, the context manager and
`transformers serve` find it in `model._cached_continuous_batching_manager`, or get it from
`init_continuous_batching(..., spec_decoder=spec)` once `hf_specdec.install()` ran. What it changes is made when its
batch processor is created: the processor becomes a `SpecBatchProcessor` and the scheduler gets the speculative
mixin. Everything it cannot speculate for is refused here, before any model work.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import GenerationConfig

from hf_specdec.attention_backends import without_cudnn_attention
from hf_specdec.config import SpecDecoder
from hf_specdec.continuous_batching.compat import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    attention_groups,
    check_transformers_version,
    kv_bytes_per_token,
)
from hf_specdec.continuous_batching.draft_model import DraftModelCBProposer
from hf_specdec.continuous_batching.mtp import MtpCBProposer, mtp_cache_config
from hf_specdec.continuous_batching.processor import CBSpecStats, SpecBatchProcessor
from hf_specdec.continuous_batching.proposers import CBProposer, NgramCBProposer
from hf_specdec.continuous_batching.sampling import RowSampler, check_processors
from hf_specdec.continuous_batching.schedule import RequestSchedule
from hf_specdec.continuous_batching.scheduling import speculative_scheduler_class
from hf_specdec.metrics import SpecDecodeStats
from hf_specdec.sampling.random import random_seeds

#: SpecDecoder methods continuous batching speculates with.
CB_METHODS = ("ngram", "draft", "mtp")


def check_spec_for_cb(spec: Any, model: torch.nn.Module) -> None:
    """Refuse what speculative continuous batching cannot do, with the value and the fix."""
    if not isinstance(spec, SpecDecoder):
        raise TypeError(f"spec_decoder must be a hf_specdec.SpecDecoder, got {type(spec).__name__}.")
    if spec.method not in CB_METHODS:
        raise ValueError(
            f"Continuous batching speculates with SpecDecoder(method=...) in {CB_METHODS}, got method={spec.method!r}: "
            "use method='ngram', 'mtp' or a draft_model, or model.generate(..., spec_decoder=spec) without continuous "
            "batching."
        )
    if spec.draft_tokenizer is not None:
        raise ValueError("Continuous batching cannot use a draft_tokenizer (another vocabulary): drop draft_tokenizer.")
    if spec.draft_confidence_threshold:
        raise ValueError(
            f"draft_confidence_threshold={spec.draft_confidence_threshold} is not supported in continuous batching: "
            "drop it (each request's draft length follows the per-request schedule)."
        )
    if isinstance(spec.seed, list):
        raise ValueError(
            "SpecDecoder(seed=[...]) gives one seed per row of a generate batch; continuous batching seeds each "
            "request from one int and its request id: pass seed=<int>."
        )
    if getattr(model.config.get_text_config(), "kv_lora_rank", None):
        raise ValueError(
            f"{type(model).__name__} uses multi-head latent attention (MLA: keys and values of different head sizes), "
            "which transformers' continuous batching cannot store in its paged cache (plain generate_batch fails on "
            "it too): use model.generate(..., spec_decoder=spec) instead."
        )
    groups = attention_groups(model.config.get_text_config())
    if groups != ["full_attention"]:
        raise ValueError(
            f"Speculative continuous batching needs full-attention layers only; {type(model).__name__} has {groups} "
            "(a sliding-window layer keeps a ring of the window's size, which draft slots would overwrite): decode "
            "without spec_decoder, or use model.generate(..., spec_decoder=spec)."
        )
    if spec.method == "mtp":
        mtp_groups = attention_groups(mtp_cache_config(drafter(spec, model)))
        if mtp_groups != ["full_attention"]:
            raise ValueError(f"The MTP layers have {mtp_groups} layers: continuous batching needs full attention.")
    draft = spec.draft_model
    if draft is not None:
        target_vocab = model.get_output_embeddings().weight.shape[0]
        draft_vocab = draft.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab:
            raise ValueError(
                f"The draft model's vocabulary ({draft_vocab}) differs from the target's ({target_vocab}): continuous "
                "batching needs a draft sharing the target's tokenizer."
            )
        if draft.device != model.device:
            raise ValueError(f"The draft model is on {draft.device}, the target on {model.device}: move it there.")
        draft_groups = attention_groups(draft.config.get_text_config())
        if draft_groups != ["full_attention"]:
            raise ValueError(f"The draft model has {draft_groups} layers: continuous batching needs full attention.")
        if draft.config._attn_implementation not in ("eager", "paged|eager", "sdpa") and "flash" not in str(
            draft.config._attn_implementation
        ):
            raise ValueError(
                f"The draft model's attention implementation {draft.config._attn_implementation!r} cannot read a paged "
                "cache: load it with attn_implementation='sdpa' (or eager, or a flash implementation)."
            )


def drafter(spec: SpecDecoder, model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that drafts for `spec` on `model`: its draft model, the target's MTP layers, or None (prompt
    lookup)."""
    if spec.method == "mtp":
        from hf_specdec.proposers.mtp import resolve_mtp_model

        return resolve_mtp_model(model, spec.mtp_model)
    return spec.draft_model


def speculative_cb_config(config: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
    """A copy of `config` with what speculation cannot use turned off: async batching (its carry-over assumes one
    new token per request), CUDA graphs and compile of the step (drafts change the ragged shapes), the one-query-token
    decode fast path, and log probabilities."""
    config = copy.copy(config) if config is not None else ContinuousBatchingConfig()
    if config.return_logprobs:
        raise ValueError(
            "ContinuousBatchingConfig(return_logprobs=True) is not supported with spec_decoder: drop it, or decode "
            "without speculation."
        )
    if config.use_async_batching:
        raise ValueError(
            "ContinuousBatchingConfig(use_async_batching=True) is not supported with spec_decoder (the carry-over "
            "assumes one new token per request): leave it unset."
        )
    config.use_async_batching = False
    config.use_cuda_graph = False
    config.varlen_compile_config = None
    config.decode_compile_config = None
    config.default_compile_level = 0
    config.max_blocks_per_request = 0
    return config


class SpecContinuousBatchingManager(ContinuousBatchingManager):
    """A continuous-batching manager whose requests are decoded with speculation (`spec_decoder`). When it stops,
    `spec_decoder.last_stats` holds the drafted and accepted counts of its loop (all requests together)."""

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: Any = None,
        *,
        spec_decoder: SpecDecoder,
    ) -> None:
        check_transformers_version()
        check_spec_for_cb(spec_decoder, model)
        if (getattr(generation_config, "num_return_sequences", None) or 1) > 1:
            raise ValueError(
                f"num_return_sequences={generation_config.num_return_sequences} is not supported with spec_decoder in "
                "continuous batching: submit the prompt several times instead."
            )
        self.spec_decoder = spec_decoder
        self._draft_attn_impl: str | None = None
        super().__init__(model, generation_config, speculative_cb_config(continuous_batching_config), workload_hints)
        check_processors(self.logit_processor)
        seed = spec_decoder.seed if spec_decoder.seed is not None else int(random_seeds(1)[0]) % (2**63)
        self.row_sampler = RowSampler(
            processors=self.logit_processor,
            do_sample=bool(getattr(generation_config, "do_sample", False)),
            base_seed=seed,
        )
        self._prepare_draft()

    def _prepare_draft(self) -> None:
        draft = self.drafter = drafter(self.spec_decoder, self.model)
        if draft is None:
            return
        draft.eval()
        # The draft reads its paged cache like the target: the target's flash implementation when transformers
        # switched it to one (no attention masks to allocate), else paged|eager for eager
        target_impl = str(self.model.config._attn_implementation)
        draft_impl = str(draft.config._attn_implementation)
        wanted = draft_impl
        if "flash" in target_impl and "flash" not in draft_impl and getattr(draft, "_supports_flash_attn", False):
            wanted = target_impl
        elif draft_impl == "eager":
            wanted = "paged|eager"
        if wanted != draft_impl:
            self._draft_attn_impl = draft_impl
            draft.set_attn_implementation(wanted)
        if self.continuous_batching_config.num_blocks is None:
            # The draft's KV comes out of the same memory: give the target its share of the budget
            target_bytes = kv_bytes_per_token(self.model.config.get_text_config(), self.model.dtype)
            kv_config = mtp_cache_config(draft) if self.spec_decoder.method == "mtp" else draft.config.get_text_config()
            draft_bytes = kv_bytes_per_token(kv_config, draft.dtype)
            share = target_bytes / (target_bytes + draft_bytes)
            self.continuous_batching_config.max_memory_percent *= share

    @property
    def spec_stats(self) -> CBSpecStats | None:
        """Speculation counters of the current (or last) generation loop."""
        processor = self.batch_processor
        return processor.spec_stats if isinstance(processor, SpecBatchProcessor) else None

    def _make_proposer(self, processor: SpecBatchProcessor) -> CBProposer:
        spec = self.spec_decoder
        if spec.method == "ngram":
            return NgramCBProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.method == "mtp":
            return MtpCBProposer(
                self.model,
                self.drafter,
                processor.cache,
                self.continuous_batching_config,
                self.distributed_helper,
                self.row_sampler,
            )
        return DraftModelCBProposer(
            spec.draft_model,
            processor.cache,
            self.continuous_batching_config,
            self.distributed_helper,
            self.row_sampler,
        )

    def _create_batch_processor(self) -> SpecBatchProcessor:
        processor = super()._create_batch_processor()
        if isinstance(processor, SpecBatchProcessor):
            return processor  # reset by transformers' own method
        processor.scheduler.__class__ = speculative_scheduler_class(type(processor.scheduler))
        processor.__class__ = SpecBatchProcessor
        spec = self.spec_decoder
        max_positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or 2**31
        if spec.draft_model is not None:
            draft_positions = getattr(spec.draft_model.config.get_text_config(), "max_position_embeddings", None)
            max_positions = min(max_positions, draft_positions or max_positions)
        processor.setup_speculation(
            proposer=self._make_proposer(processor),
            sampler=self.row_sampler,
            schedule=RequestSchedule(spec.num_speculative_tokens_schedule, spec.num_speculative_tokens),
            max_positions=max_positions,
        )
        return processor

    def _run_generation_loop(self, use_inference_mode: bool) -> None:
        # Verifies, drafts and catch-ups meet a new pair of query and key lengths almost every step, and cuDNN's
        # attention builds a plan for each on the host: 60-80 ms per forward of an 8B-shaped target on an H100
        # (benchmarks/profile_cb_gpu.py; docs/benchmarks.md). The other SDPA kernels need no plan.
        with without_cudnn_attention(self.model.device):
            super()._run_generation_loop(use_inference_mode)

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        processor = self.batch_processor
        super().stop(block=block, timeout=timeout, keep_for_next_session=keep_for_next_session, hard_stop=hard_stop)
        if isinstance(processor, SpecBatchProcessor):
            stats = processor.spec_stats
            self.spec_decoder.last_stats = SpecDecodeStats(
                num_drafting_row_steps=stats.verify_steps,
                num_draft_tokens=stats.drafted,
                num_accepted_tokens=stats.accepted,
            )
        if not keep_for_next_session and self._draft_attn_impl is not None:
            self.drafter.set_attn_implementation(self._draft_attn_impl)
            self._draft_attn_impl = None


def init_spec_continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: Any = None,
    *,
    spec_decoder: SpecDecoder,
) -> SpecContinuousBatchingManager:
    """`model.init_continuous_batching(...)` with speculation: a cached manager is reused when it speculates with
    the same `spec_decoder`, refused when it does not."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        if isinstance(cached, SpecContinuousBatchingManager) and cached.spec_decoder is spec_decoder:
            cached.switch_to_cb_friendly_attn(model, cached.continuous_batching_config.auto_switch_to_flash)
            return cached
        raise ValueError(
            f"The model keeps a {type(cached).__name__} for reuse (persistent_manager=True) that does not speculate "
            "with this spec_decoder: call model.destroy_cached_continuous_batching_manager() first."
        )
    config = generation_config if generation_config is not None else model.generation_config
    if config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if config.eos_token_id is None:
        config.eos_token_id = -1
    return SpecContinuousBatchingManager(
        model, config, continuous_batching_config, workload_hints, spec_decoder=spec_decoder
    )
