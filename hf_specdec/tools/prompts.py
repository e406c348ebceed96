"""Prompts for the CLI, demo and benchmarks: built-in demo prompts, JSONL prompt files, chat formatting, batching.

A prompt file is JSON Lines with either a ``prompt`` field or Spec-Bench's ``turns`` list (the first turn is used),
plus optional ``category`` and ``question_id``. `format_prompt` applies the tokenizer's chat template when it has
one, and `encode_batch` left-pads a batch the way `model.generate` wants it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEMO_PROMPTS", "SUFFIX_DEMO_PROMPTS", "Prompt", "encode_batch", "format_prompt", "read_prompts"]


@dataclass
class Prompt:
    """One user prompt: its text, its category (``"default"`` when the file has none), an id, and for the demo's
    prompts what kind of answer it asks for (``copies`` says whether the answer quotes the prompt).

    Demo rows may also name earlier user turns of the same conversation (``history``: their answers are generated
    first, untimed), their own speculative method (``method``, e.g. ``"suffix"``; None: the demo's), whether the
    same request was made once before (``repeat``: the row then times a request seen before), and the label of the
    answer's kind in the table (``kind``)."""

    text: str
    category: str = "default"
    question_id: str | int | None = None
    copies: bool | None = None
    history: tuple[str, ...] = ()
    method: str | None = None
    repeat: bool = False
    kind: str | None = None


_ARTICLE = (
    "The city council met on Tuesday to discuss the new bike lanes on Main Street. "
    "Supporters said the lanes would make cycling safer and reduce traffic. "
    "Shop owners worried that removing parking spaces would hurt their business. "
    "The council voted five to two to build the lanes, and construction will start in March."
)
_EMAIL = (
    "Hi team,\n\n"
    "The quarterly planning meeting will take place on Tuesday at 10 am in room 4B. "
    "Please bring your project updates, your budget estimates for next quarter and a list of open risks. "
    "Lunch will be provided after the meeting. If you cannot attend, send your update to Maria by Monday evening.\n\n"
    "Thanks,\nDaniel"
)
_PASSAGE = (
    "Dr. Alice Moreno leads the marine biology lab at the University of Valencia. Her colleague, Professor Tom "
    "Becker, directs the ocean chemistry group, and Sara Lindqvist manages the research vessel Aurora. "
    "In 2024 the three of them published a study on coral bleaching in the Mediterranean Sea."
)
_CODE = (
    "def total_price(items):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item['price'] * item['quantity']\n"
    "    return total\n\n\n"
    "def average_price(items):\n"
    "    if len(items) == 0:\n"
    "        return 0\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item['price']\n"
    "    return total / len(items)\n\n\n"
    "def most_expensive(items):\n"
    "    best = None\n"
    "    for item in items:\n"
    "        if best is None or item['price'] > best['price']:\n"
    "            best = item\n"
    "    return best\n"
)

#: The demo's built-in prompts: four whose answers copy from the prompt (where prompt lookup pays) and a chat
#: question whose answer copies nothing (where it cannot, and the adaptive schedule decodes plainly).
DEMO_PROMPTS: list[Prompt] = [
    Prompt(
        f"Summarize this article in three sentences, quoting its sentences word for word:\n\n{_ARTICLE}",
        category="summary",
        question_id="summary",
        copies=True,
    ),
    Prompt(
        f"Rewrite this email exactly as it is, changing only the day of the meeting from Tuesday to Thursday:\n\n{_EMAIL}",
        category="edit",
        question_id="edit",
        copies=True,
    ),
    Prompt(
        f"Quote the sentence of this passage that names each person, one per line:\n\n{_PASSAGE}",
        category="extraction",
        question_id="extraction",
        copies=True,
    ),
    Prompt(
        "Refactor this code: rename the parameter items to products in every function and keep everything else "
        f"the same. Return the full code.\n\n{_CODE}",
        category="code-refactor",
        question_id="code-refactor",
        copies=True,
    ),
    Prompt(
        "What are three simple tips for staying focused while studying?",
        category="chat",
        question_id="chat",
        copies=False,
    ),
]

#: The demo's suffix-decoding rows: where it shines. Suffix decoding (`method="suffix"`) also drafts from a tree
#: of earlier outputs that its `SpecDecoder` keeps across calls, so a conversation's second turn, which reuses the
#: first answer, and a request an agent makes again, are where it pays beyond prompt lookup.
SUFFIX_DEMO_PROMPTS: list[Prompt] = [
    Prompt(
        "Repeat your three tips word for word, then add one more tip.",
        category="chat, 2nd turn",
        question_id="chat-2nd-turn",
        copies=True,
        history=(DEMO_PROMPTS[-1].text,),
        method="suffix",
        kind="reuses turn 1",
    ),
    Prompt(
        DEMO_PROMPTS[3].text,
        category="code-refactor, again",
        question_id="code-refactor-again",
        copies=True,
        method="suffix",
        repeat=True,
        kind="asked before",
    ),
]


def read_prompts(path: str | Path, categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Read prompts from a JSONL file.

    Args:
        path (`str` or `Path`): JSON Lines; each object has ``prompt`` (a string) or ``turns`` (a list of strings,
            the first is used), and optionally ``category`` and ``question_id``.
        categories (`list[str]`, *optional*): keep only these categories (checked against the file's categories).
        limit (`int`, *optional*): keep at most this many prompts per category.

    Returns:
        `list[Prompt]`, in file order.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"Prompt file {str(path)!r} does not exist: pass a JSONL file with a 'prompt' or 'turns' field."
        )
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{lineno} is not valid JSON ({err.msg}): each line must be one object."
                ) from err
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                text = obj["prompt"]
            elif isinstance(obj, dict) and isinstance(obj.get("turns"), list) and obj["turns"]:
                text = str(obj["turns"][0])
            else:
                raise ValueError(
                    f"{path}:{lineno} has neither a 'prompt' string nor a non-empty 'turns' list: "
                    'write lines like {"prompt": "..."} or {"turns": ["..."], "category": "..."}.'
                )
            prompts.append(Prompt(text, str(obj.get("category", "default")), obj.get("question_id", lineno)))
    if categories:
        known = sorted({p.category for p in prompts})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"--categories {','.join(unknown)} not found in {path}: pass some of {','.join(known)}.")
        prompts = [p for p in prompts if p.category in categories]
    if limit is not None:
        counts: dict[str, int] = {}
        kept = []
        for p in prompts:
            counts[p.category] = counts.get(p.category, 0) + 1
            if counts[p.category] <= limit:
                kept.append(p)
        prompts = kept
    if not prompts:
        raise ValueError(f"No prompts left from {path}: check --categories / --limit.")
    return prompts


def format_prompt(tokenizer: Any, text: str | list[dict[str, str]]) -> str:
    """Wrap `text` as a single user turn with the tokenizer's chat template (or a conversation, a list of
    ``{"role", "content"}`` messages ending with the user's), or return it as plain text if there is none."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def encode_batch(tokenizer: Any, texts: list[str] | list[list[dict[str, str]]], device: Any = "cpu") -> dict[str, Any]:
    """Chat-format and left-pad `texts` (user prompts, or conversations) into ``input_ids`` / ``attention_mask``
    tensors on `device`."""
    formatted = [format_prompt(tokenizer, t) for t in texts]
    has_template = bool(getattr(tokenizer, "chat_template", None))
    # A chat template already inserts the special tokens it needs.
    enc = tokenizer(formatted, return_tensors="pt", padding=True, add_special_tokens=not has_template)
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
