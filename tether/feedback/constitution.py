"""A constitution: the written principles an AI judge or critic is asked to follow (Bai et al.
2022, "Constitutional AI: Harmlessness from AI Feedback", §3-4).

File format (markdown): every list item (`- `, `* `, `1. `) is one principle; lines indented under
an item continue it. A file without list items is read as paragraphs separated by blank lines.
Headings (`#`) and HTML comments are ignored, so a constitution can carry its own title and notes.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from tether.errors import UserError

_ITEM = re.compile(r"^\s{0,3}(?:[-*+]|\d+[.)])\s+(.*)$")


def parse_principles(text: str) -> list[str]:
    """The principles of a constitution's text, in order (see the module docstring)."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    items: list[list[str]] = []
    if any(_ITEM.match(ln) for ln in lines):
        for ln in lines:
            m = _ITEM.match(ln)
            if m:
                items.append([m.group(1).strip()])
            elif ln.strip() and items and ln[:1].isspace():  # an indented continuation line
                items[-1].append(ln.strip())
    else:
        block: list[str] = []
        for ln in lines + [""]:
            if ln.strip():
                block.append(ln.strip())
            elif block:
                items.append(block)
                block = []
    return [" ".join(parts).strip() for parts in items if " ".join(parts).strip()]


def load_constitution(path: str) -> list[str]:
    """Principles of the constitution file at `path`; a one-line UserError naming the file when it
    is missing, unreadable or holds no principle."""
    if not path:
        raise UserError("constitution: no file given (constitution=principles.md: one principle per '- ' item)")
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: constitution file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the constitution: {type(e).__name__}: {e}") from None
    principles = parse_principles(text)
    if not principles:
        raise UserError(f"{path}: no principles found (write one per '- ' list item)")
    return principles


def pick_principles(principles: list[str], n: int, mode: str, seed: int) -> list[list[str]]:
    """The principles shown for each of n items: one drawn uniformly per item (`sample`, as the
    Constitutional AI feedback model does) or all of them (`all`). Seeded: item i's draw depends
    only on (seed, i), so adding items never changes earlier ones."""
    if mode == "all":
        return [list(principles)] * n
    if mode != "sample":
        raise UserError(f"principles must be 'sample' or 'all'; got {mode!r}")
    return [[principles[random.Random(f"{seed}:{i}").randrange(len(principles))]] for i in range(n)]
