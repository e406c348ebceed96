"""Which host reads of a speculative step would wait for the accelerator, counted on the CPU.

On the CPU every tensor is a host tensor, so counting `.item()` / `.tolist()` calls mixes real device-to-host
syncs with reads of host state. `DeviceReads` (a `TorchFunctionMode`) tags the tensors a GPU run would hold on the
device: the model's parameters, the caller's inputs, whatever a factory makes with `device=<torch.device>` (the
batch's device: the loop's own tensors), and everything computed from a tagged tensor. Host tensors are those made
without a device (`torch.zeros(n)`), moved with `.cpu()` / `.to("cpu")`, or from numpy. It then counts, per call
site in `hf_specdec`:

- **reads**: a tagged tensor read on the host (`item`, `tolist`, `bool`, `int`, `float`, `numpy`, `cpu`,
  `.to("cpu")`) or an op whose output size depends on its data (`nonzero`, `unique`, boolean indexing, ...): each
  is a device-to-host sync on CUDA;
- **copies**: a host tensor copied to the device (`.to(device)`, `torch.tensor(.., device=)`, `copy_` into a
  device tensor, indexing a device tensor with a host index): with `non_blocking=False` PyTorch waits for the
  stream after each one (`memcpy_and_sync`), so one issued while device work is queued is a sync too.

    PYTHONPATH=.:tests python tests/device_reads.py draft ngram useless   # per-step counts by site
"""

from __future__ import annotations

import collections
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.unique, torch.unique, torch.masked_select, torch.Tensor.masked_select, torch.equal,
    torch.Tensor.equal, torch.Tensor.repeat_interleave, torch.repeat_interleave, torch.bincount,
}  # fmt: skip
_HOST_RESULTS = {
    torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
}  # fmt: skip
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_select, torch.index_select}


def _site() -> str:
    """The innermost hf_specdec frame outside this file: where the read is written."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/hf_specdec/" in name and not name.endswith("device_reads.py"):
            return f"{name.split('/hf_specdec/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<outside hf_specdec>"


def _to_host(args: tuple, kwargs: dict) -> bool | None:
    """For `Tensor.to`: True when it moves to the host ("cpu" as a string), False for a device object, None else."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, str):
            return value.startswith("cpu")
        if isinstance(value, torch.device):
            return False
    return None


class DeviceReads(TorchFunctionMode):
    """Counts host reads of (would-be) device tensors and host-to-device copies, by site, while `counting`."""

    def __init__(self, tagged: list[torch.Tensor]) -> None:
        super().__init__()
        self.device: dict[int, weakref.ref] = {}  # id -> the tagged tensor (ids are reused once it is freed)
        for t in tagged:
            self.tag(t)
        self.counting = False
        self.per_step: list[list[str]] = []  # the reads of each counted step, by site
        self.reads: collections.Counter[str] = collections.Counter()
        self.copies: collections.Counter[str] = collections.Counter()

    def tag(self, tensor: torch.Tensor) -> None:
        self.device[id(tensor)] = weakref.ref(tensor)

    def is_device(self, value: object) -> bool:
        if isinstance(value, torch.nn.Parameter):
            return True
        ref = self.device.get(id(value)) if isinstance(value, torch.Tensor) else None
        return ref is not None and ref() is value

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(self.is_device(t) for t in inputs)
        to_host = _to_host(args, kwargs) if func is torch.Tensor.to else None
        if self.counting:
            if on_device and (func in _READS or to_host or _bool_index(func, args)):
                site = f"{_site()} {getattr(func, '__name__', func)}"
                self.reads[site] += 1
                self.per_step[-1].append(site)
            elif self._copies_in(func, args, kwargs, inputs, on_device, to_host):
                self.copies[f"{_site()} {getattr(func, '__name__', func)}"] += 1
        out = func(*args, **kwargs)
        if (to_host is not None or func is torch.Tensor.cpu) and out is args[0]:
            out = out.clone()  # a move on a GPU makes a new tensor: the host copy is not the device tensor
        device_out = (on_device and func not in _HOST_RESULTS and not to_host) or to_host is False
        device_out |= isinstance(kwargs.get("device"), torch.device)
        if func is torch.Tensor.copy_ and self.is_device(args[0]):
            device_out = True
        if device_out:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.tag(t)
        return out

    def _copies_in(self, func, args, kwargs, inputs, on_device, to_host) -> bool:  # noqa: ANN001
        host = [t for t in inputs if not self.is_device(t) and t.numel() > 0]
        if func is torch.Tensor.to:
            return to_host is False and not on_device
        if func in (torch.tensor, torch.as_tensor):
            return isinstance(kwargs.get("device"), torch.device)
        if func is torch.Tensor.copy_:
            return self.is_device(args[0]) and not self.is_device(args[1])
        if func in _INDEXING and on_device:
            return any(not self.is_device(t) and t.dim() > 0 for t in tree_flatten(args[1:])[0]
                       if isinstance(t, torch.Tensor)) or _has_list_index(args)  # fmt: skip
        return on_device and any(t.dim() > 0 for t in host)  # a mixed op: an implicit copy (or an error) on CUDA


