"""Suffix decoding: drafts from a suffix tree over each row's own tokens and a global tree over earlier outputs.

Per call, every row gets its own tree (`SuffixTree`, one pool for the batch) over its prompt and the tokens it
commits; the `SpecDecoder` keeps the global tree (`SuffixCache`) over the outputs of earlier rows and calls, which
each row joins when it finishes. Drafting is host work (`suffix_search`, numba): on dynamic caches in `propose`, with
the committed tokens read in `commit`; on static caches in `plan_step`, before the step's device work, into device
tensors the captured step reads, with the committed tokens carried by the step's one host read (`host_rows`).
Drafts are one-hot (deterministic), so verification keeps greedy and sampled outputs exact.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch

from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.proposers.suffix_cache import SuffixCache, cache_for
from hf_specdec.proposers.suffix_search import COUNT_COLUMN, EXTRA_COLUMNS, KEY_COLUMN, suffix_drafts
from hf_specdec.proposers.suffix_tree import SuffixTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_specdec.batch import RaggedBatch
    from hf_specdec.config import SpecDecoder
    from hf_specdec.sampling.processors import StepSampling

__all__ = ["SuffixProposer"]


class SuffixProposer(Proposer):
    """
    Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's `method="suffix"`): each row drafts the best-scoring
    continuation found in its own suffix tree (prompt and output so far) or in the global tree of earlier outputs.

    Args:
        num_speculative_tokens (`int`): Most drafts per row and step (k).
        max_depth (`int`): The trees' depth D.
        max_spec_factor (`float`): A match of m tokens drafts at most `m * max_spec_factor` tokens.
        min_token_prob (`float`): A draft stops where its branch probability falls below this.
        cache (`SuffixCache`, *optional*): The global tree (None or disabled: each row's own tree only).
    """

    returns_probs: bool = False
    stateless: bool = False  # per-row trees follow the rows
    proposes_cheaply: bool = True  # host drafting costs microseconds: the adaptive schedule chooses from the drafts

    def __init__(
        self,
        num_speculative_tokens: int,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        cache: SuffixCache | None = None,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"`num_speculative_tokens` must be >= 1, got {num_speculative_tokens}.")
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.max_depth = int(max_depth)
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.cache = cache if cache is not None and cache.enabled else None
        self.trees: SuffixTree | None = None  # the rows' own trees (one root per row of the call)
        #: static caches: drafts are planned on the host (`plan_step`) from now on
        self.planned = False
        self.draft_ids: torch.Tensor | None = None  # [B, k] static caches: the planned drafts the step reads
        self.draft_counts: torch.Tensor | None = None  # [B]
        self.draft_keys: torch.Tensor | None = None  # [B]

    @property
    def capturable(self) -> bool:  # type: ignore[override]
        """On static caches the step only reads drafts planned on the host before it: it can be one CUDA graph."""
        return self.static is not None

    # --- host state: the rows' tokens and trees -----------------------------------------------------------------

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        """Build each row's tree from its prompt (host copies of the tokens and lengths: one read). The proposer
        keeps no reference to the batch: kept CUDA graphs name state by the path it is reached by."""
        self.tokens = batch.token_ids.to("cpu", torch.int64, copy=True).numpy()  # [B, C] host mirror of the rows
        starts = batch.pad_lengths.to("cpu", torch.int64, copy=True).numpy()  # [B]
        ends = batch.lengths.to("cpu", torch.int64, copy=True).numpy()  # [B]
        self.prompt_width = batch.prompt_width
        size, k = batch.batch_size, self.num_speculative_tokens
        prompt_tokens = int((ends - starts).sum())
        self.trees = SuffixTree(self.max_depth, num_roots=size, capacity=max(1024, prompt_tokens * 4))
        #: [B, D + 1] int32 and [B, 3] int64 (first real token, tokens in the tree, set entries of `active`)
        self.active, self.state = self.trees.start_rows(self.trees.roots, starts)
        self.trees.append_rows(self.active, self.state, self.tokens, ends, max_new_tokens=prompt_tokens)
        self.published = np.zeros(size, np.bool_)  # [B] its output went to the global tree
        self.out = np.empty((size, k + EXTRA_COLUMNS), np.int64)  # [B, k + 4] the drafting kernel's output, reused
        self.scores = np.empty(size, np.float64)  # [B]
        self.full_budgets = np.full(size, k, np.int64)  # [B]
        if self.static is not None:
            self.draft_ids = torch.full((size, k), -1, dtype=torch.long, device=batch.device)
            self.draft_counts = torch.zeros(size, dtype=torch.long, device=batch.device)
            self.draft_keys = torch.zeros(size, dtype=torch.long, device=batch.device)

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        """Dynamic caches: read the tokens each row committed (on the CPU: no copy) into its tree."""
        if self.static is not None:  # device work only; the step's host read brings the tokens (`read_host_rows`)
            return
        ends = _host(batch.lengths)  # [B]
        if batch.device.type == "cpu":
            source = _host(batch.token_ids)  # [B, C], shared with the batch
        else:
            source = _host(batch.token_ids[:, : int(np.max(ends)) if len(ends) else 0])  # `ends`: host numpy
        # A step commits at most k + 1 tokens a row: a bound for the tree's growth without reading the counts.
        self.trees.append_rows(
            self.active,
            self.state,
            source,
            ends,
            self.tokens,
            max_new_tokens=len(ends) * (self.num_speculative_tokens + 1),
        )

    def host_rows(self, batch: RaggedBatch) -> torch.Tensor | None:  # [k + 1, B]
        """Static caches: each row's last k + 1 tokens (a step commits at most that many), for the step's one read."""
        if self.static is None:
            return None
        width = self.num_speculative_tokens + 1
        index = (batch.lengths[:, None] - width + torch.arange(width, device=batch.device)).clamp(min=0)  # [B, k + 1]
        return batch.token_ids.gather(1, index).T

    def read_host_rows(self, lengths: list[int], rows: list[list[int]]) -> None:
        """What `host_rows` asked for, read with the row lengths after the step: append the new tokens."""
        ends = np.asarray(lengths, np.int64)  # [B]
        window = np.asarray(rows, np.int64).T  # [B, k + 1]: row i's tokens at ends[i] - (k + 1) ..
        seen = self.state[:, 1]
        new = ends - seen  # [B]
        if (new > window.shape[1]).any():
            raise RuntimeError(f"suffix decoding missed committed tokens ({new.tolist()} new, {window.shape[1]} read)")
        for i in np.nonzero(new > 0)[0]:
            self.tokens[i, seen[i] : ends[i]] = window[i, window.shape[1] - new[i] :]
        self.trees.append_rows(self.active, self.state, self.tokens, ends, max_new_tokens=int(new.clip(0).sum()))

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows that leave give their output to the global tree; the others' state follows them."""
        keep = keep.to("cpu").numpy()
        self._publish(np.setdiff1d(np.arange(len(self.state)), keep))
        self.tokens, self.active, self.state = self.tokens[keep], self.active[keep], self.state[keep]
        self.published, self.full_budgets = self.published[keep], self.full_budgets[keep]
        self.out, self.scores = self.out[keep], self.scores[keep]

    def detach(self) -> None:
        """The call ends: every row not yet published gives its output to the global tree."""
        if self.trees is not None:
            self._publish(np.arange(len(self.state)))
        self.trees = None

    def _publish(self, rows: np.ndarray) -> None:
        """Add the outputs of `rows` (with up to D tokens of prompt before them) to the global tree, once each."""
        for i in rows:
            first, end = int(self.state[i, 0]), int(self.state[i, 1])
            if self.cache is not None and not self.published[i] and end > self.prompt_width:
                self.cache.add(self.tokens[i, max(first, self.prompt_width - self.max_depth) : end])
            self.published[i] = True

    # --- drafting ------------------------------------------------------------------------------------------------

    def _draft(self, budgets: np.ndarray) -> int:
        """Drafts from both trees for every row within `budgets` ([B]) into `self.out` (drafts, then the count and
        key columns); returns the most drafts any row got."""
        args = (self.trees, self.active, self.state, self.tokens)
        rest = (budgets, self.num_speculative_tokens, self.max_spec_factor, self.min_token_prob, self.out, self.scores)
        if self.cache is None:
            return suffix_drafts(*args, None, *rest)[2]
        with self.cache.lock:
            return suffix_drafts(*args, self.cache.tree, *rest)[2]

    def plan_step(self, batch: RaggedBatch) -> Hashable | None:
        """Static caches: draft k for every row on the host and write the drafts where the step reads them."""
        self.planned = True
        self._plan()
        return ()

    def _plan(self) -> None:
        self._draft(self.full_budgets)
        k = self.num_speculative_tokens
        out = torch.from_numpy(self.out)  # [B, k + 4]
        self.draft_ids.copy_(out[:, :k])
        self.draft_counts.copy_(out[:, k + COUNT_COLUMN])
        self.draft_keys.copy_(out[:, k + KEY_COLUMN])

    def propose(
        self,
        batch: RaggedBatch,
        max_draft_tokens: torch.Tensor,  # [B] int64, 0..k
        sampling: StepSampling,
        width: int | None = None,
    ) -> Proposal:
        """
        Each row's best-scoring draft within its budget (`sampling` is unused: drafts are one-hot).

        On dynamic caches the drafts are made now and trimmed to the longest row's. On static caches they are
        the ones `plan_step` wrote (made now in steps that are not planned, such as the prefill), k wide.
        """
        if self.static is not None:
            if not self.planned:
                self._plan()
            counts = torch.minimum(self.draft_counts, max_draft_tokens)  # [B]
            return Proposal(self.draft_ids, counts, draft_probs=None, draft_keys=self.draft_keys)
        if batch.batch_size == 0:
            return Proposal.empty(0, batch.device)
        self.budgets = _host(max_draft_tokens)  # [B] host (the hybrid with a draft model reads them too)
        widest = self._draft(self.budgets)
        k = self.num_speculative_tokens
        out = torch.from_numpy(self.out.copy()).to(batch.device)  # [B, k + 4] one copy: `self.out` is reused
        return Proposal(out[:, :widest], out[:, k + COUNT_COLUMN], draft_probs=None, draft_keys=out[:, k + KEY_COLUMN])


def _host(tensor: torch.Tensor) -> np.ndarray:
    """An int64 numpy view of `tensor` on the host (no copy for a CPU int64 tensor)."""
    if tensor.device.type == "cpu" and tensor.dtype == torch.int64:
        return tensor.numpy()
    return tensor.to("cpu", torch.int64).numpy()


@register("suffix")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> SuffixProposer:
    """`method="suffix"`: suffix decoding (no model); the global tree is the one `spec` keeps across calls."""
    return SuffixProposer(
        spec.max_speculative_tokens,
        max_depth=spec.suffix_max_tree_depth,
        max_spec_factor=spec.suffix_max_spec_factor,
        min_token_prob=spec.suffix_min_token_prob,
        cache=cache_for(spec),
    )
