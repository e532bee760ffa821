"""Dataset formats (TRL's column names) — detection and validation.

==================== ===================================== ====================================
format               columns                               used by
==================== ===================================== ====================================
language-modeling    ``text`` | ``messages``               SFT
prompt-only          ``prompt`` (+ extra columns kept)     GRPO family, PPO, best-of-N
prompt-completion    ``prompt``, ``completion``            SFT (completion-only loss)
preference           ``prompt``, ``chosen``, ``rejected``  reward models, DPO family
implicit-preference  ``chosen``, ``rejected``              converted to ``preference``
unpaired-preference  ``prompt``, ``completion``, ``label`` KTO
stepwise             ``prompt``, ``completions``, ``labels`` process reward models
==================== ===================================== ====================================

Each may be *standard* (strings) or *conversational* (lists of ``{"role", "content"}``); one
style per dataset. Validation runs before any training and raises a one-line
:class:`~tether.data.errors.DataError` ``"<file>:<row>:<field>: <what is wrong>"`` at the first
problem.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import DataError, show
from .rows import Rows, as_rows

__all__ = ["FORMATS", "ROLES", "detect_format", "detect_style", "check_format", "validate",
           "RowChecker", "canonical_format", "check_soft_labels"]

# name -> alternative column sets (any one set identifies the format). Order = detection priority:
# the most specific shape wins (a KTO dataset also has prompt + completion).
FORMATS: dict[str, tuple[tuple[str, ...], ...]] = {
    "stepwise": (("prompt", "completions", "labels"),),
    "unpaired-preference": (("prompt", "completion", "label"),),
    "preference": (("prompt", "chosen", "rejected"),),
    "implicit-preference": (("chosen", "rejected"),),
    "prompt-completion": (("prompt", "completion"),),
    "prompt-only": (("prompt",),),
    "language-modeling": (("messages",), ("text",)),
}
_ALIASES = {"lm": "language-modeling", "language_modeling": "language-modeling",
            "prompt_only": "prompt-only", "prompt_completion": "prompt-completion",
            "unpaired_preference": "unpaired-preference", "implicit_preference": "implicit-preference"}
ROLES = ("system", "user", "assistant", "tool")


def canonical_format(name: str) -> str:
    fmt = _ALIASES.get(name, name)
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {name!r}; known: {', '.join(FORMATS)}")
    return fmt


def _describe(fmt: str) -> str:
    return " or ".join(", ".join(cols) for cols in FORMATS[fmt])


def detect_format(columns: Iterable[str], source: str | None = None) -> str:
    """The format named by a set of column names (see the table above); DataError if none fits."""
    cols = set(columns)
    for fmt, alternatives in FORMATS.items():
        if any(set(alt) <= cols for alt in alternatives):
            return fmt
    known = "; ".join(f"{_describe(f)} ({f})" for f in FORMATS)
    found = ", ".join(columns) or "no columns"
    raise DataError(source, None, None, f"cannot tell the data format from columns {found}; "
                    f"expected one of: {known} (rename columns to match)")


def check_format(columns: Sequence[str], expected: str | Sequence[str], source: str | None = None) -> str:
    """Check the data has a shape a trainer accepts; return the format to use it as.

    ``expected`` is one format or several. Beyond exact matches, ``prompt-only`` accepts any
    data with a ``prompt`` column (extra columns pass through), and ``preference`` accepts
    implicit-prompt preference data (returned as ``"implicit-preference"``; see
    :func:`tether.data.load_data`, which converts it).
    """
    wanted = [canonical_format(e) for e in ([expected] if isinstance(expected, str) else expected)]
    cols = list(columns)
    try:
        detected = detect_format(cols, source)
    except DataError:
        detected = None
    if detected in wanted:
        return detected
    if detected == "implicit-preference" and "preference" in wanted:
        return detected
    if "prompt-only" in wanted and "prompt" in cols:
        return "prompt-only"
    if "language-modeling" in wanted and detected is None and ({"text", "messages"} & set(cols)):
        return "language-modeling"
    need = ", or ".join(f"{_describe(f)} for {f} data" for f in wanted)
    raise DataError(source, None, None, f"expected columns {need}; found {', '.join(cols) or 'no columns'}")


# ------------------------------------------------------------------------------ field checks
# Each returns None when fine, or (field_suffix, message). Field names are paths like
# "messages[2].role" so the error points inside nested values.

def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and (not value or isinstance(value[0], dict))


def _check_string(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, str):
        return "", f"expected a string, got {type(value).__name__} {show(value)}"
    if value == "":
        return "", "empty string"
    return None


def _check_messages(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, list):
        return "", f"expected a list of {{role, content}} messages, got {type(value).__name__} {show(value)}"
    if not value:
        return "", "empty list of messages"
    for i, m in enumerate(value):
        at = f"[{i}]"
        if not isinstance(m, dict):
            return at, f"expected a {{role, content}} message, got {type(m).__name__} {show(m)}"
        for key in ("role", "content"):
            if key not in m:
                return at, f"message has no {key!r} key (keys: {', '.join(map(str, m)) or 'none'})"
        role, content = m["role"], m["content"]
        if role not in ROLES:
            return f"{at}.role", f"role {show(role)} is not one of {', '.join(ROLES)}"
        if content is None and m.get("tool_calls"):
            continue  # an assistant turn that only calls tools
        if isinstance(content, list):  # multimodal-style parts: [{"type": "text", "text": ...}]
            if not all(isinstance(p, dict) and "type" in p for p in content):
                return f"{at}.content", "content parts must be {type, ...} objects"
            continue
        if not isinstance(content, str):
            return f"{at}.content", f"expected a string, got {type(content).__name__} {show(content)}"
        # An empty assistant reply is a legitimate target ("say nothing"); an empty user/system/
        # tool turn is almost always a data bug.
        if content == "" and role != "assistant":
            return f"{at}.content", f"empty string in a {role} message"
    return None


def _check_bool(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, bool):
        return "", f"expected a bool (true/false), got {type(value).__name__} {show(value)}"
    return None


def _check_steps(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, list):
        return "", f"expected a list of strings (one per step), got {type(value).__name__} {show(value)}"
    if not value:
        return "", "empty list of steps"
    for i, step in enumerate(value):
        problem = _check_string(step)
        if problem:
            return f"[{i}]", problem[1]
    return None


def _check_labels(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, list):
        return "", f"expected a list of bools (one per step), got {type(value).__name__} {show(value)}"
    for i, label in enumerate(value):
        if not isinstance(label, bool):
            return f"[{i}]", f"expected a bool (true/false), got {type(label).__name__} {show(label)}"
    return None


def check_soft_labels(row: dict[str, Any]) -> tuple[str, str] | None:
    """The optional stepwise column ``soft_labels`` (Math-Shepherd's c_i/K, one number in [0, 1]
    per step, as `tether label steps` writes it): (field suffix, problem) or None when valid."""
    if "soft_labels" not in row or row["soft_labels"] is None:
        return "", "missing column (soft step targets read it; `tether label steps` writes it)"
    value = row["soft_labels"]
    if not isinstance(value, list):
        return "", f"expected a list of numbers in [0, 1] (one per step), got {type(value).__name__} {show(value)}"
    for i, y in enumerate(value):
        if isinstance(y, bool) or not isinstance(y, (int, float)) or not 0 <= y <= 1:
            return f"[{i}]", f"expected a number in [0, 1], got {show(y)}"
    if len(value) != len(row["completions"]):
        return "", f"{len(value)} values for {len(row['completions'])} completions (need one per step)"
    return None


# Fields whose style (string vs conversation) follows the dataset's style (`text` is always a
# string and `messages` always a conversation).
_STYLED = ("prompt", "completion", "chosen", "rejected")


def detect_style(row: dict[str, Any], fmt: str) -> str:
    """``"conversational"`` if the row's main field is a list of messages, else ``"standard"``."""
    fmt = canonical_format(fmt)
    if fmt == "language-modeling":
        return "conversational" if "messages" in row else "standard"
    key = "chosen" if fmt == "implicit-preference" else "prompt"
    return "conversational" if _is_conversation(row.get(key)) else "standard"


