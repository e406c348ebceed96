"""The target's multi-token-prediction (MTP) layers as the drafter of continuous batching.

MTP layer 0 at token index p mixes the embedding of token p with the target's last hidden state at p - 1 and
predicts token p + 1 (transformers' `MtpModel`). In continuous batching it runs like the draft model of
`draft_model.py` (its own `PagedAttentionCache`, transformers' ragged inputs, a catch-up forward then k - 1 one-token
forwards), with two differences:

- **Inputs.** Entry e of a request's MTP KV holds token index e + 1 at position e + 1, fed with the target's hidden
  state at index e. Those states come from the target's forwards (prefill chunks and verifies): a forward hook on the
  target's decoder, live only while the verify forward runs, keeps each request's rows (`HiddenStash`) until the
  catch-up feeds them. Prompt tokens that the target did not compute because transformers' prefix sharing reused
  their blocks have no hidden state: their entries are fed zeros (drafts after them are less informed; outputs are
  unchanged, since drafts are only proposals).
- **The chain.** Draft j + 1 comes from layer 0 fed draft j with layer 0's own output at the previous position as
  the "hidden state" (a single-layer chain, as serving engines run MTP with k > 1); a target with several MTP layers
  drafts with its first. After a verify every draft entry is rolled back (`commit`): the next catch-up feeds the
  accepted drafts again with the target's own hidden states, so the KV only ever holds what a step-by-step run of
  layer 0 over the committed tokens would hold.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hf_specdec.continuous_batching.compat import (
    ContinuousBatchingConfig,
    FutureRequestState,
    PagedAttentionCache,
    RequestState,
)
from hf_specdec.continuous_batching.draft_model import DraftModelCBProposer, _DraftRequest
from hf_specdec.continuous_batching.proposers import sequence
from hf_specdec.continuous_batching.sampling import RowSampler
from hf_specdec.placement import module_device

#: The paged arguments of a forward that the MTP layer's attention reads (the rest are the model's inputs).
_NOT_ATTENTION_ARGS = ("input_ids", "position_ids", "logits_indices", "logits_processor_args", "use_cache", "cache")


def mtp_cache_config(mtp_model: torch.nn.Module) -> object:
    """The config that sizes the MTP KV: the MTP layers' own, with the one layer that drafts."""
    config = copy.copy(mtp_model.config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:1]
    return config


@dataclass
class HiddenStash:
    """The target's last hidden states of one request, rows for token indices `start ..`, until the MTP feeds them."""

    start: int
    rows: torch.Tensor  # [m, H]

    def put(self, first: int, rows: torch.Tensor) -> None:
        """A target forward computed token indices `first ..`: they replace whatever was kept from `first` on."""
        if first <= self.start:
            self.start, self.rows = first, rows
            return
        kept = self.rows[: first - self.start]
        if kept.shape[0] < first - self.start:  # a gap (blocks reused by prefix sharing): zeros, as `take` gives
            kept = torch.cat([kept, rows.new_zeros((first - self.start - kept.shape[0], rows.shape[1]))])
        self.rows = torch.cat([kept, rows])

    def take(self, first: int, count: int) -> torch.Tensor:  # [count, H]
        """Rows for token indices `first .. first + count`, zeros where none was computed. Rows before the last of
        them are dropped (the MTP KV holds them now); the last is kept, for a step whose request the scheduler did
        not take: its newest entry is fed again."""
        lo, hi = first - self.start, first + count - self.start
        part = self.rows[max(lo, 0) : max(hi, 0)]
        before = min(max(-lo, 0), count)  # indices before the stash's start (prefix sharing)
        after = count - before - part.shape[0]
        if before or after:
            zeros = self.rows.new_zeros
            part = torch.cat([zeros((before, self.rows.shape[1])), part, zeros((after, self.rows.shape[1]))])
        drop = max(0, hi - 1)
        self.rows, self.start = self.rows[drop:], self.start + drop
        return part


