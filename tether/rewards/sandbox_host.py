"""The trainer's side of the sandbox, apart from running it: cgroups for the program tree, test
specifications, comparing outputs, and deleting what a program left. Nothing here may raise on
anything a program did (a hostile directory tree, a vanished cgroup): training goes on."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import signal
import stat
import time
from dataclasses import dataclass, field

from tether.rewards.sandbox_codec import decode, split_frames

log = logging.getLogger(__name__)
_CG = "/sys/fs/cgroup"


# --- cgroups: caps on the whole tree (memory incl. tmpfs, processes, CPU) ---------------------

def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _own_cgroup(controller):
    """Our path in the hierarchy of `controller` ('' for the v2 unified one)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if controller in ctrls.split(",") or (not controller and not ctrls):
                return path
    return None


class Cgroup:
    """One cgroup per program tree (v2 if /sys/fs/cgroup is cgroup2, else v1 memory + pids +
    cpu). `create` returns None where we may not make one: the launcher then runs a watchdog."""

    def __init__(self, dirs, v2):
        self.dirs, self.v2 = dirs, v2

    @property
    def procs(self):
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    @classmethod
    def create(cls, memory_mb, max_processes):
        name = "tether-sandbox-" + secrets.token_hex(6)
        mem, pids = str((memory_mb + 96) << 20), str(max_processes + 6)  # + launcher, init, grader
        made = []
        try:
            if os.path.exists(os.path.join(_CG, "cgroup.controllers")):
                parent = _CG + (_own_cgroup("") or "/")
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
                if not {"memory", "pids"} <= set(enabled):
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids +cpu")
                d = os.path.join(parent, name)
                os.mkdir(d)
                made.append(d)
                for fname, val in (("memory.max", mem), ("memory.swap.max", "0"),
                                   ("pids.max", pids), ("cpu.max", "100000 100000")):
                    if fname in ("memory.max", "pids.max") or os.path.exists(os.path.join(d, fname)):
                        _write(os.path.join(d, fname), val)
                return cls(made, True)
            for ctrl, files in (("memory", (("memory.limit_in_bytes", mem),
                                            ("memory.memsw.limit_in_bytes", mem))),
                                ("pids", (("pids.max", pids),)),
                                ("cpu", (("cpu.cfs_period_us", "100000"),
                                         ("cpu.cfs_quota_us", "100000")))):
                own = _own_cgroup(ctrl)
                if own is None or not os.path.isdir(os.path.join(_CG, ctrl)):
                    if ctrl == "cpu":
                        continue
                    raise OSError("no %s cgroup" % ctrl)
                d = os.path.join(_CG, ctrl) + own.rstrip("/") + "/" + name
                os.mkdir(d)
                made.append(d)
                for fname, val in files:
                    try:
                        _write(os.path.join(d, fname), val)
                    except OSError:
                        if ctrl != "cpu" and "memsw" not in fname:  # swap accounting may be off
                            raise
            return cls(made, False)
        except OSError as e:
            log.debug("sandbox: no cgroup (%s); the launcher watches the tree instead", e)
            cls(made, False).destroy()
            return None

    def peak_memory_mb(self):
        """Most memory the tree held at once (the memory controller's high-water mark)."""
        for d in self.dirs:
            for fname in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    with open(os.path.join(d, fname)) as f:
                        return int(f.read().split()[0]) / (1 << 20)
                except (OSError, ValueError, IndexError):
                    pass
        return None

    def oom_killed(self):
        for d in self.dirs:
            for fname in ("memory.events", "memory.oom_control"):
                try:
                    with open(os.path.join(d, fname)) as f:
                        for line in f:
                            k, _, v = line.partition(" ")
                            if k == "oom_kill" and int(v) > 0:
                                return True
                except (OSError, ValueError):
                    pass
        return False

    def destroy(self):
        """Kill every process left in it and remove it. Never raises."""
        for d in self.dirs:
            try:
                if self.v2 and os.path.exists(os.path.join(d, "cgroup.kill")):
                    _write(os.path.join(d, "cgroup.kill"), "1")
                for _ in range(100):
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids = [int(p) for p in f.read().split()]
                    if not pids:
                        break
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
                    time.sleep(0.005)
                for _ in range(50):
                    try:
                        os.rmdir(d)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.01)    # exiting processes leave the group a moment later
                else:
                    log.warning("sandbox: could not remove cgroup %s", d)
            except Exception as e:
                log.warning("sandbox: cgroup cleanup of %s: %s", d, e)


# --- deleting a work dir the program owned --------------------------------------------------

