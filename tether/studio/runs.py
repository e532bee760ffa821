"""Page 1, Runs: every run under runs_dir (command, status, last step, headline metric); a run's
curves, smoothed (series.ema) and downsampled (series.downsample) server-side, polled while the
run writes; its samples, filterable by step and sortable by reward.

Everything read here goes through common.py's run lookup (a run id, never a path) and its
incremental JSONL reader (a file being appended, a corrupt line, a file replaced on resume)."""

from __future__ import annotations

import json
import os
import threading

import yaml
from fastapi import APIRouter, Query, Request, Response

from tether.studio import series
from tether.studio.common import (JsonlTail, get_studio, known_runs, last_rows, read_json, resolve_run, run_file,
                                  run_status, strided_rows, tail_of)

TITLE = "Runs"
router = APIRouter(prefix="/api/runs")

# The metric a run's row shows, first one logged wins: the training reward of RL, held-out
# pass@1, a reward model's or DPO's accuracy, then the loss every trainer logs.
HEADLINE = ("reward", "eval/pass@1", "pass@1", "eval/accuracy", "accuracy", "rewards/accuracies",
            "eval/loss", "loss")
# The curves the page draws first (the rest are one click away), in this order.
DEFAULT_CURVES = ("reward", "kl", "loss", "entropy", "lr", "grad_norm", "eval/pass@1", "pass@1",
                  "accuracy", "eval/accuracy")


def _flat(tree, out=None) -> dict:
    """A config.yaml's leaves by their last name (sections flattened, as the CLI accepts them)."""
    out = {} if out is None else out
    for k, v in (tree or {}).items():
        if isinstance(v, dict):
            _flat(v, out)
        else:
            out[str(k)] = v
    return out


_SIGNATURES: dict | None = None
_SIGNATURES_LOCK = threading.Lock()


def _command_signatures() -> dict:
    """{command: {leaf name: default as describe() shows it}} for every command with a config
    (tether.cli.COMMANDS: the registry is the one list of commands). Importing every command's
    module takes seconds: `startup` starts it when the app is made, a request waits for the rest."""
    global _SIGNATURES
    from tether.cli import COMMANDS, load_command
    from tether.config import describe

    with _SIGNATURES_LOCK:
        if _SIGNATURES is None:
            sigs = {}
            for name in COMMANDS:
                try:
                    cfg_cls, _ = load_command(name)
                except Exception:  # noqa: BLE001 - a command whose optional extra is missing is just not guessed
                    continue
                sigs[name] = {key.rsplit(".", 1)[-1]: default for key, _, default, _ in describe(cfg_cls)}
            _SIGNATURES = sigs
        return _SIGNATURES


def startup(studio) -> None:
    """Called once by create_app: the commands' signatures load while the person opens the page."""
    threading.Thread(target=_command_signatures, daemon=True).start()


def infer_command(config: dict) -> str:
    """The command that wrote a run's config.yaml. config.yaml is the resolved config with no
    command name in it, so: the command whose option names match the file's best (Jaccard), ties
    broken by how many values equal that command's defaults (rloo's preset vs grpo's)."""
    leaves = _flat(config)
    if not leaves:
        return "?"
    best, best_key = "?", (0.0, -1)
    for name, sig in _command_signatures().items():
        keys = set(sig)
        jaccard = len(keys & set(leaves)) / len(keys | set(leaves))
        same = sum(1 for k, v in leaves.items() if k in sig and sig[k] == (repr(v) if isinstance(v, str) else str(v)))
        if (jaccard, same) > best_key:
            best, best_key = name, (jaccard, same)
    return best if best_key[0] >= 0.5 else "?"


def _config(run_dir) -> dict:
    p = run_file(run_dir, "config.yaml")
    if p is None:
        return {}
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


class MetricsTail(JsonlTail):
    """A metrics.jsonl read incrementally into series.Columns (the rows themselves are not kept:
    100k rows of 30 metrics as dicts would take hundreds of MB)."""

    def reset(self) -> None:
        self.rows = self.cols = series.Columns()
        self.bad = 0

    def add(self, row: dict) -> None:
        self.cols.add(row)

    def add_many(self, rows: list[dict]) -> None:
        self.cols.add_many(rows)


BIG = 4 << 20
"unread bytes of metrics.jsonl beyond which the runs list reads the file in the background"


def headline(cols: series.Columns) -> dict | None:
    """{name, value, step} of the first HEADLINE metric logged, at the last row logging it."""
    for name in HEADLINE:
        if name in cols.last:
            step, value = cols.last[name]
            return {"name": name, "value": value, "step": step}
    return None


def _load_in_background(studio, tail: MetricsTail) -> None:
    """One reader thread per app: a big file is parsed once, while the list shows its last lines."""
    with studio._lock:
        loading = studio.pages.setdefault("_loading", set())
        if tail.path in loading:
            return
        loading.add(tail.path)

    def work():
        try:
            tail.read()
        finally:
            with studio._lock:
                loading.discard(tail.path)
    threading.Thread(target=work, daemon=True).start()


def _command_of(studio, run_dir) -> str:
    """infer_command of the run's config.yaml, cached while the file is unchanged (the list is polled)."""
    p = run_file(run_dir, "config.yaml")
    try:
        st = os.stat(p) if p is not None else None
    except OSError:
        st = None
    key = (str(run_dir), st and (st.st_mtime_ns, st.st_size))
    cache = studio.pages.setdefault("_commands", {})
    if key not in cache:
        cache[key] = infer_command(_config(run_dir))
    return cache[key]


