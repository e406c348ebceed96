"""A draft model in continuous batching, on its own paged KV cache.

The draft keeps a `PagedAttentionCache` of its own (same page size and token capacity as the target's) and runs
through transformers' own ragged inputs (`ContinuousBatchingIOs`): a step first feeds every drafting request the
tokens its draft KV misses (the prompt at first, then the last step's accepted tokens and bonus token), in chunks
that fit the draft's token budget, then k - 1 one-token forwards for the requests still drafting. Rollback is a
position decrement, as for the target: after a verify that kept `a` of `k` drafts, the draft's KV stays valid up
to the committed tokens plus `min(a, k - 1)` drafts. Chosen over a `DynamicCache` per request because one ragged
forward serves every request of the batch, and because the cache is paged like the target's (exact: each
request's KV is only ever read by itself).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from hf_specdec.continuous_batching.compat import (
    ContinuousBatchingConfig,
    FutureRequestState,
    PagedAttentionCache,
    RequestState,
    new_draft_ios,
    new_paged_cache,
)
from hf_specdec.continuous_batching.draft_graphs import DraftGraphs
from hf_specdec.continuous_batching.proposers import CBProposer, Drafts, sequence
from hf_specdec.continuous_batching.sampling import RowSampler

#: The most tokens one draft forward takes.
DRAFT_MAX_BATCH_TOKENS = 2048


@dataclass
class _DraftRequest:
    """The draft's view of one request: its KV length and the step's bookkeeping."""

    shadow: RequestState  # request_id and position_offset (= tokens in the draft KV) drive the paged inputs
    owner: RequestState  # the target's state it mirrors (a new object after a soft reset: start over)
    base_len: int = 0  # committed tokens in the draft KV after this step's catch-up
    fed: int = 0  # drafts of this step written to the draft KV (k - 1)


def draft_cache_config(
    target_cb_config: ContinuousBatchingConfig, cache: PagedAttentionCache
) -> ContinuousBatchingConfig:
    """The draft cache's config: the target's page size and capacity (in tokens), no decode fast path, and at most
    `DRAFT_MAX_BATCH_TOKENS` tokens per forward (catch-ups are chunked; an sdpa draft's attention mask scales with it)."""
    config = copy.copy(target_cb_config)
    config.num_blocks = cache.num_blocks
    config.max_batch_tokens = min(cache.max_batch_tokens, DRAFT_MAX_BATCH_TOKENS)
    config.max_memory_percent = 1.0
    config.max_blocks_per_request = 0
    config.allow_block_sharing = False
    return config


class DraftModelCBProposer(CBProposer):
    """Drafts with a smaller causal LM sharing the target's vocabulary, batched over the decoding requests."""

    #: Whether the forwards may be captured (`draft_graphs.py`): their inputs are all in the ragged IOs
    capturable = True

    def __init__(
        self,
        draft: torch.nn.Module,
        target_cache: PagedAttentionCache,
        cb_config: ContinuousBatchingConfig,
        distributed_helper: object,
        sampler: RowSampler,
    ) -> None:
        self.draft = draft
        self.supports_logits_to_keep = callable(getattr(draft, "_supports_logits_to_keep", None)) and bool(
            draft._supports_logits_to_keep()
        )
        self._setup(draft.config.get_text_config(), draft.device, draft.dtype, target_cache, cb_config,
                    distributed_helper, sampler)  # fmt: skip

    def _setup(
        self,
        model_config: object,
        device: torch.device,
        dtype: torch.dtype,
        target_cache: PagedAttentionCache,
        cb_config: ContinuousBatchingConfig,
        distributed_helper: object,
        sampler: RowSampler,
    ) -> None:
        """The paged cache and ragged inputs of the drafting layers (`model_config` sizes them)."""
        self.device = device
        self.returns_probs = sampler.do_sample
        config = draft_cache_config(cb_config, target_cache)
        self.cache = new_paged_cache(model_config, config, device, dtype, distributed_helper)
        self.ios = new_draft_ios(self.cache, model_config, config, device, dtype)
        self.max_batch_tokens = self.cache.max_batch_tokens
        self.max_requests = config.max_requests_per_batch
        self.requests: dict[str, _DraftRequest] = {}
        self.graphs = None
        if self.capturable:
            self.graphs = DraftGraphs.for_device(
                device,
                ios=self.ios,
                q_interval=config.q_padding_interval_size,
                max_batch_tokens=self.max_batch_tokens,
                max_tokens_read=self.cache.max_tokens_read,
                model=self.draft,
            )

    # ------------------------------------------------------------------ bookkeeping

    def _request(self, state: RequestState) -> _DraftRequest:
        entry = self.requests.get(state.request_id)
        if entry is not None and entry.owner is not state:  # soft reset (re-prefill): the draft starts over
            self._drop(state.request_id)
            entry = None
        if entry is None:
            entry = _DraftRequest(shadow=RequestState(request_id=state.request_id, initial_tokens=[]), owner=state)
            self.requests[state.request_id] = entry
        return entry

    def _drop(self, request_id: str) -> None:
        """Forget the request's draft KV (its blocks go back to the pool)."""
        if self.requests.pop(request_id, None) is not None:
            self.cache.free_blocks(request_id)

    def release(self, request_id: str) -> None:
        self._drop(request_id)

    def reset(self) -> None:
        self.requests.clear()
        self.cache.free_all_requests()
        if self.graphs is not None:
            self.graphs.check_model()

    def commit(self, state: RequestState, num_accepted: int) -> None:
        entry = self.requests.get(state.request_id)
        if entry is not None and entry.owner is state:
            entry.shadow.position_offset = entry.base_len + min(num_accepted, entry.fed)

    # ------------------------------------------------------------------ forwards

    def _tokens(self, state: RequestState) -> list[int]:
        """What the drafting layers' KV holds, entry by entry: every token of the request (its newest included)."""
        return sequence(state)

    def _fed(self, entry: _DraftRequest, start: int, tokens: list[int], chained: bool) -> None:  # noqa: B027
        """The next forward feeds `entry` the entries `start ..` holding `tokens`: what it caught up on, or
        (`chained`) its latest draft. A hook for drafters with inputs besides tokens (MTP)."""

    def _ran(self, request_ids: list[str]) -> None:  # noqa: B027
        """The latest forward gave the logits rows of `request_ids`, in order (a hook, as `_fed`)."""

    def _forward(self, futures: list[FutureRequestState]) -> torch.Tensor:  # [R, V] for the has_new_token requests
        """One forward over `futures`: captured at its padded shape where `graphs` allows, else eager. The logits
        are valid until the next forward."""
        num_q = sum(f.query_length for f in futures)
        max_kv = sum(f.state.position_offset for f in futures)
        padded = self.graphs.padded(num_q, max_kv) if self.graphs is not None else None
        if padded is None:
            self.ios.prepare_batch_tensors(futures, self.ios_processors, False, num_q, max_kv, use_padding=False)
            return self._run(self.ios.get_model_kwargs(use_padding=False), futures)
        rows = sum(1 for f in futures if f.has_new_token)
        self.ios.prepare_batch_tensors(futures, self.ios_processors, False, *padded, use_padding=True)
        kwargs = self.ios.get_model_kwargs(use_padding=True)
        return self.graphs.run(lambda: self._run(kwargs, futures))[:rows]  # [R, V] of the padded [S, V]

    def _run(self, kwargs: dict, futures: list[FutureRequestState]) -> torch.Tensor:  # [R, V]
        """One forward of the drafting layers over the ragged batch `kwargs` (transformers' paged arguments)."""
        indices = kwargs["logits_indices"]  # [R]
        if self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = indices
            return self.draft(**kwargs).logits[0]  # [R, V]
        return self.draft(**kwargs).logits[0, indices]  # [R, V]

    @property
    def ios_processors(self):  # noqa: ANN201 (transformers' processor list)
        from transformers.generation.logits_process import LogitsProcessorList

        from hf_specdec.continuous_batching.compat import ContinuousBatchingLogitsProcessorList

        if not hasattr(self, "_ios_processors"):
            self._ios_processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList())
        return self._ios_processors

    def _catch_up(self, entries: list[_DraftRequest], sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        """Feed each request the tokens its draft KV misses; returns each one's draft logits at its last token."""
        last_logits: dict[str, torch.Tensor] = {}
        pending = list(zip(entries, sequences))
        while pending:
            futures, budget, rest = [], self.max_batch_tokens, []
            for entry, seq in pending:
                missing = len(seq) - entry.shadow.position_offset
                if budget <= 0 or len(futures) >= self.max_requests:
                    rest.append((entry, seq))
                    continue
                take = min(missing, budget)
                start = entry.shadow.position_offset
                entry.shadow.tokens_to_process = seq[start : start + take]
                self._fed(entry, start, entry.shadow.tokens_to_process, chained=False)
                futures.append(FutureRequestState(entry.shadow, take == missing, {}, take))
                budget -= take
                if take < missing:
                    rest.append((entry, seq))
            logits = self._forward(futures)
            if rest:  # the next chunk's forward may overwrite these logits (a replayed graph's output)
                logits = logits.clone()
            rows = [f.state.request_id for f in futures if f.has_new_token]
            self._ran(rows)
            for row, request_id in enumerate(rows):
                last_logits[request_id] = logits[row]
            pending = rest
        return last_logits

    # ------------------------------------------------------------------ propose

    @torch.no_grad()
    def propose(self, states: list[RequestState], max_drafts: list[int], sampler: RowSampler) -> list[Drafts]:
        out = [Drafts([]) for _ in states]
        live, seqs, ks = [], [], []
        for i, (state, k) in enumerate(zip(states, max_drafts)):
            if k <= 0 or len(live) >= self.max_requests:
                continue
            entry = self._request(state)
            seq = self._tokens(state)
            entry.shadow.position_offset = min(entry.shadow.position_offset, len(seq) - 1)
            # Reserve the draft KV for the catch-up and the k - 1 drafts it feeds; shrink k when the cache is short
            missing = len(seq) - entry.shadow.position_offset
            while k > 0 and not self.cache.can_store_request_tokens(entry.shadow, missing + k - 1):
                k -= 1
            if k == 0:
                continue
            live.append((i, entry))
            seqs.append(seq)
            ks.append(k)
        if not live:
            return out
        device = self.device
        entries = [e for _, e in live]
        owners = [e.owner for e in entries]
        args = sampler.request_args(owners, device)  # [T, R]
        last = self._catch_up(entries, seqs)
        for entry, seq in zip(entries, seqs):
            entry.base_len = len(seq)
            entry.fed = 0
        tokens: list[list[int]] = [[] for _ in live]
        probs: list[list[torch.Tensor]] = [[] for _ in live]
        logits = torch.stack([last[e.shadow.request_id] for e in entries])  # [R, V]
        active = list(range(len(live)))
        for j in range(max(ks)):
            ids = torch.tensor([seqs[r][-1] if j == 0 else tokens[r][-1] for r in active], device=device)
            scores = sampler.scores(logits, ids, args[:, active])  # [R', V]
            chosen, q = sampler.draft_tokens(scores, [owners[r] for r in active], j)
            for row, (r, token) in enumerate(zip(active, chosen.tolist())):  # one host read per draft position
                tokens[r].append(token)
                if q is not None:
                    probs[r].append(q[row])
            active = [r for r in active if len(tokens[r]) < ks[r]]
            if not active:
                break
            futures = []
            for r in active:
                shadow = entries[r].shadow
                shadow.tokens_to_process = [tokens[r][-1]]
                self._fed(entries[r], shadow.position_offset, shadow.tokens_to_process, chained=True)
                futures.append(FutureRequestState(shadow, True, {}, 1))
                entries[r].fed += 1
            logits = self._forward(futures)  # [R', V]
            self._ran([entries[r].shadow.request_id for r in active])
        for r, (i, _) in enumerate(live):
            out[i] = Drafts(tokens[r], torch.stack(probs[r]) if probs[r] else None)
        return out
