"""Background work of the live pages: a POST starts a job in a thread, the page polls a GET.

A job is a function `fn(job)` that sets `job.progress` (0..1) and `job.message` as it goes and may
append finished pieces to `job.partial` (the page draws them as they come); its return value is
`job.result`. An exception ends it in state "error" with its one-line message (a UserError's text
is meant for the user; anything else is named by its type). Jobs of one page run one at a time
(the machine's cores are shared with training runs), in the order they were started.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import HTTPException

from tether.errors import UserError
from tether.studio.common import Studio

KEEP = 20  # finished jobs kept per page (the page polls its own; older ones are forgotten)
_IDS = itertools.count(1)


@dataclass
class Job:
    id: str
    state: str = "queued"
    "queued | running | done | error"
    progress: float = 0.0
    message: str = ""
    partial: list = field(default_factory=list)
    result: Any = None
    error: str | None = None

    def view(self) -> dict:
        return {"id": self.id, "state": self.state, "progress": self.progress, "message": self.message,
                "partial": list(self.partial), "result": self.result, "error": self.error}


def _page(studio: Studio, page: str) -> dict:
    with studio._lock:
        return studio.pages.setdefault(page, {}).setdefault("_jobs", {"jobs": {}, "lock": threading.Lock()})


def start(studio: Studio, page: str, fn: Callable[[Job], Any]) -> Job:
    """Run fn(job) in a background thread (after the page's earlier jobs); returns the job."""
    state = _page(studio, page)
    job = Job(id=str(next(_IDS)))

    def work():
        with state["lock"]:
            job.state = "running"
            try:
                job.result = fn(job)
                job.progress, job.state = 1.0, "done"
            except UserError as e:
                job.state, job.error = "error", str(e)
            except Exception as e:  # noqa: BLE001 - the page shows it; the server keeps serving
                first = str(e).splitlines()[0] if str(e) else ""
                job.state, job.error = "error", f"{type(e).__name__}: {first}"

    jobs = state["jobs"]
    jobs[job.id] = job
    for old in [k for k, j in jobs.items() if j.state in ("done", "error")][:-KEEP]:
        jobs.pop(old, None)
    threading.Thread(target=work, daemon=True, name=f"studio-{page}-{job.id}").start()
    return job


def get(studio: Studio, page: str, job_id: str) -> dict:
    job = _page(studio, page)["jobs"].get(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job.view()