def run_row(studio, run_id: str, run_dir) -> dict:
    """One line of the runs table."""
    mpath = run_file(run_dir, "metrics.jsonl")
    cols, bad, loading = series.Columns(), 0, False
    if mpath is not None:
        tail = tail_of(studio, mpath, MetricsTail)
        if tail.unread() > BIG:  # not parsed yet: its last lines now, the whole file in the background
            _load_in_background(studio, tail)
            for r in last_rows(mpath):
                cols.add(r)
            loading = True
        else:
            cols, bad = tail.read(), tail.bad
    try:
        mtime = max(os.stat(p).st_mtime for p in (run_dir, mpath) if p is not None)
    except OSError:
        mtime = None
    return {"id": run_id, "command": _command_of(studio, run_dir), "status": run_status(run_dir),
            "last_step": cols.last_step, "headline": headline(cols), "rows": None if loading else cols.rows,
            "bad_lines": None if loading else bad, "modified": mtime}


@router.get("/list")
def list_runs(request: Request):
    studio = get_studio(request)
    runs = known_runs(studio)
    out = [run_row(studio, rid, path) for rid, path in runs.items()]
    out.sort(key=lambda r: -(r["modified"] or 0))  # most recent first
    return {"runs_dir": str(studio.runs_dir), "runs": out}


@router.get("/metrics")
def metrics(request: Request, run: str, smooth: float = Query(0.0, ge=0.0, lt=1.0),
            max_points: int = Query(2000, ge=4, le=100_000), names: str = "", since: str = ""):
    """A run's curves: {version, rows, bad_lines, metrics: {name: {x, y, n}}} with y smoothed by
    `smooth` (series.ema) then downsampled to `max_points` (series.downsample); n = points before
    downsampling. `names`: comma-separated metrics to send (default all). `since`: the version the
    page has; when nothing new was written the answer is {version, unchanged: true}."""
    studio = get_studio(request)
    run_dir = resolve_run(request, run)
    mpath = run_file(run_dir, "metrics.jsonl")
    if mpath is None:
        return {"version": "none", "rows": 0, "bad_lines": 0, "metrics": {}, "names": [], "defaults": [],
                "status": run_status(run_dir)}
    tail = tail_of(studio, mpath, MetricsTail)
    if tail.unread() > BIG:  # never hold a request for a big first read: the page polls until it is done
        _load_in_background(studio, tail)
        # meanwhile the curves of PREVIEW_ROWS rows spread over the file (strided_rows, a few ms):
        # the page draws them at once and replaces them when the whole file is read
        preview = series.Columns()
        preview.add_many(strided_rows(mpath, PREVIEW_ROWS))
        return _curves(preview, names, smooth, max_points,
                       {"version": "loading", "loading": True, "preview": True, "unread_bytes": tail.unread(),
                        "rows": None, "bad_lines": None, "status": run_status(run_dir)})
    cols = tail.read()
    version = tail.version
    if since and since == version:
        return {"version": version, "unchanged": True, "status": run_status(run_dir)}
    return _curves(cols, names, smooth, max_points, {"version": version, "rows": cols.rows, "bad_lines": tail.bad,
                                                     "status": run_status(run_dir)})


PREVIEW_ROWS = 2000
"rows a big unread metrics file is previewed by while it is read in the background"


def _curves(cols: series.Columns, names: str, smooth: float, max_points: int, head: dict) -> Response:
    """`head` + the curves of `cols` asked for by `names` (all when empty), smoothed then downsampled."""
    wanted = [n for n in names.split(",") if n] or list(cols.x)
    out = {}
    for name in wanted:
        if name not in cols.x:
            continue
        x, y = cols.arrays(name)
        ys = series.ema(y, smooth) if smooth > 0 else y
        dx, dy = series.downsample(x, ys, max_points)
        out[name] = {"x": dx.tolist(), "y": dy.tolist(), "n": len(x)}
    # json.dumps directly: FastAPI's encoder walks every float of the curves (~10x slower)
    return Response(json.dumps({**head, "metrics": out, "names": sorted(cols.x),
                                "defaults": [n for n in DEFAULT_CURVES if n in cols.x]}), media_type="application/json")


@router.get("/samples")
def samples(request: Request, run: str, step: int | None = None, sort: str = "", descending: bool = True,
            limit: int = Query(500, ge=1, le=10_000)):
    """A run's samples.jsonl rows ({step, prompt, completion, reward..., any other columns}), only
    those of `step` when given, sorted by the column `sort` (rows without it last), at most `limit`.
    `steps`: every step that has samples (the page's filter)."""
    studio = get_studio(request)
    run_dir = resolve_run(request, run)
    spath = run_file(run_dir, "samples.jsonl")
    rows = tail_of(studio, spath).read() if spath is not None else []
    steps = sorted({r["step"] for r in rows if isinstance(r.get("step"), int)})
    chosen = [r for r in rows if step is None or r.get("step") == step]
    if sort:
        have = [r for r in chosen if isinstance(r.get(sort), (int, float))]
        have.sort(key=lambda r: r[sort], reverse=descending)
        chosen = have + [r for r in chosen if not isinstance(r.get(sort), (int, float))]
    columns = []
    for r in chosen:
        columns += [k for k in r if k not in columns]
    return {"steps": steps, "columns": columns, "total": len(chosen), "rows": chosen[:limit]}


@router.get("/detail")
def detail(request: Request, run: str):
    """A run's resolved config and summary (as the files hold them; {} when absent or unreadable)."""
    run_dir = resolve_run(request, run)
    return {"id": run, "config": _config(run_dir), "summary": read_json(run_file(run_dir, "summary.json"), {}),
            "status": run_status(run_dir), "command": infer_command(_config(run_dir))}
