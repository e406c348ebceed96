"""The ``hf-specdec demo``: plain greedy decoding vs hf_specdec on SmolLM2, side by side, honestly timed.

For each built-in prompt (four whose answers copy from the prompt, one chat question whose answer copies nothing)
the demo times plain `model.generate` and hf_specdec's n-gram speculation (the adaptive schedule unless told
otherwise) as the median of several interleaved runs after a warm-up. Two more rows run suffix decoding, where it
shines: the chat question's second turn (its first answer is in the conversation; timed the first time it is
asked) and a request made again (an agent's retry). It streams the first speculative answer of each row and prints
a table (tok/s, speedup, acceptance, mean accepted length, identical outputs), an overall row and a one-line
verdict. `print_table` is shared with the CLI (rich when installed, plain text otherwise).
"""

from __future__ import annotations

import json
import statistics
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

from hf_specdec.tools.benchmarking import generate_batch, warm_up
from hf_specdec.tools.prompts import DEMO_PROMPTS, SUFFIX_DEMO_PROMPTS, Prompt

__all__ = ["DemoRow", "overall", "print_table", "run_demo", "verdict"]


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


@dataclass
class DemoRow:
    """One prompt's result: median seconds of each method over the timed runs, and the speculative statistics."""

    prompt: str
    copies: bool | None  # whether the answer quotes the prompt (where prompt lookup can pay)
    new_tokens: int
    plain_s: float  # median wall time of plain generate
    spec_s: float  # median wall time of hf_specdec
    acceptance_rate: float
    mean_accepted_length: float
    identical: bool  # every speculative output equals plain's, token for token
    kind: str | None = None  # the answer's kind in the table (None: from `copies`)

    @property
    def speedup(self) -> float:
        return self.plain_s / self.spec_s

    def cells(self) -> list[Any]:
        kind = self.kind or {True: "copies input", False: "free text", None: "-"}[self.copies]
        return [
            self.prompt, kind, self.new_tokens / self.plain_s, self.new_tokens / self.spec_s, f"{self.speedup:.2f}x",
            self.acceptance_rate, self.mean_accepted_length, self.identical,
        ]  # fmt: skip


def overall(rows: list[DemoRow]) -> DemoRow:
    """All prompts together: total tokens over total median seconds (so long answers weigh more)."""
    tokens = sum(r.new_tokens for r in rows)
    spec_s = sum(r.spec_s for r in rows)
    steps = sum(r.new_tokens / r.mean_accepted_length for r in rows)  # tokens per step, weighted by tokens
    drafted = [r for r in rows if r.acceptance_rate > 0]
    return DemoRow(
        prompt="overall",
        copies=None,
        new_tokens=tokens,
        plain_s=sum(r.plain_s for r in rows),
        spec_s=spec_s,
        acceptance_rate=statistics.fmean(r.acceptance_rate for r in drafted) if drafted else 0.0,
        mean_accepted_length=tokens / steps if steps else 1.0,
        identical=all(r.identical for r in rows),
    )


def verdict(rows: list[DemoRow]) -> str:
    """One line that says what the table shows, slower included."""
    total = overall(rows)
    same = "outputs identical" if total.identical else "OUTPUTS DIFFER (please report this: it is a bug)"
    word = "faster" if total.speedup >= 1.0 else "slower"
    factor = total.speedup if total.speedup >= 1.0 else 1.0 / total.speedup
    line = f"hf_specdec was {factor:.2f}x {word} than plain decoding overall, {same}."
    best = max(rows, key=lambda r: r.speedup)
    if best.speedup > 1.05:
        line += f" Best: {best.prompt} ({best.speedup:.2f}x)."
    return line


def note(schedule: str) -> str:
    if schedule == "adaptive":
        return (
            "A speedup below 1.00x means slower than plain decoding. With the adaptive schedule that happens only by "
            "noise: it measures what each verify width costs on this machine and how often drafts are accepted, and "
            "decodes plainly through the same loop where drafts do not pay (as on a chat answer, which copies nothing)."
        )
    return (
        f"A speedup below 1.00x means slower than plain decoding: the {schedule!r} schedule drafts whether or not it "
        "pays; the default, --schedule adaptive, speculates only where it does."
    )


