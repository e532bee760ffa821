"""Run untrusted, model-written Python and grade it, without letting it decide its own score.

    trainer ──Popen(new session)──> launcher ──unshare──fork──> init (PID 1 of a new namespace)
                                                                  ├─> runner  (uid U1): the code
                                                                  └─> grader  (uid U2): the tests

The verdict never comes from the program: not its exit status, not a file it could write.
  * assert-style tests run in the grader, a process the candidate's code never enters; the
    functions they call are proxies to the runner, values come back as plain data. The grader
    writes a per-run nonce to a pipe only it holds, and only after every test statement returned.
  * I/O tests (stdin -> stdout, function call -> result): the runner sends what the program
    produced, and the comparison happens here, in the trainer.
Isolation status and exit codes come from init over another pipe; nothing is read back from
the program's directory. See docs/rewards.md (threat model) and sandbox_launcher.py (isolation).
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from tether.rewards.sandbox_codec import encode
from tether.rewards.sandbox_host import (Cgroup, TestSpec, parse_tests, remove_tree,  # noqa: F401
                                        verdict)

log = logging.getLogger(__name__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER = os.path.join(_HERE, "sandbox_launcher.py")
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0          # wall clock, start to SIGKILL of everything
    memory_mb: int = 512            # each process (RLIMIT_AS) and the whole tree (cgroup/watchdog)
    file_size_mb: int = 16          # RLIMIT_FSIZE: largest single file
    disk_mb: int = 32               # the whole work dir (tmpfs size, else a watchdog)
    max_files: int = 4096           # inodes in the work dir
    max_processes: int = 16         # the tree (pids cgroup / watchdog) and RLIMIT_NPROC of uid U1
    max_open_files: int = 64        # RLIMIT_NOFILE
    output_bytes: int = 64_000      # stdout + stderr kept; more than this kills the program
    isolate: bool = True            # namespaces, minimal root, own uids (False: debugging only)


@dataclass
class SandboxResult:
    passed: bool
    reason: str             # 'ok', 'timeout', 'failed test 2 (line 3): AssertionError: ...', ...
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    duration_s: float = 0.0
    isolation: dict | None = None   # what the launcher obtained (namespaces, uids, seccomp, ...)
    missing: list = field(default_factory=list)   # isolation we asked for and did not get
    peak_memory_mb: float | None = None   # the whole tree's high-water mark (cgroup only)


_UID_BASE = 1_700_000_000   # far above any real account; no files belong to these uids
_PROGRAM = None


def _program() -> str:
    """The source run inside the sandbox: the codec, then the runner/grader."""
    global _PROGRAM
    if _PROGRAM is None:
        parts = []
        for name in ("sandbox_codec.py", "sandbox_harness.py"):
            with open(os.path.join(_HERE, name)) as f:
                parts.append(f.read())
        _PROGRAM = "\n".join(parts)
    return _PROGRAM


def _fresh_uid() -> int:
    return _UID_BASE + random.SystemRandom().randrange(100_000_000)


def _usable_by_anyone(path: str) -> bool:
    """True if a uid owning nothing can execute `path` (o+x on every directory above it)."""
    path = os.path.realpath(path)
    try:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        d = os.path.dirname(path)
        while True:
            if not os.stat(d).st_mode & 0o001:
                return False
            if d == "/":
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def sandbox_python() -> str | None:
    """An interpreter the unprivileged sandbox uid can run: ours if reachable, else the system's.
    (A pyenv under /root, mode 700, is not reachable; /usr/bin/python3 usually is.)"""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and _usable_by_anyone(cand):
            return os.path.realpath(cand)
    return None


def _binds(python: str) -> list[str]:
    """The interpreter's installation, if the system directories do not already hold it."""
    prefix = os.path.dirname(os.path.dirname(python))
    if prefix in ("/", "") or any(prefix == d or prefix.startswith(d + "/") for d in _SYSTEM):
        return []
    return [prefix]


