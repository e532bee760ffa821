"""Load rows from local files, ``save_to_disk`` directories, the Hugging Face hub, or a
reasoning-gym task (``reasoning_gym:<task>?size=N&seed=S``, tether.data.reasoning_gym).

``load_rows(source, split=None, streaming=False)`` returns :class:`~tether.data.rows.Rows`
(or :class:`~tether.data.rows.StreamingRows`) whose rows are plain dicts, with 1-based row
numbers for error messages:

* JSON Lines (``.jsonl``, ``.ndjson``, ``.gz``): the physical line number (blank lines are
  skipped but still counted), so ``file.jsonl:17`` is line 17 in an editor.
* JSON arrays (``.json``): the line on which the object starts.
* CSV: the line on which the record starts (line 1 is the header, so the first row is line 2).
* Parquet, ``save_to_disk`` directories, hub datasets: the record index counting from 1.

JSON is parsed line by line with :mod:`json` (which is what gives us line numbers); CSV with
:mod:`csv`; Parquet with :mod:`pyarrow`; the rest through :mod:`datasets`.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import DataError
from .reasoning_gym import is_reasoning_gym, reasoning_gym_rows
from .rows import Rows, StreamingRows

__all__ = ["load_rows", "parse_split", "SUFFIXES"]

# suffix -> reader kind; ".gz" variants are handled by stripping ".gz" first.
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv",
            ".parquet": "parquet", ".pq": "parquet"}

Numbered = Iterator[tuple[int, dict]]


def parse_split(split: str | None) -> tuple[str | None, slice | None]:
    """``"train"`` -> ("train", None); ``"test[:100]"`` -> ("test", slice(None, 100))."""
    if split is None:
        return None, None
    m = re.fullmatch(r"\s*([\w.-]*)\s*(?:\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\])?\s*", split)
    if not m:
        raise DataError(None, None, None, f"bad split {split!r}: expected NAME or NAME[start:stop]")
    name, a, b = m.groups()
    sl = None if a is None else slice(int(a) if a else None, int(b) if b else None)
    return name or None, sl


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    return SUFFIXES.get(Path(name).suffix)


def _looks_local(source: str) -> bool:
    """A path the user clearly meant as a file: never send those to the hub."""
    return (source.startswith((".", "/", "~")) or "\\" in source
            or any(source.lower().endswith(s) or source.lower().endswith(s + ".gz") for s in SUFFIXES))


def load_rows(source: str, split: str | None = None, *, streaming: bool = False) -> Rows | StreamingRows:
    """Load rows from ``source``: a .jsonl/.json/.csv/.parquet file (optionally .gz, except
    parquet), a ``save_to_disk`` directory (Dataset or DatasetDict), a directory holding
    ``<split>.<ext>`` files, a reasoning-gym task (``reasoning_gym:<task>?size=N&seed=S``: its
    generated entries, in memory even with ``streaming=True``), or else a hub dataset name
    through ``datasets.load_dataset``.

    ``split`` picks the split (default "train") and may carry a slice: ``"train[:1000]"``.
    ``streaming=True`` reads lazily (a :class:`StreamingRows`; one pass per iteration).
    Every failure is a one-line :class:`DataError`.
    """
    source = str(source)
    name, sl = parse_split(split)
    path = Path(source).expanduser()
    if is_reasoning_gym(source):
        if name not in (None, "train"):
            raise DataError(source, None, None, f"split {name!r} requested but a reasoning-gym "
                            "task has only one split")
        rows = reasoning_gym_rows(source)
    elif path.is_file():
        if name not in (None, "train"):
            raise DataError(source, None, None,
                            f"split {name!r} requested but a single file has only one split")
        rows = _load_file(path, source, streaming)
    elif path.is_dir():
        rows = _load_dir(path, source, name or "train", streaming)
    elif _looks_local(source):
        raise DataError(None, None, None, f"cannot load {source!r}: no such file or directory")
    else:
        rows = _load_hub(source, name or "train", streaming)
    if sl is not None:
        if isinstance(rows, Rows):
            rows = rows[sl]
        elif (sl.start or 0) >= 0 and (sl.stop is None or sl.stop >= 0):
            rows = rows.take(sl.start, sl.stop)
        else:
            raise DataError(source, None, None, "negative split slices need streaming=False")
    return rows


def _load_file(path: Path, source: str, streaming: bool) -> Rows | StreamingRows:
    kind = _kind(path)
    readers = {"jsonl": _iter_jsonl, "json": _iter_json, "csv": _iter_csv, "parquet": _iter_parquet}
    if kind not in readers:
        raise DataError(source, None, None, f"unsupported file type {''.join(path.suffixes)!r}; "
                        "expected .jsonl, .json, .csv (optionally .gz) or .parquet")
    reader = readers[kind]
    if streaming:
        return StreamingRows(lambda: reader(path, source), source)
    numbers, data = [], []
    for n, row in reader(path, source):
        numbers.append(n)
        data.append(row)
    return Rows(data, source, numbers)


def _load_dir(path: Path, source: str, split: str, streaming: bool) -> Rows | StreamingRows:
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # corrupt or version-incompatible directory
            raise DataError(source, None, None, f"cannot load save_to_disk directory: {_first_line(e)}") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(source, None, None,
                                f"no split {split!r}; available: {', '.join(ds) or 'none'}")
            ds, label = ds[split], f"{source}[{split}]"
        else:
            saved = str(ds.split) if ds.split is not None else None
            if split != "train" and split != saved:
                raise DataError(source, None, None, f"no split {split!r}: the directory holds a "
                                f"single Dataset{f' (split {saved!r})' if saved else ''}")
            label = source
        if streaming:
            return StreamingRows(lambda: enumerate(iter(ds), start=1), label)
        return Rows(ds, label)
    # A plain directory of files named after their split: train.jsonl, test.parquet, ...
    found = sorted(p for p in path.iterdir() if p.is_file() and _kind(p)
                   and p.name.split(".")[0] == split)
    if len(found) == 1:
        return _load_file(found[0], str(Path(source) / found[0].name), streaming)
    what = "several files" if found else "no save_to_disk dataset and no file"
    raise DataError(source, None, None, f"{what} for split {split!r} (expected {split}.jsonl, "
                    f"{split}.json, {split}.csv or {split}.parquet)")


def _load_hub(source: str, split: str, streaming: bool) -> Rows | StreamingRows:
    try:
        import datasets

        ds = datasets.load_dataset(source, split=split, streaming=streaming)
    except Exception as e:  # offline, missing, gated, bad config... all end the same way
        raise DataError(None, None, None, f"cannot load {source!r}: not a local file/dir and hub "
                        f"load failed: {type(e).__name__}: {_first_line(e)}") from e
    label = f"{source}[{split}]"
    if streaming:
        return StreamingRows(lambda: enumerate(iter(ds), start=1), label)
    return Rows(ds, label)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------- readers: yield (row_number, row)

def _open(path: Path, source: str):
    """Binary file handle; gzip-transparent. Errors opening become DataErrors by the caller."""
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _read_lines(path: Path, source: str) -> Iterator[tuple[int, int, bytes]]:
    """(line_number, byte_offset, raw_line) for every line; gzip corruption -> DataError."""
    lineno, offset = 0, 0
    try:
        with _open(path, source) as f:
            for lineno, raw in enumerate(f, start=1):
                yield lineno, offset, raw
                offset += len(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(source, lineno or None, None, f"cannot read file: {_first_line(e)}") from e


def _decode(raw: bytes) -> tuple[str, UnicodeDecodeError | None]:
    """Decode UTF-8; on failure keep going with surrogate escapes so that we can parse the line
    and name the *field* holding the bad bytes, then report it (see ``_bad_utf8``)."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return raw.decode("utf-8", "surrogateescape"), e


