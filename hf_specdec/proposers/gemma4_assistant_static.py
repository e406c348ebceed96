"""`StaticGemma4AssistantProposer`: a Gemma 4 assistant on static caches, fixed shapes, capturable.

The assistant keeps no cache: each draft step reads the target's own keys and values (the static cache layers of
the target's last non-shared full and sliding layers, tensors that keep their addresses) through masks over the
whole static length, taken from the verify's own mask row of the last accepted token. So the port is small: k draft
steps whatever the budgets (rows with less draw nothing past them), the masks and the hidden state kept in tensor
attributes (a captured step's state must be attributes the step graph can rebind), and nothing the target's hooks
recorded kept past `commit` (a later call with the same shapes then adopts the kept graphs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal
from hf_specdec.proposers.gemma4_assistant import Gemma4AssistantProposer
from hf_specdec.sampling.processors import StepSampling

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["StaticGemma4AssistantProposer"]


class StaticGemma4AssistantProposer(Gemma4AssistantProposer):
    """`Gemma4AssistantProposer` on static caches (`use_static`): k assistant steps per drafting step."""

    capturable = True  # fixed widths, no host read: a static step can be captured

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        assert self.static is not None, "StaticGemma4AssistantProposer runs on static caches: call use_static first"
        super().prefill(batch, sampling)
        self.allowed_full: torch.Tensor | None = None  # [B, L] the keys the newest token's query sees (full layers)
        self.allowed_sliding: torch.Tensor | None = None  # [B, L] the same within the sliding window

    def propose(
        self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling, width: int | None = None
    ) -> Proposal:
        if self.allowed_full is not None:  # the dict the base reads, from the attributes the step graph keeps
            self.allowed = {"full_attention": self.allowed_full, "sliding_attention": self.allowed_sliding}
        return super().propose(batch, max_draft_tokens, sampling, width=self.num_speculative_tokens)

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        super().commit(batch, num_accepted)
        self.allowed_full = self.allowed["full_attention"]
        self.allowed_sliding = self.allowed["sliding_attention"]
        self.allowed = {}
        self.capture.forget()  # read once: nothing of the verify's outlives its step

    def select_rows(self, keep: torch.Tensor) -> None:
        raise NotImplementedError("rows never leave a static batch: they stay, masked, until the call ends")


@register("gemma4_assistant", static=True)
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> StaticGemma4AssistantProposer:
    """`method="gemma4_assistant"` on static caches."""
    context.require_decoder_only(spec.method, target)
    return StaticGemma4AssistantProposer(target, spec.draft_model, spec.max_speculative_tokens)
