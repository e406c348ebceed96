"""`SpecBatchProcessor`: transformers' `ContinuousBatchProcessor` with the speculative step inside it.

One iteration of the manager's loop stays transformers' own (`prepare_next_batch`, `_generation_step`,
`update_batch`); each of the three is extended:

1. propose   — in the scheduler (`scheduling.py`), before the batch is built: each decoding request gets up to its
               own k drafts, carried as `tokens_to_process = [last, d_1 .. d_k]`.
2. verify    — `_generation_step`: one target forward over the ragged batch, keeping the scores of every verified
               position (k + 1 rows per verifying request, one per finishing prefill), then the rejection sampler.
3. commit    — `update_batch`: append the accepted tokens one by one (EOS or max_new_tokens can end a request inside
               the block), roll the KV position back by the rejected drafts (`position_offset -= rejected`), mark
               complete blocks for prefix sharing from committed tokens only, and update the request's k.

Per-request draft length: `schedule.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_specdec.continuous_batching.compat import (
    ContinuousBatchProcessor,
    FutureRequestState,
    RequestState,
    RequestStatus,
    new_tokens_left,
)
from hf_specdec.continuous_batching.proposers import CBProposer, Drafts
from hf_specdec.continuous_batching.sampling import RowSampler
from hf_specdec.continuous_batching.schedule import RequestSchedule


@dataclass
class CBSpecStats:
    """Counters of one manager's speculation (all requests together)."""

    verify_steps: int = 0  # request-verifies with at least one draft
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended by the speculative steps (accepted + recovered/bonus)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class SpecBatchProcessor(ContinuousBatchProcessor):
    """Set up from a transformers processor by `SpecContinuousBatchingManager` (see `setup_speculation`)."""

    def setup_speculation(
        self,
        proposer: CBProposer,
        sampler: RowSampler,
        schedule: RequestSchedule,
        max_positions: int,
    ) -> None:
        self.proposer = proposer
        self.sampler = sampler
        self.schedule = schedule
        self.max_positions = max_positions
        self.spec_stats = CBSpecStats()
        self._proposed: dict[str, tuple[RequestState, Drafts]] = {}
        self._verifies: dict[str, Drafts] = {}
        self._emitted: list[list[int]] = []
        self._known: set[str] = set()  # requests the proposer may hold state for
        self.scheduler.draft_hook = self
        self._supports_logits_to_keep: bool | None = None

    def reset(self) -> None:
        super().reset()
        self.proposer.reset()
        self._proposed.clear()
        self._verifies.clear()
        self.schedule.clear()
        self._known.clear()

    # ------------------------------------------------------------------ 1. propose (called by the scheduler)

    def _budget(self, state: RequestState) -> int:
        """The most drafts `state` may get this step: its own k, what max_new_tokens and positions leave."""
        k = self.schedule.budget(state.request_id)
        left = new_tokens_left(state) - 1  # the verify emits one token more than the drafts it keeps
        room = self.max_positions - state.position_offset - 1  # positions P .. P + k must exist
        return max(0, min(k, left, room))

    def propose_drafts(self, states: list[RequestState]) -> None:
        self.schedule.tick()
        live = set(self.scheduler.active_requests) | set(self.scheduler.waiting_requests)
        for request_id in [r for r in self._known if r not in live]:  # cancelled or failed since the last step
            self._known.discard(request_id)
            self.schedule.forget(request_id)
            self.proposer.release(request_id)
        ready = [s for s in states if len(s.tokens_to_process) == 1 and s.request_id not in self._proposed]
        ready = ready[: self.scheduler.max_requests_per_batch]
        if not ready:
            return
        budgets = [self._budget(s) for s in ready]
        proposals = self.proposer.propose(ready, budgets, self.sampler)
        for state, drafts in zip(ready, proposals):
            self._known.add(state.request_id)
            state.tokens_to_process = state.tokens_to_process[:1] + drafts.token_ids
            self._proposed[state.request_id] = (state, drafts)

    def after_schedule(self, scheduled: list[FutureRequestState] | None) -> None:
        """Keep the drafts the scheduler found room for; give the others back (their requests wait a step)."""
        by_id = {f.state.request_id: f for f in scheduled or []}
        self._verifies = {}
        for request_id, (state, drafts) in self._proposed.items():
            future = by_id.get(request_id)
            if future is None or future.state is not state:
                state.tokens_to_process = state.tokens_to_process[:1]
                self.proposer.commit(state, 0)
                continue
            kept = future.query_length - 1
            self._verifies[request_id] = Drafts(
                drafts.token_ids[:kept], drafts.probs[:kept] if drafts.probs is not None else None
            )
            future.complete_blocks = {}  # no prefix sharing of draft slots: marked after acceptance instead
        self._proposed.clear()

    # ------------------------------------------------------------------ 2. verify

    def _logits_to_keep_supported(self, model: torch.nn.Module) -> bool:
        if self._supports_logits_to_keep is None:
            check = getattr(model, "_supports_logits_to_keep", None)
            self._supports_logits_to_keep = callable(check) and bool(check())
        return self._supports_logits_to_keep

    @torch.no_grad()
    def _generation_step(self, model: torch.nn.Module) -> None:
        ios = self.inputs_and_outputs
        batch_data = ios.get_model_kwargs(use_padding=False)
        device = batch_data["input_ids"].device
        rows: list[int] = []  # flat query positions whose scores we keep
        row_request: list[int] = []  # for each kept row, its column in the processors' per-request arguments
        verifying: list[tuple[RequestState, Drafts]] = []
        end = 0
        for future in ios.requests_in_batch:
            end += future.query_length
            if not future.has_new_token:
                continue
            drafts = self._verifies.get(future.state.request_id, Drafts([]))
            n = len(drafts.token_ids)
            rows.extend(range(end - 1 - n, end))
            row_request.extend([len(verifying)] * (n + 1))
            verifying.append((future.state, drafts))
        self._emitted = []
        # A batch of prefill chunks only still runs: the forward writes their KV (one row kept, then dropped)
        indices = torch.tensor(rows or [end - 1], dtype=torch.long, device=device)  # [N]
        batch_data["logits_indices"] = indices
        with self.proposer.watching(ios.requests_in_batch):
            if self._logits_to_keep_supported(model):
                batch_data["logits_to_keep"] = indices
                logits = model(**batch_data).logits[0]  # [N, V]
            else:
                logits = model(**batch_data).logits[0, indices]  # [N, V]
        if not verifying:
            return
        args = batch_data["logits_processor_args"]  # [T, requests]
        if self.sampler.processors.do_processing:
            args = args.index_select(1, torch.tensor(row_request, dtype=torch.long, device=device))  # [T, N]
        scores = self.sampler.scores(logits, batch_data["input_ids"][0, indices], args)  # [N, V]

        batch, vocab = len(verifying), scores.shape[-1]
        counts = [len(d.token_ids) for _, d in verifying]
        width = max(counts)
        if width == 0 and not self.sampler.do_sample:  # no drafts in the batch: plain greedy decoding's argmax
            self._emitted = [[token] for token in scores.argmax(dim=-1).tolist()]
            return
        # Pad to [B, k+1] with one gather (rows past a request's drafts repeat its last row and are never read)
        starts = [0]
        for n in counts[:-1]:
            starts.append(starts[-1] + n + 1)
        gather = [[start + min(j, n) for j in range(width + 1)] for start, n in zip(starts, counts)]
        target = scores[torch.tensor(gather, dtype=torch.long, device=device)]  # [B, k+1, V]
        draft_rows = [d.token_ids + [-1] * (width - len(d.token_ids)) for _, d in verifying]
        draft_ids = torch.tensor(draft_rows, dtype=torch.long, device=device).reshape(batch, width)  # [B, k]
        num_drafts = torch.tensor(counts, dtype=torch.long, device=device)  # [B]
        draft_probs = None
        if self.proposer.returns_probs:
            draft_probs = scores.new_zeros((batch, width, vocab))  # [B, k, V]
            for b, (_, drafts) in enumerate(verifying):
                if drafts.probs is not None and counts[b]:
                    draft_probs[b, : counts[b]] = drafts.probs
        self._emitted = self.sampler.verify(target, draft_ids, num_drafts, draft_probs, [s for s, _ in verifying])

    # ------------------------------------------------------------------ 3. commit

    def _mark_committed_blocks(self, state: RequestState, before: int) -> None:
        """Offer the blocks the committed tokens completed (never a block with draft slots) for prefix sharing."""
        if not self.cache.use_prefix_sharing:
            return
        after = state.position_offset
        complete = {}
        for name, allocator in self.cache.cache_allocators.items():
            count = after // allocator.tokens_per_page - before // allocator.tokens_per_page
            if count > 0:
                complete[name] = count
        self.cache.mark_complete_blocks(state, complete)

    def update_batch(self) -> None:
        ios = self.inputs_and_outputs
        emitted = iter(self._emitted)
        pending_outputs = []
        for future in ios.requests_in_batch:
            state = future.state
            if state.status in (RequestStatus.FINISHED, RequestStatus.PENDING):
                raise RuntimeError(f"Tried to update {state.status.name} request {state.request_id} in sync mode.")
            if not future.has_new_token:
                if state.status == RequestStatus.PREFILLING:
                    self.cache.mark_complete_blocks(state, future.complete_blocks)
                continue
            if state.generated_len() == 0:
                state.status = RequestStatus.DECODING
            tokens = next(emitted)
            verified = state.request_id in self._verifies  # a decoding request (its drafts may be none)
            drafts = self._verifies.get(state.request_id, Drafts([]))
            drafted, accepted = len(drafts.token_ids), len(tokens) - 1
            # Roll back the rejected drafts' positions: their KV slots are overwritten by the next forward
            state.position_offset -= drafted - accepted
            before = state.position_offset - accepted - 1
            finished = False
            for token in tokens:
                finished = state.update_and_check_completion(token, None)
                if finished:
                    break
            if verified:
                self.schedule.record(state.request_id, drafted, accepted)
            if drafted:
                self.spec_stats.verify_steps += 1
                self.spec_stats.drafted += drafted
                self.spec_stats.accepted += accepted
                self.spec_stats.emitted += len(tokens)
            if verified:
                self._mark_committed_blocks(state, before)
            else:  # a prefill that ended in this step
                self.cache.mark_complete_blocks(state, future.complete_blocks)
            if finished:
                self.scheduler.finish_request(state.request_id)
                self.scheduler.block_new_requests = False
                self.proposer.release(state.request_id)
                self.schedule.forget(state.request_id)
                self._known.discard(state.request_id)
            else:
                self.proposer.commit(state, accepted)
            if state.streaming or state.status == RequestStatus.FINISHED:
                pending_outputs.append(state.to_generation_output())
        self._verifies = {}
        if pending_outputs:
            self.output_router.deliver_batch(pending_outputs)

    def handle_batch_error(self, error: Exception) -> None:
        for future in self.inputs_and_outputs.requests_in_batch:
            self.proposer.release(future.state.request_id)
        super().handle_batch_error(error)
