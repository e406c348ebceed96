"""A small CUDA check of EAGLE-3 heads on the captured default path, greedy and sampled (run with
CUDA_LAUNCH_BLOCKING=1 to locate a device fault): `PYTHONPATH=.:tests python benchmarks/repro_eagle3_cuda.py`."""

from __future__ import annotations

import torch
from conftest import make_model, make_prompts
from core.test_static_cache import random_eagle3_head

import hf_specdec

target = make_model("llama", seed=0).cuda()
head = random_eagle3_head(target.cpu(), [1, 1, 2]).cuda()
target = target.cuda()
inputs = {k: v.cuda() for k, v in make_prompts(3, seed=2).items()}
for sample in (False, True):
    for _ in range(2):
        spec = hf_specdec.SpecDecoder(draft_head=head, num_speculative_tokens=3, seed=1)
        out = target.generate(**inputs, max_new_tokens=24, do_sample=sample, custom_generate=hf_specdec.generate,
                              spec_decoder=spec)  # fmt: skip
        torch.cuda.synchronize()
        plain = target.generate(**inputs, max_new_tokens=24, do_sample=False)
        s = spec.last_stats
        print(
            f"sample={sample} replays={s.num_graph_replays} reuse={s.graph_reuse} drafted={s.num_draft_tokens}",
            "identical" if (sample or torch.equal(out, plain)) else "DIFFERENT",
            flush=True,
        )
