"""What every studio page shares on the server: the studio's state, the list of known runs and the
only way a request reaches a file.

Security rule: a request never carries a path. It names a run by its id (the run directory's path
relative to runs_dir, as listed by :func:`known_runs`); the id is looked up in a fresh scan of
runs_dir, and a file of that run is one of a fixed set of names (:func:`run_file`). Symlinked
directories are not followed and a file whose real path leaves its run directory is refused, so
`..`, absolute paths and symlinks all end in 404. The studio only reads run directories; the
labeler writes its own files under its own output directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request

# files a run directory holds that a page may read (run.py's contract)
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json")
# directories inside a run that are never runs themselves (pruned from the scan: they can be big)
NOT_RUNS = {"checkpoints", "plots", "tensorboard", "wandb", "mlruns", "__pycache__"}  # (wandb's runs hold a config.yaml)
SCAN_DEPTH = 4  # runs/<study>/<sub>/<run>: studies nest their runs two or three deep


@dataclass
class Studio:
    """The app's state (``request.app.state.studio``): the config and whatever a page keeps."""
    cfg: Any
    "the StudioConfig the app was made with"
    runs_dir: Path
    "the runs directory (resolved)"
    token: str | None = None
    "the access token when bound beyond loopback; None on 127.0.0.1"
    pages: dict = field(default_factory=dict)
    "per-page state: a page module keeps its own objects under its name (e.g. the labeler's session)"
    _lock: threading.Lock = field(default_factory=threading.Lock)


def get_studio(request: Request) -> Studio:
    return request.app.state.studio


def _is_run(path: Path) -> bool:
    return any((path / n).is_file() for n in ("config.yaml", "metrics.jsonl", "summary.json"))


def known_runs(studio: Studio) -> dict[str, Path]:
    """{run id: directory} for every run under runs_dir (a directory holding config.yaml,
    metrics.jsonl or summary.json), depth <= SCAN_DEPTH, symlinked directories skipped. Scanned
    afresh on every call (a few stat calls per run; checkpoints/ and plots/ are never entered), so
    a run appears as soon as its first file does."""
    runs = {}
    root = studio.runs_dir
    if root.is_dir():
        for dirpath, dirnames, _ in os.walk(root, followlinks=False):
            here = Path(dirpath)
            depth = len(here.relative_to(root).parts)
            dirnames[:] = sorted(d for d in dirnames if d not in NOT_RUNS and not d.startswith(".")
                                 and not (here / d).is_symlink() and depth < SCAN_DEPTH)
            if here != root and _is_run(here):
                runs[here.relative_to(root).as_posix()] = here
    return runs


def resolve_run(request: Request, run_id: str) -> Path:
    """The directory of a known run, or 404. The id is a key, never joined to a path."""
    runs = known_runs(get_studio(request))
    path = runs.get(run_id)
    if path is None:
        raise HTTPException(404, f"no run {run_id!r}")
    return path


def run_file(run_dir: Path, name: str) -> Path | None:
    """`run_dir/name` for a name of RUN_FILES that exists as a regular file inside the run (a
    symlink pointing elsewhere is refused); None when absent. Other names are a programming error."""
    if name not in RUN_FILES:
        raise ValueError(f"not a run file: {name}")
    p = run_dir / name
    if p.is_symlink() or not p.is_file():
        return None
    if os.path.commonpath([os.path.realpath(p), os.path.realpath(run_dir)]) != os.path.realpath(run_dir):
        return None
    return p


def run_status(run_dir: Path) -> str:
    """running (a process holds the run's flock: tether.run.RunLock), finished (summary.json
    written, which every command does last) or failed (stopped without a summary)."""
    lock = run_dir / ".lock"
    if lock.is_file() and _flock_held(lock):
        return "running"
    return "finished" if (run_dir / "summary.json").is_file() else "failed"


