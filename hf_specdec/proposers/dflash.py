"""`DFlashProposer`: block drafting with a DFlash drafter fed by the target's hidden states, batched and ragged.

This is transformers' `DFlashTokenCandidateGenerator` (`generate(assistant_model=drafter,
speculation_type="dflash")`), for any batch. The drafter (`MuseGlimmerAssistantModel`) has no embedding and no
head: it borrows the target's. Its keys and values over the past are projections of the target's hidden states at
`config.target_layer_ids` (concatenated, for every committed token but the newest), kept in its own cache. Each step
it reads one block of `block_size` slots: the newest token, then `mask_token_id` placeholders; all slots attend to
the whole context and to each other, and the target's head turns the placeholders' outputs into up to
`block_size - 1` drafts in one forward. The hidden states come from the verify the loop runs anyway
(`VerifyCapture`); rejected positions never enter the drafter's cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.compat import crop_cache
from hf_specdec.model_support import check_attention_implementation
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.proposers.mtp import _draw
from hf_specdec.proposers.target_states import VerifyCapture
from hf_specdec.sampling.processors import StepSampling

__all__ = ["DFlashProposer", "check_dflash_drafter"]


def check_dflash_drafter(drafter: object) -> int:
    """Raise a clear error unless `drafter` is a DFlash drafter; return its `block_size`."""
    config = getattr(drafter, "config", None)
    needed = ("block_size", "mask_token_id", "target_layer_ids")
    missing = [name for name in needed if getattr(config, name, None) is None]
    if missing or not hasattr(drafter, "encoder"):
        raise TypeError(
            f"speculation_type='dflash' needs a DFlash drafter as assistant_model (a MuseGlimmerAssistantModel, whose "
            f"config has {', '.join(needed)}), but got {type(drafter).__name__}"
            + (f" (its config lacks {missing})" if missing else "")
            + ": pass the drafter checkpoint, or drop speculation_type to draft with a causal LM."
        )
    block = int(config.block_size)
    if block < 2:
        raise ValueError(f"The DFlash drafter's block_size is {block}; it drafts block_size - 1 tokens, so it needs >= 2.")
    return block


class DFlashProposer(Proposer):
    """Drafts up to min(k, block_size - 1) tokens per row in one drafter forward over a block of placeholders.

    Args:
        target (`PreTrainedModel`): The model being decoded; its embeddings, head and hidden states are used.
        drafter (`MuseGlimmerAssistantModel`): The DFlash drafter trained for this target.
        num_speculative_tokens (`int`): The most drafts per row and step, k <= block_size - 1.
    """

    def __init__(self, target: PreTrainedModel, drafter: PreTrainedModel, num_speculative_tokens: int) -> None:
        raise NotImplementedError("DFlash drafting is not implemented yet.")

    def propose(self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling) -> Proposal:
        raise NotImplementedError


_UNUSED = (DynamicCache, crop_cache, check_attention_implementation, _draw, VerifyCapture)
