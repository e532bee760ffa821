"""The run directory: what every training or evaluation command leaves behind.

    runs/<name>/
      config.yaml        resolved config (enough to re-run)
      metrics.jsonl      {"step": int, "time": float, <metric>: float, ...} per logged step
      summary.json       final numbers
      samples.jsonl      sampled completions at eval points
      checkpoints/step-<N>/   HF model + tokenizer + trainer_state.pt
      plots/*.png        curves

Rank-aware: only rank 0 writes, so the same trainer code runs under torchrun. Files that must
never be seen half-written (config, summary, checkpoints) are written to a temporary name and
renamed; a row appended to metrics.jsonl or samples.jsonl is there whole or not at all.

A full disk (ENOSPC, a quota's EDQUOT, a file-size limit's EFBIG) while writing any of these stops
the run with one line (DiskFullError) naming the run, the file, the cause and the last complete
checkpoint, which a resume continues from: the write that failed leaves no partial row and no
temporary file, and a checkpoint cut short is never renamed into place.

Experiment trackers (`log_with`: TensorBoard, written here; wandb, trackio, mlflow through
tether.trackers) get every metrics row, the config and the samples on rank 0. A tracker that fails
(its own error, its network, its disk) is said once (`warn`) and left out for the rest of the run:
training never stops for one. TensorBoard's event files are the run directory's own and follow
the full-disk rule above.

One run at a time: rank 0 holds an exclusive lock on `<run>/.lock` (flock; pid and host written in
it) from opening the directory to `close()`, so a second run into the same directory is refused
with one line instead of interleaving its metrics and checkpoints with the first one's. A fresh
run never deletes a previous run's files unless asked (`overwrite=True`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import random
import re
import shutil
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tether import distributed, trackers
from tether.config import save_config, to_dict
from tether.errors import DiskFullError, UserError
from tether.model_card import write_model_card

TRAINER_STATE = "trainer_state.pt"
LOCK = ".lock"
# What a run leaves in its directory: a fresh run with overwrite=True removes exactly these.
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "summary.json", "checkpoints", "plots", "tensorboard",
             trackers.RECORDS, "wandb", "mlruns", "mlflow.db")


def dist_rank() -> int:
    if distributed.active():
        return distributed.rank()
    return int(os.environ.get("RANK", 0))


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)`, then `tmp` renamed to `path`; a failed write leaves `path` as it was, no tmp."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _append(path: Path, text: str) -> None:
    """Append `text` whole or not at all: a write cut short (a full disk) is cut back off, so the
    file never ends in a partial row."""
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


# The errors a full disk gives: no space, a quota, a file-size limit (`ulimit -f`, with SIGXFSZ ignored)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust writers (safetensors, tokenizers) say it


def disk_full_cause(error: BaseException, where: Path | None = None) -> tuple[int, str] | None:
    """(errno, its text) when `error` comes from a full disk, else None. Writers below Python keep
    the errno in different places: an OSError in the exception's chain (torch.save into a Python
    file), "(os error N)" in the message (Rust), "No space left on device" in the message (C++),
    one rank's exception inside torch.distributed.checkpoint's CheckpointException. Failing all of
    them, a filesystem with no block left at `where` is the cause."""
    texts = {os.strerror(code): code for code in DISK_FULL}
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e.errno, e.strerror or os.strerror(e.errno)
        message = str(e)
        m = _OS_ERROR.search(message)
        if m and int(m.group(1)) in DISK_FULL:
            return int(m.group(1)), os.strerror(int(m.group(1)))
        for text, code in texts.items():
            if text in message:
                return code, text
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()
                     if isinstance(f, (tuple, BaseException))]
    if where is not None:
        try:
            if os.statvfs(where).f_bavail == 0:
                return errno.ENOSPC, os.strerror(errno.ENOSPC)
        except OSError:
            pass
    return None


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes events from a thread that keeps a failed write's exception (a full disk)
    for the writer to raise in the caller's thread at its next write or flush (RunDir.log flushes
    every row, so it surfaces there as DiskFullError), and also lets it escape the thread, where
    threading.excepthook would print it as a traceback after the run's one line. This hook drops
    that thread's copy of the exception, and only that: everything else goes to the hook before."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard: its thread is left as it is
        return
    previous = threading.excepthook
    if getattr(previous, "tether_tensorboard", False):
        return

    def hook(args):
        if not (isinstance(args.thread, _AsyncWriterThread) and args.exc_value is args.thread.exception):
            previous(args)
    hook.tether_tensorboard = True
    threading.excepthook = hook


def _to_float(v: Any):
    if isinstance(v, torch.Tensor):
        v = v.detach().float().mean().item() if v.numel() > 1 else v.detach().item()
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    return v


def previous_run(path: str | Path) -> list[str]:
    """The files of a previous run in `path` (metrics, samples, summary, checkpoints...), if any."""
    path = Path(path)
    found = [n for n in RUN_FILES if n != "checkpoints" and (path / n).exists()]
    if any((path / "checkpoints").glob("step-*")):
        found.append("checkpoints")
    return found


def refuse_previous_run(path: str | Path, overwrite: bool) -> None:
    """A fresh run into a directory holding a previous run is an error unless `overwrite`: re-running
    a finished run by mistake (or with a typo that fails later) must not cost its results."""
    found = previous_run(path)
    if found and not overwrite:
        raise UserError(f"run directory {path} already holds a run ({', '.join(found)}): continue it "
                        f"with resume=true, choose another name=, or replace it with overwrite=true")


class RunLock:
    """An exclusive flock on `<dir>/.lock` with the holder's pid and host written in it.

    The kernel drops a flock when its holder dies (kill -9 included), so a lock left by a dead run
    never blocks; the pid and host are for the message, and for telling a dead holder from a live
    one where the filesystem has no flock (some network filesystems): there a lock file naming a
    live pid on this host, or any other host, blocks, and one naming a dead pid here is stale.
    Within one process the lock is not re-entrant across RunDirs: a later RunDir of the same path
    takes it over from an earlier one (a run that raised keeps its RunDir alive in the traceback;
    the next run of the same process must not be refused by it)."""

    _held: dict[str, "RunLock"] = {}

    def __init__(self, directory: Path):
        self.file = directory / LOCK
        self.key = os.path.realpath(self.file)
        self.fd: int | None = None
        previous = RunLock._held.get(self.key)
        if previous is not None and previous.fd is not None:
            self.fd, previous.fd = previous.fd, None  # take it over (same process, see above)
        else:
            self.fd = _take_lock(self.file)
        RunLock._held[self.key] = self

    def release(self) -> None:
        if self.fd is None:
            return
        if RunLock._held.get(self.key) is self:
            del RunLock._held[self.key]
        os.close(self.fd)  # closing the descriptor drops the flock
        self.fd = None


def _holder(fd: int) -> tuple[int, str]:
    try:
        pid, host = os.pread(fd, 4096, 0).decode("utf-8", "replace").split()[:2]
        return int(pid), host
    except (ValueError, OSError):
        return 0, "?"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_lock(file: Path) -> int:
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    host = socket.gethostname()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, where = _holder(fd)
        os.close(fd)
        gone = " (that process is gone; one it started still holds the lock)" \
            if where == host and pid and not _pid_alive(pid) else ""
        raise UserError(f"run directory {file.parent} is in use by another run (pid {pid} on {where}"
                        f"{gone}); wait for it to finish, or choose another name=") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
        pid, where = _holder(fd)  # no flock here: trust the pid file, stale only if provably dead
        if pid and pid != os.getpid() and (where != host or _pid_alive(pid)):
            os.close(fd)
            raise UserError(f"run directory {file.parent} is in use by another run (pid {pid} on "
                            f"{where}; this filesystem has no flock: delete {file} if that run is "
                            f"gone), or choose another name=") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {host}\n".encode(), 0)
    return fd


def check_lock(path: str | Path) -> None:
    """Fail early (before loading anything) when another run holds `path`; takes nothing."""
    file = Path(path) / LOCK
    if not file.exists() or os.path.realpath(file) in RunLock._held:
        return
    RunLock(Path(path)).release()


def _tensorboard_writer():
    """torch's SummaryWriter, or one line naming the extra when the tensorboard package is missing
    (checked before the run directory is touched)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # imports the tensorboard package
    except ImportError:
        raise UserError("run.log_with=tensorboard needs the tensorboard package: "
                        "pip install 'tether[tensorboard]'") from None
    return SummaryWriter


