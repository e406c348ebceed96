"""Benchmark: suffix decoding on one GPU (issue 42), an 8B-shaped target on a stream of new, repeated and edited
requests, against compiled plain and plain eager `generate` in the same process.

The target is `grid_models`' 8B-shaped Llama (random bf16 weights made decisive: its greedy next token is
`rule[current token]`, every layer still runs). The stream has `--bases` random prompts of `--prompt` tokens; each
is asked new, then asked again word for word (a retried tool call), then edited (a span in the middle of the prompt
replaced: an agent that changes its context and asks again), interleaved so that other requests come between a
request and its repeats. With this target an edit that keeps the prompt's last token gets the same answer, as an
unchanged task in an edited context would.

Per round, in one process: compiled plain (`cache_implementation="static"`) runs the stream, then hf_specdec with
`SpecDecoder(method="suffix")` and no other flag runs it with a fresh `SpecDecoder` (its global tree starts empty:
every round's new requests are new to it). Library state is never reset. The ratio of a round is compiled plain's
total seconds over hf_specdec's; the summary gives min and median over rounds, and the same over the repeated and
edited requests alone. Plain eager is timed once per distinct prompt (its output is the reference every greedy
output is checked against).

Run (one H100, about 3 minutes): `PYTHONPATH=. python benchmarks/bench_suffix_gpu.py --out suffix_gpu.json`;
`--dry-run` runs it on the CPU with tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from typing import Any

import torch
import transformers

import hf_specdec
from benchmarks import grid_models as gm


def stream(bases: int, prompt: int, vocab: int) -> list[tuple[str, int, torch.Tensor]]:
    """(kind, base, input ids [1, prompt]) in the order asked: new requests, their repeats and their edits."""
    g = torch.Generator().manual_seed(0)
    originals = [torch.randint(3, vocab, (1, prompt), generator=g) for _ in range(bases)]
    edited = []
    for ids in originals:
        ids = ids.clone()
        start = prompt // 3
        ids[:, start : start + prompt // 8] = torch.randint(3, vocab, (1, prompt // 8), generator=g)
        edited.append(ids)
    order: list[tuple[str, int, torch.Tensor]] = []
    for b in range(bases):  # base b is new; base b - 1 is repeated; base b - 2 is edited
        order.append(("new", b, originals[b]))
        if b >= 1:
            order.append(("repeat", b - 1, originals[b - 1]))
        if b >= 2:
            order.append(("edit", b - 2, edited[b - 2]))
    order += [("repeat", bases - 1, originals[bases - 1]), ("edit", bases - 2, edited[bases - 2]),
              ("edit", bases - 1, edited[bases - 1])]  # fmt: skip
    return [(kind, b, ids.to(gm.Setup.device)) for kind, b, ids in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bases", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--answer", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.dry_run:
        gm.Setup.use_tiny()
        args.prompt, args.answer = 24, 16
    torch.set_grad_enabled(False)
    layout, shape = gm.TARGETS["llama-8b"]
    target = gm.build(layout, shape, seed=0)
    gm.make_decisive(target)
    requests = stream(args.bases, args.prompt, gm.vocab_size(layout))
    gen = dict(max_new_tokens=args.answer, do_sample=False)

    def run(ids: torch.Tensor, how: str, spec: hf_specdec.SpecDecoder | None = None) -> torch.Tensor:
        mask = torch.ones_like(ids)
        if how == "eager":
            return target.generate(input_ids=ids, attention_mask=mask, **gen)
        if how == "compiled":
            return target.generate(input_ids=ids, attention_mask=mask, **gen, cache_implementation="static")
        return target.generate(input_ids=ids, attention_mask=mask, **gen, custom_generate=hf_specdec.generate,
                               spec_decoder=spec)  # fmt: skip

    reference: dict[bytes, torch.Tensor] = {}
    eager_s: dict[bytes, float] = {}
    for _, _, ids in requests:
        key = ids.cpu().numpy().tobytes()
        if key not in reference:
            eager_s[key], reference[key] = gm.timed(lambda ids=ids: run(ids, "eager"))
    first = {"compiled": [gm.timed(lambda: run(requests[0][2], "compiled"))[0] for _ in range(2)]}  # it compiles twice
    warm = hf_specdec.SpecDecoder(method="suffix")  # a warm-up stream: first captures and calibration, untimed
    first["suffix"] = [gm.timed(lambda ids=ids: run(ids, "suffix", warm))[0] for _, _, ids in requests]
    rounds: list[dict[str, Any]] = []
    identical = True
    for _ in range(args.rounds):
        seconds: dict[str, list[float]] = {"compiled": [], "suffix": []}
        spec = hf_specdec.SpecDecoder(method="suffix")  # fresh: its global tree starts empty
        stats = []
        for _, _, ids in requests:
            seconds["compiled"].append(gm.timed(lambda ids=ids: run(ids, "compiled"))[0])
        for _, _, ids in requests:
            s, out = gm.timed(lambda ids=ids: run(ids, "suffix", spec))
            seconds["suffix"].append(s)
            identical &= bool(torch.equal(out, reference[ids.cpu().numpy().tobytes()]))
            last = spec.last_stats
            stats.append(dict(mean_accepted_length=round(last.mean_accepted_length, 2),
                              acceptance=round(last.acceptance_rate, 3), replays=last.num_graph_replays))  # fmt: skip
        again = [i for i, (kind, _, _) in enumerate(requests) if kind != "new"]
        rounds.append(dict(
            seconds=seconds, stats=stats,
            vs_compiled=sum(seconds["compiled"]) / sum(seconds["suffix"]),
            vs_compiled_again=sum(seconds["compiled"][i] for i in again) / sum(seconds["suffix"][i] for i in again),
            vs_compiled_new=sum(s for i, s in enumerate(seconds["compiled"]) if i not in again)
            / sum(s for i, s in enumerate(seconds["suffix"]) if i not in again),
        ))  # fmt: skip
        print(json.dumps({k: round(v, 3) for k, v in rounds[-1].items() if k.startswith("vs")}), flush=True)
    eager_total = sum(eager_s[ids.cpu().numpy().tobytes()] for _, _, ids in requests)  # each prompt's one eager call
    summary = {
        name: dict(min=min(r[name] for r in rounds), median=statistics.median(r[name] for r in rounds))
        for name in ("vs_compiled", "vs_compiled_again", "vs_compiled_new")
    }
    summary["vs_eager_median"] = eager_total / statistics.median(sum(r["seconds"]["suffix"]) for r in rounds)
    summary["identical"] = identical
    print(json.dumps(summary), flush=True)
    result = dict(
        meta=dict(
            gpu=torch.cuda.get_device_name() if gm.Setup.device == "cuda" else platform.processor() or "cpu",
            torch=torch.__version__,
            transformers=transformers.__version__,
            command=" ".join(sys.argv),
            args=vars(args),
        ),  # fmt: skip
        kinds=[kind for kind, _, _ in requests],
        first_calls=first,
        rounds=rounds,
        summary=summary,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
