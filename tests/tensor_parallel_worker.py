"""One rank of `tests/core/test_tensor_parallel.py`: a tiny Llama loaded with transformers' `tp_plan="auto"`.

Run by `torchrun --standalone --nproc_per_node 2 tests/tensor_parallel_worker.py MODEL_DIR OUT_DIR` (gloo on the
CPU, NCCL on GPUs, where the calls take the captured default path). Each rank writes `OUT_DIR/rank<r>.json`: its tokens and the checks it made; the test compares
them with plain generate and across ranks. The draft model runs whole on every rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # conftest's model factories

from conftest import EOS_ID, PAD_ID, make_noisy_copy, make_prompts  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec.adaptive import _MEMORY, ModelMemory, StepCosts, model_serial  # noqa: E402

MAX_NEW = 16
K = 3


def load(model_dir: str, tensor_parallel: bool) -> torch.nn.Module:
    kwargs: dict = {"attn_implementation": "sdpa"}
    if tensor_parallel:
        try:  # a DistributedConfig (5.17 and 5.24; the tp_plan argument is deprecated), tp_plan= where it is missing
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
        except ImportError:
            kwargs["tp_plan"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model


def disagreeing_costs(target: torch.nn.Module, draft: torch.nn.Module, batch_size: int, rank: int) -> None:
    """What this rank 'learned' earlier about step costs, different on each rank: rank 0 found drafting cheap, the
    others found it ruinous. Both are settled (no calibration forward runs, so every rank runs the same forwards
    until the schedule decides); left alone, the ranks would then choose differently."""
    widths = range(1, K + 2)
    forward = {w: 0.01 * (1 + 0.01 * w) if rank == 0 else 0.01 * (1 + 100 * (w - 1)) for w in widths}
    costs = StepCosts(forward=forward, calibrated=True, timed={w: 3 for w in widths}, passes=3, draft_measured=True)
    memory = _MEMORY.setdefault(target, ModelMemory())
    memory.costs[(f"draft:{model_serial(draft)}", batch_size)] = costs


def main(model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    target = load(model_dir, tensor_parallel=True)  # initialises the process group
    rank = dist.get_rank()
    reference = load(model_dir, tensor_parallel=False).to(target.device)
    draft = make_noisy_copy(reference, noise=0.05).to(target.device)
    inputs = {name: t.to(target.device) for name, t in make_prompts(3, seed=1).items()}
    greedy = dict(max_new_tokens=MAX_NEW, do_sample=False)
    plain = target.generate(**inputs, **greedy)
    result: dict = {"plain_equals_unsharded": torch.equal(plain, reference.generate(**inputs, **greedy))}

    def speculative(spec: hf_specdec.SpecDecoder, **kwargs) -> torch.Tensor:
        return target.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **kwargs)

    for name, spec in {
        "draft": hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=K,
                                        num_speculative_tokens_schedule="constant"),
        "ngram": hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=K, prompt_lookup_max=2,
                                        num_speculative_tokens_schedule="constant"),
    }.items():  # fmt: skip
        result[f"{name}_equals_plain"] = torch.equal(speculative(spec, **greedy), plain)

    # The adaptive schedule with per-rank costs that disagree: every rank must take rank 0's choices (it drafts).
    disagreeing_costs(target, draft, inputs["input_ids"].shape[0], rank)
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=K, num_speculative_tokens_schedule="adaptive"
    )
    result["adaptive_equals_plain"] = torch.equal(speculative(spec, **greedy), plain)
    result["adaptive_drafted"] = int(spec.last_stats.num_draft_tokens)
    result["graph_replays"] = int(spec.last_stats.num_graph_replays)  # on GPUs: the captured default path

    # Sampling with seed=None: each rank seeds torch differently; the rows' seeds are rank 0's on every rank.
    torch.manual_seed(1000 + rank)
    spec = hf_specdec.SpecDecoder(
        draft_model=draft, num_speculative_tokens=K, num_speculative_tokens_schedule="constant"
    )
    result["sampled"] = speculative(spec, max_new_tokens=MAX_NEW, do_sample=True).tolist()
    result["plain"] = plain.tolist()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
