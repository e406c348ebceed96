"""Speculative-decoding statistics: drafted, accepted, per-position acceptance and wall time.

`SpecDecodeStats` is filled by the decoding loop and left on `SpecDecoder.last_stats` after
every call (and on the `generate` output when `return_dict_in_generate=True`). Definitions follow
vLLM: acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / (row-steps that
drafted), i.e. the tokens a drafting step emits on average.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

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

    def record_step(
        self,
        num_draft_tokens: torch.Tensor,  # [B] drafts per row this step
        num_accepted: torch.Tensor,  # [B] accepted drafts per row this step
    ) -> None:
        """Add one verify step of the batch to the counters (one host sync)."""
        k = int(num_draft_tokens.max().item()) if num_draft_tokens.numel() else 0
        self.num_steps += 1
        self.num_row_steps += num_draft_tokens.numel()
        if k == 0:
            return
        positions = torch.arange(k, device=num_draft_tokens.device)  # [k]
        drafted = (positions < num_draft_tokens[:, None]).sum(0)  # [k]
        accepted = (positions < num_accepted[:, None]).sum(0)  # [k]
        counts = torch.stack([drafted, accepted]).tolist()
        if len(self.drafted_per_position) < k:
            grow = k - len(self.drafted_per_position)
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(k):
            self.drafted_per_position[j] += counts[0][j]
            self.accepted_per_position[j] += counts[1][j]
        self.num_draft_tokens += sum(counts[0])
        self.num_accepted_tokens += sum(counts[1])
        self.num_drafting_row_steps += counts[0][0]

    def to_dict(self) -> dict:
        """Plain dict with the counters and the derived rates (for JSON)."""
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_second=self.tokens_per_second,
        )
        return out