class RowChecker:
    """Validates rows one at a time (so streams can be checked lazily). The first row fixes the
    style; later rows must match it."""

    def __init__(self, fmt: str, source: str | None = None, columns: Sequence[str] = ()):
        self.fmt = canonical_format(fmt)
        self.source = source
        self.style: str | None = None
        self.columns = list(columns)
        self.count = 0
        self.identical = 0  # preference pairs whose chosen equals rejected (no preference to learn)

    def fields(self, row: dict[str, Any]) -> tuple[str, ...]:
        if self.fmt == "language-modeling":
            # the dataset's columns decide (a row lacking "messages" is a missing column, not text)
            return ("messages",) if "messages" in (self.columns or row) else ("text",)
        return FORMATS[self.fmt][0]

    def __call__(self, row: dict[str, Any], n: int) -> dict[str, Any]:
        """Check one row (number ``n``); return it unchanged so this can be used in ``map``."""
        src = self.source
        if not isinstance(row, dict):
            raise DataError(src, n, None, f"expected a row object, got {type(row).__name__}")
        fields = self.fields(row)
        for f in fields:
            if f not in row:
                raise DataError(src, n, f, f"missing column (row has: {', '.join(map(str, row)) or 'nothing'})")
            if row[f] is None:
                raise DataError(src, n, f, "is null")
        if self.style is None:
            self.style = detect_style(row, self.fmt)
        conversational = self.style == "conversational"
        if self.fmt == "stepwise" and conversational:
            raise DataError(src, n, "prompt", "stepwise data must be standard (strings); got a list of messages")
        for f in fields:
            value = row[f]
            if f == "messages":
                problem = _check_messages(value)
            elif f == "text":
                problem = _check_string(value)
            elif f in _STYLED and self.fmt != "stepwise":
                if _is_conversation(value) != conversational:
                    first = "conversational (lists of messages)" if conversational else "standard (strings)"
                    raise DataError(src, n, f, f"is {'a list' if isinstance(value, list) else type(value).__name__} "
                                    f"but this dataset is {first}; use one style for every field and row")
                problem = _check_messages(value) if conversational else _check_string(value)
            elif f == "completions":
                problem = _check_steps(value)
            elif f == "label":
                problem = _check_bool(value)
            elif f == "labels":
                problem = _check_labels(value)
            else:
                problem = _check_string(value)
            if problem:
                raise DataError(src, n, f + problem[0], problem[1])
        if self.fmt == "stepwise" and len(row["labels"]) != len(row["completions"]):
            raise DataError(src, n, "labels", f"{len(row['labels'])} labels for "
                            f"{len(row['completions'])} completions (need one per step)")
        # (language-modeling `messages` without an assistant turn are legal: with completion-only
        # loss the tokenizer drops them and counts them in its report.)
        if conversational and self.fmt in ("prompt-completion", "preference", "unpaired-preference",
                                           "implicit-preference"):
            for f in ("completion", "chosen", "rejected"):
                if f in fields and not any(m.get("role") == "assistant" for m in row[f]):
                    raise DataError(src, n, f, "has no assistant message to train on")
        if self.fmt == "preference":
            self.identical += row["chosen"] == row["rejected"]
            m = row.get("margin")  # optional (Llama 2's reward-model margin); NaN would poison the loss
            if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m)):
                raise DataError(src, n, "margin", f"must be a finite number, got {show(m)}")
        self.count += 1
        return row


def validate(rows: Any, fmt: str | None = None, source: str | None = None, *,
             limit: int | None = None) -> None:
    """Check every row (or the first ``limit``) against ``fmt`` (detected if None).

    Raises a one-line DataError at the first problem: missing column, wrong type, bad role,
    empty string, empty dataset, mixed styles. ``rows`` is anything :func:`as_rows` accepts.
    """
    rows = as_rows(rows, source)
    src = rows.source
    columns = rows.columns
    if not columns and (len(rows) == 0 if isinstance(rows, Rows) else next(iter(rows), None) is None):
        raise DataError(src, None, None, "dataset is empty (0 rows)")
    fmt = detect_format(columns, src) if fmt is None else check_format(columns, fmt, src)
    checker = RowChecker(fmt, src, columns if isinstance(rows, Rows) else ())
    for i, (n, row) in enumerate(rows.numbered()):
        if limit is not None and i >= limit:
            break
        checker(row, n)
    if checker.count == 0:
        raise DataError(src, None, None, "dataset is empty (0 rows)")