def _bool_index(func, args: tuple) -> bool:  # noqa: ANN001
    """Boolean-mask indexing: its output size is the mask's count (a read on CUDA)."""
    if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _has_list_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in index)


@contextmanager
def count_step_reads(models: list[torch.nn.Module], inputs: dict) -> Iterator[tuple[DeviceReads, list[int]]]:
    """Count device reads and copies inside `SpeculativeLoop.step` after step 0; yields (counter, [steps])."""
    from hf_specdec.decoding import SpeculativeLoop

    tagged = [b for m in models for b in m.buffers()] + [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    counter = DeviceReads(tagged)
    steps = [0]
    original = SpeculativeLoop.step

    def step(self) -> None:  # noqa: ANN001
        counter.counting = self.prefilled  # step 0 (the prefill) reads what a call reads once
        steps[0] += self.prefilled
        if self.prefilled:
            counter.per_step.append([])
        try:
            original(self)
        finally:
            counter.counting = False

    SpeculativeLoop.step = step
    try:
        with counter:
            yield counter, steps
    finally:
        SpeculativeLoop.step = original


def spec_models(spec: object) -> list[torch.nn.Module]:
    return [m for m in vars(spec).values() if isinstance(m, torch.nn.Module)]


def main() -> None:
    sys.path.insert(0, "tests")
    from conftest import make_model, make_noisy_copy, make_prompts, spec_generate

    import hf_specdec

    torch.set_num_threads(1)
    target = make_model("llama", seed=0)
    settings = {
        "draft": dict(draft_model=make_noisy_copy(target, noise=0.01)),
        "useless": dict(draft_model=make_model("llama", seed=5)),
        "ngram": dict(method="ngram"),
        "draft-constant": dict(draft_model=make_noisy_copy(target, noise=0.01), num_speculative_tokens_schedule="constant"),
        "ngram-constant": dict(method="ngram", num_speculative_tokens_schedule="constant"),
    }  # fmt: skip
    for name in sys.argv[1:] or list(settings):
        spec = hf_specdec.SpecDecoder(**settings[name])
        inputs = make_prompts(4, seed=3, min_len=4, max_len=16)
        for _ in range(2):  # calibration and warm-up calls
            spec_generate(target, inputs, spec, max_new_tokens=40, do_sample=False, eos_token_id=None)
        with count_step_reads([target, *spec_models(spec)], inputs) as (counter, steps):
            spec_generate(target, inputs, spec, max_new_tokens=40, do_sample=False, eos_token_id=None)
        n = max(steps[0], 1)
        print(f"{name}: {steps[0]} steps, {sum(counter.reads.values()) / n:.2f} device reads/step, "
              f"{sum(counter.copies.values()) / n:.2f} host-to-device copies/step")  # fmt: skip
        for kind, counts in (("read", counter.reads), ("copy", counter.copies)):
            for site, count in counts.most_common():
                print(f"   {kind} {count / n:5.2f}/step  {site}")


if __name__ == "__main__":
    main()
