"""The one error type of the data layer.

Every problem with user data (unreadable file, malformed JSON, wrong column, wrong type, empty
string, ...) is raised as a :class:`DataError` whose ``str`` is exactly ONE line::

    <file>:<row>:<field>: <what is wrong>

``row`` and ``field`` are left out when they do not apply (``data.jsonl: dataset is empty``,
``data.jsonl:17: malformed JSON: ...``). The CLI prints ``str(err)`` and exits, so the message
must stand on its own and must never span lines (user values are shown with ``repr`` and cut).
"""

from __future__ import annotations

from tether.errors import UserError

__all__ = ["DataError", "show"]


def show(value: object, limit: int = 40) -> str:
    """A short, single-line rendering of a user value for error messages."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


class DataError(UserError):
    """A problem with user data, located by source file, row and field.

    ``row`` is 1-based: the physical line number for JSON Lines (and JSON/CSV where known),
    otherwise the record index counting from 1 (see ``docs/data.md``).
    """

    def __init__(self, source: str | None, row: int | None, field: str | None, message: str):
        self.source = source  # None: the message names what failed itself (e.g. hub loads)
        self.row = row
        self.field = field
        # One line, always: a multi-line message would break the CLI's contract.
        self.message = " ".join(str(message).split("\n")).strip()
        super().__init__(self.__str__())

    def __str__(self) -> str:
        parts = [p for p in (self.source, self.row, self.field) if p is not None]
        if not parts:
            return self.message
        return ":".join(str(p) for p in parts) + f": {self.message}"

    def __reduce__(self):  # keep it picklable (datasets / multiprocessing workers)
        return (type(self), (self.source, self.row, self.field, self.message))
