"""The ``hf-specdec`` console script: ``demo``, ``generate`` and ``bench`` sub-commands.

Only argument parsing and printing live here; the work is done by `hf_specdec.tools.demo`, `hf_specdec.tools.benchmarking`,
`hf_specdec.tools.model_loading` and `hf_specdec.tools.prompts`. Bad arguments end with exit code 2 and a message that says
what to pass instead. Run ``hf-specdec COMMAND --help`` for each command's options.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["build_parser", "main"]

MAX_K = 32


def _bounded_int(lo: int, hi: int | None, what: str):  # noqa: ANN202
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"{what} must be in {bound}, got {value}")
        return value

    return parse


def _positive_float(what: str):  # noqa: ANN202
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(
                f"{what} must be > 0, got {value} (for greedy decoding leave out --do-sample)"
            )
        return value

    return parse


def _add_common(p: argparse.ArgumentParser, default_new_tokens: int, default_k: int = 5) -> None:
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=_bounded_int(1, MAX_K, "-k"), default=default_k,
                   help=f"draft tokens per speculative step (the most, with the adaptive schedule), 1..{MAX_K} "
                        f"(default: {default_k})")  # fmt: skip
    p.add_argument("--max-new-tokens", type=_bounded_int(1, None, "--max-new-tokens"), default=default_new_tokens,
                   help=f"tokens to generate per prompt (default: {default_new_tokens})")  # fmt: skip


def _add_model_args(p: argparse.ArgumentParser, model_required: bool) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--model", default=None if model_required else "smollm2", metavar="ID_OR_PATH",
                   help="target model: 'smollm2' (offline SmolLM2-135M-Instruct), 'tiny' (tiny random Llama), "
                        "a local directory or a hub id" + ("" if model_required else " (default: smollm2)"))  # fmt: skip
    g.add_argument("--gguf-file", default=None, metavar="F", help="a GGUF file inside --model's directory to load")
    g.add_argument("--draft", default=None, metavar="ID_OR_PATH",
                   help="draft model sharing the target's tokenizer ('tiny' with --model tiny); implies method draft")  # fmt: skip
    g.add_argument("--tiny", action="store_true",
                   help="use tiny random Llama models built from a config (target + smaller draft), no checkpoint")  # fmt: skip
    g.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"], help="(default: auto)")
    g.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "float16", "auto"],
                   help="(default: auto = bfloat16 on cuda, float32 on cpu)")  # fmt: skip


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=_positive_float("--temperature"), default=None, metavar="T")
    g.add_argument("--top-p", type=_positive_float("--top-p"), default=None, metavar="P")
    g.add_argument("--seed", type=_bounded_int(0, None, "--seed"), default=None, metavar="S",
                   help="seed of the sampling draws (row i of a batch uses S + i)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Build the ``hf-specdec`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="hf-specdec",
        description="Exact, batched speculative decoding inside transformers' model.generate.",
        epilog="Run 'hf-specdec COMMAND --help' for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="plain vs speculative (prompt lookup) decoding on SmolLM2, offline",
                          description="Run five built-in prompts (four whose answers copy from the prompt, one chat "
                                      "answer that copies nothing) on SmolLM2-135M-Instruct with plain greedy decoding "
                                      "and with hf_specdec's n-gram speculation, each timed as the median of "
                                      "interleaved runs after a warm-up; stream the speculative text and print a "
                                      "comparison table with an overall row and a verdict.")  # fmt: skip
    demo.set_defaults(subparser=demo)
    _add_common(demo, default_new_tokens=96, default_k=8)  # long copies pay on this CPU: see docs/benchmarks.md
    demo.add_argument("--no-stream", action="store_true", help="print each answer at the end instead of streaming")
    demo.add_argument("--schedule", default="adaptive", choices=["adaptive", "constant", "heuristic"],
                      help="how many drafts per step: adaptive (default: only where drafts pay), constant (always k) "
                           "or heuristic (HF's +2 / -1 rule)")  # fmt: skip
    demo.add_argument("--repeats", type=_bounded_int(1, None, "--repeats"), default=3, metavar="N",
                      help="timed runs per method and prompt, interleaved; the median counts (default: 3)")  # fmt: skip
    demo.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default: cpu)")
    demo.add_argument("--threads", type=_bounded_int(1, None, "--threads"), default=None, metavar="N",
                      help="torch threads (default: at most the free cores; OMP_NUM_THREADS is respected)")  # fmt: skip
    demo.add_argument("--json", default=None, metavar="FILE.json", help="also write the results as JSON")

    gen = sub.add_parser("generate", help="generate text with speculative decoding",
                         description="Generate completions with hf_specdec (chat template applied when the tokenizer "
                                     "has one) and print them with the decoding statistics.")  # fmt: skip
    gen.set_defaults(subparser=gen)
    _add_model_args(gen, model_required=True)
    gen.add_argument("--method", default=None, choices=["ngram", "draft", "mtp", "suffix", "plain"],
                     help="speculation method (default: draft with --draft, else ngram; plain = no speculation)")  # fmt: skip
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one prompt")
    src.add_argument("--prompts", metavar="FILE.jsonl", help="JSONL with a 'prompt' field or Spec-Bench 'turns'")
    gen.add_argument("--batch-size", type=_bounded_int(1, None, "--batch-size"), default=1, metavar="N")
    gen.add_argument("--out", metavar="FILE.jsonl", help="also write the completions as JSON Lines")
    _add_common(gen, default_new_tokens=128)
    _add_sampling(gen)

    serve = sub.add_parser("serve", help="OpenAI-compatible server (transformers serve) with speculative CB",
                           description="Serve MODEL with transformers' OpenAI-compatible app and continuous batching, "
                                       "every request decoded with speculation (prompt lookup, the target's MTP layers, or --draft).")  # fmt: skip
    serve.set_defaults(subparser=serve)
    serve.add_argument("model", metavar="MODEL", help="model id or local path (the target)")
    serve.add_argument("--draft", default=None, metavar="ID", help="a draft model sharing the target's tokenizer")
    serve.add_argument("--method", default=None, choices=["ngram", "draft", "mtp"],
                       help="default: draft with --draft, else ngram (prompt lookup); mtp: the target's MTP layers")  # fmt: skip
    serve.add_argument("--k", type=_bounded_int(1, 32, "--k"), default=4, help="most drafts per step (default: 4)")
    serve.add_argument("--schedule", default="adaptive", choices=["adaptive", "constant", "heuristic"],
                       help="per-request draft length: adaptive (from each request's acceptance, default), heuristic (HF's +2/-1) or constant")  # fmt: skip
    serve.add_argument("--host", default="localhost")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--cb-page-size", type=int, default=None)
    serve.add_argument("--cb-num-blocks", type=int, default=None)
    serve.add_argument("--cb-max-batch-tokens", type=int, default=None)

    bench = sub.add_parser("bench", help="benchmark methods over a prompt file, Spec-Bench style",
                           description="Run each method over the prompts (tqdm progress), print per-category speedup "
                                       "over plain and mean accepted tokens, write JSON and optionally a bar chart.")  # fmt: skip
    bench.set_defaults(subparser=bench)
    bench.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                       help="JSONL prompts, e.g. Spec-Bench's question file ({'category', 'turns'})")  # fmt: skip
    bench.add_argument("--categories", default=None, metavar="a,b", help="only these categories")
    bench.add_argument("--limit", type=_bounded_int(1, None, "--limit"), default=None, metavar="N",
                       help="at most N prompts per category")  # fmt: skip
    bench.add_argument("--methods", default="plain,ngram", metavar="M,...",
                       help="comma list of plain, ngram, draft, mtp, suffix, hf-ngram, hf-draft, hf-stock (transformers' own "
                            "prompt lookup, plus assisted decoding when a draft is given); default: plain,ngram")  # fmt: skip
    bench.add_argument("--batch-size", type=_bounded_int(1, None, "--batch-size"), default=1, metavar="N",
                       help="rows per generate call (hf-* methods always run one row at a time)")  # fmt: skip
    bench.add_argument("--out", required=True, metavar="results.json", help="where to write the JSON results")
    bench.add_argument("--plot", default=None, metavar="speedup.png", help="also draw a speedup bar chart")
    bench.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_model_args(bench, model_required=False)
    _add_common(bench, default_new_tokens=128)
    _add_sampling(bench)
    return parser


def _check_sampling(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.do_sample and (args.temperature is not None or args.top_p is not None):
        parser.error("--temperature/--top-p only apply when sampling: add --do-sample (or drop them for greedy)")
    if args.top_p is not None and args.top_p > 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")


def _load_models(parser: argparse.ArgumentParser, args: argparse.Namespace, need_draft: bool) -> tuple[Any, Any, Any]:
    from hf_specdec.tools.model_loading import TINY, load_model

    if args.tiny:
        if args.model not in (None, "smollm2", TINY) or args.draft not in (None, TINY):
            parser.error("--tiny replaces --model and --draft: drop one or the other")
        args.model, args.draft = TINY, TINY if need_draft else None
    if args.model is None:
        parser.error("pass --model ID_OR_PATH ('smollm2' for the offline SmolLM2, a local directory) or --tiny")
    if args.draft == TINY and args.model != TINY:
        parser.error("--draft tiny only fits --model tiny (the draft must share the target's vocabulary)")
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, device=args.device, dtype=args.dtype)
    draft = None
    if args.draft is not None:
        draft, _ = load_model(args.draft, device=args.device, dtype=args.dtype, role="draft")
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"--draft {args.draft} has vocab_size {draft.config.vocab_size} but --model {args.model} has "
                f"{model.config.vocab_size}: pass a draft of the same model family (same tokenizer)."
            )
    return model, tokenizer, draft


def _sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"do_sample": args.do_sample, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}


def _cmd_demo(args: argparse.Namespace) -> int:
    from hf_specdec.tools.demo import run_demo
    from hf_specdec.tools.threads import configure_threads

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA GPU: drop --device (CPU).")
    else:
        print(configure_threads(args.threads))
    run_demo(
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        schedule=args.schedule,
        repeats=args.repeats,
        stream=not args.no_stream,
        device=args.device,
        json_path=args.json,
    )
    return 0


def _cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hf_specdec.tools.benchmarking import generate_batch
    from hf_specdec.tools.prompts import Prompt, read_prompts

    _check_sampling(parser, args)
    method = args.method or ("draft" if args.draft else "ngram")
    if args.draft is not None and method != "draft":
        parser.error(f"--draft was given with --method {method}: drop --method (draft is implied) or drop --draft")
    model, tokenizer, draft = _load_models(parser, args, need_draft=method == "draft")
    if method == "draft" and draft is None:
        parser.error("--method draft needs a draft model: pass --draft ID_OR_PATH (or --tiny)")
    prompts = [Prompt(args.prompt, question_id=0)] if args.prompt is not None else read_prompts(args.prompts)
    stream = len(prompts) == 1
    streamer = None
    if stream:
        from transformers import TextStreamer

        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    settings = {"max_new_tokens": args.max_new_tokens, "k": args.k, "draft_model": draft, **_sampling_settings(args)}
    records = []
    totals = {"new_tokens": 0, "wall_time_s": 0.0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        res = generate_batch(model, tokenizer, [p.text for p in batch], method, streamer=streamer, **settings)
        totals["new_tokens"] += res.new_tokens
        totals["wall_time_s"] += res.wall_time_s
        for key in ("num_draft_tokens", "num_accepted_tokens"):
            totals[key] += (res.stats or {}).get(key) or 0
        for p, comp in zip(batch, res.completions):
            text = tokenizer.decode(comp, skip_special_tokens=True)
            records.append({"question_id": p.question_id, "category": p.category, "prompt": p.text,
                            "completion": text, "new_tokens": len(comp)})  # fmt: skip
            if not stream:
                print(f"### [{p.question_id}] {p.text.splitlines()[0][:70] if p.text else ''}\n{text}\n")
    acc = totals["num_accepted_tokens"] / totals["num_draft_tokens"] if totals["num_draft_tokens"] else None
    tps = totals["new_tokens"] / totals["wall_time_s"] if totals["wall_time_s"] else 0.0
    acc_text = f", acceptance {acc:.2f}" if acc is not None else ""
    print(
        f"\n[{method}, k={args.k}] {len(prompts)} prompt(s), {totals['new_tokens']} new tokens, {tps:.1f} tok/s{acc_text}"
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    return 0


def _cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hf_specdec.tools.benchmarking import parse_methods, plot_speedup, run_benchmark, save_results, summarize
    from hf_specdec.tools.demo import print_table
    from hf_specdec.tools.prompts import read_prompts

    _check_sampling(parser, args)
    has_draft = args.draft is not None or args.tiny
    try:
        methods = parse_methods(args.methods, has_draft=has_draft)
    except ValueError as err:
        parser.error(str(err))
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = read_prompts(args.prompts, categories=categories, limit=args.limit)
    needs_draft = any(m == "hf-draft" or m.startswith("draft") for m in methods)
    model, tokenizer, draft = _load_models(parser, args, need_draft=needs_draft)
    settings = {"max_new_tokens": args.max_new_tokens, "k": args.k, "draft_model": draft, **_sampling_settings(args)}
    results = run_benchmark(model, tokenizer, prompts, methods, batch_size=args.batch_size,
                            progress=not args.no_progress, **settings)  # fmt: skip
    summary = summarize(results)
    config = {k: v for k, v in vars(args).items() if k != "subparser"}
    config["methods"] = methods
    save_results(args.out, results, summary, config)
    headers = ["category"] + [f"{m} {h}" for m in methods if m != "plain" for h in ("speedup", "tok/fwd")]
    headers.insert(1, "plain tok/s")
    rows = []
    for cat, table in [*summary["categories"].items(), ("overall", summary["overall"])]:
        row: list[Any] = [cat, table["plain"]["tokens_per_s"]]
        for m in methods[1:]:
            row += [table[m].get("speedup"), table[m].get("tokens_per_target_forward")]
        rows.append(row)
    print_table(f"Speedup over plain (tok/fwd = mean tokens per target forward), k={args.k}", headers, rows)
    print(f"wrote {args.out}")
    if args.plot:
        plot_speedup(summary, args.plot, title=f"{args.model} speedup over plain, k={args.k}")
        print(f"wrote {args.plot}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from hf_specdec.tools.serve import start_server

    method = args.method or ("draft" if args.draft else "ngram")
    start_server(
        args.model, method=method, draft=args.draft, k=args.k, schedule=args.schedule, host=args.host,
        port=args.port, device=args.device, dtype=args.dtype, cb_page_size=args.cb_page_size,
        cb_num_blocks=args.cb_num_blocks, cb_max_batch_tokens=args.cb_max_batch_tokens,
    )  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hf-specdec`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from hf_specdec.tools.smollm import SmolLM2NotAvailableError

    try:
        if args.command == "demo":
            return _cmd_demo(args)
        if args.command == "generate":
            return _cmd_generate(args.subparser, args)
        if args.command == "serve":
            return _cmd_serve(args)
        return _cmd_bench(args.subparser, args)
    except SmolLM2NotAvailableError as err:
        print(f"hf-specdec: error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"hf-specdec {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