def missing_isolation(iso: dict | None) -> list[str]:
    """What the launcher did not get, in words (docs/rewards.md explains each)."""
    if not iso:
        return ["everything: the launcher reported nothing"]
    out = [f"{ns} namespace" for ns in ("net", "ipc", "uts", "mount", "pid", "cgroup")
           if not iso.get(ns)]
    if iso.get("fs") != "minimal root":
        out.append("minimal root filesystem (the program sees the host's files)")
    if not iso.get("uids"):
        out.append("separate uids for the program and the grader")
    if not iso.get("seccomp"):
        out.append("seccomp filter")
    if not iso.get("cgroup_limits"):
        out.append("cgroup (tree memory/process caps by a polling watchdog)")
    return out


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script. `passed` is only "exited with status 0": a program can always
    arrange that, so never use this to grade a task -- use run_tests. Never raises."""
    return _run(code, None, limits or SandboxLimits())


def run_tests(code: str, tests, limits: SandboxLimits | None = None) -> SandboxResult:
    """Grade `code` against `tests` (see sandbox_host.parse_tests for the accepted forms).
    `passed` only if every test passed, as decided outside the program. Never raises for
    anything the code does; a malformed `tests` raises ValueError."""
    spec = parse_tests(tests)
    if spec is None:
        raise ValueError("no tests")
    return _run(code, spec, limits or SandboxLimits())


def run_batch(programs: list[str], limits: SandboxLimits | None = None, workers: int = 2,
              tests: list | None = None) -> list[SandboxResult]:
    """Several programs concurrently (each may use a full core), each with its row's `tests`
    (run_tests) or, without `tests`, just run (run_python). Results in input order."""
    if not programs:
        return []
    if tests is None:
        job = (lambda i: run_python(programs[i], limits))
    else:
        specs = [parse_tests(t) for t in tests]     # malformed tests fail here, before any run
        job = (lambda i: _run(programs[i], specs[i], limits or SandboxLimits()))
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(programs)))) as pool:
        return list(pool.map(job, range(len(programs))))


def _jobs(code: str, spec: TestSpec | None, limits: SandboxLimits):
    """(mode, runner job, grader job, results cap)."""
    if spec is None:
        return "plain", {"mode": "plain", "code": code}, None, 0
    if spec.kind == "asserts":
        return "serve", {"mode": "serve", "code": code}, {"tests": spec.source}, 0
    if spec.kind == "calls":
        calls = [{"fn": fn, "args": [encode(a) for a in args],
                  "kw": {k: encode(v) for k, v in kw.items()}}
                 for fn, args, kw in spec.inputs]
        cap = sum(2 * len(json.dumps(o, default=str)) + limits.output_bytes for o in spec.outputs)
        return "calls", {"mode": "calls", "code": code, "calls": calls}, None, cap
    caps = [max(limits.output_bytes, 2 * len(o) + 1024) for o in spec.outputs]
    job = {"mode": "stdio", "code": code, "inputs": spec.inputs, "caps": caps}
    return "stdio", job, None, sum(caps) + 1024 * len(caps)


def _run(code: str, spec: TestSpec | None, limits: SandboxLimits) -> SandboxResult:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tether_sandbox_")
    proc, cg, ours = None, None, []
    try:
        root = os.geteuid() == 0
        isolate = limits.isolate
        # As root, an interpreter the fresh uid can run even outside the minimal root; failing
        # that, ours (its prefix is bound into the minimal root, below world-searchable dirs).
        python = (sandbox_python() if root else None) or os.path.realpath(sys.executable)
        uids = [_fresh_uid(), _fresh_uid()] if (isolate and root) else None
        if isolate and root:
            cg = Cgroup.create(limits.memory_mb, limits.max_processes)
        mode, runner_job, grader_job, results_cap = _jobs(code, spec, limits)
        nonce = secrets.token_hex(16)
        if grader_job is not None:
            grader_job["nonce"] = nonce
        names = ["status"] + ["verdict"] * (mode == "serve") + ["results"] * bool(results_cap)
        pipes = {name: os.pipe() for name in names}
        ours = [fd for pair in pipes.values() for fd in pair]
        lim = asdict(limits)
        lim["cpu_s"] = int(limits.timeout_s) + 1          # CPU limit backs up the wall clock
        cfg = {"mode": mode, "runner_job": runner_job, "grader_job": grader_job,
               "fds": {k: w for k, (_, w) in pipes.items()}, "isolate": isolate, "uids": uids,
               "cgroups": cg.procs if cg else [], "watchdog": cg is None, "workdir": workdir,
               "binds": _binds(python), "limits": lim, "python": python, "program": _program(),
               # Scrubbed: the program sees none of the trainer's variables (tokens, keys).
               "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}}
        cfg_fd = os.memfd_create("tether-sandbox-config")
        ours.append(cfg_fd)
        os.write(cfg_fd, json.dumps(cfg).encode())
        os.lseek(cfg_fd, 0, 0)
        proc = subprocess.Popen([sys.executable, "-I", "-S", _LAUNCHER], stdin=cfg_fd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=[w for _, w in pipes.values()],
                                env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
        for fd in [w for _, w in pipes.values()] + [cfg_fd]:
            os.close(fd)
            ours.remove(fd)
        caps = {"status": 1 << 20, "verdict": 1 << 20, "results": results_cap + (1 << 20)}
        streams, why = _collect(proc, {k: r for k, (r, _) in pipes.items()}, caps, limits, start)
        for k, (r, _) in pipes.items():
            ours.remove(r)                                # _collect closed them
        oom, peak = (cg.oom_killed(), cg.peak_memory_mb()) if cg else (False, None)
        res = SandboxResult(**verdict(mode, spec, streams, why, oom, nonce, limits.output_bytes))
        res.duration_s, res.peak_memory_mb = time.monotonic() - start, peak
        res.missing = (["isolate=False"] if not isolate else []) + missing_isolation(res.isolation)
        if res.reason.startswith("sandbox error"):   # ours, not the program's: say it loudly
            log.warning("sandbox: %s", res.reason)
        elif not res.passed:
            log.info("sandbox: %s", res.reason)
        return res
    except Exception as e:  # our own failure (fork refused, no memfd): score 0, keep training
        log.warning("sandbox could not run a program: %s: %s", type(e).__name__, e)
        return SandboxResult(False, f"sandbox error: {type(e).__name__}: {e}",
                             duration_s=time.monotonic() - start)
    finally:
        _stop(proc, cg)
        for fd in ours:
            try:
                os.close(fd)
            except OSError:
                pass
        remove_tree(workdir)


def _stop(proc, cg):
    """SIGKILL the launcher's group (the PID namespace dies with init), then the cgroup's
    stragglers; reap the launcher. Never raises, never waits long."""
    try:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if cg is not None:
            cg.destroy()
        if proc is not None:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                log.warning("sandbox: launcher %d did not exit", proc.pid)
    except Exception as e:
        log.warning("sandbox: cleanup: %s", e)


def _collect(proc, extra: dict, caps: dict, limits: SandboxLimits, start: float):
    """Read every pipe until all close, the deadline passes or a cap is hit. Non-blocking reads
    of pipes we created: nothing the program does can make this block or read without bound."""
    fds = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    fds.update({fd: name for name, fd in extra.items()})
    bufs = {name: bytearray() for name in fds.values()}
    sel = selectors.DefaultSelector()
    for fd in fds:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = start + limits.timeout_s
    why = None
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                name = fds[key.fd]
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[name] += chunk
                if name in caps and len(bufs[name]) > caps[name]:
                    why = "output limit"
            if len(bufs["stdout"]) + len(bufs["stderr"]) > limits.output_bytes:
                why = "output limit"
            if why:
                break
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
        for fd in extra.values():
            os.close(fd)
    return bufs, why
