"""The code sandbox. Hostile programs (tests/hostile/*.py, one attack each, none solving its task)
must score 0 and leave no trace outside; benign programs must score what they deserve.

No wall-clock bounds here beyond "it came back": timings belong in benchmarks, not tests.
Guarantees that need root (namespaces, own uids, cgroups) are asserted when the sandbox reports
it obtained them; the unprivileged path is exercised by running as `nobody` where possible."""

import ctypes
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tether.rewards import load_reward
from tether.rewards.sandbox import (SandboxLimits, missing_isolation, run_batch, run_python,
                                    run_tests, sandbox_python)
from tether.rewards.sandbox_host import parse_tests, remove_tree, same_stdout

HOSTILE = Path(__file__).parent / "hostile"
LIMITS = SandboxLimits(timeout_s=3.0)
ROOT = os.geteuid() == 0 and sandbox_python() is not None
GOOD = "def add(a, b):\n    return a + b\n"
TASKS = {  # every hostile program is written against one of these and solves none of them
    "asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"],
    "stdio": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 5\n", "output": "15\n"}],
    "calls": [{"fn": "add", "args": [1, 2], "expected": 3},
              {"fn": "add", "args": [10, 5], "expected": 15}],
}


def hostile_programs():
    out = []
    for path in sorted(HOSTILE.glob("*.py")):
        head = dict(re.findall(r"^# (\w+): (.*)$", path.read_text(), re.M))
        out.append(pytest.param(path, head["class"], head["mode"], id=path.stem))
    return out


def uid_processes(uids):
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(ln.startswith("Uid:") and set(map(str, uids)) & set(ln.split()) for ln in f):
                    n += 1
        except OSError:
            pass
    return n


@pytest.fixture(scope="module")
def bait(tmp_path_factory):
    """What a program would reach if it got out: listeners, a victim process whose command line
    carries a marker, a SysV shared memory segment, paths it should not be able to create."""
    d = tmp_path_factory.mktemp("bait")
    tag = uuid.uuid4().hex[:12]
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(d / "s.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0tether-bait-" + tag)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    for s in (unix, abstract, tcp):
        s.listen(8)
        s.setblocking(False)
    marker = "tether-marker-" + tag
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    libc = ctypes.CDLL(None, use_errno=True)
    shmkey = 0x7E000000 | (os.getpid() & 0xFFFF)
    shmid = libc.shmget(shmkey, 4096, 0o1000 | 0o666)          # IPC_CREAT
    escape = f"/tmp/tether_escape_{tag}"
    tokens = {"__UNIX_SOCK__": str(d / "s.sock"), "__ABSTRACT__": "tether-bait-" + tag,
              "__PORT__": str(tcp.getsockname()[1]), "__VICTIM__": str(victim.pid),
              "__TRAINER__": str(os.getpid()), "__ESCAPE__": escape,
              "__ESCAPE_NAME__": f"tether_escape_{tag}", "__SHMKEY__": str(shmkey)}
    paths = [escape, f"/dev/shm/tether_escape_{tag}", f"/work/main/tether_escape_{tag}",
             f"/var/tmp/tether_escape_{tag}", "/usr/escape"]
    yield dict(tokens=tokens, listeners=(unix, abstract, tcp), victim=victim, marker=marker,
               paths=paths, shm=shmid)
    victim.kill()
    victim.wait()
    for s in (unix, abstract, tcp):
        s.close()
    if shmid >= 0:
        libc.shmctl(shmid, 0, None)                             # IPC_RMID


# What a contained attack prints (root: every layer present). Keys: program names.
CONTAINED_OUTPUT = {
    "esc_ptrace": ["ptrace 1 -1 1"], "esc_unshare_userns": ["unshare -1 1"],
    "esc_clone3_newuser": ["clone3 -1 38"], "esc_mount": ["mount -1 1", "remount -1 1"],
    "esc_tcp_ctypes": ["inet -1 raw -1 netlink -1"], "esc_x32_abi": ["x32 unshare -1 1"],
    "esc_sysv_ipc": ["shmget -1 2"], "esc_unix_socket_ctypes": ["connect -1"],
    "esc_kernel_surfaces": [f"{nr} -1 1" for nr in (250, 321, 425, 298, 323, 310)],
}


@pytest.mark.parametrize("path, cls, mode", hostile_programs())
def test_hostile_program_scores_zero_and_stays_inside(path, cls, mode, bait):
    code = path.read_text()
    for k, v in bait["tokens"].items():
        code = code.replace(k, v)
    fn = load_reward("code", limits=LIMITS)
    scores = fn([""], [f"```python\n{code}```"], None, tests=[TASKS[mode]])
    res = fn.last_results[0]
    assert scores == [0.0], f"false pass: {res.reason}"
    assert res.reason and res.duration_s < LIMITS.timeout_s + 30      # came back, with a reason
    # Nothing outside changed: no connection, the victim lives, no file appeared.
    for s in bait["listeners"]:
        with pytest.raises(BlockingIOError):
            s.accept()
    assert bait["victim"].poll() is None
    assert not any(os.path.exists(p) for p in bait["paths"])
    assert bait["marker"] not in res.stdout + res.stderr
    assert "[build-system]" not in res.stdout and "root:" not in res.stdout
    if ROOT:
        iso = res.isolation
        assert iso["fs"] == "minimal root" and iso["seccomp"] and iso["pid"] and iso["net"]
        assert res.missing == []
        assert uid_processes(iso["uids"]) == 0                  # every process it made is gone
        for want in CONTAINED_OUTPUT.get(path.stem, []):
            assert want in res.stdout, (want, res.stdout)
        if res.peak_memory_mb is not None:                      # the tree, not each process
            assert res.peak_memory_mb <= LIMITS.memory_mb + 96 + 1
        m = re.search(r"children (\d+)", res.stdout)
        assert m is None or int(m.group(1)) <= LIMITS.max_processes


def test_the_hostile_suite_covers_every_class():
    classes = [p.values[1] for p in hostile_programs()]
    assert len(classes) >= 40
    for cls in ("false_pass", "hang_crash", "escape", "limits"):
        assert classes.count(cls) >= 7, cls
