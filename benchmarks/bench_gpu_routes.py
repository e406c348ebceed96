"""Benchmark on one GPU: every drafting route, and the processors and criteria that used to leave the captured step,
against plain `generate` with the same arguments (issue 39's table: no route below 1.0x plain eager).

The models are `bench_gpu_default.py`'s: an 8B-shaped bf16 Llama target with a clear greedy rule, a 124M-shaped
synthetic draft right with probability alpha, and `synthetic_eagle3.SyntheticEagle3Head` (an 8B head's real layer,
`fc` and 32k `lm_head`, proposing what the synthetic draft proposes). Each group runs at one batch size on the same
prompts (128 tokens, ragged at B > 1, 64 new tokens, greedy):

- `alpha=0.8` and `alpha=0.0`: a draft model and the EAGLE-3 head with no flags (the captured default), the head
  uncaptured (`HF_SPECDEC_CAPTURE_STEPS=0`), the draft on the eager dynamic path (`cache_implementation="dynamic"`),
  and the draft with logits processors that used to keep a call off the captured step (`sequence_bias`,
  `exponential_decay_length_penalty`, `repetition_penalty`) and with host criteria (`max_time` and a criterion of the
  caller's own), each against plain eager (and compiled plain) `generate` given the same processors or criteria.
  Each alpha is its own draft object (a shallow copy sharing the weights), as a user's good and useless drafts are.
- `any`: methods whose acceptance the benchmark does not set: prompt lookup and suffix decoding on prompts that do
  not hold the answer (they find little), early exit (the target's first 4 layers and its head: the greedy rule
  lives in the embeddings, so they draft well) and a random DFlash drafter (2 layers, block 5: it drafts nothing
  right), each with no flags and uncaptured.
- `lengths` (not run by default): the draft model at alpha 0.8 with no flags, each round on its own prompt width
  (the `--prompt-len`, 3/4 and 1/2 of it) and answer length (likewise), as a user's calls come: kept graphs serve
  calls of other lengths, and compiled plain meets new shapes.

Every arm is called once in a warm-up round (its first call, reported), then `--rounds` rounds time every arm once in
turn (every arm of a round on the same prompts, its output compared with its baseline's of that round), with a fresh `SpecDecoder` per call and no library state reset. Reported per arm: the ratio to its baseline per
round (min and median), tokens/s, acceptance, drafting share and graph replays of its last call, and whether every
output equals its baseline's.

Run (GPU): `PYTHONPATH=. python benchmarks/bench_gpu_routes.py --batches 1 --out routes_b1.json` (and
`--batches 16`); `--dry-run` runs it tiny on the CPU (the no-flag arms on static caches, the CPU's route to the
captured step's code).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import transformers
from transformers import StoppingCriteria

import hf_specdec
from benchmarks import bench_gpu_e2e as e2e
from benchmarks.bench_gpu_default import setup
from hf_specdec.cache_route import CAPTURE_ENV

K = 4
EARLY_EXIT_LAYERS = 4


class NeverStops(StoppingCriteria):
    """A caller's own criterion: called after every token, as plain `generate` calls it, and never stops a row."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:  # noqa: ANN003
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def processor_kwargs(vocab: int) -> dict:
    """Processors that used to keep a call off the captured step. EOS (for the length penalty) and the biased
    sequences are single tokens of a 128k vocabulary that the decisive target's rule almost never writes, and the
    penalties are far below its logit margin, so the greedy output stays the rule's (and the drafts right)."""
    return dict(sequence_bias={(vocab - 1,): -2.0, (vocab - 2, vocab - 3): -1.0},
                exponential_decay_length_penalty=(8, 1.01), eos_token_id=2, repetition_penalty=1.05)  # fmt: skip


def criteria_kwargs() -> dict:
    return dict(max_time=600.0, stopping_criteria=transformers.StoppingCriteriaList([NeverStops()]))


