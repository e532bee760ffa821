"""Run untrusted, model-written Python in a contained child process.

Layout of one run (the caller is the trainer)::

    trainer ──Popen(new session)──> launcher (root if we are root)  ──fork──> program (uid U)

The *launcher* is a tiny Python script that sets up isolation, forks the program and reports its
exit status. The program's parent is the launcher, never the trainer, so `os.kill(os.getppid())`
cannot reach the trainer; when we are root the program also runs under a fresh, unused uid U, so
it cannot signal any process but its own. See docs/rewards.md for what is and isn't guaranteed.

Isolation, when running as root (namespaces need CAP_SYS_ADMIN):
  * new network namespace: no interfaces but a down loopback, so no connection of any kind;
  * new mount namespace: every mount re-mounted read-only, except the fresh temp dir (cwd);
  * new PID namespace: the program is PID 1 there; when it dies, everything it spawned dies;
  * unused uid/gid: RLIMIT_NPROC counts per uid, and the kernel ignores it for root, so a fork
    bomb is only contained because U is not root; U also owns no file outside the temp dir.
Always: rlimits (CPU, address space, file size, processes, open files, no core dumps), wall-clock
timeout, scrubbed environment, capped stdout/stderr, the whole process group SIGKILLed at the end,
and `socket.socket` replaced by one that raises before the program's code runs.
"""

from __future__ import annotations

import json
import logging
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0          # wall clock, from start to SIGKILL of the process group
    memory_mb: int = 512            # RLIMIT_AS (address space, not RSS)
    file_size_mb: int = 16          # RLIMIT_FSIZE: largest file the program may write
    max_processes: int = 16         # RLIMIT_NPROC for the program's uid (fork bombs)
    max_open_files: int = 64        # RLIMIT_NOFILE
    output_bytes: int = 64_000      # stdout + stderr kept; more than this kills the program
    isolate: bool = True            # use namespaces and an unused uid when running as root


@dataclass
class SandboxResult:
    passed: bool
    reason: str             # 'ok', 'timeout', 'output limit', 'memory', 'exit code 1: ...'
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    duration_s: float = 0.0
    isolation: dict | None = None   # which namespaces the launcher managed to enter


# Replaces socket creation before the program runs. Best effort on its own (ctypes or a fresh
# import of _socket under another name gets around it): the network namespace is the real block.
_PRELUDE = r"""
import sys, socket, _socket
def _blocked(*a, **k):
    raise PermissionError("network access is disabled in the tether sandbox")
class _NoSocket(socket.socket):
    def __init__(self, *a, **k):
        _blocked()
socket.socket = socket.SocketType = _NoSocket
_socket.socket = _socket.SocketType = _NoSocket
socket.socketpair = socket.fromfd = socket.create_connection = _blocked
import runpy
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""

# The launcher runs in the child of the trainer (argv[1]: JSON config). It stays root (if we
# are) so the program cannot signal it, and exits with the program's status (128+signal).
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
iso = {"uid": None, "net": False, "mount": False, "pid": False}
libc = ctypes.CDLL(None, use_errno=True)
def unshare(flag):
    return libc.unshare(flag) == 0
if cfg["isolate"] and os.geteuid() == 0:
    iso["net"] = unshare(0x40000000)                      # CLONE_NEWNET
    if unshare(0x00020000):                               # CLONE_NEWNS
        MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
        ok = libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
        wd = cfg["workdir"].encode()
        ok = ok and libc.mount(wd, wd, None, MS_BIND, None) == 0
        points = []
        with open("/proc/self/mounts") as f:
            for line in f:
                p = line.split()[1].replace("\\040", " ")
                if p != cfg["workdir"] and not p.startswith(("/proc", "/sys")):
                    points.append(p)
        for p in points:   # read-only everywhere but the temp dir; a failure means not contained
            r = libc.mount(None, p.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
            ok = ok and (r == 0 or not os.path.exists(p))
        iso["mount"] = bool(ok)
    iso["pid"] = unshare(0x20000000)                      # CLONE_NEWPID: next fork is PID 1
    iso["uid"] = cfg["uid"]
with open(os.path.join(cfg["workdir"], ".isolation.json"), "w") as f:
    json.dump(iso, f)
lim = cfg["limits"]
pid = os.fork()
if pid == 0:
    try:
        os.chdir(cfg["workdir"])
        R = resource
        mb = 1 << 20
        for res, val in ((R.RLIMIT_CPU, lim["cpu_s"]), (R.RLIMIT_AS, lim["memory_mb"] * mb),
                         (R.RLIMIT_FSIZE, lim["file_size_mb"] * mb), (R.RLIMIT_CORE, 0),
                         (R.RLIMIT_NPROC, lim["max_processes"]),
                         (R.RLIMIT_NOFILE, lim["max_open_files"])):
            resource.setrlimit(res, (val, val))
        if iso["uid"] is not None:
            os.setgroups([])
            os.setgid(iso["uid"])
            os.setuid(iso["uid"])
        os.execve(cfg["python"], [cfg["python"], "-I", "-c", cfg["prelude"]], cfg["env"])
    except BaseException as e:
        os.write(2, ("sandbox setup failed: %r\n" % (e,)).encode())
    os._exit(127)
_, status = os.waitpid(pid, 0)
if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status))
"""

