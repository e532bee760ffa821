"""One call from a config's ``data:`` entry to validated rows: load -> rename -> detect/check
format -> (implicit prompt -> explicit) -> validate.

Trainers call ``load_data(cfg.path, expect="prompt-completion")`` (or a tuple of accepted
formats) and get :class:`Rows` with ``.format`` set, or a one-line DataError before any model
is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import DataError
from .formats import RowChecker, check_format, detect_format
from .load import load_rows
from .prompts import hh_to_conversational, to_explicit_prompt
from .rows import Rows, StreamingRows, as_rows

__all__ = ["load_data", "prepare"]
log = logging.getLogger(__name__)

# Streams are validated lazily as they are read; this many rows are checked up front so that
# an obviously wrong file fails before training starts.
STREAM_PRECHECK_ROWS = 1000


def load_data(source: str, expect: str | Sequence[str] | None = None, *, split: str | None = None,
              streaming: bool = False, rename: Mapping[str, str] | None = None,
              conversational: bool = False) -> Rows | StreamingRows:
    """Load ``source`` (see :func:`load_rows`) and :func:`prepare` it."""
    rows = load_rows(source, split, streaming=streaming)
    return prepare(rows, expect, rename=rename, conversational=conversational)


def prepare(rows: Any, expect: str | Sequence[str] | None = None, *, source: str | None = None,
            rename: Mapping[str, str] | None = None, conversational: bool = False) -> Rows | StreamingRows:
    """Validate rows and bring them into the format a trainer expects.

    * ``rename`` maps dataset columns to format columns, e.g. ``{"question": "prompt"}`` (GSM8K).
    * implicit-prompt preference data (only ``chosen``/``rejected``) gets its shared prompt
      extracted (:func:`~tether.data.prompts.to_explicit_prompt`); with ``conversational=True``
      HH-RLHF-style texts become lists of messages instead.
    * every row is validated (streams: the first ``STREAM_PRECHECK_ROWS`` now, the rest as read).

    Returns rows with ``.format`` set to the format they are used as.
    """
    rows = as_rows(rows, source)
    src = rows.source
    if rename:
        mapping = dict(rename)
        have = rows.columns
        missing = [k for k in mapping if k not in have] if have else []
        if missing:
            raise DataError(src, None, missing[0], f"column mapping names a column the data does not "
                            f"have (columns: {', '.join(have)})")
        clash = [v for v in mapping.values() if v in have and v not in mapping]
        if clash:  # renaming onto a column that stays would silently drop one of the two
            raise DataError(src, None, clash[0], "column mapping renames another column onto this "
                            "one, which the data already has (map it away too, or drop it)")
        rows = rows.map(lambda r, n: {mapping.get(k, k): v for k, v in r.items()})
    columns = rows.columns
    if not columns:
        raise DataError(src, None, None, "dataset is empty (0 rows)")
    fmt = check_format(columns, expect, src) if expect is not None else detect_format(columns, src)

    if fmt == "implicit-preference":
        raw = RowChecker(fmt, src, columns)

        def explicit(row: dict, n: int) -> dict:
            raw(row, n)  # the full texts must be valid before we cut them
            try:
                if conversational and isinstance(row["chosen"], str):
                    return hh_to_conversational(row)
                return to_explicit_prompt(row)
            except ValueError as e:
                raise DataError(src, n, "chosen", f"cannot extract the shared prompt: {e}") from None

        rows = rows.map(explicit)
        fmt = "preference"
    checker = RowChecker(fmt, src, rows.columns if isinstance(rows, Rows) else ())
    if isinstance(rows, Rows):
        for n, row in rows.numbered():
            checker(row, n)
        if checker.count == 0:
            raise DataError(src, None, None, "dataset is empty (0 rows)")
        if checker.identical:  # legal, but such a pair teaches nothing (its loss gradient is ~0)
            log.warning("%s: %d of %d pairs have chosen identical to rejected", src, checker.identical,
                        checker.count)
    else:
        pre = RowChecker(fmt, src)
        for i, (n, row) in enumerate(rows.numbered()):
            if i >= STREAM_PRECHECK_ROWS:
                break
            pre(row, n)
        if pre.count == 0:
            raise DataError(src, None, None, "dataset is empty (0 rows)")
        rows = rows.map(checker)  # the rest is checked as training reads it
    rows.format = fmt
    return rows
