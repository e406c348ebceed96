"""The scheduler side of speculation: drafts ride in a decoding request's `tokens_to_process`.

A decoding request normally carries one token to process (the last sampled one). With drafts it carries
`[last, d_1 .. d_k]`, and transformers' scheduler then reserves KV slots, positions and query tokens for all k + 1 of
them through the chunked-prefill mechanism (vLLM v1's lookahead slots). `speculative_scheduler_class` adds three rules on top of any
transformers scheduler (FIFO, prefill-first):

- drafts are proposed right before scheduling (after new requests and cancellations were taken in);
- a request whose drafts do not fit the token budget or the free cache keeps fewer drafts (down to none) instead of
  being split like a prefill or starved: speculation shrinks, it never fails for lack of room;
- blocks holding draft slots are never offered for prefix sharing at schedule time: the processor marks complete
  blocks after acceptance, from the committed tokens only.
"""

from __future__ import annotations

from typing import Protocol

from hf_specdec.continuous_batching.compat import FutureRequestState, RequestState, RequestStatus, Scheduler


class DraftHook(Protocol):
    """What the scheduler calls: the processor's proposal step and its record of scheduled verifies."""

    def propose_drafts(self, states: list[RequestState]) -> None: ...

    def after_schedule(self, scheduled: list[FutureRequestState] | None) -> None: ...


def _speculative_subclass(base: type[Scheduler]) -> type[Scheduler]:
    """`base` with the three rules of this module (a subclass, so that a live scheduler's class can be swapped)."""

    class SpeculativeScheduler(base):
        draft_hook: DraftHook | None = None

        def schedule_batch(self, token_budget: int, cache_budget: int):  # noqa: ANN202 (transformers' own tuple)
            if self.draft_hook is not None:
                decoding = [s for s in self.active_requests.values() if s.status == RequestStatus.DECODING]
                self.draft_hook.propose_drafts(decoding)
            result = super().schedule_batch(token_budget, cache_budget)
            if self.draft_hook is not None:
                self.draft_hook.after_schedule(result[0])
            return result

        def _infer_request_tokens(self, state: RequestState, request_ids_to_remove_from_waiting: set[str]) -> list[int]:
            tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
            if state.status == RequestStatus.DECODING and len(tokens) > 1:
                # Shrink the drafts until the cache can hold them all (dry run: nothing is allocated here)
                keep = len(tokens)
                while keep > 1 and not self.cache.can_store_request_tokens(state, keep, dry_run=True):
                    keep -= 1
                if keep < len(tokens):
                    state.tokens_to_process = tokens = tokens[:keep]
            return tokens

        def _schedule_request(
            self,
            state: RequestState,
            request_tokens: list[int],
            token_budget: int,
            request_ids_to_remove_from_waiting: set[str],
        ) -> None:
            if state.status == RequestStatus.DECODING and len(request_tokens) > token_budget:
                # A verify never splits: it keeps the drafts that fit (token_budget >= 1 here)
                state.tokens_to_process = request_tokens[:token_budget]
                return
            super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    SpeculativeScheduler.__name__ = SpeculativeScheduler.__qualname__ = f"Speculative{base.__name__}"
    return SpeculativeScheduler


_CLASSES: dict[type, type] = {}


def is_speculative_scheduler(scheduler: Scheduler) -> bool:
    return type(scheduler) in _CLASSES.values()


def speculative_scheduler_class(base: type[Scheduler]) -> type[Scheduler]:
    """`base` with the speculative rules (one class per base, reused)."""
    if base in _CLASSES.values():
        return base
    if base not in _CLASSES:
        _CLASSES[base] = _speculative_subclass(base)
    return _CLASSES[base]
