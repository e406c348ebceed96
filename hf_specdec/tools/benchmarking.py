"""Run decoding methods over prompts and measure them the way Spec-Bench does.

`generate_batch` runs one method (``plain``, hf_specdec's ``ngram`` / ``draft`` / ``mtp`` / ``suffix``, or transformers'
own ``hf-ngram`` prompt lookup / ``hf-draft`` assisted decoding) on a batch and times it (``suffix`` keeps one
`SpecDecoder` per settings for the process, as a user would: its global tree of earlier outputs lives there); `run_benchmark` loops it over
prompts grouped by category and `summarize` aggregates tokens/s, speedup over ``plain``, acceptance rate, mean
accepted length and tokens per target forward per category and overall. `save_results` writes JSON and
`plot_speedup` a matplotlib bar chart.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_specdec.tools.prompts import Prompt, encode_batch

__all__ = [
    "METHODS", "BatchResult", "generate_batch", "parse_methods", "plot_speedup", "run_benchmark", "spec_variant",
    "summarize", "warm_up",
]  # fmt: skip

#: hf_specdec methods, transformers' stock methods, and the baseline. ``hf-stock`` expands to hf-ngram (+ hf-draft).
#: Variants of the hf_specdec methods: a bare name (``ngram``) is the library's default, the adaptive schedule with
#: k in 0..``k``, as is ``ngram-adaptive``; ``ngram-k4`` is a fixed k = 4 (overriding ``k``); ``ngram-heuristic``
#: HF's heuristic schedule from ``k``; likewise for ``draft`` and ``mtp``.
SPEC_METHODS = ("ngram", "draft", "mtp", "suffix")
HF_METHODS = ("hf-ngram", "hf-draft")
METHODS = ("plain", *SPEC_METHODS, *HF_METHODS, "hf-stock")


def spec_variant(method: str) -> tuple[str, int | None, str] | None:
    """``ngram`` and ``ngram-adaptive`` -> (ngram, None, adaptive); ``ngram-k4`` -> (ngram, 4, constant);
    ``ngram-heuristic`` -> (ngram, None, heuristic); None for a name that is not an hf_specdec method."""
    base, _, variant = method.partition("-")
    if base not in SPEC_METHODS:
        return None
    if variant in ("", "adaptive", "heuristic"):
        return base, None, variant or "adaptive"
    if variant.startswith("k") and variant[1:].isdigit() and 1 <= int(variant[1:]) <= 32:
        return base, int(variant[1:]), "constant"
    return None


@dataclass
class BatchResult:
    """What one `generate_batch` call produced and measured."""

    method: str
    completions: list[list[int]]  # new token ids per row, cut after the first EOS
    wall_time_s: float
    target_forwards: int  # forward calls of the target model (prefill included)
    stats: dict[str, Any] | None = None  # SpecDecodeStats as a dict (hf_specdec methods only)
    question_ids: list[Any] = field(default_factory=list)
    category: str = "default"

    @property
    def new_tokens(self) -> int:
        return sum(len(c) for c in self.completions)


def parse_methods(text: str, has_draft: bool) -> list[str]:
    """Parse ``--methods a,b,c``: check the names, expand ``hf-stock``, put ``plain`` first (added if missing)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS and spec_variant(m) is None]
    if unknown:
        raise ValueError(
            f"--methods: unknown method(s) {','.join(unknown)}; pass a comma list of {','.join(METHODS)} "
            "(hf_specdec methods also as e.g. ngram-k4 for a fixed k in 1..32, or ngram-adaptive)."
        )
    out: list[str] = []
    for m in names:
        expanded = (["hf-ngram"] + (["hf-draft"] if has_draft else [])) if m == "hf-stock" else [m]
        out += [e for e in expanded if e not in out]
    if not has_draft and any(m == "hf-draft" or m.startswith("draft") for m in out):
        raise ValueError("--methods draft/hf-draft need a draft model: pass --draft ID_OR_PATH (or --tiny).")
    return ["plain"] + [m for m in out if m != "plain"]


