"""N-gram prompt-lookup proposer: drafts copied from earlier in each row's own context.

On dynamic caches the batch's tokens are copied to the host once per step and searched by the numba kernel in
`hf_specdec.proposers.ngram_search` (largest matching n-gram, most recent occurrence). On static caches the same
search runs on the device (`hf_specdec.proposers.ngram_device`: fixed shapes, no host read), so a whole step can
be captured as one CUDA graph. Drafts are one-hot (no probabilities), so exact speculative sampling treats them
as a deterministic draft. The proposer keeps no state between steps: `prefill`, `commit` and `select_rows` are
no-ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.proposers.ngram_device import ngram_search_device
from hf_specdec.proposers.ngram_search import ngram_search

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_specdec.batch import RaggedBatch
    from hf_specdec.config import SpecDecoder
    from hf_specdec.sampling.processors import StepSampling

__all__ = ["NgramProposer"]


class NgramProposer(Proposer):
    """
    Prompt-lookup ("n-gram") drafting: look the last n tokens of each row up earlier in the same row and
    propose the tokens that followed the most recent occurrence, preferring the largest n.

    On dynamic caches the returned `Proposal.draft_token_ids` is trimmed to the largest number of drafts any row
    actually got this step (between 0 and `num_speculative_tokens`), so steps where few rows match verify a
    narrower block. On static caches (`use_static`) it always has width `num_speculative_tokens` (-1 padded),
    found on the device without a host read: the proposer is then `capturable`.

    Args:
        num_speculative_tokens (`int`):
            Maximum number of draft tokens per row and step (k).
        prompt_lookup_min (`int`, *optional*, defaults to 1):
            Smallest n-gram size that counts as a match.
        prompt_lookup_max (`int`, *optional*, defaults to 4):
            Largest n-gram size tried.
    """

    returns_probs: bool = False
    stateless: bool = True
    proposes_cheaply: bool = True
    reads_host_budget: bool = True

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(
                f"`num_speculative_tokens` must be >= 1, got {num_speculative_tokens}; it is the number of "
                "draft tokens proposed per step (typical values: 3-10)."
            )
        if prompt_lookup_min < 1:
            raise ValueError(
                f"`prompt_lookup_min` must be >= 1, got {prompt_lookup_min}; use 1 to allow single-token matches."
            )
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"`prompt_lookup_max` must be >= `prompt_lookup_min`, got prompt_lookup_max={prompt_lookup_max} "
                f"and prompt_lookup_min={prompt_lookup_min}."
            )
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.prompt_lookup_min = int(prompt_lookup_min)
        self.prompt_lookup_max = int(prompt_lookup_max)
        #: dynamic caches: the host's copy of every row's tokens, by the row's index in the caller's batch (rows
        #: that leave keep theirs: nothing to select)
        self.tokens: np.ndarray | None = None  # [B_total, C]
        self.read_rows: np.ndarray | None = None  # [B] caller rows of the step's `host_rows`

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        """Dynamic caches: the host's copy of the rows (one read, before the first step)."""
        self.tokens = None
        if self.static is None and batch.host_row_ids is not None:
            self.tokens = batch.token_ids.to("cpu", torch.int64, copy=True).numpy()

    def host_rows(self, batch: RaggedBatch) -> torch.Tensor | None:  # [k + 1, B]
        """Dynamic caches: each row's last k + 1 tokens (a step commits at most that many), for the step's read."""
        self.read_rows = batch.host_row_ids
        if self.tokens is None or self.read_rows is None:
            self.tokens = None  # the host lost track of the rows: search the device's tokens from now on
            return None
        width = self.num_speculative_tokens + 1
        index = (batch.lengths[:, None] - width + torch.arange(width, device=batch.device)).clamp(min=0)  # [B, k + 1]
        return batch.token_ids.gather(1, index).T

    def read_host_rows(self, lengths: np.ndarray, rows: np.ndarray) -> None:
        """What `host_rows` asked for, read with the rows' lengths after the step, into the host's copy."""
        assert self.tokens is not None and self.read_rows is not None
        width = self.num_speculative_tokens + 1
        index = np.maximum(np.asarray(lengths)[:, None] - width + np.arange(width), 0)  # [B, k + 1]
        tokens = self.tokens[self.read_rows]  # [B, C]
        np.put_along_axis(tokens, index, np.asarray(rows, np.int64).T, axis=1)
        self.tokens[self.read_rows] = tokens

    def select_rows(self, keep: torch.Tensor, host_keep: np.ndarray | None = None) -> None:
        """Nothing to select: the host's copy is kept by caller row (`RaggedBatch.host_row_ids`)."""

    @property
    def capturable(self) -> bool:  # type: ignore[override]
        """On static caches the search runs on the device with fixed shapes: a step can be one CUDA graph."""
        return self.static is not None

    def propose(
        self,
        batch: RaggedBatch,
        max_draft_tokens: torch.Tensor,  # [B] int64, 0..k
        sampling: StepSampling,
        width: int | None = None,  # unused: the search reads the budgets with the lengths
        host_budget: np.ndarray | None = None,  # [B] max_draft_tokens on the host (dynamic caches), or None
    ) -> Proposal:
        """
        Search every row of `batch` for a repeated n-gram and return its continuation as drafts.

        `sampling` is ignored: drafts are one-hot (`draft_probs=None`). On dynamic caches, two device-to-host
        copies per step: the per-row metadata (lengths, left padding, draft budget: one `[3, B]` tensor) and the
        token buffer up to the longest row (`[B, max(lengths)]`), searched by numba. On static caches, none: the
        search runs on `batch.device` over the whole buffer and the width is always k.

        Args:
            batch ([`RaggedBatch`]): The rows still generating.
            max_draft_tokens (`torch.Tensor` of shape `(B,)`): At most this many drafts for row i.
            sampling (`StepSampling`): Unused.

        Returns:
            [`Proposal`]: `draft_token_ids` `[B, k']` (-1 padded), `num_draft_tokens` `[B]` and `draft_keys` `[B]`
            (the n of the n-gram that matched, 0 without drafts) on `batch.device`, with k' the largest count
            in the batch (0 when no row matched), or k on static caches.
        """
        if self.static is not None:
            drafts, counts, match_lengths = ngram_search_device(
                batch.token_ids,
                batch.pad_lengths,
                batch.lengths,
                max_draft_tokens,
                self.prompt_lookup_min,
                self.prompt_lookup_max,
                self.num_speculative_tokens,
            )  # [B, k], [B], [B]
            return Proposal(drafts, counts, draft_probs=None, draft_keys=match_lengths)
        batch_size = batch.batch_size
        device = batch.device
        if batch_size == 0:
            return Proposal.empty(0, device)
        if host_budget is not None and self.tokens is not None and batch.host_row_ids is not None:
            return self._propose_host(batch, host_budget)
        meta = torch.stack([batch.lengths, batch.pad_lengths, max_draft_tokens.to(batch.lengths.device)])
        meta = meta.to("cpu", torch.int64).numpy()  # [3, B]
        ends, starts, num_tokens = meta[0], meta[1], meta[2]
        width = int(ends.max())
        if width == 0 or int(num_tokens.max()) <= 0:
            return Proposal.empty(batch_size, device)
        token_ids = batch.token_ids[:, :width].to("cpu", torch.int64).contiguous().numpy()  # [B, width]
        drafts, counts, match_lengths = ngram_search(
            token_ids,
            starts,
            ends,
            num_tokens,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.num_speculative_tokens,
        )  # [B, k], [B]
        k_used = int(np.max(counts))
        draft_token_ids = torch.from_numpy(drafts[:, :k_used].copy()).to(device)  # [B, k_used]
        num_draft_tokens = torch.from_numpy(counts).to(device)  # [B]
        draft_keys = torch.from_numpy(match_lengths).to(device)  # [B] the matched n: longer matches are surer
        return Proposal(draft_token_ids, num_draft_tokens, draft_probs=None, draft_keys=draft_keys)

    def _propose_host(self, batch: RaggedBatch, host_budget: np.ndarray) -> Proposal:
        """The search over the host's copy of the rows: no read; the drafts go to the device in one copy."""
        assert self.tokens is not None and batch.host_row_ids is not None
        assert batch.host_lengths is not None and batch.host_pad_lengths is not None
        rows = batch.host_row_ids
        tokens = self.tokens if len(rows) == len(self.tokens) else self.tokens[rows]  # [B, C]: rows leave in order
        drafts, counts, match_lengths = ngram_search(
            tokens,
            batch.host_pad_lengths,
            batch.host_lengths,
            host_budget,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.num_speculative_tokens,
        )  # [B, k], [B], [B]
        k_used = int(np.max(counts))
        packed = torch.from_numpy(np.concatenate([drafts[:, :k_used], counts[:, None], match_lengths[:, None]], 1))
        packed = packed.to(batch.device)  # [B, k_used + 2]
        return Proposal(
            packed[:, :k_used],
            packed[:, k_used],
            draft_probs=None,
            draft_keys=packed[:, k_used + 1],  # the matched n: longer matches are surer
            host_num_draft_tokens=counts,
            host_draft_keys=match_lengths,
        )


@register("ngram")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> NgramProposer:
    """`method="ngram"`: prompt lookup (no model)."""
    return NgramProposer(spec.max_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