def remove_tree(path, max_entries=1_000_000):
    """Delete `path` without recursion, without following symlinks, at any depth: every
    directory's subdirectories are first renamed up to `path` itself, so no path ever grows
    long and no stack ever grows deep (a 3,000-deep tree costs 3,000 renames). Never raises."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    n, tag = 0, secrets.token_hex(4)
    try:
        while n < max_entries:
            names = os.listdir(top)
            if not names:
                break
            progress = False
            for name in names:
                n += 1
                try:
                    st = os.stat(name, dir_fd=top, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        os.unlink(name, dir_fd=top)
                        progress = True
                        continue
                    os.chmod(name, 0o700, dir_fd=top)  # a directory, not a link: lstat'ed above
                    d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                    try:
                        for sub in os.listdir(d):
                            n += 1
                            if stat.S_ISDIR(os.stat(sub, dir_fd=d, follow_symlinks=False).st_mode):
                                os.rename(sub, ".rm-%s-%d" % (tag, n), src_dir_fd=d, dst_dir_fd=top)
                            else:
                                os.unlink(sub, dir_fd=d)
                    finally:
                        os.close(d)
                    progress = True                # its subdirectories are at the top now
                    os.rmdir(name, dir_fd=top)
                except OSError:
                    pass
            if not progress:                       # only what we cannot remove is left
                break
        os.close(top)
        top = None
        os.rmdir(path)
    except Exception as e:
        log.warning("sandbox: could not remove %s: %s", path, e)
    finally:
        if top is not None:
            os.close(top)


# --- tests -------------------------------------------------------------------------------------

@dataclass
class TestSpec:
    """What a row's tests are. kind 'asserts': Python source run by the grader; 'stdio': the
    program's stdout for each stdin; 'calls': a function's return value for each argument list."""
    kind: str
    source: str = ""
    inputs: list = field(default_factory=list)      # stdio: str; calls: (fn, args, kwargs)
    outputs: list = field(default_factory=list)     # stdio: str; calls: the expected values


def parse_tests(tests) -> TestSpec | None:
    """A row's `tests` as a TestSpec; None for no tests. Accepted: assert source (a string or a
    list of strings); [{"input", "output"}...]; [{"fn", "args", "kwargs"?, "expected"}...];
    {"inputs": [...], "outputs": [...], "fn_name"?: f} (APPS; also {"input", "output"} lists as
    in code_contests), or that dict as a JSON string."""
    if tests is None or isinstance(tests, TestSpec):
        return tests
    if isinstance(tests, str):
        s = tests.strip()
        if s.startswith("{"):
            try:
                return parse_tests(json.loads(s))
            except ValueError:
                pass
        return TestSpec("asserts", source=tests) if s else None
    if isinstance(tests, dict):
        ins = tests.get("inputs", tests.get("input"))
        outs = tests.get("outputs", tests.get("output"))
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError("test dict needs equally long 'inputs' and 'outputs' lists")
        if not ins:
            return None
        fn = tests.get("fn_name")
        if fn:
            return TestSpec("calls", inputs=[(fn, a if isinstance(a, list) else [a], {})
                                             for a in ins], outputs=list(outs))
        return TestSpec("stdio", inputs=[_text(i) for i in ins], outputs=[_text(o) for o in outs])
    if isinstance(tests, (list, tuple)):
        if not tests:
            return None
        if all(isinstance(t, str) for t in tests):
            return TestSpec("asserts", source="\n".join(tests))
        if all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
            return TestSpec("stdio", inputs=[_text(t["input"]) for t in tests],
                            outputs=[_text(t["output"]) for t in tests])
        if all(isinstance(t, dict) and "fn" in t and "expected" in t for t in tests):
            return TestSpec("calls", inputs=[(t["fn"], list(t.get("args", [])),
                                              dict(t.get("kwargs", {}))) for t in tests],
                            outputs=[t["expected"] for t in tests])
    raise ValueError(f"unrecognized tests of type {type(tests).__name__}: {str(tests)[:80]!r}")


def _text(x):
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def same_stdout(got: str, want: str) -> bool:
    """Token by token (whitespace and line breaks are layout); a token the reference writes with
    a decimal point matches within 1e-6 relative/absolute, as contest checkers do."""
    g, w = got.split(), want.split()
    if len(g) != len(w):
        return False
    for a, b in zip(g, w):
        if a == b:
            continue
        if "." not in b:
            return False
        try:
            fa, fb = float(a), float(b)
        except ValueError:
            return False
        if not math.isclose(fa, fb, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def _jsonish(x):
    if isinstance(x, (list, tuple)):
        return [_jsonish(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonish(v) for k, v in x.items()}
    return x


def same_value(got, want) -> bool:
    """A call's decoded result vs the spec's expected value (JSON, so tuples are lists). `got`
    holds builtin types only (sandbox_codec.decode), so == here runs no candidate code. APPS
    wraps each expected value in a list; either form counts."""
    try:
        g = _jsonish(got)
        return g == _jsonish(want) or (isinstance(want, list) and len(want) == 1
                                       and g == _jsonish(want[0]))
    except RecursionError:
        return False


# --- the verdict -------------------------------------------------------------------------------

def _crash(rc, err):
    """Why the runner ended badly, in words; None if it exited 0."""
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
    if rc == 0:
        return None
    if rc is None:
        return "sandbox error: no exit status from the sandbox" + (f" ({last[:200]})" if last else "")
    if "MemoryError" in last:
        return "memory: " + last[:200]
    if rc < 0:
        sig = -rc
        name = {signal.SIGXCPU: "cpu time limit", signal.SIGXFSZ: "file size limit"}.get(sig)
        try:
            return name or f"killed by signal {sig} ({signal.Signals(sig).name})"
        except ValueError:
            return f"killed by signal {sig}"
    if rc == 127 and "sandbox setup failed" in err:
        return "sandbox error: " + last[:300]
    return f"exit code {rc}: {last[:300]}"


def verdict(mode, spec, streams, why, oom, nonce, output_bytes):
    """Fields of a SandboxResult from what came over the pipes. A pass needs positive evidence
    from outside the program: the grader's nonce, or every output compared equal here."""
    out = bytes(streams["stdout"][:output_bytes]).decode("utf-8", "replace")
    err = bytes(streams["stderr"][:output_bytes]).decode("utf-8", "replace")
    status = [f for f in split_frames(bytes(streams["status"])) if isinstance(f, dict)]
    iso = next((f["iso"] for f in status if "iso" in f), None)
    fin = next((f for f in status if "exit" in f), None) or {"exit": {}}
    st = fin["exit"].get("runner")
    rc = os.waitstatus_to_exitcode(st) if isinstance(st, int) else None

    def res(passed, reason):
        return dict(passed=passed, reason=reason, stdout=out, stderr=err, returncode=rc,
                    isolation=iso)

    if why:
        return res(False, why)
    if fin.get("watchdog"):
        return res(False, fin["watchdog"])
    if oom:
        return res(False, "memory: the program's processes hit their memory cap (cgroup)")
    crash = _crash(rc, err)
    if mode == "plain":
        return res(rc == 0, crash or "ok")
    if mode == "serve":
        v = [f for f in split_frames(bytes(streams.get("verdict", b""))) if isinstance(f, dict)]
        if len(v) == 1 and v[0].get("pass") is True and v[0].get("nonce") == nonce:
            return res(True, "ok")
        if v and v[0].get("pass") is False:
            f, e = v[0], str(v[0].get("error", ""))
            if f.get("bad_tests"):
                log.warning("sandbox: %s", e)
            if f.get("gone") and crash:
                return res(False, crash)
            reason = f"failed test {f['test']} (line {f['line']}): {e}" if "test" in f else e
            return res(False, ("memory: " if e.startswith("MemoryError") else "") + reason)
        return res(False, crash or "no verdict from the grader")
    frames = [f for f in split_frames(bytes(streams.get("results", b""))) if isinstance(f, dict)]
    load = next((f["load_error"] for f in frames if "load_error" in f), None)
    if load:
        return res(False, "the program failed to load: " + str(load))
    by_case = {f["case"]: f for f in frames if type(f.get("case")) is int}
    for i, want in enumerate(spec.outputs):
        f = by_case.get(i)
        if f is None:
            return res(False, crash or f"no result for case {i}")
        if mode == "stdio":
            code = os.waitstatus_to_exitcode(f["status"]) if type(f.get("status")) is int else None
            if f.get("over"):
                return res(False, f"case {i}: output limit")
            if code != 0:
                return res(False, f"case {i}: " + (_crash(code, err) or "no status"))
            if not same_stdout(str(f.get("out", "")), want):
                return res(False, f"wrong output on case {i}")
            continue
        if "raise" in f:
            return res(False, f"case {i}: raised {f['raise']}: {f.get('msg', '')}")
        try:
            got = decode(f.get("v"))
        except (ValueError, KeyError, TypeError, RecursionError):
            return res(False, f"case {i}: unreadable result")
        if not same_value(got, want):
            return res(False, f"wrong result on case {i}")
    return res(True, "ok")