class MtpCBProposer(DraftModelCBProposer):
    """Drafts with MTP layer 0 of the target, batched over the decoding requests (see the module doc)."""

    #: Each forward feeds hidden states built for it (not in the ragged IOs): eager
    capturable = False

    def __init__(
        self,
        target: torch.nn.Module,
        mtp_model: torch.nn.Module,
        target_cache: PagedAttentionCache,
        cb_config: ContinuousBatchingConfig,
        distributed_helper: object,
        sampler: RowSampler,
    ) -> None:
        self.target = target
        self.mtp = mtp_model
        layer = mtp_model.layers[0]
        self._setup(mtp_cache_config(mtp_model), module_device(layer), mtp_model.dtype, target_cache, cb_config,
                    distributed_helper, sampler)  # fmt: skip
        self.stash: dict[str, HiddenStash] = {}
        self._prev: dict[str, torch.Tensor] = {}  # request id -> [q, H] previous hidden states of its next forward
        self._outputs: dict[str, torch.Tensor] = {}  # request id -> [H] layer 0's output at its latest entry
        self._rows: torch.Tensor | None = None  # [R, H] the latest forward's outputs at its logits rows

    # ------------------------------------------------------------------ the target's hidden states

    @contextlib.contextmanager
    def watching(self, futures: list[FutureRequestState]) -> Iterator[None]:
        """While the target's forward over `futures` runs, keep its decoder's output rows per request."""
        owner = threading.get_ident()
        captured: list[torch.Tensor] = []

        def capture(module: torch.nn.Module, args: object, output: object) -> None:
            if threading.get_ident() == owner:
                hidden = getattr(output, "last_hidden_state", None)
                captured.append(hidden if hidden is not None else output[0])

        hook = self.target.get_decoder().register_forward_hook(capture)
        try:
            yield
        finally:
            hook.remove()
        if not captured:
            return
        hidden = captured[-1][0].detach()  # [N, H] the flat batch
        end = 0
        for future in futures:
            q = future.query_length
            rows, end = hidden[end : end + q], end + q
            state = future.state
            first = state.position_offset - q  # the forward fed token indices first .. position_offset
            stash = self.stash.get(state.request_id)
            if stash is None:
                self.stash[state.request_id] = HiddenStash(first, rows)
            else:
                stash.put(first, rows)

    # ------------------------------------------------------------------ the drafting layers' inputs

    def _tokens(self, state: RequestState) -> list[int]:
        return sequence(state)[1:]  # entry e holds token index e + 1

    def _fed(self, entry: _DraftRequest, start: int, tokens: list[int], chained: bool) -> None:
        request_id = entry.shadow.request_id
        if chained:  # a draft: layer 0's own output at the previous entry
            self._prev[request_id] = self._outputs[request_id][None]
            return
        stash = self.stash.get(request_id)
        if stash is None:  # the target computed nothing for it yet (not expected: its prefill runs first): zeros
            stash = self.stash[request_id] = HiddenStash(start, self._no_rows())
        self._prev[request_id] = stash.take(start, len(tokens))  # target states of token indices start ..

    def _no_rows(self) -> torch.Tensor:  # [0, H]
        return torch.zeros((0, self.mtp.config.hidden_size), device=self.device, dtype=self.mtp.dtype)

    def _run(self, kwargs: dict, futures: list[FutureRequestState]) -> torch.Tensor:  # [R, V]
        mtp, layer = self.mtp, self.mtp.layers[0]
        previous = torch.cat([self._prev.pop(f.state.request_id) for f in futures])[None]  # [1, N, H]
        positions = kwargs["position_ids"] + 1  # [1, N] entry e is token index e + 1
        embeds = mtp.embed_tokens(kwargs["input_ids"]).to(previous.device)  # [1, N, H]
        rotary = mtp.rotary_emb(embeds, position_ids=positions) if mtp.rotary_emb is not None else None
        attention = {name: value for name, value in kwargs.items() if name not in _NOT_ATTENTION_ARGS}
        out = layer(embeds, previous.to(embeds.dtype), position_embeddings=rotary, position_ids=positions,
                    cache=kwargs["cache"], **attention)  # fmt: skip  # [1, N, H]
        if getattr(mtp, "use_shared_post_norm", False):
            out = mtp.shared_post_norm(out)
        self._rows = out[0, kwargs["logits_indices"]]  # [R, H]
        return mtp._project_to_logits(self._rows)  # [R, V]

    def _ran(self, request_ids: list[str]) -> None:
        for row, request_id in enumerate(request_ids):
            self._outputs[request_id] = self._rows[row]

    # ------------------------------------------------------------------ bookkeeping

    def commit(self, state: RequestState, num_accepted: int) -> None:
        entry = self.requests.get(state.request_id)
        if entry is not None and entry.owner is state:
            entry.shadow.position_offset = entry.base_len  # drafts' entries go; the catch-up re-feeds accepted ones

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.stash.pop(request_id, None)
        self._outputs.pop(request_id, None)

    def reset(self) -> None:
        super().reset()
        self.stash.clear()
        self._outputs.clear()
