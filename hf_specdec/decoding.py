"""The speculative decoding loop: propose → verify → accept → commit → roll back, batched and ragged.

One step drafts up to k tokens per row, verifies all rows in one target forward, lets the
rejection sampler accept a prefix of each row's drafts plus one recovered or bonus token, commits
those tokens with `generate`'s own stopping rules applied token by token, and rolls every cache
back to what the sequences hold. Finished rows leave the batch. `run_speculative_loop` returns
the token rows as plain `generate` would lay them out, plus the per-token scores if asked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from hf_specdec import first_shapes, fused_layers, graph_reuse
from hf_specdec.batch import RaggedBatch
from hf_specdec.cache import CacheView
from hf_specdec.compat import experts_implementation
from hf_specdec.continuation import CacheHandoff
from hf_specdec.draft_budgets import DraftBudgets
from hf_specdec.exact import ExactPath
from hf_specdec.metrics import SpecDecodeStats, StepRecord
from hf_specdec.model_guard import ModelGuard, model_serial
from hf_specdec.model_support import capture_hint
from hf_specdec.proposers.base import Proposal, Proposer
from hf_specdec.proposers.draft_model import draft_position_limit
from hf_specdec.proposers.top1 import Top1Proposer
from hf_specdec.sampling import random as row_random
from hf_specdec.sampling.processors import StepSampling
from hf_specdec.sampling.rejection import SAMPLER_ENV, rejection_sample
from hf_specdec.schedules import SpeculationSchedule
from hf_specdec.static_cache import StaticCacheView, StaticPlan
from hf_specdec.step_graph import StepGraph
from hf_specdec.stopping import StopRules

#: plain steps a captured static call runs back to back as one graph (one host read), once the schedule keeps
#: drafting off (`SpeculativeLoop.plain_block`)
PLAIN_BLOCK = 4


def capture_blocker(
    sampling: StepSampling,
    stop_rules: StopRules,
    exact: ExactPath | None,
    proposer: Proposer,
    plans_on_host: bool,
    host_outputs: bool,
    hybrid: bool = False,
) -> str | None:
    """Why a static step cannot be device work alone (one CUDA graph), or None when it can."""
    if host_outputs:
        return "output_scores / output_logits / on_step / a returned cache read every step on the host"
    if exact is not None:
        return "logits processors or stopping criteria off the vectorised allow-list run position by position"
    if sampling.per_prefix:
        names = sorted({type(p).__name__ for p in sampling.per_prefix})
        return f"logits processors that read each position's prefix ({names}) run per prefix on the host"
    if not proposer.capturable:
        return "this proposer decides on the host every step"
    if not plans_on_host:
        return "this k schedule decides on the host every step"
    if hybrid:
        return "hybrid models roll their recurrent states back with host reads and re-runs"
    return None


def _drafts_nothing(proposal: Proposal) -> bool:
    """Whether the host knows that no row drafts in `proposal`."""
    host = proposal.host_num_draft_tokens
    return host is not None and not host.any()


@dataclass
class StepRead:
    """What a dynamic step's one host read brought back, per row (numpy int64 [B])."""

    num_kept: np.ndarray  # tokens the step kept
    num_accepted: np.ndarray  # drafts the target accepted
    num_draft_tokens: np.ndarray  # drafts verified
    done: np.ndarray  # bool: the row can leave the batch
    stop_lengths: np.ndarray | None  # each row's first stop (host criteria only)


@dataclass
class LoopOutput:
    sequences: torch.Tensor  # [B, L] token ids laid out like plain generate's
    scores: tuple[torch.Tensor, ...] | None  # one [B, V] per generated column (processed scores)
    logits: tuple[torch.Tensor, ...] | None  # one [B, V] per generated column (raw logits)
    cache: object | None = None  # the cache plain generate would leave (when a CacheHandoff asks)


