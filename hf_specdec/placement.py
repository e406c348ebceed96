"""Where a model runs: the devices its layers compute on, what accelerate offloads, tensor parallelism.

A model loaded with accelerate's `device_map` may compute on several devices (layers on cuda:0 and cuda:1), stream
the weights of modules "offloaded" to the CPU or the disk into each forward through its hooks (their parameters sit
on the `meta` device, so `model.device` can say `meta`), or both. A model loaded with `tp_plan` computes on one
device per rank, with collectives inside its forward. `placement(model)` reads this once from what transformers and
accelerate record (`hf_device_map`, the modules' `_hf_hook`, `_device_mesh` / `_tp_size` through `compat`), and
`capture_blocker` says why a placement cannot have its step captured as one CUDA graph. The loop's bookkeeping lives
on the batch's device; `hf_specdec.devices` carries indices to the devices of the tensors they touch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_specdec import compat

#: `device_map` values that are storage, not compute: their modules run on the main device, weights streamed in.
OFFLOAD_TARGETS = ("cpu", "disk")


@dataclass(frozen=True)
class Placement:
    """Where one model computes."""

    devices: tuple[torch.device, ...]  # the devices its forward computes on, in the order of its device_map
    offloaded: tuple[str, ...]  # "cpu" / "disk": weights accelerate streams into each forward from there
    input_device: torch.device  # where its input embeddings run: token ids go there
    tensor_parallel: int = 1  # ranks its weights are split over (transformers' tp_plan)

    @property
    def spread(self) -> bool:
        """Its forward computes on more than one device (a pipeline over accelerate's device_map)."""
        return len(self.devices) > 1

    def describe(self) -> str:
        """`cuda:0, cuda:1` plus what is offloaded, for messages."""
        where = ", ".join(map(str, self.devices))
        return where + (f" (weights offloaded to {' and '.join(self.offloaded)})" if self.offloaded else "")


def _as_device(value: object) -> torch.device:
    """A device_map value (an int GPU index, "cuda:1", "cpu", a torch.device) as a torch.device."""
    if isinstance(value, int):  # an accelerator index, as accelerate writes it
        accelerators = getattr(torch, "accelerator", None)  # torch >= 2.6
        current = accelerators.current_accelerator() if accelerators is not None else None
        return torch.device(current.type if current is not None else "cuda", value)
    return torch.device(value)


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device accelerate's hook on `module` moves its inputs to (None: no such hook)."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", (hook,)):  # a SequentialHook holds several
        device = getattr(h, "execution_device", None)
        if device is not None:
            return _as_device(device)
    return None


def _first_real_device(module: torch.nn.Module) -> torch.device | None:
    """The device of the first parameter or buffer that is not on `meta` (offloaded weights are)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return None


def module_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: accelerate's hook's execution device, else its first non-meta tensor's device (a
    module of a spread model whose forward is called directly, as MTP layers and shared heads are)."""
    return _hook_device(module) or _first_real_device(module) or torch.device("cpu")


def dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate dispatched `model` with hooks: its `device_map` names several places, or the disk."""
    values = {str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()}
    return len(values) > 1 or "disk" in values


def input_device(model: torch.nn.Module) -> torch.device:
    """Where `model` embeds its input ids: `model.device` for a model on one device; for one dispatched by accelerate
    (spread or offloaded: `model.device` may say `meta`), its embedding's execution device (the hook's), else the
    embedding weight's device, else the model's first non-meta tensor's."""
    device = getattr(model, "device", None)
    if not dispatched(model) and isinstance(device, torch.device) and device.type != "meta":
        return device
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a drafter fed embeddings (DFlash), MTP layers
        embeddings = None
    if isinstance(embeddings, torch.nn.Module):
        names = {module: name for name, module in model.named_modules()}
        name = names.get(embeddings, "")
        for owner in [embeddings, *(model.get_submodule(p) for p in _prefixes(name))]:  # the module, then its parents
            device = _hook_device(owner)
            if device is not None:
                return device
        weight = getattr(embeddings, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
            return weight.device
    return _hook_device(model) or _first_real_device(model) or getattr(model, "device", torch.device("cpu"))


def check_has_data(model: torch.nn.Module, name: str, home: torch.device) -> None:
    """Raise a clear error when `model` computes on `meta` (built under `torch.device("meta")`, weights never
    loaded): its forward would return tensors with no data."""
    if input_device(model).type == "meta":
        raise ValueError(
            f"The {name} is on meta: its weights have no data (it was built on the meta device and never loaded), "
            f"while the target computes on {home}. Load its weights (from_pretrained, or load_state_dict(..., "
            f"assign=True)) and move it with .to('{home}')."
        )


def _prefixes(name: str) -> list[str]:
    """ "model.embed_tokens" -> ["model", ""]: the names of a module's parents, nearest first."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def placement(model: torch.nn.Module) -> Placement:
    """Where `model` computes (see the module docstring)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    values = list(dict.fromkeys(str(v) if not isinstance(v, int) else v for v in device_map.values()))
    compute = [_as_device(v) for v in values if v not in OFFLOAD_TARGETS]
    first = input_device(model)
    if compute:  # cpu / disk entries run on the main device (accelerate's dispatch_model)
        offloaded = tuple(v for v in OFFLOAD_TARGETS if v in values)
    else:  # only cpu and disk: the CPU computes, disk weights are streamed in
        compute = [torch.device("cpu")] if values else [first]
        offloaded = ("disk",) if "disk" in values else ()
    devices = tuple(dict.fromkeys([first, *compute]))  # the input device first
    return Placement(devices, offloaded, first, compat.tensor_parallel_size(model))


def capture_blocker(model: torch.nn.Module, draft: torch.nn.Module | None = None) -> str | None:
    """Why the target's (and the draft's) placement keeps a step from being captured as one CUDA graph, or None.

    torch's CUDA graphs record the work of one device's stream: a forward spread over several GPUs is a pipeline
    the graph of one device cannot replay, and accelerate's offload hooks copy weights from host memory or load
    them from the disk inside each forward (host work a replay skips). Tensor parallelism is capturable (its
    collectives are recorded with the kernels on each rank's one device)."""
    where = placement(model)
    if where.spread:
        return f"the target computes on several devices ({where.describe()}): a CUDA graph replays one device's work"
    if where.offloaded:
        return (
            f"accelerate streams the target's weights offloaded to {' and '.join(where.offloaded)} into each forward "
            "(hooks that a CUDA graph cannot replay)"
        )
    if draft is not None:
        draft_where = placement(draft)
        if draft_where.spread or draft_where.offloaded or draft_where.input_device != where.input_device:
            return (
                f"the draft model computes on {draft_where.describe()} and the target on {where.describe()}: a CUDA "
                "graph replays one device's work"
            )
    return None