_UID_BASE = 1_700_000_000   # far above any real account; no files belong to these uids


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


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in the sandbox. Never raises for anything the code does."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tether_sandbox_")
    python = sandbox_python() if (limits.isolate and os.geteuid() == 0) else None
    # Without an interpreter the new uid can run, fall back to our own uid (documented weaker).
    uid = _fresh_uid() if python else None
    python = python or sys.executable
    proc = None
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
        lim = asdict(limits)
        lim["cpu_s"] = int(limits.timeout_s) + 1   # CPU limit backs up the wall clock
        cfg = {"workdir": workdir, "uid": uid, "isolate": limits.isolate, "limits": lim,
               "prelude": _PRELUDE, "python": python,
               # Scrubbed: the program sees none of the trainer's variables (tokens, keys).
               "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
                       "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}}
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"},
                                start_new_session=True, close_fds=True)
        out, err, why = _collect(proc, limits, start)
        _kill_all(proc, uid, python)
        try:
            rc = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            rc = None
        iso = _read_json(os.path.join(workdir, ".isolation.json"))
        res = _classify(why, rc, out, err)
        res.duration_s = time.monotonic() - start
        res.isolation = iso
        if not res.passed:
            log.info("sandbox: %s", res.reason)
        return res
    except Exception as e:  # our own failure (disk full, fork refused): score 0, keep training
        log.warning("sandbox could not run a program: %s: %s", type(e).__name__, e)
        return SandboxResult(False, f"sandbox error: {type(e).__name__}: {e}",
                             duration_s=time.monotonic() - start)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_all(proc, uid, python)
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc, limits, start):
    """Read stdout/stderr until both close, the deadline passes or the output cap is hit."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    deadline = start + limits.timeout_s
    why = None
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fileobj] += chunk
            if sum(len(b) for b in bufs.values()) > limits.output_bytes:
                why = "output limit"
                break
    finally:
        sel.close()
        for f in bufs:
            f.close()
    cap = limits.output_bytes
    return (bytes(bufs[proc.stdout][:cap]).decode("utf-8", "replace"),
            bytes(bufs[proc.stderr][:cap]).decode("utf-8", "replace"), why)


def _kill_all(proc, uid, python):
    """Kill everything the program started, then the launcher.

    With its own uid: kill(-1) from a process with uid U signals exactly U's processes, which
    also catches children that called setsid to leave the process group. The launcher (root)
    survives that, reaps the program and exits; killing the launcher first would orphan the
    program to PID 1, which in a container may never reap it (a zombie counted in NPROC)."""
    if uid is not None:
        subprocess.run([python, "-I", "-S", "-c",
                        "import os,signal\ntry: os.kill(-1, signal.SIGKILL)\nexcept OSError: pass"],
                       user=uid, group=uid, extra_groups=[], env={}, timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    try:  # the whole process group: the only handle we have without a uid of its own
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _classify(why, rc, out, err) -> SandboxResult:
    def res(passed, reason):
        return SandboxResult(passed, reason, out, err, rc)

    if why is not None:
        return res(False, why)
    if rc == 0:
        return res(True, "ok")
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
    if "MemoryError" in err:
        return res(False, "memory: " + last[:200])
    if rc is None:
        return res(False, "sandbox launcher did not exit")
    if rc < 0:  # the launcher itself was killed (e.g. by the program); we are unaffected
        return res(False, f"sandbox launcher killed by signal {-rc}")
    if rc > 128:
        sig = rc - 128
        name = {signal.SIGXCPU: "cpu time limit", signal.SIGXFSZ: "file size limit"}.get(sig)
        return res(False, name or f"killed by signal {sig} ({signal.Signals(sig).name})")
    return res(False, f"exit code {rc}: {last[:300]}")


def run_batch(programs: list[str], limits: SandboxLimits | None = None,
              workers: int = 2) -> list[SandboxResult]:
    """Run several programs concurrently (a small pool: each one may use a full core)."""
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(programs)))) as pool:
        return list(pool.map(lambda c: run_python(c, limits), programs))
