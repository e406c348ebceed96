"""Ragged rows of a speculative batch: the token buffer, per-row lengths and left padding.

Every row lives in one rectangular token buffer laid out exactly like the `input_ids` that plain
`generate` would hold for it: left padding, prompt, generated tokens. Rows advance by different
numbers of tokens per step (ragged acceptance), so each row has its own length; the space past a
row's length is scratch (drafts are written there while they are verified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RaggedBatch:
    """The token state of the B rows still generating."""

    token_ids: torch.Tensor  # [B, C] int64: left padding, prompt, generated tokens, then scratch
    lengths: torch.Tensor  # [B] int64: tokens of each row in token_ids, left padding included
    pad_lengths: torch.Tensor  # [B] int64: left padding of each row (its first real token's index)
    row_ids: torch.Tensor  # [B] int64: the row's index in the caller's batch
    prompt_width: int  # P: width of the left-padded prompt (same for every row)

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def capacity(self) -> int:
        return self.token_ids.shape[1]

    def num_generated(self) -> torch.Tensor:  # [B]
        return self.lengths - self.prompt_width

    def last_token_ids(self) -> torch.Tensor:  # [B]
        return self.token_ids.gather(1, (self.lengths - 1).unsqueeze(1)).squeeze(1)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` ([B'] int64 indices)."""
        self.token_ids = self.token_ids[keep]
        self.lengths = self.lengths[keep]
        self.pad_lengths = self.pad_lengths[keep]
        self.row_ids = self.row_ids[keep]
