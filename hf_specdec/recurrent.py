"""Recurrent layers of hybrid models (gated delta-net, Mamba2, Kimi delta attention): exact rollback of their state.

A hybrid's cache mixes attention layers (columns, rolled back through `CacheView`'s column map) with
`linear_attention` layers that hold one conv state and one recurrent state per row, not one column per token.
A verify moves those states past drafts that may be rejected, by a different number per row. `RecurrentRollback`
snapshots every recurrent layer's states before the first forward after a rollback and records the input each
recurrent mixer received (a forward pre-hook); on rollback, rows that keep fewer tokens than they were fed get
the snapshot back and only the recurrent mixers re-run over the kept tokens' recorded inputs (the inputs of a
causal model's kept tokens do not depend on the rejected ones): short runs one token at a time in one pass for
every kept count, long ones (a prefill) in one chunked call per kept count. Rows that kept everything they were
fed keep the state the forward left. `check_recurrent_call` refuses, before any model work, what this rollback
does not cover.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_specdec import compat
from hf_specdec.devices import PerDevice
from hf_specdec.model_support import model_layer_types

#: The cache layer type of recurrent layers (transformers' `LinearAttentionLayer`).
RECURRENT_LAYER_TYPE = "linear_attention"

#: Kept runs up to this long re-run one token at a time (the mixers' single-step kernels, as plain decoding runs
#: them); longer ones (a prefill) in one chunked call. Measured in benchmarks/bench_recurrent_cpu.py.
STEPWISE_MAX_TOKENS = 8

#: Names under which a recurrent mixer's forward takes the cache (transformers renames `cache_params` to `cache`).
_CACHE_ARGUMENTS = ("cache_params", "cache")


def recurrent_layer_indices(model: PreTrainedModel) -> list[int]:
    """Indices of the decoder layers whose cache layer is recurrent (empty for attention-only models)."""
    return [i for i, kind in enumerate(model_layer_types(model)) if kind == RECURRENT_LAYER_TYPE]


def is_hybrid(model: PreTrainedModel) -> bool:
    """Whether `model` has recurrent cache layers (a hybrid, or an all-recurrent model)."""
    return not model.config.is_encoder_decoder and bool(recurrent_layer_indices(model))


def find_mixers(model: PreTrainedModel, role: str = "target") -> dict[int, nn.Module]:
    """The recurrent mixer module of each recurrent layer: the module with that `layer_idx` whose forward takes
    the cache as `cache_params`/`cache`. Raises a clear error when a layer has none or several."""
    layers = recurrent_layer_indices(model)
    candidates: dict[int, list[nn.Module]] = {i: [] for i in layers}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if index in candidates and _takes_cache(module):
            candidates[index].append(module)
    found = {i: modules[0] for i, modules in candidates.items() if len(modules) == 1}
    missing = sorted(set(layers) - set(found))
    if missing:
        raise NotImplementedError(
            f"The {role} model {type(model).__name__} has recurrent (linear_attention) layers {missing} whose mixer "
            "hf_specdec cannot find (one module per layer with that `layer_idx` taking `cache_params`), so it "
            "cannot roll their state back exactly: generate without speculation for this model."
        )
    return found


def _takes_cache(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in _CACHE_ARGUMENTS)


#: Hybrid families whose rollback is tested exact against plain decoding (tests/core/test_hybrid.py, and the
#: architecture sweep with rejected drafts). Others with the same layer types are refused rather than trusted:
#: Nemotron-H, for one, differs from plain decoding in a batch of 8 (not yet understood).
VERIFIED_HYBRIDS = frozenset(
    {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "bamba", "bailing_hybrid", "olmo_hybrid"}
)


def check_recurrent_call(
    model: PreTrainedModel, spec: Any, generation_config: Any, model_kwargs: dict[str, Any]
) -> None:
    """Refuse, before any model work, a call with a hybrid target or draft that hf_specdec cannot run exactly."""
    hybrids = [(role, m) for role, m in (("target", model), ("draft", spec.draft_model)) if m is not None]
    hybrids = [(role, m) for role, m in hybrids if is_hybrid(m)]
    if not hybrids:
        return
    role, hybrid = hybrids[0]
    name = f"The {role} model {type(hybrid).__name__} has recurrent (linear_attention) layers"
    for role_, model_ in hybrids:
        model_type = model_.config.get_text_config(decoder=True).model_type
        if model_type not in VERIFIED_HYBRIDS:
            raise NotImplementedError(
                f"The {role_} model {type(model_).__name__} ({model_type!r}) is a hybrid with recurrent layers whose "
                f"rollback under speculation hf_specdec has not verified exact (verified: {sorted(VERIFIED_HYBRIDS)}): "
                "generate without speculation for this model."
            )
    missing = compat.missing_recurrent_cache_api()
    if missing:
        raise NotImplementedError(
            f"{name}, whose state hf_specdec rolls back through transformers' recurrent cache API, but this "
            f"transformers ({compat.transformers_version()}) lacks {missing}: upgrade transformers (5.23 or newer "
            "is tested), or generate without speculation."
        )
    if spec.method == "early_exit":
        raise NotImplementedError(
            f"{name}; SpecDecoder(method='early_exit') is not supported for hybrid models in hf_specdec yet "
            "(its draft would share the target's recurrent state): use method='draft' with a draft model, or "
            "method='ngram' (prompt lookup)."
        )
    mtp_layer_types = getattr(model.config.get_text_config(), "mtp_layer_types", None) or []
    if spec.method == "mtp" and RECURRENT_LAYER_TYPE in mtp_layer_types:
        raise NotImplementedError(
            f"{name}, and its MTP layers are recurrent too (mtp_layer_types={list(mtp_layer_types)}): hf_specdec "
            "drafts with attention MTP layers only (their caches roll back like the target's attention layers): "
            "use method='draft' with a draft model, or method='ngram' (prompt lookup)."
        )
    if spec.draft_tokenizer is not None:
        raise NotImplementedError(
            f"{name}; a draft with another tokenizer (draft_tokenizer=...) is not supported with hybrid models in "
            "hf_specdec yet: use a draft sharing the target's tokenizer, or method='ngram'."
        )
    cache = compat.get_cache(model_kwargs)
    if cache is not None and getattr(cache, "_is_user_defined", False):
        raise NotImplementedError(
            f"{name}; hf_specdec does not continue or fill a caller's past_key_values for hybrid models yet "
            "(their recurrent states are not handed back): pass no past_key_values (give the whole conversation "
            "as input_ids)."
        )
    if generation_config.return_dict_in_generate:
        raise NotImplementedError(
            f"{name}; with return_dict_in_generate=True plain generate returns the filled cache, which hf_specdec "
            "does not hand back for hybrid models yet: pass return_dict_in_generate=False (read the statistics "
            "from spec_decoder.last_stats)."
        )


@dataclass
class _Fed:
    """What one forward fed the recurrent mixers since the last snapshot."""

    valid: torch.Tensor  # [B, w] slots that hold one of the row's tokens (in order), False for unused slots
    mask: torch.Tensor | None  # [B, w] the 2-D padding mask the mixers got (None: every slot real)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, w, H] the mixer's input
    kwargs: dict[int, dict[str, Any]] = field(default_factory=dict)  # layer -> the mixer's other arguments


class RecurrentRollback:
    """Snapshots and exact per-row rollback of the recurrent layers of one `CacheView`'s cache."""

    def __init__(self, model: PreTrainedModel, cache: Any) -> None:
        self.cache = cache
        self.mixers = find_mixers(model)
        # layer -> per state index: (conv [B, C, K] or None, recurrent [B, ...] or None, had a previous state)
        self.snapshot: dict[int, list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]] | None = None
        self.base_lengths: torch.Tensor | None = None  # [B] cached tokens per row at the snapshot
        self.fed: list[_Fed] = []
        self._recording: _Fed | None = None
        self._hooks: list[Any] = []
        self.stepwise_max_tokens = STEPWISE_MAX_TOKENS
        self.replayed_rows = 0  # rows re-run (statistics for the benchmark)

    def _make_hook(self, index: int):  # noqa: ANN202
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            fed = self._recording
            if fed is None or _cache_of(kwargs) is not self.cache:
                return  # a forward hf_specdec did not start (or another cache): nothing to roll back
            hidden = args[0] if args else kwargs["hidden_states"]
            fed.inputs[index] = hidden  # [B, w, H]
            fed.kwargs[index] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

        return record

    def start_forward(
        self,
        cached_lengths: torch.Tensor,  # [B] tokens each row's states hold before this forward
        valid: torch.Tensor,  # [B, w] slots that feed one of the row's next tokens
        mask: torch.Tensor | None,  # [B, w] the mixers' 2-D padding mask, None when every slot is real
    ) -> None:
        """Before a forward: snapshot the states if this is the first forward since a rollback; record its inputs."""
        if self.snapshot is None:
            self.snapshot = {index: self._layer_states(index, clone=True) for index in self.mixers}
            self.base_lengths = cached_lengths.clone()
        elif self.fed and not bool(self.fed[-1].valid.all()):
            self._settle(cached_lengths)
        self._recording = _Fed(valid=valid, mask=mask)
        self._hooks = [  # live only during this forward: the model is left as it was
            mixer.register_forward_pre_hook(self._make_hook(index), with_kwargs=True)
            for index, mixer in self.mixers.items()
        ]

    def end_forward(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._recording is not None:
            self.fed.append(self._recording)
        self._recording = None

    def _layer_states(self, index: int, clone: bool) -> list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]:
        layer = self.cache.layers[index]
        states = []
        for s in range(layer.number_of_states):
            conv = layer.conv_states[s] if layer.is_conv_states_initialized[s] else None
            recurrent = layer.recurrent_states[s] if layer.is_recurrent_states_initialized[s] else None
            if clone:
                conv = conv.clone() if conv is not None else None
                recurrent = recurrent.clone() if recurrent is not None else None
            states.append((conv, recurrent, bool(layer.has_previous_state[s])))
        return states

    def _settle(self, cached_lengths: torch.Tensor) -> None:  # [B] tokens each row holds, every fed one
        """Before another forward since the snapshot (a draft's next position): rows whose last forward had unused
        slots (a row 1 token behind in a 2-wide catch-up, a row that stopped drafting) passed them through the
        mixers, which moves a state even on a masked input (a decay, a conv shift). Re-run those rows over every
        token fed since the snapshot, so the next forward starts from plain decoding's state; the snapshot and
        the recorded inputs stay for the rollback."""
        valid = torch.cat([f.valid for f in self.fed], dim=1)  # [B, W] slots fed since the snapshot
        counts = (cached_lengths - self.base_lengths).masked_fill(self.fed[-1].valid.all(1), -1)  # [B]
        self._restore(self.fed, self.snapshot, counts, valid)

    def rollback(self, cached_lengths: torch.Tensor) -> None:  # [B] tokens each row keeps in the cache
        """Put each row's recurrent states where plain decoding of its kept tokens would have them."""
        fed, self.fed, snapshot, self.snapshot = self.fed, [], self.snapshot, None
        if snapshot is None or not fed:
            return
        num_kept = cached_lengths - self.base_lengths  # [B] of the tokens fed since the snapshot
        valid = torch.cat([f.valid for f in fed], dim=1)  # [B, W] slots fed since the snapshot
        exact = valid.all(1) & (num_kept == valid.shape[1])  # [B] rows whose state the forwards left is right
        self._restore(fed, snapshot, num_kept.masked_fill(exact, -1), valid)

    def _restore(
        self,
        fed: list[_Fed],
        snapshot: dict[int, list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]],
        counts: torch.Tensor,  # [B] tokens to keep per row (from the snapshot on), -1 for rows left as they are
        valid: torch.Tensor,  # [B, W] slots fed since the snapshot
    ) -> None:
        """Rows with counts >= 0 get the snapshot back, then their mixers re-run over their first `counts` tokens."""
        groups = [int(c) for c in torch.unique(counts).tolist() if c >= 0]
        if not groups:
            return
        masks = [f.mask if f.mask is not None else f.valid.new_ones(f.valid.shape) for f in fed]
        mask = torch.cat(masks, dim=1).long()  # [B, W]
        rank = valid.long().cumsum(1) - 1  # [B, W] the fed token each slot holds
        if self._replay_stepwise(fed, snapshot, counts, valid, mask, max(groups)):
            return
        for count in groups:
            rows = (counts == count).nonzero().squeeze(1)  # [b]
            self.replayed_rows += int(rows.numel())
            keep = valid[rows] & (rank[rows] < count)  # [b, W]: exactly `count` slots per row
            slots = keep.nonzero()[:, 1].view(rows.numel(), count)  # [b, count]
            kept_mask = PerDevice(mask[rows[:, None], slots])  # [b, c]
            rows_on, slots_on = PerDevice(rows), PerDevice(slots)  # each mixer's layer may sit on its own device
            for index, mixer in self.mixers.items():
                hidden = torch.cat([f.inputs[index] for f in fed], dim=1)  # [B, W, H]
                self._replay(index, mixer, fed[-1].kwargs[index], snapshot[index], rows_on, hidden, kept_mask, slots_on)

    def _replay(
        self,
        index: int,
        mixer: nn.Module,
        kwargs: dict[str, Any],
        snapshot: list[tuple[torch.Tensor | None, torch.Tensor | None, bool]],
        rows_on: PerDevice,  # [b]
        hidden: torch.Tensor,  # [B, W, H]
        kept_mask: PerDevice,  # [b, c] the padding mask of the kept slots
        slots_on: PerDevice,  # [b, c]
    ) -> None:
        """Restore rows `rows` of layer `index` to the snapshot, then re-run its mixer over their kept slots."""
        layer = self.cache.layers[index]
        rows, slots = rows_on.on(hidden.device), slots_on.on(hidden.device)  # the layer's states and inputs are there
        current = self._layer_states(index, clone=False)  # the full [B, ...] tensors the forward left
        for s, ((conv, recurrent, had_state), (full_conv, full_recurrent, _)) in enumerate(zip(snapshot, current)):
            if full_conv is not None:
                layer.conv_states[s] = conv[rows] if conv is not None else full_conv.new_zeros(full_conv[rows].shape)
            if full_recurrent is not None:
                zeros = full_recurrent.new_zeros(full_recurrent[rows].shape)
                layer.recurrent_states[s] = recurrent[rows] if recurrent is not None else zeros
            layer.has_previous_state[s] = had_state
        count = slots.shape[1]
        if count:
            call = dict(kwargs)
            call["attention_mask"] = kept_mask.on(hidden.device)  # all ones where nothing is padded: the same states
            with torch.no_grad():  # the mixer updates the b-row states in place
                mixer(hidden[rows[:, None], slots], **call)  # [b, c, H]
        for s, (full_conv, full_recurrent, _) in enumerate(current):
            if full_conv is not None:
                full_conv[rows] = layer.conv_states[s].to(full_conv.dtype)
                layer.conv_states[s] = full_conv
            if full_recurrent is not None:
                full_recurrent[rows] = layer.recurrent_states[s].to(full_recurrent.dtype)
                layer.recurrent_states[s] = full_recurrent
            layer.has_previous_state[s] = True

    def _replay_stepwise(
        self,
        fed: list[_Fed],
        snapshot: dict[int, list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]],
        counts: torch.Tensor,  # [B] tokens to keep per row, -1 for rows whose state is already right
        valid: torch.Tensor,  # [B, W] slots fed since the snapshot
        mask: torch.Tensor,  # [B, W] their padding mask
        most: int,  # the largest count
    ) -> bool:
        """Short kept runs (decoding steps): every row to re-run starts from the snapshot and its mixers step one
        kept token at a time, step j over the rows that keep more than j tokens (the single-step kernels plain
        decoding runs, one batch per step for all kept counts). False, having done nothing, for long runs (a
        prefill), padding among the kept tokens, or a snapshot taken before the first forward."""
        if most > self.stepwise_max_tokens or not all(h for states in snapshot.values() for _, _, h in states):
            return False
        rows = (counts >= 0).nonzero().squeeze(1)  # [R]
        kept_counts = counts[rows]  # [R]
        width = valid.shape[1]
        positions = torch.arange(width, device=valid.device)  # [W]
        slots = torch.where(valid[rows], positions, width + positions).argsort(1)[:, :most]  # [R, most] in order
        in_run = positions[:most][None, :] < kept_counts[:, None]  # [R, most]
        if not bool((mask[rows].gather(1, slots).bool() | ~in_run).all()):
            return False  # a kept slot is padding: the chunked re-run applies the mask
        self.replayed_rows += int(rows.numel())
        steps = [(counts[rows] > j).nonzero().squeeze(1) for j in range(most)]  # [a_j] rows that take step j
        on_devices = [PerDevice(t) for t in (rows, slots, *steps)]  # each mixer's layer may sit on its own device
        for index, mixer in self.mixers.items():
            layer = self.cache.layers[index]
            hidden = torch.cat([f.inputs[index] for f in fed], dim=1)  # [B, W, H]
            rows, slots, *steps = (t.on(hidden.device) for t in on_devices)  # where its states and inputs are
            current = self._layer_states(index, clone=False)  # the full [B, ...] tensors the forward left
            work = [
                (c[rows] if c is not None else None, r[rows] if r is not None else None) for c, r, _ in snapshot[index]
            ]
            call = {**fed[-1].kwargs[index], "attention_mask": None}
            for j, active in enumerate(steps):
                for s, (conv, recurrent) in enumerate(work):
                    if conv is not None:
                        layer.conv_states[s] = conv[active]
                    if recurrent is not None:
                        layer.recurrent_states[s] = recurrent[active]
                    layer.has_previous_state[s] = True
                with torch.no_grad():
                    mixer(hidden[rows[active], slots[active, j]][:, None], **call)  # [a, 1, H]
                for s, (conv, recurrent) in enumerate(work):
                    if conv is not None:
                        conv[active] = layer.conv_states[s].to(conv.dtype)
                    if recurrent is not None:
                        recurrent[active] = layer.recurrent_states[s].to(recurrent.dtype)
            for s, ((conv, recurrent), (full_conv, full_recurrent, _)) in enumerate(zip(work, current)):
                if full_conv is not None:
                    full_conv[rows] = conv.to(full_conv.dtype)
                    layer.conv_states[s] = full_conv
                if full_recurrent is not None:
                    full_recurrent[rows] = recurrent.to(full_recurrent.dtype)
                    layer.recurrent_states[s] = full_recurrent
                layer.has_previous_state[s] = True
        return True

    def select_rows(self, keep: torch.Tensor | PerDevice) -> None:  # [B'] indices
        """Keep only rows `keep` of every recurrent layer's states (and of a pending snapshot), each on its device."""
        keep = keep if isinstance(keep, PerDevice) else PerDevice(keep)
        for index in self.mixers:
            layer = self.cache.layers[index]
            for s in range(layer.number_of_states):
                if layer.is_conv_states_initialized[s]:
                    layer.conv_states[s] = keep.rows(layer.conv_states[s])
                if layer.is_recurrent_states_initialized[s]:
                    layer.recurrent_states[s] = keep.rows(layer.recurrent_states[s])
        if self.base_lengths is not None:
            self.base_lengths = keep.rows(self.base_lengths)
        if self.snapshot is not None:
            self.snapshot = {
                index: [
                    (keep.rows(c) if c is not None else None, keep.rows(r) if r is not None else None, h)
                    for c, r, h in states
                ]
                for index, states in self.snapshot.items()
            }
        for f in self.fed:
            f.valid, f.mask = keep.rows(f.valid), keep.rows(f.mask) if f.mask is not None else None
            f.inputs = {index: keep.rows(hidden) for index, hidden in f.inputs.items()}


def _cache_of(kwargs: dict[str, Any]) -> Any:
    for name in _CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None
