"""Ragged rows of a speculative batch: the token buffer, per-row lengths and left padding.

Every row lives in one rectangular token buffer laid out exactly like the `input_ids` that plain
`generate` would hold for it: left padding, prompt, generated tokens. Rows advance by different
numbers of tokens per step (ragged acceptance), so each row has its own length; the space past a
row's length is scratch (drafts are written there while they are verified).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RaggedBatch:
    """The token state of the B rows still generating."""

    token_ids: torch.Tensor  # [B, C] int64: left padding, prompt, generated tokens, then scratch
    lengths: torch.Tensor  # [B] int64: tokens of each row in token_ids, left padding included
    pad_lengths: torch.Tensor  # [B] int64: left padding of each row (its first real token's index)
    row_ids: torch.Tensor  # [B] int64: the row's index in the caller's batch
    prompt_width: int  # P: width of the left-padded prompt (same for every row)
    #: the host's copies of `lengths` and `pad_lengths` (numpy int64 [B]), which the dynamic loop keeps from its one
    #: read per step (`advance_host`); None where nobody keeps them
    host_lengths: np.ndarray | None = None
    host_pad_lengths: np.ndarray | None = None
    host_row_ids: np.ndarray | None = None

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

    @classmethod
    def from_prompts(
        cls,
        input_ids: torch.Tensor,  # [B, P]
        attention_mask: torch.Tensor | None,  # [B, P] or None (generate drops an all-ones mask)
        capacity: int,  # C: max_length + the most drafts a step verifies + 1
    ) -> RaggedBatch:
        """The batch of a `generate` call's left-padded prompts; right padding is refused with the fix."""
        batch_size, prompt_width = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            pad_lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        else:
            mask = attention_mask.to(device=device, dtype=torch.long)
            bad = (mask[:, 1:] < mask[:, :-1]).any(1) | (mask.sum(1) == 0)  # [B] right-padded or empty rows
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                if bool(mask[row, -1]) and bool(mask[row].any()):  # ends with a real token: a hole inside the prompt
                    raise ValueError(
                        f"The attention_mask of row {row} is {mask[row].tolist()}: it masks tokens between real ones, "
                        "which hf_specdec does not support. Without an attention_mask, transformers infers this one "
                        f"from the pad token id found inside the prompt (input_ids[{row}] = "
                        f"{input_ids[row].tolist()}): pass attention_mask=torch.ones_like(input_ids) if those are "
                        "real tokens, or remove them from the prompt."
                    )
                raise ValueError(
                    "hf_specdec needs left-padded batches (padding first, then the prompt), but the attention_mask "
                    f"of row {row} is {mask[row].tolist()} (padding after a prompt token, or no token at all): set "
                    "tokenizer.padding_side = 'left' before tokenizing."
                )
            pad_lengths = (mask == 0).sum(1)
        token_ids = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, C]
        token_ids[:, :prompt_width] = input_ids
        return cls(
            token_ids=token_ids,
            lengths=torch.full((batch_size,), prompt_width, dtype=torch.long, device=device),
            pad_lengths=pad_lengths,
            row_ids=torch.arange(batch_size, device=device),
            prompt_width=prompt_width,
            host_lengths=np.full(batch_size, prompt_width, dtype=np.int64),
            host_pad_lengths=pad_lengths.cpu().numpy().astype(np.int64),  # one read, before any step
            host_row_ids=np.arange(batch_size, dtype=np.int64),
        )

    def advance_host(self, num_kept: np.ndarray) -> None:  # [B]
        """The host's copy of `lengths` after a step that kept `num_kept` tokens per row (read by the loop)."""
        if self.host_lengths is not None:
            self.host_lengths = self.host_lengths + num_kept

    def select_rows(self, keep: torch.Tensor, host_keep: np.ndarray | None = None) -> None:
        """Keep only rows `keep` ([B'] int64 indices; `host_keep`: the same on the host, which keeps the host's
        copies, else they are dropped)."""
        self.token_ids = self.token_ids[keep]
        self.lengths = self.lengths[keep]
        self.pad_lengths = self.pad_lengths[keep]
        self.row_ids = self.row_ids[keep]
        if host_keep is None or self.host_lengths is None or self.host_pad_lengths is None or self.host_row_ids is None:
            self.host_lengths = self.host_pad_lengths = self.host_row_ids = None
        else:
            self.host_lengths, self.host_pad_lengths = self.host_lengths[host_keep], self.host_pad_lengths[host_keep]
            self.host_row_ids = self.host_row_ids[host_keep]