def _flock_held(path: Path) -> bool:
    """Whether some process holds a flock on `path`. Read from /proc/locks (Linux) so the studio
    never takes the lock itself, even for an instant: a run starting at that moment would be
    refused. Elsewhere, a non-blocking shared lock taken and dropped at once."""
    try:
        st = os.stat(path)  # /proc/locks names a file as major:minor:inode (kernel's "%02x:%02x:%lu")
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == key:
                    return True
        return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class JsonlTail:
    """Rows of a JSONL file that another process may be appending to, read incrementally.

    Each `read()` parses only the bytes added since the last one, up to the last complete line (a
    line still being written is left for the next read). A line that is not a JSON object is
    skipped and counted (`bad`), not fatal: one corrupt line must not hide the rest of a run. A file
    that shrank or was replaced (resume's truncate_after rewrites it) is read again from the start.
    A subclass keeps something other than the rows by overriding `reset`, `add` and `add_many`."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._ino = None
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.rows: list[dict] = []
        self.bad = 0

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def add_many(self, rows: list[dict]) -> None:
        for r in rows:
            self.add(r)

    def unread(self) -> int:
        """Bytes written since the last read (the whole file when it was replaced)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return 0
        return st.st_size if st.st_ino != self._ino or st.st_size < self._offset else st.st_size - self._offset

    def read(self):
        """Parse what was appended; returns self.rows (a subclass: whatever it keeps)."""
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                self._offset, self._ino = 0, None
                self.reset()
                return self.rows
            if st.st_ino != self._ino or st.st_size < self._offset:
                self._offset, self._ino = 0, st.st_ino
                self.reset()
            if st.st_size > self._offset:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    left, rest = st.st_size - self._offset, b""
                    # in blocks: one splitlines over a 100 MB file holds the GIL for ~0.5 s, and a
                    # big first read runs in a thread beside the requests (runs.py)
                    while left > 0:
                        block = rest + f.read(min(left, self.BLOCK))
                        left -= len(block) - len(rest)
                        end = block.rfind(b"\n") + 1  # complete lines only
                        self._parse(block[:end])
                        self._offset += end
                        rest = block[end:]
            return self.rows

    BLOCK = 1 << 20
    "bytes read and parsed at a time"

    def _parse(self, text: bytes) -> None:
        batch: list[dict] = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict):
                batch.append(row)
            else:
                self.bad += 1
        self.add_many(batch)

    @property
    def version(self) -> str:
        """Changes whenever new complete lines were read (what a polling page compares)."""
        return f"{self._ino}:{self._offset}"


def last_rows(path: Path, nbytes: int = 1 << 16) -> list[dict]:
    """The JSON objects of the complete lines in the last `nbytes` of a file (the first, likely
    cut, line dropped): a big file's latest rows without reading all of it."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - nbytes))
            chunk = f.read()
    except OSError:
        return []
    lines = chunk[:chunk.rfind(b"\n") + 1].splitlines()
    if size > nbytes:
        lines = lines[1:]
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def strided_rows(path: Path, count: int, window: int = 1 << 14) -> list[dict]:
    """About `count` JSON objects spread evenly over a file, without reading all of it: the first
    complete line after each of `count` evenly spaced byte offsets before the last `window`
    bytes, then the complete lines of those (last_rows). A JSONL log is in step order, so even
    offsets are roughly even steps: a preview of a big file's curves in milliseconds, where
    parsing all of it takes seconds."""
    rows, starts = [], set()
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            body = max(0, size - window)  # last_rows covers the rest
            for i in range(count if body else 0):
                offset = body * i // count
                f.seek(offset)
                chunk = f.read(window)
                start = 0 if offset == 0 else chunk.find(b"\n") + 1  # the line the offset fell in is cut
                end = chunk.find(b"\n", start)
                if (offset and start == 0) or end < 0 or offset + start >= body or offset + start in starts:
                    continue  # no line boundary in the window, past the body, or a line already taken
                starts.add(offset + start)
                try:
                    row = json.loads(chunk[start:end])
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except OSError:
        return []
    return rows + last_rows(path, window)


def tail_of(studio: Studio, path: Path, kind: type = JsonlTail) -> JsonlTail:
    """The one `kind` (JsonlTail or a subclass) of `path` for this app, kept across requests so
    reads stay incremental."""
    tails = studio.pages.setdefault("_tails", {})
    with studio._lock:
        t = tails.get((path, kind))
        if t is None:
            t = tails[(path, kind)] = kind(path)
        return t


def read_json(path: Path | None, default=None):
    """A JSON file's content, or `default` when it is absent or not (yet) valid JSON."""
    if path is None:
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default
