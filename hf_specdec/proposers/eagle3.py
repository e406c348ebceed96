"""`Eagle3Proposer`: chain drafting with an EAGLE-3 head fed by the target's hidden states, batched and ragged.

The head's KV cache (`Eagle3ContextView`, a `CacheView`) holds one column per committed token p of each row (from
the row's second real token on): the head's layer over `[embed(token p) ‖ fc(target states at p - 1)]` at position
`p - 1 - pad` (the EAGLE convention: the position of the state's token). The target's states at the head's
`aux_layer_ids` (inputs of those decoder layers) come from the verify the loop runs anyway (`VerifyCapture`), so only
accepted tokens' states ever enter. Each step feeds the new context, whose last slot gives draft 1; draft j + 1 feeds
draft j with the head's own output; the draft columns are cropped again once the drafts are read. The reduced-vocabulary
distribution is mapped onto the target's vocabulary (tokens outside the draft vocabulary get q = 0). On static caches
`eagle3_static.StaticEagle3Proposer` replaces the context queue and the host-read widths (capturable steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.placement import input_device, module_device
from hf_specdec.proposers import ProposerContext, register
from hf_specdec.proposers.base import Proposal, widest
from hf_specdec.proposers.eagle3_head import Eagle3Head, is_eagle3_head
from hf_specdec.proposers.mtp import _draw
from hf_specdec.proposers.target_states import TargetStateDrafter, VerifyCapture
from hf_specdec.sampling.processors import StepSampling

if TYPE_CHECKING:
    from hf_specdec.config import SpecDecoder

__all__ = ["Eagle3ContextView", "Eagle3Proposer", "check_eagle3_target"]


class Eagle3ContextView(CacheView):
    """The head's cache over the ragged batch: column map, masks, rollback, compaction and row selection are
    `CacheView`'s; `feed` appends the slots it is given (buffer index per slot, -1 for unused slots)."""

    def feed(
        self,
        embeds: torch.Tensor,  # [B, s, H] embeddings of the fed tokens
        hidden: torch.Tensor,  # [B, s, H] fc(target states of the previous token), or the head's previous output
        index: torch.Tensor,  # [B, s] buffer index of each slot's token, -1 for slots a row does not use
    ) -> torch.Tensor:  # [B, s, H] the head's output per slot
        pad = self.pad_lengths[:, None]  # [B, 1]
        position_ids = torch.where(index >= 0, index - 1 - pad, 0).clamp(min=0)  # [B, s]
        keys = torch.cat([self.column_index, index], dim=1)  # [B, W + s]
        mask = self._attention_mask(index, keys)
        out = self.model(embeds, hidden, mask, position_ids, self.cache)  # [B, s, H]
        self.column_index = keys
        self.cached_lengths = torch.maximum(self.cached_lengths, index.max(dim=1).values + 1)
        return out


