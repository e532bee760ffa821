"""Row containers that remember where each row came from.

Everything downstream (validation, tokenization, trainers) iterates plain ``dict`` rows, but error
messages must say ``file.jsonl:17``. So the loader returns a :class:`Rows` (in memory, random
access, ``len``) or a :class:`StreamingRows` (lazy, single pass per iteration); both carry
``source`` and a 1-based row number per row (the physical line for JSON Lines).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

__all__ = ["Rows", "StreamingRows", "as_rows"]

Row = dict[str, Any]


class Rows(Sequence):
    """An in-memory sequence of dict rows with a source name and 1-based row numbers.

    ``data`` is a list of dicts or anything indexable that yields dicts (a ``datasets.Dataset``
    is kept as is, memory-mapped, rather than copied into Python objects).
    """

    def __init__(self, data: Sequence[Row], source: str = "<rows>",
                 row_numbers: Sequence[int] | None = None, format: str | None = None):
        if row_numbers is not None and len(row_numbers) != len(data):
            raise ValueError("row_numbers must have one entry per row")
        self._data = data
        self.source = source
        self._numbers = list(row_numbers) if row_numbers is not None else None
        self.format = format  # set by tether.data.load_data once detected/validated

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.select(range(len(self))[i])
        if i < 0:
            i += len(self)
        return self._data[i]

    def __iter__(self) -> Iterator[Row]:
        return iter(self._data)

    def __repr__(self) -> str:
        fmt = f", format={self.format!r}" if self.format else ""
        return f"Rows({self.source!r}, {len(self)} rows{fmt})"

    def row_number(self, i: int) -> int:
        """1-based row number of the i-th row (0-based index), as shown in error messages."""
        return self._numbers[i] if self._numbers is not None else i + 1

    def where(self, i: int) -> str:
        """``"<source>:<row>"`` for the i-th row, e.g. ``data/x.jsonl:17``."""
        return f"{self.source}:{self.row_number(i)}"

    def numbered(self) -> Iterator[tuple[int, Row]]:
        """Yield ``(row_number, row)`` pairs."""
        if self._numbers is None:
            return ((i + 1, row) for i, row in enumerate(self._data))
        return zip(self._numbers, self._data)

    @property
    def columns(self) -> list[str]:
        """Column names: the Dataset's, or the union of keys over all rows in first-seen order."""
        names = getattr(self._data, "column_names", None)
        if names is not None:
            return list(names)
        seen: dict[str, None] = {}
        for row in self._data:
            for k in row:
                seen.setdefault(k)
        return list(seen)

    def select(self, indices: Iterable[int]) -> Rows:
        idx = list(indices)
        data = [self._data[i] for i in idx]
        return Rows(data, self.source, [self.row_number(i) for i in idx], self.format)

    def map(self, fn: Callable[[Row, int], Row], format: str | None = None) -> Rows:
        """A new Rows with ``fn(row, row_number)`` applied to every row; numbering is kept."""
        out, numbers = [], []
        for n, row in self.numbered():
            out.append(fn(row, n))
            numbers.append(n)
        return Rows(out, self.source, numbers, format or self.format)

    def shard(self, rank: int, world_size: int) -> Rows:
        """Rows ``rank, rank + world_size, ...`` — every row goes to exactly one rank."""
        return self.select(range(rank, len(self), world_size))

    def to_list(self) -> list[Row]:
        return [dict(r) for r in self._data]


class StreamingRows:
    """A lazily read iterable of rows. ``factory`` returns a fresh iterator of
    ``(row_number, row)`` each time, so the stream can be iterated once per epoch."""

    def __init__(self, factory: Callable[[], Iterator[tuple[int, Row]]], source: str = "<stream>",
                 format: str | None = None):
        self._factory = factory
        self.source = source
        self.format = format

    def numbered(self) -> Iterator[tuple[int, Row]]:
        return self._factory()

    def __iter__(self) -> Iterator[Row]:
        return (row for _, row in self._factory())

    def __repr__(self) -> str:
        return f"StreamingRows({self.source!r})"

    def where(self, row_number: int) -> str:
        return f"{self.source}:{row_number}"

    @property
    def columns(self) -> list[str]:
        """Keys of the first row (reads one row)."""
        first = next(iter(self), None)
        return list(first) if first is not None else []

    def map(self, fn: Callable[[Row, int], Row], format: str | None = None) -> StreamingRows:
        factory = self._factory
        return StreamingRows(lambda: ((n, fn(r, n)) for n, r in factory()), self.source,
                             format or self.format)

    def take(self, start: int | None, stop: int | None) -> StreamingRows:
        factory = self._factory
        return StreamingRows(lambda: itertools.islice(factory(), start, stop), self.source,
                             self.format)

    def shard(self, rank: int, world_size: int) -> StreamingRows:
        factory = self._factory
        return StreamingRows(lambda: itertools.islice(factory(), rank, None, world_size),
                             self.source, self.format)


def as_rows(data: Any, source: str | None = None) -> Rows | StreamingRows:
    """Wrap a list of dicts, a ``datasets.Dataset``/``IterableDataset`` or an existing Rows."""
    if isinstance(data, (Rows, StreamingRows)):
        if source is not None:
            data.source = source
        return data
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return Rows(data, source or "<rows>")
    if isinstance(data, Iterable):  # e.g. datasets.IterableDataset: re-iterable, no len
        return StreamingRows(lambda: enumerate(iter(data), start=1), source or "<stream>")
    raise TypeError(f"expected rows (list of dicts, datasets.Dataset, Rows), got {type(data).__name__}")