#: The suffix-decoding rows' most drafts per step (`SpecDecoder(method="suffix")`'s default).
SUFFIX_K = 24


def _conversation(model: Any, tokenizer: Any, prompt: Prompt, method: str, settings: dict[str, Any]) -> Any:
    """The row's request: its text, or, with earlier turns, the conversation (their answers generated first, with
    the row's method, untimed) ending with it."""
    if not prompt.history:
        return prompt.text
    messages: list[dict[str, str]] = []
    for turn in prompt.history:
        messages.append({"role": "user", "content": turn})
        answer = generate_batch(model, tokenizer, [list(messages)], method, **settings).completions[0]
        messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return [*messages, {"role": "user", "content": prompt.text}]


@contextmanager
def _status(text: str, file: Any):  # noqa: ANN202
    """A transient status line on a terminal (rich), a plain line elsewhere."""
    try:
        from rich.console import Console
    except ImportError:
        Console = None  # noqa: N806
    if Console is not None and getattr(file, "isatty", lambda: False)():
        with Console(file=file).status(text):
            yield
        return
    print(text, file=file, flush=True)
    yield


def run_demo(
    max_new_tokens: int = 96,
    k: int = 8,
    schedule: str = "adaptive",
    repeats: int = 3,
    model: Any = None,
    tokenizer: Any = None,
    prompts: list[Prompt] | None = None,
    stream: bool = True,
    device: str = "cpu",
    json_path: str | None = None,
    file: Any = None,
) -> list[DemoRow]:
    """Run the demo and print its table, overall row and verdict.

    Args:
        max_new_tokens (`int`, *optional*, defaults to 96): tokens generated per prompt.
        k (`int`, *optional*, defaults to 8): most draft tokens per step (every step's with a constant schedule).
        schedule (`str`, *optional*, defaults to `"adaptive"`): `SpecDecoder.num_speculative_tokens_schedule`.
        repeats (`int`, *optional*, defaults to 3): timed runs of each method per prompt (interleaved); the median
            counts. One untimed warm-up of each method comes first.
        model, tokenizer (*optional*): defaults to SmolLM2-135M-Instruct via `hf_specdec.tools.smollm.load_smollm2`.
        prompts (`list[Prompt]`, *optional*): defaults to `DEMO_PROMPTS`.
        stream (`bool`, *optional*, defaults to `True`): stream the first speculative answer of each prompt.
        device (`str`, *optional*, defaults to `"cpu"`): where SmolLM2 runs when `model` is not given.
        json_path (`str`, *optional*): also write the rows, the overall row and the verdict there as JSON.
        file (*optional*): where to print (defaults to stdout).

    Returns:
        `list[DemoRow]`: one row per prompt.
    """
    from transformers import TextStreamer

    file = file or sys.stdout
    loaded = model is None or tokenizer is None
    if loaded:
        from hf_specdec.tools.smollm import load_smollm2

        print("Loading SmolLM2-135M-Instruct (offline; the first load dequantises the GGUF file)...", file=file)
        model, tokenizer = load_smollm2(device=device)
    prompts = prompts or [*DEMO_PROMPTS, *SUFFIX_DEMO_PROMPTS]
    variant = schedule if schedule != "constant" else f"k{k}"
    spec_method = f"ngram-{variant}"
    settings = {"max_new_tokens": max_new_tokens, "k": k}
    # Suffix decoding drafts long repeated blocks: its own default k (24), one kept SpecDecoder for the whole demo.
    suffix = {"method": f"suffix-{variant if schedule != 'constant' else 'k24'}", "k": SUFFIX_K}
    methods = [("plain", settings), (spec_method, settings)]
    if any(p.method == "suffix" for p in prompts):
        methods.append((suffix["method"], {**settings, "k": suffix["k"]}))
    with _status("Warming up (the adaptive schedule's first calls also time the verify widths)...", file):
        calibration_s = sum(warm_up(model, tokenizer, [prompts[0].text], m, **kw) for m, kw in methods)
    rows: list[DemoRow] = []
    for prompt in prompts:
        row_method, row_settings = (
            (suffix["method"], {**settings, "k": suffix["k"]}) if prompt.method == "suffix" else (spec_method, settings)
        )
        label = f"{prompt.category} [suffix]" if prompt.method == "suffix" else prompt.category
        print(f"\n=== {label}: {prompt.text.splitlines()[0][:80]}", file=file)
        request = _conversation(model, tokenizer, prompt, row_method, row_settings)
        if prompt.repeat:  # the first time this request is made (untimed): the timed runs repeat it
            generate_batch(model, tokenizer, [request], row_method, **row_settings)
        plain_runs, spec_runs = [], []
        for run in range(repeats):  # interleaved, the order alternating so that a drift favours neither
            for method in ("plain", row_method) if run % 2 == 0 else (row_method, "plain"):
                streamer = None
                if method == "plain":
                    status = _status(f"plain generate (not streamed), run {run + 1}/{repeats}...", file)
                elif stream and run == 0:
                    print("hf_specdec: ", end="", file=file, flush=True)
                    status, streamer = (
                        nullcontext(),
                        TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                    )
                else:
                    status = _status(f"hf_specdec, run {run + 1}/{repeats}...", file)
                with status:
                    result = generate_batch(model, tokenizer, [request], method, streamer=streamer, **row_settings)
                (plain_runs if method == "plain" else spec_runs).append(result)
        if not stream:
            print(tokenizer.decode(spec_runs[0].completions[0], skip_special_tokens=True), file=file)
        stats = spec_runs[0].stats or {}
        # Suffix decoding remembers its answers: a row that is not a repeat counts only its first (new) request.
        first_only = prompt.method == "suffix" and not prompt.repeat
        rows.append(
            DemoRow(
                prompt=label,
                copies=prompt.copies,
                new_tokens=plain_runs[0].new_tokens,
                plain_s=statistics.median(r.wall_time_s for r in plain_runs),
                spec_s=spec_runs[0].wall_time_s if first_only else statistics.median(r.wall_time_s for r in spec_runs),
                acceptance_rate=stats.get("acceptance_rate", 0.0),
                mean_accepted_length=stats.get("mean_accepted_length", 1.0),
                identical=all(r.completions == plain_runs[0].completions for r in plain_runs + spec_runs),
                kind=prompt.kind,
            )
        )
    total = overall(rows)
    print(file=file)
    headers = ["prompt", "answer", "tok/s plain", "tok/s spec", "speedup", "acceptance", "mean acc. len", "identical"]
    name = "SmolLM2-135M" if loaded else type(model).__name__
    title = f"{name} greedy: plain vs hf_specdec prompt lookup ({schedule} schedule, k <= {k})"
    if len(methods) > 2:
        title += f", [suffix]: suffix decoding (k <= {suffix['k']})"
    print_table(title, headers, [r.cells() for r in [*rows, total]], file=file)
    print(
        f"{max_new_tokens} new tokens at most per prompt; times are medians of {repeats} interleaved runs.", file=file
    )
    if len(methods) > 2:
        print(
            "[suffix] rows: suffix decoding keeps a tree of earlier answers across calls. A row that is not asked "
            "before counts only its first request (later runs repeat it); 'asked before' times the request again.",
            file=file,
        )
    line = verdict(rows)
    print(line, file=file)
    print(note(schedule), file=file)
    if calibration_s:
        print(
            f"The adaptive schedule's first calls spent {calibration_s:.2f} s timing verify widths (once per process, "
            "at most three forwards per call; in the warm-up here).",
            file=file,
        )
    if json_path:
        payload = {
            "settings": {"max_new_tokens": max_new_tokens, "k": k, "schedule": schedule, "repeats": repeats},
            "rows": [{**asdict(r), "speedup": r.speedup} for r in rows],
            "overall": {**asdict(total), "speedup": total.speedup},
            "verdict": line,
            "calibration_s": calibration_s,
        }
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
    return rows