class RunDir:
    """Writes one run's files. Takes the run directory's lock (released by `close()` or at exit).
    `resume=True` keeps what is there (the caller drops the rows after the checkpoint); a fresh
    run into a directory with a previous run is an error unless `overwrite=True`, which removes
    that run's files — only now, after the lock is held and everything before was validated.

    `log_with`: trackers beside metrics.jsonl (a list, one name, "a,b", or "none"; see
    tether.trackers): a missing package is one line now, before the directory is touched; they
    start at `write_config` (with the config; on resume the tracker runs of trackers.json) and
    finish at `close()`. `tracker_project`: their project / experiment; `mlflow_uri`: MLflow's
    tracking URI. `warn(name, text)` says a dropped tracker (Training sets its own, which also
    lists it in summary.json)."""

    def __init__(self, path: str | Path, resume: bool = False, log_with: str | list[str] | None = "none",
                 overwrite: bool = False, tracker_project: str | None = None, mlflow_uri: str | None = None):
        self.path = Path(path)
        self.rank = dist_rank()
        self.is_main = self.rank == 0
        self.t0 = time.time()
        self.resumed = resume
        self._tb = None
        self._lock = None
        try:
            self.log_with = trackers.log_targets(log_with)
        except ValueError as e:
            raise UserError(f"run.{e}") from None
        trackers.check_installed(self.log_with)  # every rank says it, before anything is written
        self._trackers: dict = {}  # name -> adapter (rank 0), started by write_config, dropped on failure
        self._trackers_started = False
        self._warned: set = set()
        self.warn = self._warn
        writer = _tensorboard_writer() if self.is_main and "tensorboard" in self.log_with else None
        if self.is_main:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = RunLock(self.path)
            try:
                if not resume:
                    refuse_previous_run(self.path, overwrite)  # again, now under the lock
                    for name in RUN_FILES:  # a fresh run must not inherit another run's files
                        p = self.path / name
                        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
                (self.path / "checkpoints").mkdir(exist_ok=True)
                if writer is not None:
                    _quiet_tensorboard_thread()
                    with self.writing("tensorboard"):
                        self._tb = writer(str(self.path / "tensorboard"))
                self._trackers = {n: trackers.make_tracker(n, self.path, self.path.name, tracker_project, mlflow_uri)
                                  for n in self.log_with if n in trackers.TRACKERS}
            except BaseException:
                self._lock.release()
                raise

    # --- a full disk ------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, what: str):
        """Around a write into the run directory (`what`: the file or folder, relative to it): a
        full disk (`disk_full_cause`) raises DiskFullError, one line naming the run, `what`, the
        cause and the last complete checkpoint; the run's TensorBoard writer and lock are let go
        (the run is over). Any other error passes through as it is. (Not only Exception: DCP's
        CheckpointException, which carries a rank's OSError, is a BaseException.)"""
        try:
            yield
        except (DiskFullError, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:
            cause = disk_full_cause(e, self.path if self.path.exists() else None)
            if cause is None:
                raise
            raise self._stopped(what, *cause) from e

    def _stopped(self, what: str, code: int, text: str) -> DiskFullError:
        tb, self._tb = self._tb, None
        if tb is not None:
            with contextlib.suppress(Exception):  # its pending events have nowhere to go
                tb.close()
        for tracker in self._trackers.values():  # what they hold goes to their own stores, if it can
            with contextlib.suppress(Exception):
                tracker.finish()
        self._trackers.clear()
        if self._lock is not None:
            self._lock.release()
        ckpt = latest_checkpoint(self.path)
        then = (f"last complete checkpoint: {ckpt} (resume with resume=true)" if ckpt is not None
                else "no complete checkpoint yet")
        error = DiskFullError(f"run '{self.path}' stopped: no space left writing {what} "
                              f"(OSError {code}: {text}); {then}")
        return error if self.is_main else distributed.rank_local(error)

    # --- config / summary ------------------------------------------------------------------
    def write_config(self, cfg) -> None:
        """config.yaml; then the trackers start, with the same config as theirs."""
        if self.is_main:
            with self.writing("config.yaml"):
                _atomic_write(self.path / "config.yaml", lambda tmp: save_config(cfg, tmp))
            if self._trackers:
                self._start_trackers(to_dict(cfg))

    def write_summary(self, summary: dict) -> None:
        if self.is_main:
            with self.writing("summary.json"):
                _atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")

    def read_summary(self) -> dict:
        p = self.path / "summary.json"
        return json.loads(p.read_text()) if p.exists() else {}

    # --- metrics and samples ---------------------------------------------------------------
    def log(self, step: int, metrics: dict, time_offset: float = 0.0) -> dict:
        row = {"step": int(step), "time": round(time.time() - self.t0 + time_offset, 3)}
        for k, v in metrics.items():
            v = _to_float(v)
            if isinstance(v, (int, float)):
                row[k] = v if math.isfinite(v) else None
        # A row with no metric (e.g. a final evaluation with no eval set) says nothing: not written.
        if self.is_main and len(row) > 2:
            with self.writing("metrics.jsonl"):
                _append(self.path / "metrics.jsonl", json.dumps(row) + "\n")
            if self._tb is not None:
                with self.writing("tensorboard"):
                    for k, v in row.items():
                        if k not in ("step", "time") and v is not None:
                            self._tb.add_scalar(k, v, step)
                    self._tb.flush()  # a failed write raises here, with the step that made it
            self._to_trackers("log", step, {k: v for k, v in row.items() if k not in ("step", "time") and v is not None})
        return row

    def add_samples(self, step: int, samples: list[dict]) -> None:
        if self.is_main and samples:
            with self.writing("samples.jsonl"):
                _append(self.path / "samples.jsonl", "".join(
                    json.dumps({"step": int(step), **s}, ensure_ascii=False) + "\n" for s in samples))
            self._to_trackers("log_samples", int(step), samples)

    def read_metrics(self) -> list[dict]:
        return read_jsonl(self.path / "metrics.jsonl")

    def truncate_after(self, step: int) -> None:
        """On resume, drop rows logged after the checkpoint: they will be produced again."""
        if not self.is_main:
            return
        for name in ("metrics.jsonl", "samples.jsonl"):
            p = self.path / name
            if p.exists():
                rows = [r for r in read_jsonl(p) if r.get("step", 0) <= step]
                with self.writing(name):
                    _atomic_write_text(p, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    # --- experiment trackers -----------------------------------------------------------------
    def _start_trackers(self, config: dict) -> None:
        """Start the trackers (once): a fresh tracker run, or on resume the one trackers.json names;
        their ids and links go to trackers.json."""
        if self._trackers_started or not self._trackers:
            return
        self._trackers_started = True
        records = trackers.read_records(self.path) if self.resumed else {}
        for name, tracker in list(self._trackers.items()):
            try:
                records[name] = tracker.start(config, records.get(name))
            except Exception as e:
                self._drop_tracker(name, "start", e)
        with self.writing(trackers.RECORDS):
            _atomic_write_text(self.path / trackers.RECORDS, json.dumps(records, indent=2) + "\n")

    def _to_trackers(self, method: str, *args) -> None:
        if not self._trackers_started:  # a RunDir whose config was never written: started without one
            self._start_trackers({})
        for name, tracker in list(self._trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:
                self._drop_tracker(name, method, e)

    def _drop_tracker(self, name: str, what: str, error: Exception) -> None:
        tracker = self._trackers.pop(name)
        said = (str(error).strip().splitlines() or [""])[0]
        self.warn(f"tracker_{name}", f"run.log_with={name}: {what} failed ({type(error).__name__}: {said}); "
                                     f"{name} is left out for the rest of the run (metrics.jsonl has every row)")
        if what not in ("start", "finish"):
            with contextlib.suppress(Exception):  # let it close what it holds, if it still can
                tracker.finish()

    def _warn(self, name: str, text: str) -> None:
        """A warning said once per name (Training replaces this with its own `warn`)."""
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"{self.path.name}: {text}", stacklevel=4)

    def tracker_links(self) -> dict:
        """{tracker: link}: where each tracker's run is (a URL, or a local path / store URI), as
        trackers.json keeps it (also after close(), and for a resumed run)."""
        return trackers.read_links(self.path)

    def close(self) -> None:
        """Finish the trackers, flush TensorBoard and release the run directory's lock."""
        for name, tracker in list(self._trackers.items()):
            if self._trackers_started:  # (a start that failed before write_config started none)
                try:
                    tracker.finish()
                except Exception as e:
                    self._drop_tracker(name, "finish", e)
        self._trackers.clear()
        if self._tb is not None:
            with self.writing("tensorboard"):
                self._tb.flush()  # close() drops a failed write's error; flush() raises it
                self._tb.close()
        if self._lock is not None:
            self._lock.release()

    # --- checkpoints -----------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step-{step}"

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.path)

    def save_checkpoint(self, step: int, model, tokenizer, state: dict, keep_last: int = 2,
                        extra=None, dtype: torch.dtype | None = None, state_dict: dict | None = None,
                        sharded=None, name: str | None = None) -> Path:
        """Model + tokenizer (HF format) + trainer_state.pt + the model card (README.md, tether.model_card),
        written whole or not at all.
        `extra(dir)` writes a trainer's other state (e.g. PPO's critic) inside the same atomic write.
        `dtype`: write the model's weights in this dtype (see :func:`save_model_as`).

        Under torch.distributed every rank calls this: `sharded(dir)` (each rank writes its shards:
        the optimizer state) and `extra(dir)` run on every rank (they may gather; rank 0 writes),
        `state_dict` is the model's gathered on rank 0 (None: the model's own), every rank's RNG
        state is kept, and only rank 0 writes the rest and renames the directory into place.
        `name`: write checkpoints/<name> instead of step-<step> (keep_best's `best`), which the
        `keep_last` rotation of step-* directories never deletes."""
        final = self.path / "checkpoints" / name if name else self.checkpoint_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        with self.writing(f"checkpoints/{final.name}"):
            try:
                if self.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir(parents=True)
                distributed.barrier()  # the directory exists before any rank writes into it
                if sharded is not None:
                    sharded(tmp)
                if extra is not None:
                    extra(tmp)
                rngs = distributed.all_gather_object(rng_state())
                if self.is_main:
                    save_model_as(model, tmp, dtype, state_dict=state_dict)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(tmp)
                    extra_rng = {"rng_ranks": rngs} if len(rngs) > 1 else {}
                    # into a Python file: a failed write keeps its OSError (errno) in the chain
                    with open(tmp / TRAINER_STATE, "wb") as f:
                        torch.save({**state, "rng": rngs[0], **extra_rng}, f)
                    # the model card (README.md): this step's eval numbers and keep_best's race so far
                    write_model_card(tmp, self.path, step=step, best=(state.get("carry") or {}).get("best"),
                                     folder=str(final))
            except BaseException:
                if self.is_main:  # a write cut short: its space back, nothing left that looks whole
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
        if self.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if keep_last > 0 and not name:
                ckpts = sorted((p for p in (self.path / "checkpoints").glob("step-*")
                                if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
                for old in ckpts[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        distributed.barrier()  # nobody goes on (or resumes) before the checkpoint is complete
        return final


MASTER_WEIGHTS = "master_weights.safetensors"


def save_model_as(model, out: Path, dtype: torch.dtype | None, state_dict: dict | None = None) -> None:
    """`model.save_pretrained(out)` with the weights in `dtype` (None: as they are), config.json
    saying so. A model trained in fp32 from a bf16 checkpoint is thereby saved as bf16 (half the
    size, what it was published as). When the cast loses bits (to bf16 / fp16), the exact weights
    also go to `master_weights.safetensors`, which a resume loads over the cast ones
    (:func:`load_master_weights`): resume stays exact, the shipped model is the small one.
    `state_dict`: the weights to write instead of the model's own (a sharded model's, gathered)."""
    sd = model.state_dict() if state_dict is None else state_dict
    params = [v for v in sd.values() if v.is_floating_point()]
    live = params[0].dtype if params else None
    if dtype is None or live is None or dtype == live:
        model.save_pretrained(out, safe_serialization=True, state_dict=state_dict)
        return
    cast, shared = {}, {}
    for k, v in sd.items():
        if v.is_floating_point():
            # tied weights (embeddings = LM head) stay one tensor, so they are written once
            ident = (v.data_ptr(), tuple(v.shape))
            v = shared.setdefault(ident, v.detach().to(dtype))
        cast[k] = v
    model.save_pretrained(out, safe_serialization=True, state_dict=cast)
    cfg_file = out / "config.json"  # save_pretrained records the live weights' dtype
    cfg = json.loads(cfg_file.read_text())
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if dtype != torch.float32:  # fp32 holds bf16 / fp16 weights exactly: nothing to keep
        from safetensors.torch import save_file
        # a tied weight once, under the name its parameter has; weights that are row blocks of one
        # buffer (rollout/fuse.py: the sampled policy's q|k|v) are written each as its own tensor
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        save_file({k: v.detach().contiguous() for k, v in sd.items() if k in names}, str(out / MASTER_WEIGHTS))


def load_master_weights(model, ckpt: Path) -> bool:
    """Put a checkpoint's exact weights (:func:`save_model_as`) into `model`; False if it has none."""
    path = Path(ckpt) / MASTER_WEIGHTS
    if not path.exists():
        return False
    from safetensors.torch import load_file
    tensors = load_file(str(path), device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # a tied weight is in the file once: its other names are the same tensor as a loaded one
    own = model.state_dict()
    loaded = {own[k].data_ptr() for k in tensors if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise UserError(f"{path}: its weights do not match the model (missing {untied[:3]}, "
                        f"unexpected {unexpected[:3]})")
    return True


def latest_checkpoint(run_path: str | Path) -> Path | None:
    """The newest complete checkpoint (a `.tmp` directory is a write that was cut short)."""
    ckpts = [p for p in (Path(run_path) / "checkpoints").glob("step-*")
             if (p / TRAINER_STATE).exists() and p.name[5:].isdigit()]
    return max(ckpts, key=lambda p: int(p.name[5:]), default=None)


def load_trainer_state(ckpt: Path) -> dict:
    # weights_only=False: the file holds numpy RNG state and plain Python objects, and it is our
    # own run directory's file. Never point resume at a checkpoint you did not produce.
    return torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=False)


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything before it is good
    return rows


# --- RNG ---------------------------------------------------------------------------------------

def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