class SpeculativeLoop:
    """State and steps of one speculative `generate` call."""

    def __init__(
        self,
        model: PreTrainedModel,
        proposer: Proposer,
        batch: RaggedBatch,
        sampling: StepSampling,
        stop_rules: StopRules,
        num_speculative_tokens: int,
        max_length: int,
        streamer: object | None,
        output_scores: bool,
        output_logits: bool,
        static: StaticPlan | None = None,
        exact: ExactPath | None = None,
        handoff: CacheHandoff | None = None,
        view_factory: Callable[[PreTrainedModel, RaggedBatch], CacheView] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        schedule: SpeculationSchedule | None = None,
    ) -> None:
        self.model = model
        self.budgets = DraftBudgets(schedule, static is not None)  # asks the k schedule, tells it what was accepted
        self.on_step = on_step  # SpecDecoder.on_step: told every step's kept tokens (one host copy, only when set)
        self.proposer = proposer
        self.batch = batch
        self.sampling = sampling
        self.stop_rules = stop_rules
        self.k = num_speculative_tokens
        self.max_length = max_length  # the host's; device work reads `length_limit`
        #: max_length as the device reads it, so that kept graphs serve calls of other lengths (`graph_reuse`)
        self.length_limit = torch.tensor(max_length, device=batch.device)
        self.streamer = streamer
        self.exact = exact  # processors/criteria off the allow-lists: lockstep, scored position by position
        self.stats = SpecDecodeStats()
        total = batch.batch_size
        device = batch.device
        self.static = static
        # On a static cache rows never leave the batch (a new batch size would be a new graph): finished rows stay,
        # frozen (fed nothing, emit nothing) until every row is done.
        self.frozen = torch.zeros(total, dtype=torch.bool, device=device)  # [B]
        self.frozen_rows: set[int] = set()  # the same rows, on the host (batch indices)
        self.num_frozen = 0
        self.step_graph: StepGraph | None = None
        if static is None:
            # An encoder-decoder target's view also feeds the encoder output (`hf_specdec.seq2seq`).
            self.target = view_factory(model, batch) if view_factory else CacheView(model, total, batch.pad_lengths)
        else:
            proposer.use_static(static)
            # A streamer reads the batch after the step's device work (at its one host read): it does not stop capture.
            capturable = self._capturable(output_scores or output_logits or on_step is not None or handoff is not None)
            static.capture_steps = static.can_capture and capturable
            self.target = StaticCacheView(model, total, batch.pad_lengths, static)
            if capturable:  # planned steps (host decisions, then device work); captured on a GPU
                description = f"a speculative step of {type(model).__name__}"
                # The signature reads small processor tensors on the host: only when graphs may be kept for reuse.
                signature = self._graph_signature() if graph_reuse.enabled() else None
                # What the models' forwards can see now, before the proposer attaches its hooks: kept graphs are
                # adopted only by calls whose models are the same in every respect (`model_guard`).
                models = graph_reuse.driven_models(self, model)
                guard = ModelGuard(models) if signature is not None else None
                hint = lambda: capture_hint([view.model for view in static.views])  # noqa: E731 - views exist by then
                # fused kernels while steps are captured (`fused_layers`): found only where a capture can happen
                swaps = fused_layers.swaps(models) if static.capture_steps and fused_layers.enabled() else []
                self.step_graph = StepGraph(
                    self, self.device_steps, description, static.capture_steps, model, signature, hint, guard, swaps
                )
        #: steps in which no row drafts run as `plain_step`: dynamic caches, with nothing that reads each position
        #: (the exact path's processors and criteria, output scores or logits, `on_step`)
        self.plain_steps_allowed = (
            static is None and exact is None and not (output_scores or output_logits) and on_step is None
        )
        self.handoff = handoff  # adopts a filled past_key_values; keeps leaving rows' caches to hand back
        if handoff is not None:
            handoff.adopt(self.target)
        self.prefilled = False
        #: steps the next planned step runs back to back (`plain_block`): 1, or PLAIN_BLOCK plain steps
        self.block = 1
        #: whether plain steps may run in blocks: a captured static step with no host criterion and no proposer
        #: that reads every step's tokens on the host
        self.blocks_allowed = (
            self.step_graph is not None and stop_rules.host is None and proposer.host_rows(batch) is None
        )
        self.longest_room = max_length  # tokens the live row furthest from max_length may still get (host)
        self.step_read: StepRead | None = None  # the dynamic step's one host read (`read_step`)
        #: a GPU's first dynamic call of this model at this batch size: its steps warm up, they are not timed
        self.warming = self.static is None and first_shapes.note(model, ("call", batch.batch_size), batch.device)
        self.sequences = batch.token_ids.clone()  # [B_total, C] final rows (the first max_length columns count)
        self.final_lengths = batch.lengths.clone()  # [B_total] length of each row when it left
        self.streamed = batch.prompt_width
        vocab = None
        self.score_buffer = self.logit_buffer = None
        if output_scores or output_logits:
            from hf_specdec.proposers.draft_model import output_vocab_size

            vocab = output_vocab_size(model)
            # Grown as tokens come (`_grown`), as plain generate's per-step tuple grows: never [B, max_new, V] upfront.
            shape = (total, 0, vocab)
            self.score_buffer = torch.zeros(shape, device=device) if output_scores else None
            self.logit_buffer = torch.zeros(shape, device=device) if output_logits else None

    # --- the step ----------------------------------------------------------------------------------

    def run(self) -> LoopOutput:
        start = time.perf_counter()
        self.stats.start(self.k, self.batch.device)
        self.proposer.attach(self.model)
        try:
            self.budgets.start(self.batch)
            self.proposer.prefill(self.batch, self.sampling)
            self.step()  # step 0: its verify is the target's prefill, as in plain generate and HF's assisted loop
            self.stats.time_to_first_token_s = time.perf_counter() - start
            if self.live():
                self.budgets.calibrate(self.time_verify)
                self.proposer.calibrate(self.time_verify)
            while self.live():
                self.step()
            self.budgets.finish()
        finally:
            self.proposer.detach()
            if self.step_graph is not None:
                self.step_graph.finish()  # its graphs serve the next call with the same shapes (`graph_reuse`)
        self.stats.wall_time_s = time.perf_counter() - start
        return self.finish()

    def _graph_signature(self) -> tuple:
        """Everything a captured step bakes in besides its state tensors: shapes, Python numbers, the models (and
        the kernels they were set to: `set_attn_implementation`, `set_experts_implementation`) and the sampling and
        stopping settings. Calls with equal signatures can replay each other's graphs."""

        def settings(obj: object) -> tuple:  # a processor or a proposer: its type, scalar settings, small tensors
            skip = getattr(obj, "PER_CALL", ())  # numbers the graphs read from tensors instead
            values = [(k, v) for k, v in vars(obj).items() if isinstance(v, (int, float, str)) and k not in skip]
            values += [(k, tuple(v.reshape(-1).tolist())) for k, v in vars(obj).items()
                       if isinstance(v, torch.Tensor) and v.numel() <= 64 and type(obj).__module__.startswith("transformers")]  # fmt: skip
            return (type(obj).__name__, tuple(sorted(values)))

        def kernels(model: torch.nn.Module) -> tuple:
            attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
            return model_serial(model), attention, experts_implementation(model)

        inner = getattr(self.proposer, "inner", self.proposer)
        models = tuple(kernels(m) for m in vars(inner).values() if isinstance(m, torch.nn.Module))
        stops = self.stop_rules  # its EOS ids are state (copied in on adoption); whether it has any is a setting
        return (
            kernels(self.model), self.batch.batch_size, self.batch.capacity, self.k,
            self.static.max_columns, str(self.batch.device), self.sampling.do_sample,
            tuple(settings(p) for p in self.sampling.pure), tuple(f.key() for f in self.sampling.forms if f),
            settings(stops), stops.length_limit is None,
            stops.stop_strings_key(),
            settings(self.proposer), settings(inner), models, type(self.budgets.schedule).__name__,
            os.environ.get(SAMPLER_ENV, ""),  # Triton or torch draws and sampler
            fused_layers.enabled(),  # fused kernels in the graphs, or the eager layers' own
        )  # fmt: skip

    def live(self) -> bool:
        """Whether any row still generates (host state only: no sync)."""
        return self.batch.batch_size > self.num_frozen

    def time_verify(self, width: int) -> float:
        """Seconds one target forward of `width` tokens per row takes right now; the forward is then undone.

        It feeds whatever the scratch space past each row's tokens holds (its cost does not depend on the ids)
        and rolls the cache back, so the sequences, the caches and the stats are as before. A row near the
        target's position limit (learned positions, e.g. GPT-2's `n_positions`) is fed fewer slots, never a
        position the model was not built for.
        """
        if self.static is not None:  # a static verify runs at width 1 or 1 + k: those are the costs to know
            width = 1 if width == 1 else 1 + self.k
        num_new = torch.full((self.batch.batch_size,), width, dtype=torch.long, device=self.batch.device)
        limit = draft_position_limit(self.model)
        if limit is not None:  # the slots fed start at the newest token (position seq_len - 1)
            seq_lengths = self.batch.lengths - self.batch.pad_lengths  # [B]
            num_new = torch.minimum(num_new, (limit - seq_lengths + 1).clamp(min=1))
        host = self._host_cached()  # dynamic caches: the same on the host (nothing read)
        if host is not None:
            host_num_new = np.full(self.batch.batch_size, width, dtype=np.int64)
            if limit is not None:
                seq = self.batch.host_lengths - self.batch.host_pad_lengths
                host_num_new = np.minimum(host_num_new, np.maximum(limit - seq + 1, 1))
            fed = {"host_num_new": host_num_new}
            undo = {"host_cached": self.batch.host_lengths - 1}
        else:
            fed, undo = self._width(width), {}
        synchronize = torch.cuda.synchronize if self.batch.device.type == "cuda" else (lambda: None)
        start = time.perf_counter()
        compiled_before = self.static.compile_time_s if self.static is not None else 0.0

        def timed() -> float:
            synchronize()
            timed_from = time.perf_counter()
            self.target.forward(self.batch.token_ids, num_new, **fed)
            synchronize()
            seconds = time.perf_counter() - timed_from
            self.target.rollback(self.batch.lengths - 1, **undo)
            return seconds

        seconds = timed()
        if self.batch.device.type == "cuda" or (
            self.static is not None and self.static.compile_time_s != compiled_before
        ):
            # The first forward of a width on a GPU pays one-time costs (cuBLAS / attention plans for the shape:
            # 0.9 s against 30 ms measured on an H100), or it compiled this width's graph: time the forward again
            # (on a GPU always: the second timing also halves the noise of a busy host).
            seconds = min(seconds, timed())
        self.stats.calibration_time_s += time.perf_counter() - start
        return seconds

    def _capturable(self, host_outputs: bool) -> bool:
        """Whether a step's device work can be one CUDA graph: fixed shapes, no host read, no host output."""
        hybrid = self.static is not None and self.static.hybrid
        plans = self.budgets.plans_on_host
        return (
            capture_blocker(self.sampling, self.stop_rules, self.exact, self.proposer, plans, host_outputs, hybrid)
            is None
        )

    def step(self) -> None:
        self.block = 1
        if self.step_graph is not None and self.prefilled:  # host decisions first, then the device work
            key = self.plan_step()
            self._make_room()
            self.step_graph.run(key)
        else:
            self.device_step()
        for _ in range(self.block):
            self.stats.count_step(self.batch.batch_size - self.num_frozen)
        self.retire_finished()
        # A step whose forwards ran a shape for the first time (a GPU's kernel loads) took longer than its kind will.
        new_shape = first_shapes.take_new()
        steady = not new_shape and not self.warming and (self.step_graph is None or self.step_graph.steady)
        self.budgets.after_step(measured=steady, steps=self.block)
        self.proposer.after_step()

    def plan_step(self) -> Hashable | None:
        """A planned static step's host decisions, made before its device work, as the key of its CUDA graph: no
        row drafts (one graph; `PLAIN_BLOCK` of them back to back while the schedule keeps drafting off), or some
        do, each within its budget, at width k (the proposer's graph)."""
        if self.budgets.plan(self.batch, self.k) == 0:
            self.block = self.plain_block()
            return ("plain",) if self.block == 1 else ("plain", self.block)
        inner = self.proposer.plan_step(self.batch)
        self.budgets.restart_timing()  # a draft's catch-up after plain steps is not the drafting step's own cost
        return None if inner is None else ("draft", inner)

    def plain_block(self) -> int:
        """How many plain steps to run as one captured graph with one host read: `PLAIN_BLOCK` once the schedule
        has kept drafting off for a step already (`DraftBudgets.plain_streak`) and a live row has room for them all,
        else 1. A host read per token is what separates a captured step from a compiled one at batch 1 (the GPU
        waits while the host plans); in a block the GPU runs on. Rows that finish inside the block are frozen on
        the device (`device_steps`), so the tokens are plain's; the block may cost up to `PLAIN_BLOCK - 1` forwards
        past the last row's EOS, and the schedule's next chance to draft comes up to that many steps later."""
        if not self.blocks_allowed or self.budgets.plain_streak < 2 or self.longest_room < PLAIN_BLOCK:
            return 1
        return PLAIN_BLOCK

    def device_steps(self) -> None:
        """The planned step's device work: `block` steps, each after freezing the rows the one before finished
        (the device's copy of what the host does at its read, so that a finished row emits nothing more)."""
        for index in range(self.block):
            if index:
                self.frozen |= self.stop_rules.done(self.batch) | (self.batch.lengths >= self.length_limit)
            self.device_step()

    def _make_room(self) -> None:
        """Room in every static cache for the planned step's forwards, which a captured step cannot make itself: a
        cache that might run short reads its true offset and compacts only if that is short too
        (`StaticCacheView.make_room`), here, between steps, so the step still replays. Before, the whole step ran
        eagerly to compact inside its first forward: on an H200, the last 3 of 25 steps of an 8B target at B = 16
        took 62-127 ms each against 15 ms replayed, a third of the call."""
        for view in self.static.views:
            room = max(self.step_graph.host_change(view, "offset_bound"), 2 * (self.k + 1), 2 * self.block)
            if view.offset_bound + room > view.max_columns:
                view.make_room(room)

    def device_step(self) -> None:
        """One step's device work: propose → verify → accept → commit → roll back (no host read on static caches)."""
        proposal = self.propose()
        if self.plain_steps_allowed and self.prefilled and _drafts_nothing(proposal) and self.plain_step(proposal):
            return
        target_logits = self.verify(proposal)  # [B, w, V]
        if self.static is None:  # the step's own kernels (acceptance, sampling) also run a first time per shape
            first_shapes.note(self.model, ("step", *target_logits.shape[:2]), self.batch.device)
        stop_hits = None
        if self.exact is not None:
            output_ids, scores, stop_hits = self.exact.accept(self, proposal, target_logits)  # [B, w], [B, w, V]
        else:
            scores = self.score(proposal, target_logits)
            output_ids = self.accept(proposal, scores)  # [B, w]
        num_kept, num_accepted = self.commit(proposal, output_ids, scores, target_logits, stop_hits)
        if self.static is None:  # dynamic caches: the step's one host read, then host decisions from it
            self.step_read = self.read_step(proposal, num_kept, num_accepted)
        self.rollback(num_accepted)
        self.sampling.advance()  # the next step draws anew (a device counter: replays advance it too)

    def plain_step(self, proposal: Proposal) -> bool:
        """A dynamic step in which no row drafts, as the host knows before its forward: plain decoding's step, in
        about as many device operations (each row's newest token through the target, one token out and its stop
        checked; the host knows that each row keeps one token and accepted nothing). The rest of the loop's step
        (slots for drafts, acceptance, the commit's cut, the rollback) is there for drafts: on an 8B target at
        batch 1 on a GPU, where an eager step is bound by the host's operations, it cost 8-16% of plain's speed
        when drafting was off. False when the target's view cannot feed it this way (`CacheView.forward_newest`):
        the step then runs whole."""
        batch = self.batch
        logits = self.target.forward_newest(batch.token_ids)  # [B, 1, V]
        if logits is None:
            return False
        first_shapes.note(self.model, ("step", *logits.shape[:2]), batch.device)
        output_ids = self.accept(proposal, self.score(proposal, logits))  # [B, 1]
        batch.token_ids.scatter_(1, batch.lengths[:, None], output_ids)  # within capacity: live rows < max_length
        self.stop_rules.apply_newest(batch, output_ids[:, 0])
        batch.lengths = batch.lengths + 1
        self.step_read = self.read_step(proposal)
        none = proposal.host_num_draft_tokens  # [B] zeros (host)
        self.budgets.accepted(proposal.num_draft_tokens, (none, none))
        self.proposer.commit(batch, proposal.num_draft_tokens)  # nothing accepted
        self.sampling.advance()
        return True

    def _host_cached(self) -> np.ndarray | None:  # [B]
        """Dynamic caches: the target's cached lengths as the host keeps them (None when it does not)."""
        if self.static is not None or self.batch.host_lengths is None:
            return None
        host = self.target.host_columns()
        return None if host is None else host.cached

    def _width(self, width: int) -> dict[str, int]:
        """The fixed slot count of a static forward (its CUDA graph); a dynamic forward finds its own."""
        return {} if self.static is None else {"width": width}

    def propose(self) -> Proposal:
        batch = self.batch
        if self.budgets.planned_width == 0:  # planned: no row drafts this step
            proposal = Proposal.empty(batch.batch_size, batch.device)
        else:
            host_budget = None  # dynamic caches: the budgets on the host too, from its copy of the lengths
            if self.static is None and batch.host_lengths is not None:
                host_room = np.clip(self.max_length - batch.host_lengths - 1, 0, self.k)  # [B]
                host_budget = self.budgets.host_budgets(batch, host_room)
            if host_budget is None:
                room = self.length_limit - batch.lengths - 1  # [B] drafts that still fit before max_length
                max_draft = room.clamp(min=0, max=self.k).masked_fill(self.frozen, 0)  # [B]
                budget = self.budgets.budgets(batch, max_draft)
            elif host_budget.any():
                budget = torch.from_numpy(host_budget).to(batch.device)  # the step's one copy to the device
            else:  # no row drafts (as when drafting does not pay): nothing to copy
                budget = torch.zeros(batch.batch_size, dtype=torch.long, device=batch.device)
            proposal = self.proposer.propose(
                batch, budget, self.sampling, trim=self.budgets.trim, host_budget=host_budget
            )
        self.budgets.proposed(proposal)
        # Drafts go into the scratch space after each row's tokens: processors and stops read them.
        width = proposal.draft_token_ids.shape[1]
        if width:
            rows = torch.arange(self.batch.batch_size, device=self.batch.device)[:, None]
            columns = (self.batch.lengths[:, None] + torch.arange(width, device=self.batch.device)).clamp(
                max=self.batch.capacity - 1
            )  # [B, k]
            drafted = proposal.draft_token_ids >= 0
            self.batch.token_ids[rows, columns] = torch.where(
                drafted, proposal.draft_token_ids, self.batch.token_ids[rows, columns]
            )
        return proposal

    def verify(self, proposal: Proposal) -> torch.Tensor:  # [B, 1 + k, V]
        """One target forward over each row's unseen tokens and its drafts; logits of [last token, drafts].

        The target has seen every token but each row's newest one, except at step 0, where it has seen nothing:
        that verify is the prefill, so the first tokens cost no forward of their own.
        """
        unseen = self.batch.lengths - self.target.cached_lengths  # [B] 1, or the whole row at step 0
        num_new = (unseen + proposal.num_draft_tokens).masked_fill(self.frozen, 0)  # [B]
        width = proposal.draft_token_ids.shape[1]  # the longest row's drafts (dynamic), or k (static)
        cached = self._host_cached() if proposal.host_num_draft_tokens is not None else None
        if cached is not None:  # dynamic caches, the counts known on the host: the forward reads nothing
            fed = {"host_num_new": self.batch.host_lengths - cached + proposal.host_num_draft_tokens}
        else:
            fed = self._width(1 + width if self.prefilled else self.batch.prompt_width + width)
        if not self.prefilled:  # step 0 (all the prompt a filled cache lacks): keep [last prompt token, drafts]
            self.prefilled = True  # static: every row feeds its whole prompt
            return self.target.forward(self.batch.token_ids, num_new, logits_to_keep=1 + width, **fed)
        # After step 0 every fed slot is [newest token, drafts]: keep them all (no host sync).
        return self.target.forward(self.batch.token_ids, num_new, **fed)

    def score(self, proposal: Proposal, target_logits: torch.Tensor) -> torch.Tensor:  # [B, 1 + k, V]
        if not self.sampling.pure:  # no processors: the logits are the scores
            return target_logits
        width = target_logits.shape[1]
        offsets = torch.arange(width, device=target_logits.device)  # [w]
        prefix_lengths = self.batch.lengths[:, None] + offsets  # [B, w]
        valid = offsets <= proposal.num_draft_tokens[:, None]  # [B, w]
        return self.sampling.process(self.batch.token_ids, prefix_lengths, valid, target_logits)

    def accept(self, proposal: Proposal, scores: torch.Tensor) -> torch.Tensor:  # [B, 1 + k]
        batch_size, width, vocab = scores.shape
        device = scores.device
        if width == 1 and not self.sampling.do_sample:  # no drafts, greedy: the sampler's bonus token is the argmax
            output_ids = scores[:, 0].argmax(-1, keepdim=True)  # [B, 1]
            return output_ids if self.static is None else output_ids.masked_fill(self.frozen[:, None], -1)
        if self.sampling.do_sample:
            uniforms = self.sampling.draw_uniforms(width - 1)  # [B, k]
            exponentials = self.sampling.draw_exponentials(row_random.STREAM_RESIDUAL, vocab)  # [B, V]
        else:
            uniforms = torch.zeros(batch_size, width - 1, device=device)
            exponentials = torch.ones(batch_size, 1, device=device).expand(batch_size, vocab)
        is_greedy = torch.full((batch_size,), not self.sampling.do_sample, device=device)
        draft_probs = proposal.draft_probs if self.sampling.do_sample else None
        output_ids = rejection_sample(
            scores,
            proposal.draft_token_ids,
            proposal.num_draft_tokens,
            draft_probs,
            is_greedy,
            uniforms,
            exponentials,
            check_values=False,  # the counts are in 0..k by construction, and greediness is known on the host:
            all_greedy=not self.sampling.do_sample,  # no host read in the step
        )
        if self.static is None:  # rows leave a dynamic batch: none is frozen
            return output_ids
        return output_ids.masked_fill(self.frozen[:, None], -1)  # frozen rows emit nothing

    def commit(
        self,
        proposal: Proposal,
        output_ids: torch.Tensor,  # [B, w]
        scores: torch.Tensor,  # [B, w, V]
        target_logits: torch.Tensor,  # [B, w, V]
        stop_hits: torch.Tensor | None = None,  # [B, w] the exact path's criteria answers, or None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each row's emitted tokens, cut at the first stop, and update the stats."""
        batch = self.batch
        num_emitted = (output_ids >= 0).sum(1)  # [B]
        num_accepted = num_emitted - 1
        width = output_ids.shape[1]
        rows = torch.arange(batch.batch_size, device=batch.device)[:, None]
        columns = (batch.lengths[:, None] + torch.arange(width, device=batch.device)).clamp(max=batch.capacity - 1)
        emitted = output_ids >= 0
        batch.token_ids[rows, columns] = torch.where(emitted, output_ids, batch.token_ids[rows, columns])
        num_kept = self.stop_rules.apply(batch, num_emitted, width, stop_hits)  # [B]
        self.record_outputs(num_kept, scores, target_logits)
        if self.on_step is not None:
            self.on_step(
                StepRecord.from_step(
                    batch.row_ids, output_ids, num_kept, proposal.num_draft_tokens, num_accepted, ~self.frozen
                )
            )
        batch.lengths = batch.lengths + num_kept
        self.stats.record_step(proposal.num_draft_tokens, num_accepted)
        return num_kept, num_accepted

    def read_step(
        self, proposal: Proposal, num_kept: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None
    ) -> StepRead:
        """A dynamic step's one host read: per row the tokens kept, drafts accepted and verified, whether it is done
        (and its first stop for host criteria), with the rows a proposer that drafts on the host asks for
        (`Proposer.host_rows`). The host's copy of the lengths advances by what it read. Without `num_kept` the step
        was a `plain_step`: the host knows that each row kept one token and drafted nothing, and reads the rest."""
        batch = self.batch
        plain = num_kept is None
        done = self.stop_rules.done(batch)  # [B]
        if not plain:  # (a plain step's lengths are known on the host)
            done = done | (batch.lengths >= self.length_limit)
        parts = [done.long()] if plain else [num_kept, num_accepted, proposal.num_draft_tokens, done.long()]
        host_criteria = self.stop_rules.host is not None
        if host_criteria:
            parts.append(self.stop_rules.stop_lengths.to(batch.device))
        proposer_rows = self.proposer.host_rows(batch)  # [r, B] or None
        if proposer_rows is not None:
            parts.append(proposer_rows.long())
        stacked = parts[0][None] if len(parts) == 1 else torch.cat([p.reshape(-1, batch.batch_size) for p in parts])
        values = stacked.cpu().numpy()  # [n, B]: the read
        if plain:
            none = proposal.host_num_draft_tokens  # [B] zeros
            kept, accepted, drafted = np.ones_like(none), none, none
            batch.advance_host(kept)
            done_rows = values[0].astype(bool) | (batch.host_lengths >= self.max_length)
            rest = values[1:]
        else:
            kept, accepted, drafted, done_rows = values[:4]
            batch.advance_host(kept)
            done_rows = done_rows.astype(bool)
            rest = values[4:]
        stops = rest[0] if host_criteria else None
        if proposer_rows is not None:
            self.proposer.read_host_rows(batch.host_lengths, rest[int(host_criteria) :])
        return StepRead(kept, accepted, drafted, done_rows, stops)

    def rollback(self, num_accepted: torch.Tensor) -> None:
        # The target holds every token but each row's newest one, which the next verify feeds.
        read = self.step_read
        host = self._host_cached() if read is not None else None
        self.target.rollback(
            self.batch.lengths - 1, **({} if host is None else {"host_cached": self.batch.host_lengths - 1})
        )
        self.budgets.accepted(num_accepted, None if read is None else (read.num_draft_tokens, read.num_accepted))
        self.proposer.commit(self.batch, num_accepted)

    # --- bookkeeping -------------------------------------------------------------------------------

    def record_outputs(self, num_kept: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> None:
        if self.score_buffer is None and self.logit_buffer is None:
            return
        batch = self.batch
        width = scores.shape[1]
        offsets = torch.arange(width, device=scores.device)
        rows, cols = (offsets < num_kept[:, None]).nonzero(as_tuple=True)
        targets = batch.lengths[rows] + cols - batch.prompt_width
        needed = int(targets.max().item()) + 1 if targets.numel() else 0
        self.score_buffer = _grown(self.score_buffer, needed, self.max_length - batch.prompt_width)
        self.logit_buffer = _grown(self.logit_buffer, needed, self.max_length - batch.prompt_width)
        for buffer, values in ((self.score_buffer, scores), (self.logit_buffer, logits)):
            if buffer is not None:
                buffer[batch.row_ids[rows], targets] = values[rows, cols]

    def retire_finished(self) -> None:
        """Rows that are done leave the batch (their tokens are copied out first); stream what is final.

        On a static cache they stay, frozen. Reading which rows are done is the step's one host sync; the host
        criteria (`max_time`, your own) are then called on what it read.
        """
        batch = self.batch
        read, self.step_read = self.step_read, None
        if self.static is None and read is not None and batch.host_lengths is not None:
            lengths = batch.host_lengths.tolist()
            ending = {int(i): lengths[i] for i in np.flatnonzero(read.done)}  # batch index -> final length
            if self.stop_rules.host is not None or ending:
                row_ids = batch.host_row_ids.tolist()
                if self.stop_rules.host is not None:
                    ending = self.stop_rules.host.settle(self, row_ids, lengths, read.stop_lengths.tolist(), ending)
                if ending:
                    self._leave(ending, row_ids)
            self.stream()
            return
        done = self.stop_rules.done(batch) | (batch.lengths >= self.length_limit)  # [B]
        if self.static is not None:
            self._freeze(done)
        elif self.stop_rules.host is not None or done.any():
            rows = torch.stack([done.long(), batch.row_ids, batch.lengths, self.stop_rules.stop_lengths])  # [4, B]
            finished, row_ids, lengths, stops = rows.tolist()
            ending = {i: lengths[i] for i, d in enumerate(finished) if d}  # batch index -> final length
            if self.stop_rules.host is not None:
                ending = self.stop_rules.host.settle(self, row_ids, lengths, stops, ending)
            if ending:
                self._leave(ending, row_ids)
        self.stream()

    def _leave(self, ending: dict[int, int], row_ids: list[int]) -> None:
        """Rows `ending` (batch index -> final length) leave the dynamic batch, their tokens copied out first."""
        batch = self.batch
        for i, length in ending.items():
            self.sequences[row_ids[i], :length] = batch.token_ids[i, :length]
            self.final_lengths[row_ids[i]] = length
        leaving = torch.tensor(sorted(ending), dtype=torch.long, device=batch.device)  # [n]
        if self.handoff is not None:
            self.handoff.stash(self.target, leaving, batch.row_ids[leaving])
            for i, length in ending.items():  # a row cut by a host criterion hands back only what it kept
                self.handoff.cut(row_ids[i], length)
        host_keep = np.array([i for i in range(batch.batch_size) if i not in ending], dtype=np.int64)  # [B']
        keep = torch.from_numpy(host_keep).to(batch.device)
        batch.select_rows(keep, host_keep)
        self.frozen = self.frozen[keep]
        self.target.select_rows(keep, host_keep)
        self.budgets.select_rows(keep, host_keep)
        if isinstance(self.proposer, Top1Proposer):
            self.proposer.select_rows(keep, host_keep)
        else:
            self.proposer.select_rows(keep)
        self.sampling.select_rows(keep)
        self.stop_rules.select_rows(keep)

    def _freeze(self, done: torch.Tensor) -> None:  # [B] bool
        """Copy out the rows that finished since the last read (rows the host has not frozen yet: a block of plain
        steps freezes on the device too) and freeze them. The step's one host read: [3, B] ints (4 with host
        criteria: each row's first stop), the write offset of every static cache (so that no forward has to read one
        to know whether it fits), and the rows a proposer that drafts on the host asks for (`Proposer.host_rows`:
        suffix decoding's committed tokens)."""
        views = self.static.views
        offsets = torch.stack([view.offset for view in views]).expand(len(self.batch.lengths), -1).T  # [n, B]
        host = self.stop_rules.host is not None
        rows_info = [done.long(), self.batch.row_ids, self.batch.lengths]
        rows_info += [self.stop_rules.stop_lengths] if host else []
        proposer_rows = self.proposer.host_rows(self.batch)  # [r, B] or None
        parts = [torch.stack(rows_info), offsets, *([proposer_rows.long()] if proposer_rows is not None else [])]
        done, row_ids, lengths, *rest = torch.cat(parts).tolist()
        stops = rest.pop(0) if host else None
        for view, offset in zip(views, rest[: len(views)]):
            view.offset_bound = offset[0] if offset else 0
        if proposer_rows is not None:
            self.proposer.read_host_rows(lengths, rest[len(views) :])
        ending = {i: lengths[i] for i, d in enumerate(done) if d and i not in self.frozen_rows}  # index -> length
        if host:
            ending = self.stop_rules.host.settle(self, row_ids, lengths, stops, ending)
        live = [lengths[i] for i in range(len(lengths)) if i not in self.frozen_rows and i not in ending]
        self.longest_room = self.max_length - min(live, default=self.max_length)
        for i, length in ending.items():
            self.sequences[row_ids[i], :length] = self.batch.token_ids[i, :length]
            self.final_lengths[row_ids[i]] = length
        if ending:
            self.frozen[torch.tensor(sorted(ending), device=self.frozen.device)] = True
            self.frozen_rows.update(ending)
            self.num_frozen = len(self.frozen_rows)

    def stream(self) -> None:
        """Send the columns that no row can still change to the streamer, one [B] column at a time."""
        if self.streamer is None:
            return
        final_length = self.stop_rules.final_length(self.final_lengths, self.batch, self.live())
        if self.static is None and self.batch.host_lengths is not None:  # the host's copies (no frozen rows)
            lengths, row_ids = self.batch.host_lengths.tolist(), self.batch.host_row_ids.tolist()
            frozen = [0] * len(lengths)
        else:  # one host read of [3, B]: each row's length, caller row id and whether it is frozen (static caches)
            lengths, row_ids, frozen = torch.stack(
                [self.batch.lengths, self.batch.row_ids, self.frozen.long()]
            ).tolist()
        live = {row: i for i, (row, f) in enumerate(zip(row_ids, frozen)) if not f}
        safe = min((lengths[i] for i in live.values()), default=final_length)
        safe = min(safe, final_length, self.stop_rules.confirmed_width())  # host criteria may still cut later ones
        if safe <= self.streamed:
            return
        block = self.sequences[:, self.streamed : safe].clone()  # [B_total, n]
        for row, i in live.items():
            block[row] = self.batch.token_ids[i, self.streamed : safe]
        block = self.stop_rules.pad_finished(block, self.final_lengths, self.streamed, live)
        for column in block.cpu().unbind(1):
            self.streamer.put(column)
        self.streamed = safe

    def finish(self) -> LoopOutput:
        final_length = self.stop_rules.final_length(self.final_lengths, self.batch, self.live())
        self.stats.num_generated_tokens = int((self.final_lengths - self.batch.prompt_width).sum())
        self.stats.finalize()
        if self.static is not None:
            self.stats.compile_time_s = self.static.compile_time_s
            self.stats.num_compactions = self.static.num_compactions
        if self.step_graph is not None:
            self.stats.compile_time_s += self.step_graph.capture_time_s
            self.stats.num_graph_replays = self.step_graph.replays
            self.stats.graph_reuse, self.stats.graph_reuse_reason = self.step_graph.reuse_outcome
        # The caller's own copy: `self.sequences` may be a kept graph's tensor, which a later call writes.
        sequences = self.sequences[:, :final_length].clone()
        sequences = self.stop_rules.pad_finished(sequences, self.final_lengths, 0, {})
        if self.streamer is not None:
            self.stream()
            self.streamer.end()
        generated = final_length - self.batch.prompt_width
        scores = logits = None
        if self.score_buffer is not None:
            scores = tuple(self.score_buffer[:, :generated].unbind(1))
        if self.logit_buffer is not None:
            logits = tuple(self.logit_buffer[:, :generated].unbind(1))
        cache = self.handoff.hand_back(self.model, sequences) if self.handoff is not None else None
        return LoopOutput(sequences=sequences, scores=scores, logits=logits, cache=cache)


def _grown(buffer: torch.Tensor | None, needed: int, limit: int) -> torch.Tensor | None:  # [B_total, T', V]
    """`buffer` with room for `needed` token columns: doubled when short (amortised copies), never past `limit`."""
    if buffer is None or buffer.shape[1] >= needed:
        return buffer
    width = min(max(needed, 2 * buffer.shape[1]), max(limit, needed))
    grown = buffer.new_zeros(buffer.shape[0], width, buffer.shape[2])
    grown[:, : buffer.shape[1]] = buffer
    return grown
