"""The ``hf-specdec demo``: plain greedy decoding vs hf_specdec prompt lookup on SmolLM2, side by side.

For each built-in prompt (a summary that copies from its input, a code edit, a chat answer) the demo runs plain
`model.generate`, then hf_specdec's n-gram speculation while streaming its text, and prints a table of tokens/s,
speedup, acceptance rate, mean accepted length and whether the two outputs are token-for-token identical.
`print_table` is shared with the CLI (rich when installed, plain text otherwise).
"""

from __future__ import annotations

import sys
from typing import Any

from hf_specdec.tools.benchmarking import generate_batch
from hf_specdec.tools.prompts import DEMO_PROMPTS, Prompt

__all__ = ["print_table", "run_demo"]


def print_table(title: str, headers: list[str], rows: list[list[Any]], file: Any = None) -> None:
    """Print a table with rich if it is installed, else as aligned plain text."""
    file = file or sys.stdout
    cells = [[_fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
        print(title, file=file)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)), file=file)
        for r in cells:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)
        return
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in cells:
        table.add_row(*r)
    first = max([len(headers[0]), *(len(r[0]) for r in cells)])
    Console(file=file, width=max(100, first + 4 + (len(headers) - 1) * 14)).print(table)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def run_demo(
    max_new_tokens: int = 96,
    k: int = 5,
    model: Any = None,
    tokenizer: Any = None,
    prompts: list[Prompt] | None = None,
    stream: bool = True,
    file: Any = None,
) -> list[dict[str, Any]]:
    """Run the demo and print its table.

    Args:
        max_new_tokens (`int`, *optional*, defaults to 96): tokens generated per prompt.
        k (`int`, *optional*, defaults to 5): draft tokens per speculative step.
        model, tokenizer (*optional*): defaults to SmolLM2-135M-Instruct via `hf_specdec.tools.smollm.load_smollm2`.
        prompts (`list[Prompt]`, *optional*): defaults to `DEMO_PROMPTS`.
        stream (`bool`, *optional*, defaults to `True`): stream the speculative output as it is generated.
        file (*optional*): where to print (defaults to stdout).

    Returns:
        `list[dict]`: one row per prompt with the numbers of the table.
    """
    from transformers import TextStreamer

    file = file or sys.stdout
    if model is None or tokenizer is None:
        from hf_specdec.tools.smollm import load_smollm2

        print("Loading SmolLM2-135M-Instruct (offline; the first load dequantises the GGUF file)...", file=file)
        model, tokenizer = load_smollm2()
    prompts = prompts or DEMO_PROMPTS
    settings = {"max_new_tokens": max_new_tokens, "k": k}
    for method in ("plain", "ngram"):  # warm-up, untimed
        generate_batch(model, tokenizer, [prompts[0].text], method, **{**settings, "max_new_tokens": 4})
    rows: list[dict[str, Any]] = []
    for prompt in prompts:
        print(f"\n=== {prompt.category}: {prompt.text.splitlines()[0][:80]}", file=file)
        plain = generate_batch(model, tokenizer, [prompt.text], "plain", **settings)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
        spec = generate_batch(model, tokenizer, [prompt.text], "ngram", streamer=streamer, **settings)
        if not stream:
            print(tokenizer.decode(spec.completions[0], skip_special_tokens=True), file=file)
        stats = spec.stats or {}
        tps_plain = plain.new_tokens / plain.wall_time_s
        tps_spec = spec.new_tokens / spec.wall_time_s
        rows.append(
            {
                "prompt": prompt.category,
                "tokens_per_s_plain": tps_plain,
                "tokens_per_s_spec": tps_spec,
                "speedup": tps_spec / tps_plain,
                "acceptance_rate": stats.get("acceptance_rate"),
                "mean_accepted_length": stats.get("mean_accepted_length"),
                "identical": plain.completions == spec.completions,
            }
        )
    print(file=file)
    headers = ["prompt", "tok/s plain", "tok/s spec", "speedup", "acceptance", "mean acc. len", "identical"]
    print_table(
        f"SmolLM2-135M greedy, hf_specdec ngram k={k}, {max_new_tokens} new tokens",
        headers,
        [list(r.values()) for r in rows],
        file=file,
    )
    return rows
