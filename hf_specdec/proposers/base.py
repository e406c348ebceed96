"""The proposer interface: what every drafting method (n-gram, draft model, MTP, Top-1) implements.

A proposer sees the ragged batch (`hf_specdec.batch.RaggedBatch`) and returns, per row, up to k
draft tokens (`Proposal`). The decoding loop calls `prefill` once, then per step `propose`, then
`commit` with what the target accepted, and `select_rows` when finished rows leave the batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_specdec.batch import RaggedBatch
    from hf_specdec.sampling.processors import StepSampling
    from hf_specdec.static_cache import StaticPlan


@dataclass
class Proposal:
    """Drafts for one step of a batch of B rows (k = draft_token_ids.shape[1])."""

    draft_token_ids: torch.Tensor  # [B, k] int64, -1 past num_draft_tokens
    num_draft_tokens: torch.Tensor  # [B] int64 in 0..k
    draft_probs: torch.Tensor | None = None  # [B, k, V] float32, or None for one-hot drafts
    #: [B] int64 >= 0: what the proposer knows about how good each row's drafts are, as a small category that the
    #: adaptive schedule learns acceptance per (the n-gram proposer: the matched n). None: one category for all.
    draft_keys: torch.Tensor | None = None
    #: [B] int64 numpy: `num_draft_tokens` as the host knows it without a read (a host search, a draft model given
    #: its budgets on the host), else None; the dynamic loop then sizes its verify from it
    host_num_draft_tokens: np.ndarray | None = None
    host_draft_keys: np.ndarray | None = None  # [B] int64 numpy: `draft_keys` on the host, when known there

    @classmethod
    def empty(cls, batch_size: int, device: torch.device) -> Proposal:
        """A proposal with no drafts for any row (k = 0)."""
        return cls(
            draft_token_ids=torch.empty(batch_size, 0, dtype=torch.long, device=device),
            num_draft_tokens=torch.zeros(batch_size, dtype=torch.long, device=device),
            host_num_draft_tokens=np.zeros(batch_size, dtype=np.int64),
        )


def widest(max_draft_tokens: torch.Tensor, width: int | None) -> int:
    """The most drafts any row may have this step: `width` when the caller read it with its own host read of the
    budgets (`Top1Proposer`), else one read of the device here."""
    if width is not None:
        return width
    return int(max_draft_tokens.max().item()) if max_draft_tokens.numel() else 0


class Proposer(ABC):
    """Base class of all proposers. Subclasses keep whatever per-row state they need."""

    #: True when the proposer returns draft probabilities (needed for exact speculative sampling
    #: with a stochastic draft); False for one-hot drafts (n-gram, greedy argmax drafts).
    returns_probs: bool = False

    #: Positions the proposer's model can take (a draft's `max_position_embeddings`); None when unlimited.
    #: `Top1Proposer` gives rows that would run past it no drafts, so the draft never sees such positions.
    max_positions: int | None = None

    #: True when a row's drafts depend only on that row's tokens (no per-row state across steps), so that
    #: `Top1Proposer` may call `propose` on a sub-batch of the rows that speculate.
    stateless: bool = False
    #: True when, on static caches, `propose` and `commit` run fixed-shape device work only (no host read, host
    #: state that moves the same way every step), so a whole step can be captured as one CUDA graph.
    capturable: bool = False

    #: True when proposing costs next to nothing next to a verify (the n-gram search): the adaptive schedule then
    #: lets every row propose k drafts and decides from the drafts (and their `draft_keys`) how many to verify.
    proposes_cheaply: bool = False

    #: True when `propose` takes `host_budget` (the rows' budgets on the host, dynamic caches) and returns
    #: `Proposal.host_num_draft_tokens`, and `select_rows` takes `host_keep`: the loop's step then reads the device
    #: once.
    reads_host_budget: bool = False

    #: The call's static-cache plan (`use_static`), or None on dynamic caches.
    static: StaticPlan | None = None

    def use_static(self, plan: StaticPlan) -> None:
        """Called before `prefill` when the call runs on static caches: proposals then have a fixed width k
        (rows with fewer drafts padded with -1), and a proposer with a model keeps it on a `StaticCacheView`."""
        self.static = plan

    def attach(self, target: PreTrainedModel) -> None:  # noqa: B027
        """Called once before the target's prefill: proposers that read the target's activations hook in here."""

    def detach(self) -> None:  # noqa: B027
        """Called once when the `generate` call ends, also when it fails: undo what `attach` did."""

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:  # noqa: B027
        """Called once before step 0, whose verify is the target's prefill (so before the first `propose`)."""

    def calibrate(self, time_verify: Callable[[int], float]) -> None:  # noqa: B027
        """Called once after step 0 with a function that times one target forward of a given width (seconds)
        and undoes it; a proposer whose schedule needs step costs measures them here."""

    @abstractmethod
    def propose(
        self,
        batch: RaggedBatch,
        max_draft_tokens: torch.Tensor,  # [B] int64, 0..k: row i may draft at most this many
        sampling: StepSampling,
        width: int | None = None,
    ) -> Proposal:
        """Return up to max_draft_tokens[i] drafts for each row i of the batch. `width`: the largest of them, when
        the caller has read it on the host already (`widest`)."""

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:  # noqa: B027
        """Called after the step was committed (batch.lengths already include the new tokens).

        num_accepted [B] int64: drafts of this step that the target accepted, per row.
        Stateful proposers roll their caches back to what the sequences now hold.
        """

    def plan_step(self, batch: RaggedBatch) -> Hashable | None:
        """Static caches, a capturable proposer: make this step's host decisions before its device work, and name
        them (the key of the step's CUDA graph: steps with equal keys run the same kernels). None: this step
        cannot be replayed (it runs uncaptured)."""
        return () if self.capturable else None

    def after_step(self) -> None:  # noqa: B027
        """Called after every step, outside its device work: host-side learning from the step's outcome."""

    def host_rows(self, batch: RaggedBatch) -> torch.Tensor | None:  # [r, B] int64 on batch.device
        """Static caches: rows of device values a proposer that drafts on the host needs after each step; the
        loop reads them with the step's one host read and hands them to `read_host_rows`. None: nothing."""
        return None

    def read_host_rows(self, lengths: list[int], rows: list[list[int]]) -> None:  # noqa: B027
        """The values `host_rows` asked for (`rows`, r lists of B), with the rows' lengths after the step."""

    def select_rows(self, keep: torch.Tensor) -> None:  # noqa: B027
        """Keep only rows `keep` ([B'] int64 indices into the current batch): the others finished."""