def _has_escape(s: str) -> bool:
    return any("\udc80" <= c <= "\udcff" for c in s)


def _bad_field(obj: Any, path: str = "") -> str | None:
    """Path (``messages[1].content``) of the first string or key holding surrogate-escaped
    bytes, i.e. the field that had invalid UTF-8 in the file."""
    if isinstance(obj, str):
        return (path or None) if _has_escape(obj) else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            if _has_escape(str(k)):
                return key
            found = _bad_field(v, key)
            if found:
                return found
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _bad_field(v, f"{path}[{i}]")
            if found:
                return found
    return None


def _bad_utf8(source: str, line: int, field: str | None, err: UnicodeDecodeError, offset: int) -> DataError:
    byte = err.object[err.start]
    return DataError(source, line, field, f"invalid UTF-8: byte 0x{byte:02x} at byte offset "
                     f"{offset + err.start} of the file (not UTF-8 text? re-encode the file as UTF-8)")


def _parse_json_line(text: str, source: str, line: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(source, line, None, f"malformed JSON: {e.msg} (column {e.colno})") from None


def _check_object(obj: Any, source: str, line: int) -> dict:
    if not isinstance(obj, dict):
        raise DataError(source, line, None, f"expected a JSON object per row, got {type(obj).__name__}")
    return obj


def _iter_jsonl(path: Path, source: str) -> Numbered:
    for line, offset, raw in _read_lines(path, source):
        text, err = _decode(raw)
        if line == 1:
            text = text.removeprefix("\ufeff")  # tolerate a UTF-8 byte-order mark
        if not text.strip():
            continue
        if err is not None:
            try:
                field = _bad_field(json.loads(text))
            except json.JSONDecodeError:
                field = None
            raise _bad_utf8(source, line, field, err, offset)
        yield line, _check_object(_parse_json_line(text, source, line), source, line)


def _iter_json(path: Path, source: str) -> Numbered:
    """A JSON array of objects (row number = line where each object starts), or JSON Lines
    saved with a .json name (as ``datasets``' ``to_json`` writes by default)."""
    try:
        with _open(path, source) as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(source, None, None, f"cannot read file: {_first_line(e)}") from e
    text, err = _decode(raw)
    text = text.removeprefix("\ufeff")
    if not text.lstrip().startswith("["):
        yield from _iter_jsonl(path, source)
        return
    elements = []  # (line, start, end, obj)
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    line = 1 + text.count("\n", 0, pos)
    ws = re.compile(r"\s*")
    while True:
        nxt = ws.match(text, pos).end()
        line += text.count("\n", pos, nxt)
        pos = nxt
        if pos < len(text) and text[pos] == "]" and not elements:
            break
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if err is not None:  # undecodable bytes are the likelier root cause
                raise _bad_utf8(source, 1 + raw[:err.start].count(b"\n"), None, err, 0) from None
            raise DataError(source, e.lineno, None, f"malformed JSON: {e.msg} (column {e.colno})") from None
        elements.append((line, pos, end, obj))
        line += text.count("\n", pos, end)
        nxt = ws.match(text, end).end()
        line += text.count("\n", end, nxt)
        pos = nxt
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos < len(text) and text[pos] == "]":
            break
        col = pos - text.rfind("\n", 0, pos)
        raise DataError(source, line, None, f"malformed JSON: expected ',' or ']' (column {col})")
    rest = text[pos + 1:]
    if rest.strip():  # e.g. two arrays concatenated: refuse rather than silently ignore data
        extra = pos + 1 + (len(rest) - len(rest.lstrip()))
        raise DataError(source, 1 + text.count("\n", 0, extra), None, "malformed JSON: extra data after the array")
    if err is not None:  # name the row and field holding the bad bytes
        bad = next(i for i, c in enumerate(text) if _has_escape(c))
        bad_line = 1 + text.count("\n", 0, bad)
        field = next((_bad_field(o) for _, s, e, o in elements if s <= bad < e), None)
        raise _bad_utf8(source, bad_line, field, err, 0)
    for line, _, _, obj in elements:
        yield line, _check_object(obj, source, line)


# Columns that hold lists in the formats: in CSV they are JSON-encoded cells.
_LIST_COLUMNS = {"messages", "completions", "labels"}
_MAYBE_CONVERSATIONAL = {"prompt", "completion", "chosen", "rejected"}
_BOOL = {"true": True, "false": False, "1": True, "0": False}


def _csv_cell(column: str, value: str) -> Any:
    """CSV has only strings. Convert what the formats need typed: ``label`` booleans
    (true/false/1/0) and JSON-encoded lists (``messages``, ``completions``, ``labels`` and
    conversational ``prompt``/``completion``/``chosen``/``rejected``). Everything else stays a
    string, so e.g. a numeric ``answer`` column keeps its exact text."""
    if column == "label" and value.strip().lower() in _BOOL:
        return _BOOL[value.strip().lower()]
    s = value.lstrip()
    if (column in _LIST_COLUMNS and s.startswith("[")) or \
            (column in _MAYBE_CONVERSATIONAL and s.startswith("[{")):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value  # validation will say what is wrong with it
    return value


def _iter_csv(path: Path, source: str) -> Numbered:
    csv.field_size_limit(2**31 - 1)  # long documents: the default limit is 128 KiB per cell
    bad: list = []  # first (line, offset, UnicodeDecodeError) seen in the current record

    def lines() -> Iterator[str]:
        for line, offset, raw in _read_lines(path, source):
            text, err = _decode(raw)
            if err is not None and not bad:
                bad.append((line, offset, err))
            yield text.removeprefix("\ufeff") if line == 1 else text

    reader = csv.reader(lines())
    start = 1
    header = None
    try:
        for record in reader:
            end = reader.line_num
            if bad:
                line, offset, err = bad[0]
                names = header or [f"column {i + 1}" for i in range(len(record))]
                field = next((n for n, v in zip(names, record) if _has_escape(v)), None)
                raise _bad_utf8(source, line, field, err, offset)
            if header is None:
                header = [h.strip() for h in record]
                dup = {h for h in header if header.count(h) > 1}
                if not record or dup or "" in header:
                    raise DataError(source, start, None, "bad CSV header: "
                                    + (f"duplicate column {sorted(dup)[0]!r}" if dup else "empty column name"))
            elif record:  # csv yields [] for blank lines
                if len(record) != len(header):
                    raise DataError(source, start, None, f"expected {len(header)} fields "
                                    f"({', '.join(header)}), found {len(record)}")
                yield start, {h: _csv_cell(h, v) for h, v in zip(header, record)}
            start = end + 1
    except csv.Error as e:
        raise DataError(source, start, None, f"malformed CSV: {e}") from None


def _iter_parquet(path: Path, source: str) -> Numbered:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        n = 0
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield n, row
    except DataError:
        raise
    except Exception as e:  # ArrowInvalid, OSError: not parquet, truncated, ...
        raise DataError(source, None, None, f"cannot read parquet: {_first_line(e)}") from e
