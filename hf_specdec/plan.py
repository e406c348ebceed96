"""The call plan: everything a `generate` call decides before any model work, decided once, in one order.

`CallPlan.build` resolves the route (dynamic, static, hybrid, encoder-decoder), runs every check of the call (each
owned by the module of what it checks, all called from here, in the order `build` lists), and builds what the loop
runs with: the ragged batch, the per-row sampling state, the stop rules, the exact path, the cache handoff, and the
proposer with its schedule. The plan is frozen: the loop and the output formatting read it, nothing rewrites it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from hf_specdec import compat, proposers
from hf_specdec.batch import RaggedBatch
from hf_specdec.cache_route import choose_route, say_once, static_plan
from hf_specdec.call_checks import (
    check_alibi_columns,
    check_call,
    check_spec_decoder,
    check_speculation_type,
)
from hf_specdec.config import SpecDecoder
from hf_specdec.continuation import CacheHandoff, build_handoff
from hf_specdec.decoding import capture_blocker
from hf_specdec.draft_budgets import DraftBudgets
from hf_specdec.exact import ExactPath, needs_exact_path
from hf_specdec.model_support import check_supported_cache
from hf_specdec.proposers.base import Proposer
from hf_specdec.proposers.top1 import Top1Proposer
from hf_specdec.ranks import rank_agreement
from hf_specdec.recurrent import check_recurrent_call, is_hybrid
from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling, is_pure
from hf_specdec.schedules import HeuristicSchedule, SpeculationSchedule
from hf_specdec.static_cache import StaticPlan
from hf_specdec.stopping import StopRules

Route = Literal["dynamic", "static", "hybrid", "encoder_decoder"]


@dataclass(frozen=True)
class CallPlan:
    """One `generate` call, checked and resolved: what the loop runs and how its outputs are laid out."""

    spec: SpecDecoder
    #: static (hybrids too: `static.hybrid`), hybrid (dynamic cache, recurrent rollback), encoder_decoder, dynamic
    route: Route
    batch: RaggedBatch
    sampling: StepSampling
    stop_rules: StopRules
    proposer: Top1Proposer  # the method's proposer, under the per-row budgets
    max_length: int
    streamer: Any
    output_scores: bool
    output_logits: bool
    return_dict: bool
    encoder: Any = None  # an encoder-decoder target's `EncoderState` (`hf_specdec.seq2seq`), or None
    view_factory: Callable | None = None  # the target's CacheView factory (encoder-decoder), or None (CacheView)
    static: StaticPlan | None = None
    exact: ExactPath | None = None  # processors or criteria off the allow-lists: the position-by-position path
    handoff: CacheHandoff | None = None
    schedule: SpeculationSchedule | None = None  # the per-row k schedule the loop asks for budgets (None: always k)

    @classmethod
    def build(
        cls,
        model: PreTrainedModel,
        input_ids: torch.LongTensor,  # [B, P]
        generation_config: GenerationConfig,
        spec_decoder: Any,
        model_kwargs: dict[str, Any],
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        *,
        streamer: Any = None,
        tokenizer: Any = None,
        stop_strings: str | list[str] | None = None,
    ) -> CallPlan:
        """Check the call and resolve it; no model forward runs here.

        The checks, in order: the SpecDecoder; the target's cache and attention (`model_support`); generate's
        settings (`call_checks.check_call`); the draft's cache; ALiBi; `speculation_type`; hybrids (`recurrent`);
        stop strings' tokenizer; an encoder-decoder target (`seq2seq`); the cache route (`cache_route.choose_route`)
        and the static route's refusals (`static_plan`); a filled `past_key_values` (`continuation`); the per-row
        seeds; the exact path's route; the proposer's own (its registered constructor in `hf_specdec.proposers`);
        on the default route, whether the step can be captured (`decoding.capture_blocker`; if not: dynamic).
        """
        spec = check_spec_decoder(spec_decoder)
        config = generation_config
        check_supported_cache(model)
        check_call(model, input_ids, config, model_kwargs)
        if spec.draft_model is not None and spec.method in ("draft", "suffix"):
            check_supported_cache(spec.draft_model, role="draft", needs_positions=not model.config.is_encoder_decoder)
        check_alibi_columns(model, spec, input_ids, config, model_kwargs)
        check_speculation_type(getattr(config, "speculation_type", None), spec)
        check_recurrent_call(model, spec, config, model_kwargs)
        streamer = streamer if streamer is not None else spec.streamer
        tokenizer = tokenizer if tokenizer is not None else spec.tokenizer
        stopping_criteria = with_stop_strings(stopping_criteria, stop_strings, tokenizer)

        encoder = None
        decoder_mask = model_kwargs.get("attention_mask")
        if model.config.is_encoder_decoder:  # generate ran the encoder; its attention_mask is the encoder's
            from hf_specdec.seq2seq import check_seq2seq_target, encoder_state

            check_seq2seq_target(model, input_ids.shape[0], spec.method)
            encoder, decoder_mask = encoder_state(model_kwargs), None
        cache = compat.get_cache(model_kwargs)
        cache_route = choose_route(model, spec, config, cache)
        static = static_plan(model, spec, config, cache, cache_route.compile) if cache_route.static else None
        handoff = (
            None
            if static or is_hybrid(model)  # hybrids: no cache to adopt or hand back (refused above)
            else build_handoff(model, spec, input_ids, config, cache)
        )
        # Static: the token buffer as wide as the bucketed caches, so that calls of other lengths fit kept graphs.
        capacity = static.max_columns if static else config.max_length + spec.max_speculative_tokens + 1
        batch = RaggedBatch.from_prompts(input_ids, decoder_mask, capacity)
        seeds = row_seeds(spec.seed, batch.batch_size)
        agreement = rank_agreement(model)
        if agreement is not None and spec.seed is None:  # drawn from each rank's own generator: take the first's
            seeds = agreement.agree(seeds)
        seeds = seeds.to(batch.device)
        sampling = StepSampling(processors=logits_processor, do_sample=bool(config.do_sample), seeds=seeds)
        pad = config._pad_token_tensor
        exact_path = needs_exact_path(sampling)
        stop_rules = StopRules(
            stopping_criteria,
            pad_token_id=int(pad.reshape(-1)[0]) if pad is not None else None,
            max_length=config.max_length,
            batch_size=batch.batch_size,
            prompt_width=batch.prompt_width,
            host_calls=not exact_path,  # the exact path calls every criterion itself, in lockstep
        )
        exact = None
        if exact_path:
            exact = ExactPath(logits_processor, stopping_criteria, stop_rules.pad_token_id)
            if static is not None and not cache_route.by_default:
                names = sorted({type(p).__name__ for p in logits_processor if not is_pure(p)})
                raise NotImplementedError(
                    f"This call has logits processors off hf_specdec's vectorised allow-list ({names}), which run on "
                    "the exact position-by-position path; that path does not run on static caches yet: drop "
                    "cache_implementation='static' (the default dynamic cache supports them)."
                )
        proposer = build_proposer(spec, model, tokenizer, encoder, static=static is not None)
        schedule = build_schedule(spec, model, proposer.inner, static=static is not None)
        if static is not None and cache_route.by_default:  # the default takes the static path only where it is captured
            proposer.use_static(static)  # what it can capture depends on the path (prompt lookup: on the device)
            plans = DraftBudgets(schedule, static=True).plans_on_host
            blocker = capture_blocker(sampling, stop_rules, exact, proposer, plans, host_outputs=False,
                                      hybrid=static.hybrid)  # fmt: skip
            if blocker is not None:
                say_once(blocker)
                static = None
                proposer = build_proposer(spec, model, tokenizer, encoder, static=False)
                schedule = build_schedule(spec, model, proposer.inner, static=False)
                if handoff is None and not is_hybrid(model):
                    handoff = build_handoff(model, spec, input_ids, config, cache)
        route: Route = "static" if static is not None else "encoder_decoder" if encoder is not None else "dynamic"
        if route == "dynamic" and is_hybrid(model):
            route = "hybrid"
        return cls(
            spec=spec,
            route=route,
            batch=batch,
            sampling=sampling,
            stop_rules=stop_rules,
            proposer=proposer,
            max_length=config.max_length,
            streamer=streamer,
            output_scores=bool(config.return_dict_in_generate and config.output_scores),
            output_logits=bool(config.return_dict_in_generate and config.output_logits),
            return_dict=bool(config.return_dict_in_generate),
            encoder=encoder,
            view_factory=seq2seq_views(encoder),
            static=static,
            exact=exact,
            handoff=handoff,
            schedule=schedule,
        )


def with_stop_strings(
    criteria: StoppingCriteriaList, stop_strings: str | list[str] | None, tokenizer: Any
) -> StoppingCriteriaList:
    """`criteria` plus a `StopStringCriteria` for `stop_strings` (which need the tokenizer), as plain generate adds."""
    if stop_strings is None:
        return criteria
    if tokenizer is None:
        raise ValueError(
            "stop strings need the tokenizer: pass spec_tokenizer=tokenizer (or SpecDecoder(tokenizer=...))."
        )
    return StoppingCriteriaList([*criteria, StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)])


def seq2seq_views(encoder: Any) -> Callable | None:
    """The CacheView factory of an encoder-decoder call (None: the loop's plain CacheView)."""
    if encoder is None:
        return None
    from hf_specdec.seq2seq import view_factory

    return view_factory(encoder)


def build_proposer(
    spec: SpecDecoder, model: PreTrainedModel, tokenizer: Any = None, encoder: Any = None, static: bool = False
) -> Top1Proposer:
    """The proposer that `spec` describes, checked against the target model.

    The method's registered constructor (`hf_specdec.proposers`) builds and checks it; it is always wrapped in a
    `Top1Proposer`, which drafts within each row's budget (the loop's, under the draft's position limit and
    `max_draft_len`); its cost is a few [B] tensor ops per step.
    """
    inner = proposers.build(spec, model, proposers.ProposerContext(tokenizer=tokenizer, encoder=encoder, static=static))
    return Top1Proposer(inner, max_draft_len=spec.max_draft_len)


def build_schedule(
    spec: SpecDecoder, model: PreTrainedModel, inner: Proposer, static: bool = False
) -> SpeculationSchedule | None:
    """The per-row k schedule that `spec.num_speculative_tokens_schedule` names (None: always k)."""
    schedule = spec.num_speculative_tokens_schedule
    if schedule == "adaptive":
        from hf_specdec.adaptive import AdaptiveSchedule
        from hf_specdec.model_guard import model_serial, model_version

        key = acceptance_key = f"ngram:{spec.prompt_lookup_min}-{spec.prompt_lookup_max}"
        if spec.draft_model is not None or spec.draft_head is not None:
            draft = spec.draft_model if spec.draft_model is not None else spec.draft_head
            key = f"{spec.method}:{model_serial(draft)}"
            acceptance_key = f"{spec.method}:{model_version(draft)}"  # a changed draft is judged anew
        elif spec.method == "suffix":  # its keys are match-length buckets (`suffix_search.key_of`)
            key = acceptance_key = (
                f"suffix:{spec.suffix_max_tree_depth}-{spec.suffix_max_spec_factor}-{spec.suffix_min_token_prob}"
            )
        elif spec.method != "ngram":
            key = acceptance_key = "mtp" if spec.method == "mtp" else f"exit:{spec.early_exit_layers}"
        return AdaptiveSchedule(
            spec.num_speculative_tokens,
            model,
            key,
            inner.proposes_cheaply,
            draft_share=_draft_share(spec, model),
            static=static,
            acceptance_key=acceptance_key,
            agreement=rank_agreement(model),
        )
    if schedule.startswith("heuristic"):

        def persist(k: int) -> None:  # HF's "heuristic" keeps the final k for the next call
            spec.num_speculative_tokens = k
            if spec.draft_model is not None:
                spec.draft_model.generation_config.num_assistant_tokens = k

        on_finish = persist if schedule == "heuristic" else None
        return HeuristicSchedule(spec.num_speculative_tokens, spec.max_speculative_tokens, on_finish)
    return None


def _draft_share(spec: SpecDecoder, model: PreTrainedModel) -> float:
    """What drafting one token costs next to a one-token target forward, before the adaptive schedule measures it:
    the draft's parameters over the target's (the share of the target's layers for early exit and MTP)."""
    layers = max(1, getattr(model.config.get_text_config(), "num_hidden_layers", 1) or 1)
    if spec.method == "early_exit":
        return spec.early_exit_layers / layers
    if spec.method == "mtp":
        return 1 / layers
    draft = spec.draft_model if spec.draft_model is not None else spec.draft_head
    if draft is None:
        return 0.0
    return min(1.0, sum(p.numel() for p in draft.parameters()) / sum(p.numel() for p in model.parameters()))


def row_seeds(seed: int | list[int] | None, batch_size: int) -> torch.Tensor:  # [B] int64
    """The seed of each row: `seed + i` for an int, the list as given, or draws from torch's global generator."""
    if seed is None:
        return row_random.random_seeds(batch_size)
    if isinstance(seed, int):
        if seed + batch_size > 2**63:
            raise ValueError(
                f"SpecDecoder(seed={seed}) plus the row index overflows int64 for {batch_size} rows: use a smaller seed."
            )
        return seed + torch.arange(batch_size)
    if len(seed) != batch_size:
        raise ValueError(
            f"SpecDecoder(seed=[...]) gives {len(seed)} per-row seeds but the batch has {batch_size} rows "
            "(num_return_sequences included): pass one seed per row, or a single int (row i then uses seed + i)."
        )
    return torch.tensor(seed, dtype=torch.long)
