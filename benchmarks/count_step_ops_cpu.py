"""Operations per step outside the models, on the eager dynamic path (the host's work that a GPU step waits for).

An eager step of a large target on a GPU is bound by the host: each device operation costs a few microseconds to
launch, whatever its size. This counts the aten operations of one `generate` call (after a warm-up call) with a
dispatch mode, split into those inside the target's and the draft's forwards and those outside (the loop's own
work), per verify step, and lists the outside ones by function. The draft is the target itself (every draft
accepted), k constant.

    PYTHONPATH=. python benchmarks/count_step_ops_cpu.py --batch 1 4
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_specdec
from benchmarks.bench_dynamic_overhead_cpu import prompts, small_llama


class Counter(TorchDispatchMode):
    """Counts aten operations inside and outside the hooked models' forwards, and the outside ones by function."""

    def __init__(self, models: list[torch.nn.Module]) -> None:
        super().__init__()
        self.depth = 0
        self.inside = 0
        self.outside: collections.Counter = collections.Counter()
        self.hooks = [model.register_forward_pre_hook(lambda *args: self._enter()) for model in models]
        self.hooks += [model.register_forward_hook(lambda *args: self._leave()) for model in models]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _enter(self) -> None:
        self.depth += 1

    def _leave(self) -> None:
        self.depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
        if self.depth:
            self.inside += 1
        else:
            frames = [f for f in traceback.extract_stack() if "/hf_specdec/" in f.filename]
            where = f"{frames[-1].filename.split('/hf_specdec/')[-1]}:{frames[-1].name}" if frames else "(transformers)"
            self.outside[where] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = small_llama(0), small_llama(0)
    for batch in args.batch:
        inputs = prompts(batch)
        spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=args.k,
                                      num_speculative_tokens_schedule="constant")  # fmt: skip
        settings = dict(max_new_tokens=args.new_tokens, do_sample=False, cache_implementation="dynamic")
        with torch.inference_mode():
            target.generate(**inputs, **settings, custom_generate=hf_specdec.generate, spec_decoder=spec)
            with Counter([target, draft]) as counter:
                target.generate(**inputs, **settings, custom_generate=hf_specdec.generate, spec_decoder=spec)
            counter.remove()
        steps = spec.last_stats.num_steps
        total = sum(counter.outside.values())
        print(f"B = {batch}: {steps} steps; per step {total / steps:.0f} operations outside the models, "
              f"{counter.inside / steps:.0f} inside")  # fmt: skip
        for where, count in counter.outside.most_common(8):
            print(f"  {count / steps:7.1f}  {where}")


if __name__ == "__main__":
    main()