class Eagle3Proposer(TargetStateDrafter):
    """Drafts up to k tokens per row with an EAGLE-3 head, one head forward per draft position.

    Args:
        target (`PreTrainedModel`): The model being decoded; its hidden states (and embeddings, unless the head has
            its own) are read.
        head (`Eagle3Head`): From `hf_specdec.load_draft_head`.
        num_speculative_tokens (`int`): The most drafts per row and step.
    """

    def __init__(self, target: PreTrainedModel, head: Eagle3Head, num_speculative_tokens: int) -> None:
        self.layer_ids = check_eagle3_target(target, head)
        self.target = target
        self.head = head
        self.num_speculative_tokens = num_speculative_tokens
        # The input of decoder layer i is the output of layer i - 1.
        # the layers' states on the head's device (a target spread over devices computes them on several)
        self.capture = VerifyCapture(
            target,
            layer_ids=[i - 1 for i in self.layer_ids],
            keep_last_hidden=False,
            device=head.device,
            keep_inputs=False,
        )
        self.embeddings = head.embed_tokens if head.embed_tokens is not None else target.get_input_embeddings()
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.target_ids = head.draft_to_target()  # [Vd]
        self.same_vocab = head.draft_vocab_size == self.vocab_size and not bool(head.d2t.any())
        self.view: Eagle3ContextView | None = None
        self.context_end: torch.Tensor | None = None  # [B] columns for buffer indices < context_end are queued or fed
        self.verify_start: torch.Tensor | None = None  # [B] buffer index of the latest verify's first slot
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # context not yet fed: [B, c, H], [B, c]
        self.seen_forwards = 0

    def prefill(self, batch: RaggedBatch, sampling: StepSampling) -> None:
        self.view = Eagle3ContextView(self.head, batch.batch_size, batch.pad_lengths)
        self.context_end = batch.pad_lengths + 1  # a row's first real token has no previous state: no column
        self.verify_start = torch.zeros_like(batch.lengths)  # the prefill feeds every buffer index from 0
        self.pending = []
        self.seen_forwards = self.capture.count

    def propose(
        self, batch: RaggedBatch, max_draft_tokens: torch.Tensor, sampling: StepSampling, width: int | None = None
    ) -> Proposal:
        assert self.view is not None, "prefill() must run before propose()"
        k = self._draft_width(max_draft_tokens, width)  # head forwards this step
        hidden = self._newest_output(batch) if k else None  # [B, H]
        if hidden is None:  # step 0: the first draft needs the prefill's states
            return Proposal.empty(batch.batch_size, batch.device)
        rows = torch.arange(batch.batch_size, device=batch.device)
        draft_ids = torch.full((batch.batch_size, k), -1, dtype=torch.long, device=batch.device)  # [B, k]
        draft_probs: list[torch.Tensor] = []
        for j in range(k):
            if j > 0:  # feed draft j - 1 (at buffer index lengths - 1 + j) with the head's own output
                at = batch.lengths - 1 + j  # [B]
                index = torch.where(max_draft_tokens > j, at, -1)[:, None]  # [B, 1]
                embeds = self._embed(draft_ids[:, j - 1 : j].clamp(min=0))  # [B, 1, H]
                hidden = self.view.feed(embeds, hidden[:, None], index)[:, 0]  # [B, H]
            logits = self._target_logits(self.head.logits(hidden))  # [B, V]
            drafting = max_draft_tokens > j  # [B]
            token, probs = _draw(sampling, batch, batch.lengths + j, drafting, logits, j)  # [B], [B, V] or None
            draft_ids[:, j] = torch.where(drafting, token, -1)
            if probs is not None:
                draft_probs.append(probs)
            write_at = (batch.lengths + j).clamp(max=batch.capacity - 1)
            batch.token_ids[rows, write_at] = torch.where(drafting, token, batch.token_ids[rows, write_at])
        self.view.rollback(batch.lengths)  # the drafts' columns go: only verified context stays
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, k, V]
        return Proposal(draft_token_ids=draft_ids, num_draft_tokens=max_draft_tokens.clamp(max=k), draft_probs=probs)

    def _draft_width(self, max_draft_tokens: torch.Tensor, width: int | None) -> int:
        """Draft positions (head forwards) this step: the widest budget (a host read unless the caller knows it)."""
        return widest(max_draft_tokens, width)

    def _newest_output(self, batch: RaggedBatch) -> torch.Tensor | None:  # [B, H]
        """Feed the queued context; the head's output at each row's newest token (None before the first commit)."""
        if not self.pending:
            return None
        hidden = torch.cat([states for states, _ in self.pending], dim=1)  # [B, c, H]
        index = torch.cat([index for _, index in self.pending], dim=1)  # [B, c]
        self.pending = []
        tokens = batch.token_ids.gather(1, index.clamp(min=0))  # [B, c]
        out = self.view.feed(self._embed(tokens), hidden, index)  # [B, c, H]
        rows = torch.arange(batch.batch_size, device=batch.device)
        return out[rows, index.argmax(dim=1)]  # [B, H] the newest token's slot (the largest index)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, s, H] in the head's dtype
        # where the embedding computes (its weight may be on `meta`: offloaded, loaded by accelerate's hook)
        embeds = self.embeddings(tokens.to(module_device(self.embeddings)))
        return embeds.to(self.head.device, self.head.dtype)

    def _target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [B, V] float32
        """Draft-vocabulary logits [B, Vd] placed at their target ids; every other token gets -inf (q = 0)."""
        draft_logits = draft_logits.float()
        if self.same_vocab:
            return draft_logits
        full = draft_logits.new_full((draft_logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids, draft_logits)

    def commit(self, batch: RaggedBatch, num_accepted: torch.Tensor) -> None:
        """Queue the context columns of the tokens committed this step: token p with the target's states at p - 1."""
        assert self.context_end is not None and self.verify_start is not None
        hidden, index = self._new_context(batch)  # [B, c, H], [B, c]
        if hidden is not None:
            self.pending.append((hidden, index))
        self.context_end = torch.maximum(self.context_end, batch.lengths)
        self.verify_start = batch.lengths - 1  # the next verify feeds from the newest token

    def _new_context(self, batch: RaggedBatch) -> tuple[torch.Tensor | None, torch.Tensor]:  # [B, c, H], [B, c]
        """The context columns of the tokens committed by the latest verify: `fc` of the target's states at p - 1 for
        token p in `context_end .. lengths - 1`, and each slot's buffer index (-1 where a row has fewer tokens). The
        verify's width bounds them (no host read); None when it fed nothing."""
        capture = self.capture
        if capture.count == self.seen_forwards:
            raise RuntimeError(
                "Eagle3Proposer did not see the target's latest forward: the loop must call attach(target) before "
                "the target's prefill."
            )
        self.seen_forwards = capture.count
        states = torch.cat([capture.layer_outputs[i - 1] for i in self.layer_ids], dim=-1)  # [B, w, 3H]
        capture.forget()  # read once: nothing of the verify's outlives its step
        start = self.context_end  # [B]
        num_new = (batch.lengths - start).clamp(min=0)  # [B] tokens start .. lengths - 1
        width = states.shape[1] if batch.batch_size else 0
        slots = torch.arange(width, device=batch.device)  # [c]
        index = start[:, None] + slots  # [B, c] buffer index of each new column's token
        if width == 0:
            return None, index
        state_slot = (index - 1 - self.verify_start[:, None]).clamp(0, width - 1)  # [B, c]
        picked = states.gather(1, state_slot[:, :, None].expand(-1, -1, states.shape[-1]))  # [B, c, 3H]
        hidden = self.head.fc(picked.to(self.head.dtype))  # [B, c, H]
        return hidden, torch.where(slots < num_new[:, None], index, -1)

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.view is not None:
            self.view.select_rows(keep)
        if self.context_end is not None:
            self.context_end = self.context_end[keep]
            self.verify_start = self.verify_start[keep]
        self.pending = [(hidden[keep], index[keep]) for hidden, index in self.pending]


def check_eagle3_target(target: PreTrainedModel, head: object) -> list[int]:
    """Raise a clear error unless `head` is an EAGLE-3 head that fits `target`; return the target layers it reads."""
    if not is_eagle3_head(head):
        raise TypeError(
            f"SpecDecoder(draft_head=...) needs an EAGLE-3 head from hf_specdec.load_draft_head(path), got "
            f"{type(head).__name__}: load the head with load_draft_head, or pass a causal LM as draft_model=."
        )
    name = type(target).__name__
    if target.config.is_encoder_decoder or target.get_output_embeddings() is None:
        raise NotImplementedError(f"EAGLE-3 heads draft for decoder-only causal LMs, not for {name}.")
    config = target.config.get_text_config()
    if head.target_hidden_size != config.hidden_size:
        raise ValueError(
            f"The EAGLE-3 head reads target states of hidden_size={head.target_hidden_size} (its fc takes "
            f"3 x {head.target_hidden_size}) but {name} has hidden_size={config.hidden_size}: load the head trained "
            "for this target."
        )
    vocab = int(target.get_output_embeddings().weight.shape[0])
    if head.config.vocab_size != vocab:
        raise ValueError(
            f"The EAGLE-3 head maps its draft vocabulary onto {head.config.vocab_size} target tokens (vocab_size, t2d) "
            f"but {name}'s head scores {vocab}: load the head trained for this target (same tokenizer)."
        )
    if head.embed_tokens is None and head.config.hidden_size != config.hidden_size:
        raise ValueError(
            f"The EAGLE-3 head has hidden_size={head.config.hidden_size} and no embed_tokens of its own, so it would "
            f"borrow {name}'s embeddings of size {config.hidden_size}: load the head's checkpoint with its embeddings."
        )
    layers = config.num_hidden_layers
    ids = head.layer_ids_for(layers)
    bad = [i for i in ids if not 1 <= i <= layers]
    if bad:
        raise ValueError(
            f"The EAGLE-3 head reads the inputs of target layers {ids}, but {name} has {layers} decoder layers "
            f"(usable ids 1..{layers}; bad: {bad}): load the head trained for this target, or fix "
            "eagle_aux_hidden_state_layer_ids in its config.json."
        )
    if head.device != input_device(target):
        raise ValueError(
            f"The EAGLE-3 head is on {head.device} but {name} takes its input on {input_device(target)}: move it "
            "with head.to(model.device), or pass device= to load_draft_head."
        )
    return ids


@register("eagle3")
def from_spec(spec: SpecDecoder, target: PreTrainedModel, context: ProposerContext) -> Eagle3Proposer:
    """`SpecDecoder(draft_head=...)`: an EAGLE-3 head fed the verify's layer states (decoder-only targets)."""
    context.require_decoder_only(spec.method, target)
    return Eagle3Proposer(target, spec.draft_head, spec.max_speculative_tokens)