def dflash_drafter(target):  # noqa: ANN001, ANN201
    """A random DFlash drafter (`MuseGlimmerAssistantModel`) for `target`: 2 layers of the target's width, block 5,
    reading 3 of its layers' states."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    text = target.config
    layers = text.num_hidden_layers
    config = MuseGlimmerAssistantConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=2, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=text.hidden_size // text.num_attention_heads,
        max_position_embeddings=text.max_position_embeddings, sliding_window=4096,
        layer_types=["sliding_attention", "full_attention"], block_size=K + 1, mask_token_id=3,
        target_layer_ids=sorted({1, layers // 2, layers - 2}),
    )  # fmt: skip
    torch.manual_seed(5)
    with torch.device(e2e.DEVICE):
        drafter = MuseGlimmerAssistantModel._from_config(config, attn_implementation="sdpa", dtype=target.dtype)
    return drafter.eval()


def arms_for(group: str, target, draft, head, drafter, shape: dict) -> dict[str, tuple]:  # noqa: ANN001
    """name -> (call, baseline name, spec holder); a baseline's own entry has baseline None. Every call reads the
    round's prompts and answer length from `shape` ("inputs", "n_new"), which `run_group` sets."""
    static = {"cache_implementation": "static"} if e2e.DEVICE == "cpu" else {}  # a dry run: the static path
    proc, crit = processor_kwargs(target.config.vocab_size), criteria_kwargs()

    def plain(**extra) -> Callable[[], torch.Tensor]:  # noqa: ANN003
        return lambda: target.generate(**shape["inputs"], max_new_tokens=shape["n_new"], do_sample=False, **extra)

    def ours(holder: dict, make_spec: Callable[[], hf_specdec.SpecDecoder], env: dict | None = None,
             **extra) -> Callable[[], torch.Tensor]:  # noqa: ANN003  # fmt: skip
        def call() -> torch.Tensor:
            spec = holder["spec"] = make_spec()
            os.environ.update(env or {})
            try:
                kwargs = {**static, **extra} if "cache_implementation" not in extra else extra
                return target.generate(**shape["inputs"], max_new_tokens=shape["n_new"], do_sample=False, **kwargs,
                                       custom_generate=hf_specdec.generate, spec_decoder=spec)  # fmt: skip
            finally:
                for key in env or {}:
                    os.environ.pop(key, None)

        return call

    uncaptured = {CAPTURE_ENV: "0"}
    arms: dict[str, tuple] = {"plain_eager": (plain(), None, None),
                              "plain_compiled": (plain(cache_implementation="static"), None, None)}  # fmt: skip

    def add(name: str, baseline: str, make_spec: Callable[[], hf_specdec.SpecDecoder], env: dict | None = None,
            **extra) -> None:  # noqa: ANN003  # fmt: skip
        holder: dict = {}
        arms[name] = (ours(holder, make_spec, env, **extra), baseline, holder)

    if group == "any":
        for method in ("ngram", "suffix"):
            add(method, "plain_eager", lambda m=method: hf_specdec.SpecDecoder(method=m, num_speculative_tokens=K))
        early = lambda: hf_specdec.SpecDecoder(early_exit_layers=EARLY_EXIT_LAYERS, num_speculative_tokens=K)  # noqa: E731
        add("early_exit", "plain_eager", early)
        add("early_exit_uncaptured", "plain_eager", early, uncaptured)
        dflash = lambda: hf_specdec.SpecDecoder(method="dflash", draft_model=drafter)  # noqa: E731
        add("dflash", "plain_eager", dflash)
        add("dflash_uncaptured", "plain_eager", dflash, uncaptured)
        return arms
    with_draft = lambda: hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=K)  # noqa: E731
    if group == "lengths":  # each round its own prompt width and answer length
        add("draft", "plain_eager", with_draft)
        return arms
    with_head = lambda: hf_specdec.SpecDecoder(draft_head=head, num_speculative_tokens=K)  # noqa: E731
    add("draft", "plain_eager", with_draft)
    add("draft_dynamic", "plain_eager", with_draft, cache_implementation="dynamic")
    add("eagle3", "plain_eager", with_head)
    add("eagle3_uncaptured", "plain_eager", with_head, uncaptured)
    arms["plain_eager_processors"] = (plain(**proc), None, None)
    add("draft_processors", "plain_eager_processors", with_draft, **proc)
    arms["plain_eager_criteria"] = (plain(**crit), None, None)
    add("draft_criteria", "plain_eager_criteria", with_draft, **crit)
    return arms


def with_alpha(model, alpha: float):  # noqa: ANN001, ANN201
    """A new model object sharing `model`'s weights, right with probability alpha (a user's second draft)."""
    clone = copy.copy(model)
    clone.alpha = alpha
    return clone


