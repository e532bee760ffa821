"""Implicit-prompt preference data: split ``chosen``/``rejected`` into a shared prompt + responses.

Anthropic HH-RLHF (and datasets built like it) store two full conversations::

    chosen   = "\\n\\nHuman: hi\\n\\nAssistant: Hello! How can I help?"
    rejected = "\\n\\nHuman: hi\\n\\nAssistant: Go away."

The prompt is everything up to and including the last ``"\\n\\nAssistant:"`` that both share;
the responses are what follows (they keep their leading space, which is how the text continues
after ``"Assistant:"`` and how a tokenizer will see it at generation time).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["HH_ASSISTANT", "extract_shared_prompt", "extract_shared_messages",
           "to_explicit_prompt", "hh_to_messages", "hh_to_conversational"]

HH_ASSISTANT = "\n\nAssistant:"
HH_HUMAN = "\n\nHuman:"


def _common_prefix_len(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def extract_shared_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Split two full texts into ``(prompt, chosen_completion, rejected_completion)``.

    If the shared prefix contains ``"\\n\\nAssistant:"`` (HH-RLHF), split right after the last
    such marker inside it. Otherwise split at the common prefix, backed off to the last whitespace
    so that no word is cut in two (``"The answer is 52"``/``"...57"`` -> prompt ``"The answer
    is"``, completions ``" 52"``, ``" 57"``). Raises ValueError when nothing is shared.
    """
    if not isinstance(chosen, str) or not isinstance(rejected, str):
        raise ValueError("chosen and rejected must both be strings")
    shared = _common_prefix_len(chosen, rejected)
    marker = chosen.rfind(HH_ASSISTANT, 0, shared)  # the marker must lie fully in the prefix
    if marker >= 0:
        cut = marker + len(HH_ASSISTANT)
    else:
        cut = shared
        if shared < len(chosen) or shared < len(rejected):
            ws = max(chosen.rfind(c, 0, shared) for c in " \t\n")
            cut = ws if ws > 0 else shared
        if chosen[:cut].strip() == "":
            raise ValueError("chosen and rejected share no prompt prefix")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def extract_shared_messages(chosen: list[dict], rejected: list[dict]) -> tuple[list, list, list]:
    """Conversational version: the prompt is the longest run of identical leading messages."""
    k = _common_prefix_len(chosen, rejected)
    if k == 0:
        raise ValueError("chosen and rejected share no leading messages")
    if k == len(chosen) or k == len(rejected):
        # one conversation is a prefix of the other: keep at least the last message as response
        k = min(len(chosen), len(rejected)) - 1
        if k == 0:
            raise ValueError("chosen and rejected share no prompt before their responses")
    return chosen[:k], chosen[k:], rejected[k:]


def to_explicit_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """Implicit-prompt preference row -> ``{prompt, chosen, rejected, **other columns}``."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, list) and isinstance(rejected, list):
        prompt, c, r = extract_shared_messages(chosen, rejected)
    else:
        prompt, c, r = extract_shared_prompt(chosen, rejected)
    out = {"prompt": prompt, "chosen": c, "rejected": r}
    out.update((k, v) for k, v in row.items() if k not in out)
    return out


_TURN = re.compile(r"\n\n(Human|Assistant):")


def hh_to_messages(text: str) -> list[dict[str, str]]:
    """``"\\n\\nHuman: a\\n\\nAssistant: b"`` -> ``[{user: a}, {assistant: b}]``.

    Content is stripped of surrounding whitespace (the space after ``Human:`` is formatting, not
    content). Text before the first turn marker, if any, becomes a system message.
    """
    parts = _TURN.split(text)
    messages = []
    if parts[0].strip():
        messages.append({"role": "system", "content": parts[0].strip()})
    for role, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if role == "Human" else "assistant", "content": content.strip()})
    if not messages:
        raise ValueError("no '\\n\\nHuman:' / '\\n\\nAssistant:' turns found")
    return messages


def hh_to_conversational(row: dict[str, Any]) -> dict[str, Any]:
    """HH-RLHF row (full ``chosen``/``rejected`` texts) -> conversational preference row:
    ``prompt`` = shared messages, ``chosen``/``rejected`` = the diverging assistant turn(s)."""
    out = to_explicit_prompt({"chosen": hh_to_messages(row["chosen"]),
                              "rejected": hh_to_messages(row["rejected"])})
    out.update((k, v) for k, v in row.items() if k not in out)
    return out