@contextlib.contextmanager
def _hook_removed() -> Iterator[None]:
    """Make sure `hf_specdec.install()`'s generate hook is off (so stock methods really are stock), then restore."""
    import hf_specdec

    was = bool(getattr(hf_specdec, "is_installed", lambda: False)())
    if was:
        hf_specdec.uninstall()
    try:
        yield
    finally:
        if was:
            hf_specdec.install()


@contextlib.contextmanager
def _count_forwards(model: Any) -> Iterator[list[int]]:
    """Count forward passes of `model` through its input embeddings (called once per forward, whatever the path)."""
    counter = [0]
    handle = model.get_input_embeddings().register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    try:
        yield counter
    finally:
        handle.remove()


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _completions(sequences: torch.Tensor, prompt_len: int, eos: set[int], pad: int | None) -> list[list[int]]:
    """New tokens of each row, up to and including the first EOS (padding after it dropped)."""
    out = []
    for row in sequences[:, prompt_len:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        if cut is None and pad is not None and pad not in eos:
            while row and row[-1] == pad:
                row = row[:-1]
        out.append(row[:cut] if cut is not None else row)
    return out


def _stats_dict(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    if hasattr(stats, "to_dict"):
        return stats.to_dict()
    keys = ("num_steps", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_accepted_length")
    return {k: getattr(stats, k, None) for k in keys}


#: `suffix` variants' SpecDecoders, one per settings, kept for the process: each keeps its global tree of earlier
#: outputs across calls (a benchmark that made a new one per call would measure a user who throws it away).
SUFFIX_SPECS: dict[tuple, Any] = {}


def generate_batch(
    model: Any,
    tokenizer: Any,
    texts: list[str] | list[list[dict[str, str]]],
    method: str,
    *,
    max_new_tokens: int = 64,
    k: int = 5,
    draft_model: Any = None,
    prompt_lookup_min: int = 1,
    prompt_lookup_max: int = 4,
    do_sample: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    streamer: Any = None,
) -> BatchResult:
    """Generate completions of `texts` with one method and time it.

    Args:
        model, tokenizer: the target model and its tokenizer (left padding).
        texts (`list[str]`): user prompts (or conversations: lists of ``{"role", "content"}`` messages); the chat
            template is applied when the tokenizer has one.
        method (`str`): ``plain``, ``ngram``, ``draft``, ``mtp`` (or a variant: ``ngram-k4``, ``ngram-adaptive``),
            ``hf-ngram`` or ``hf-draft``. The ``hf-*``
            methods are transformers' own and run one row at a time (transformers supports batch size 1 only).
        max_new_tokens, k, draft_model, prompt_lookup_min, prompt_lookup_max: the same settings for every method.
        do_sample, temperature, top_p, seed: sampling settings (``seed`` seeds hf_specdec's `SpecDecoder` and
            torch's global generator for the other methods).
        streamer (`BaseStreamer`, *optional*): receives the tokens (batch size 1 only).

    Returns:
        `BatchResult`.
    """
    import hf_specdec

    gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
    if do_sample:
        gen_kwargs.update({k_: v for k_, v in (("temperature", temperature), ("top_p", top_p)) if v is not None})
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    eos, pad = _eos_ids(model, tokenizer), tokenizer.pad_token_id
    device = model.device
    rows = [texts] if not method.startswith("hf-") else [[t] for t in texts]
    completions: list[list[int]] = []
    stats = None
    if seed is not None:
        torch.manual_seed(seed)
    with _count_forwards(model) as forwards, torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for chunk in rows:
            enc = encode_batch(tokenizer, chunk, device)
            if method == "plain":
                with _hook_removed():
                    out = model.generate(**enc, **gen_kwargs, streamer=streamer)
            elif method == "hf-ngram":
                with _hook_removed():
                    out = model.generate(
                        **enc, **gen_kwargs, prompt_lookup_num_tokens=k, max_matching_ngram_size=prompt_lookup_max,
                        streamer=streamer,
                    )  # fmt: skip
            elif method == "hf-draft":
                draft_model.generation_config.num_assistant_tokens = k
                draft_model.generation_config.num_assistant_tokens_schedule = "constant"
                draft_model.generation_config.assistant_confidence_threshold = 0.0
                with _hook_removed():
                    out = model.generate(**enc, **gen_kwargs, assistant_model=draft_model, streamer=streamer)
            elif (variant := spec_variant(method)) is not None:
                base, fixed_k, schedule = variant
                spec_kwargs: dict[str, Any] = {
                    "method": base,
                    "num_speculative_tokens": fixed_k or k,
                    "num_speculative_tokens_schedule": schedule,
                    "seed": seed,
                }
                if base == "draft":
                    spec_kwargs["draft_model"] = draft_model
                if base == "ngram":
                    spec_kwargs.update(prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max)
                if base == "suffix":
                    key = tuple(sorted((k_, str(v)) for k_, v in spec_kwargs.items()))
                    spec = SUFFIX_SPECS.setdefault(key, hf_specdec.SpecDecoder(**spec_kwargs))
                else:
                    spec = hf_specdec.SpecDecoder(**spec_kwargs)
                out = model.generate(
                    **enc, **gen_kwargs, custom_generate=hf_specdec.generate, spec_decoder=spec,
                    spec_streamer=streamer, spec_tokenizer=tokenizer,
                )  # fmt: skip
                stats = _stats_dict(spec.last_stats)
            else:
                raise ValueError(f"Unknown method {method!r}: pass one of {', '.join(METHODS)}.")
            sequences = out.sequences if hasattr(out, "sequences") else out
            completions += _completions(sequences, enc["input_ids"].shape[1], eos, pad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    return BatchResult(method, completions, wall, forwards[0], stats)


def warm_up(model: Any, tokenizer: Any, texts: list[str], method: str, **settings: Any) -> float:
    """Untimed short calls of `method` until its one-time costs are paid: one call, and for the adaptive schedule
    as many as its step-cost timing takes (it times a few verify widths per call). Returns those timing seconds."""
    settings = {**settings, "max_new_tokens": min(16, settings.get("max_new_tokens", 16)), "streamer": None}
    calibration = 0.0
    for _ in range(16):
        stats = generate_batch(model, tokenizer, texts, method, **settings).stats or {}
        calibration += stats.get("calibration_time_s", 0.0)
        if not stats.get("calibration_time_s"):
            break
    return calibration


def run_benchmark(
    model: Any,
    tokenizer: Any,
    prompts: list[Prompt],
    methods: list[str],
    *,
    batch_size: int = 1,
    progress: bool = True,
    **settings: Any,
) -> list[BatchResult]:
    """Run every method over `prompts`, batched within each category, after one untimed warm-up per method.

    Args:
        prompts (`list[Prompt]`): what to run; batches never mix categories.
        methods (`list[str]`): as returned by `parse_methods` (``plain`` first).
        batch_size (`int`, *optional*, defaults to 1): rows per `generate` call for plain and hf_specdec methods.
        progress (`bool`, *optional*, defaults to `True`): show a tqdm bar over prompts x methods.
        **settings: passed to `generate_batch` (max_new_tokens, k, draft_model, ...).

    Returns:
        `list[BatchResult]`, one per (method, batch).
    """
    from tqdm.auto import tqdm

    batches: list[list[Prompt]] = []
    for cat in dict.fromkeys(p.category for p in prompts):
        in_cat = [p for p in prompts if p.category == cat]
        batches += [in_cat[i : i + batch_size] for i in range(0, len(in_cat), batch_size)]
    for method in methods:  # untimed warm-up on the first batch's shapes (first calls pay one-time costs)
        warm_up(model, tokenizer, [p.text for p in batches[0]], method, **settings)
    results = []
    with tqdm(total=len(prompts) * len(methods), unit="prompt", desc="bench", disable=not progress) as bar:
        for batch in batches:
            for method in methods:
                bar.set_postfix_str(f"{batch[0].category}/{method}")
                res = generate_batch(model, tokenizer, [p.text for p in batch], method, **settings)
                res.question_ids = [p.question_id for p in batch]
                res.category = batch[0].category
                results.append(res)
                bar.update(len(batch))
    return results


def _aggregate(results: list[BatchResult], plain: list[BatchResult] | None) -> dict[str, Any]:
    tokens = sum(r.new_tokens for r in results)
    wall = sum(r.wall_time_s for r in results)
    row_forwards = sum(r.target_forwards * len(r.completions) for r in results if not r.method.startswith("hf-"))
    row_forwards += sum(r.target_forwards for r in results if r.method.startswith("hf-"))
    out: dict[str, Any] = {
        "num_prompts": sum(len(r.completions) for r in results),
        "new_tokens": tokens,
        "wall_time_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "tokens_per_target_forward": tokens / row_forwards if row_forwards else None,
    }
    stats = [r.stats for r in results if r.stats]
    if stats:
        drafted = sum(s.get("num_draft_tokens") or 0 for s in stats)
        accepted = sum(s.get("num_accepted_tokens") or 0 for s in stats)
        out["acceptance_rate"] = accepted / drafted if drafted else 0.0
        if all("num_drafting_row_steps" in s for s in stats):
            steps = sum(s["num_drafting_row_steps"] for s in stats)
            out["mean_accepted_length"] = 1.0 + accepted / steps if steps else 1.0
        else:
            weights = [max(s.get("num_steps") or 0, 1) for s in stats]
            out["mean_accepted_length"] = sum(
                w * (s.get("mean_accepted_length") or 1.0) for w, s in zip(weights, stats)
            )
            out["mean_accepted_length"] /= sum(weights)
    if plain is not None:
        base = sum(r.new_tokens for r in plain) / max(sum(r.wall_time_s for r in plain), 1e-12)
        out["speedup"] = out["tokens_per_s"] / base if base else None
        same = [a == b for r, p in zip(results, plain) for a, b in zip(r.completions, p.completions)]
        out["identical_to_plain"] = sum(same) / len(same) if same else None
    return out


def summarize(results: list[BatchResult]) -> dict[str, Any]:
    """Aggregate `run_benchmark` results per category and overall, for every method (speedup is over ``plain``)."""
    methods = list(dict.fromkeys(r.method for r in results))
    cats = list(dict.fromkeys(r.category for r in results))
    summary: dict[str, Any] = {"categories": {}, "overall": {}}
    for scope, keep in [*((c, (lambda r, c=c: r.category == c)) for c in cats), ("overall", lambda r: True)]:
        plain = [r for r in results if r.method == "plain" and keep(r)] or None
        table = {m: _aggregate([r for r in results if r.method == m and keep(r)], plain) for m in methods}
        if scope == "overall":
            summary["overall"] = table
        else:
            summary["categories"][scope] = table
    return summary


def save_results(path: str | Path, results: list[BatchResult], summary: dict[str, Any], config: dict[str, Any]) -> None:
    """Write config, per-batch results (with per-prompt token counts) and the summary as JSON."""
    per_batch = []
    for r in results:
        d = asdict(r)
        d["new_tokens_per_prompt"] = [len(c) for c in d.pop("completions")]
        per_batch.append(d)
    payload = {"config": config, "summary": summary, "batches": per_batch}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")


def plot_speedup(summary: dict[str, Any], path: str | Path, title: str = "Speedup over plain decoding") -> None:
    """Grouped bar chart: speedup over ``plain`` per category (and overall) for each non-plain method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[demo]').") from err
    groups = {**summary["categories"], "overall": summary["overall"]}
    methods = [m for m in summary["overall"] if m != "plain"]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [(groups[c].get(m) or {}).get("speedup") or 0.0 for c in groups], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right")
    ax.set_ylabel("speedup (x)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