def run_group(name: str, arms: dict[str, tuple], shape: dict, shapes: list[tuple[dict, int]], rounds: int) -> dict:
    """A warm-up round (first calls), then `rounds` interleaved rounds of every arm; round r (the warm-up is round 0)
    runs every arm on `shapes[r % len(shapes)]` (prompts, answer length), set into `shape`."""
    seconds: dict[str, list[float]] = {key: [] for key in arms}
    tokens: list[int] = []
    first: dict[str, float] = {}
    identical = {key: True for key, (_, base, _) in arms.items() if base is not None}
    with torch.no_grad():
        for index in range(rounds + 1):
            shape["inputs"], shape["n_new"] = shapes[index % len(shapes)]
            outputs = {}
            for key, (fn, base, _) in arms.items():
                e2e.sync()
                start = time.perf_counter()
                outputs[key] = fn()
                e2e.sync()
                if index == 0:
                    first[key] = time.perf_counter() - start
                else:
                    seconds[key].append(time.perf_counter() - start)
                if base is not None:
                    identical[key] = identical[key] and torch.equal(outputs[key], outputs[base])
            if index == 0:
                arms["plain_compiled"][0]()  # its second call compiles again
            else:
                tokens.append(shape["inputs"]["input_ids"].shape[0] * shape["n_new"])
    rows = {}
    for key, (_, base, holder) in arms.items():
        row: dict = dict(tps_median=statistics.median(n / s for n, s in zip(tokens, seconds[key])),
                         first_call_s=first[key])  # fmt: skip
        if base is not None:
            for against in {base, "plain_compiled"}:
                per_round = [b / o for b, o in zip(seconds[against], seconds[key])]
                row[f"vs_{against}"] = dict(min=min(per_round), median=statistics.median(per_round),
                                            rounds=per_round)  # fmt: skip
            s = holder["spec"].last_stats
            row.update(identical=identical[key], acceptance=s.acceptance_rate,
                       drafting_share=s.num_drafting_row_steps / max(1, s.num_row_steps), steps=s.num_steps,
                       replays=s.num_graph_replays)  # fmt: skip
        rows[key] = row
    brief = {key: (round(r[f"vs_{arms[key][1]}"]["min"], 2), round(r[f"vs_{arms[key][1]}"]["median"], 2),
                   round(r["acceptance"], 2), r["replays"], r["identical"])
             for key, r in rows.items() if arms[key][1] is not None}  # fmt: skip
    print(json.dumps({"group": name, "vs_baseline(min, median, acceptance, replays, identical)": brief}), flush=True)
    return dict(group=name, batch=shape["inputs"]["input_ids"].shape[0], rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--groups", nargs="+", default=["0.8", "0.0", "any"], help="alphas, 'any' and 'lengths'")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", "--tiny", action="store_true", dest="tiny", help="tiny shapes on the CPU")
    args = parser.parse_args()
    if args.tiny:
        e2e.use_tiny_shapes()
    global EARLY_EXIT_LAYERS
    EARLY_EXIT_LAYERS = min(EARLY_EXIT_LAYERS, e2e.TARGET_SHAPE["num_hidden_layers"] - 1)
    results: dict = {"meta": dict(gpu=e2e.device_name(), torch=torch.__version__,
                                  transformers=transformers.__version__, python=platform.python_version(),
                                  new_tokens=args.new_tokens, prompt_len=args.prompt_len, rounds=args.rounds,
                                  command=" ".join(sys.argv)), "groups": []}  # fmt: skip
    target, draft, all_inputs, head = setup(args.batches, args.new_tokens, args.prompt_len, head=True)
    drafter = dflash_drafter(target) if "any" in args.groups else None
    n_new, width = args.new_tokens, args.prompt_len
    varied = {}  # batch -> [(prompts, answer length)]: three widths and answer lengths, one per round in turn
    if "lengths" in args.groups:
        varied = {b: [(e2e.prompts(b, width * f // 4, ragged=b > 1), n_new * f // 4) for f in (4, 3, 2)]
                  for b in args.batches}  # fmt: skip
        # the draft learns every prompt's continuation (the EAGLE-3 head keeps its own table: no head in that group)
        e2e.teach_synthetic_draft(target, draft, [*all_inputs.values(), *(i for v in varied.values() for i, _ in v)],
                                  n_new)  # fmt: skip
    for batch in args.batches:
        for group in args.groups:
            alpha = 0.8 if group == "lengths" else None if group == "any" else float(group)
            shape: dict = {}
            arms = arms_for(group, target, with_alpha(draft, alpha or 0.0), with_alpha(head, alpha or 0.0), drafter,
                            shape)  # fmt: skip
            shapes = varied[batch] if group == "lengths" else [(all_inputs[batch], n_new)]
            results["groups"].append(run_group(f"B={batch} alpha={group}", arms, shape, shapes, args.rounds))
            if args.out:  # after each group, so a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
