"""Speculative-decoding statistics: drafted, accepted, per-position acceptance and wall time.

`SpecDecodeStats` is filled by the decoding loop and left on `SpecDecoder.last_stats` after
every call (and on the `generate` output when `return_dict_in_generate=True`). Definitions follow
vLLM: acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / (row-steps that
drafted), i.e. the tokens a drafting step emits on average.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import torch


@dataclass
class SpecDecodeStats:
    """Counters of one `generate` call (all rows of the batch together)."""

    num_steps: int = 0  # verify forwards of the target
    num_row_steps: int = 0  # (row, step) pairs, i.e. tokens decided by a verify
    num_drafting_row_steps: int = 0  # (row, step) pairs that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_generated_tokens: int = 0  # tokens kept in the outputs, all rows
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0  # from the call's start to the end of step 0 (the prefill's verify)
    calibration_time_s: float = 0.0  # seconds the adaptive schedule spent timing verify widths (first calls only)
    compile_time_s: float = 0.0  # seconds in forwards that compiled or captured a graph (static caches on a GPU)
    num_compactions: int = 0  # static caches: in-place compactions of holes
    num_graph_replays: int = 0  # static caches on a GPU: steps run as one replayed CUDA graph
    #: captured steps: "adopted" (replayed graphs an earlier call kept), "captured" (captured its own) or "" (none)
    graph_reuse: str = ""
    graph_reuse_reason: str = ""  # why no kept graphs were adopted, e.g. which check of the models failed
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # [2, k] drafted / accepted per position, on the loop's device until `finalize` (no host sync per step)
    _counts: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / drafting row-steps: the tokens a drafting step emits on average."""
        if not self.num_drafting_row_steps:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafting_row_steps

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of drafts accepted at draft position j (0-based), over the rows that drafted there."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def start(self, max_k: int, device: torch.device) -> None:
        """Called when the call starts: the per-position counters live on `device` until `finalize`."""
        self._counts = torch.zeros(2, max_k, dtype=torch.long, device=device)

    def record_step(
        self,
        num_draft_tokens: torch.Tensor,  # [B] drafts per row this step
        num_accepted: torch.Tensor,  # [B] accepted drafts per row this step
    ) -> None:
        """Add one verify step's drafts and acceptances to the counters (on the device: no host sync)."""
        if self._counts is None:
            raise RuntimeError("SpecDecodeStats.start(max_k, device) must be called before record_step")
        positions = torch.arange(self._counts.shape[1], device=num_draft_tokens.device)  # [k]
        drafted = (positions < num_draft_tokens[:, None]).sum(0)  # [k]
        accepted = (positions < num_accepted[:, None]).sum(0)  # [k]
        self._counts += torch.stack([drafted, accepted])

    def count_step(self, num_rows: int) -> None:
        """Count one verify step of `num_rows` rows (frozen rows of a static batch excluded): host counters."""
        self.num_steps += 1
        self.num_row_steps += num_rows

    def finalize(self) -> None:
        """Copy the device counters to the plain fields (one host sync, at the end of the call)."""
        if self._counts is None:
            return
        drafted, accepted = self._counts.tolist()
        self._counts = None
        used = max((j + 1 for j, d in enumerate(drafted) if d), default=0)
        self.drafted_per_position = drafted[:used]
        self.accepted_per_position = accepted[:used]
        self.num_draft_tokens = sum(drafted)
        self.num_accepted_tokens = sum(accepted)
        self.num_drafting_row_steps = drafted[0] if drafted else 0

    def to_dict(self) -> dict:
        """Plain dict with the counters and the derived rates (for JSON)."""
        out = asdict(self)
        out.pop("_counts", None)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_second=self.tokens_per_second,
        )
        return out


@dataclass
class StepRecord:
    """One verify step as `SpecDecoder(on_step=...)` sees it: each generating row's kept tokens and how they came.

    Of row i's `tokens[i]`, the first `min(num_accepted[i], len(tokens[i]))` are drafts the target accepted; a token
    after them is the target's own: "recovered" (chosen or sampled in place of a rejected draft) when the row had
    more drafts than it accepted, "bonus" (one more token after every draft was accepted) when it had drafts, and
    "plain" when it had none (a plain decoding step). Stopping may cut a step short.
    """

    row_ids: list[int]  # the caller's row index of each generating row (after num_return_sequences expansion)
    tokens: list[list[int]]  # tokens each row kept this step
    num_drafts: list[int]  # drafts each row verified this step
    num_accepted: list[int]  # of those, how many the target accepted

    @classmethod
    def from_step(
        cls,
        row_ids: torch.Tensor,  # [B]
        output_ids: torch.Tensor,  # [B, w] emitted tokens, -1 beyond
        num_kept: torch.Tensor,  # [B]
        num_drafts: torch.Tensor,  # [B]
        num_accepted: torch.Tensor,  # [B]
        live: torch.Tensor,  # [B] bool: rows still generating (a static batch keeps finished rows, frozen)
    ) -> StepRecord:
        """Build the record with one host copy."""
        counts = torch.stack([row_ids, num_kept, num_drafts.to(num_kept.dtype), num_accepted, live.long()], dim=1)
        host = torch.cat([counts, output_ids.to(counts.dtype)], dim=1).tolist()  # [B, 5 + w]
        rows = [r for r in host if r[4]]
        return cls(
            row_ids=[r[0] for r in rows],
            tokens=[r[5 : 5 + r[1]] for r in rows],
            num_drafts=[r[2] for r in rows],
            num_accepted=[r[3] for r in rows],
        )

    def kinds(self, i: int) -> list[Literal["accepted", "recovered", "bonus", "plain"]]:
        """How each of row i's kept tokens came (see the class doc)."""
        accepted = min(self.num_accepted[i], len(self.tokens[i]))
        own = (
            "plain" if not self.num_drafts[i] else "recovered" if self.num_accepted[i] < self.num_drafts[i] else "bonus"
        )
        return ["accepted"] * accepted + [own] * (len(self.tokens[i]) - accepted)
