"""One test per sandbox limit: each attack is contained, scored 0 with a reason, and the run goes
on (the next correct program still scores 1). Root-only guarantees (namespaces, a fresh uid) are
asserted when the sandbox reports it got them, and skipped otherwise."""

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tether.rewards import load_reward
from tether.rewards.sandbox import SandboxLimits, run_batch, run_python, sandbox_python

FAST = SandboxLimits(timeout_s=1.5)
ROOT = os.geteuid() == 0 and sandbox_python() is not None
GOOD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def code_reward(solutions, tests=TESTS, limits=FAST):
    fn = load_reward("code", limits=limits)
    scores = fn([""] * len(solutions), solutions, None, tests=[tests] * len(solutions))
    return scores, fn.last_results


def still_works():
    """The run goes on: after an attack, a correct program still scores 1."""
    scores, _ = code_reward([GOOD])
    assert scores == [1.0]


def uid_processes(uid):
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(ln.startswith("Uid:") and str(uid) in ln.split() for ln in f):
                    n += 1
        except OSError:
            pass
    return n


def test_correct_scores_one_wrong_scores_zero():
    wrong = "def add(a, b):\n    return a - b\n"
    fenced = f"Here you go:\n```python\n{GOOD}```\nDone."
    scores, res = code_reward([GOOD, wrong, fenced, "def add(a, b) return"])
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert res[1].reason.startswith("exit code 1: AssertionError")
    assert "SyntaxError" in res[3].reason
    fn = load_reward("code")
    assert fn(["", ""], [GOOD, GOOD], None, tests=[None, "assert add(2, 2) == 4"]) == [None, 1.0]


def test_infinite_loop_is_killed_at_the_timeout():
    t = time.monotonic()
    scores, res = code_reward(["while True:\n    pass\n"])
    assert time.monotonic() - t < 3.0
    assert scores == [0.0] and res[0].reason == "timeout"
    still_works()


def test_fork_bomb_is_contained_by_nproc():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t = time.monotonic()
    res = run_python(bomb, SandboxLimits(timeout_s=1.0, max_processes=8))
    assert time.monotonic() - t < 4.0
    assert not res.passed and res.reason == "timeout"
    if res.isolation and res.isolation.get("uid"):
        assert uid_processes(res.isolation["uid"]) == 0  # every copy was killed
    still_works()


def test_memory_bomb_hits_the_address_space_limit():
    scores, res = code_reward(["hog = []\nwhile True:\n    hog.append(bytearray(50 * 2**20))\n"],
                              limits=SandboxLimits(timeout_s=3, memory_mb=256))
    assert scores == [0.0] and res[0].reason.startswith("memory")
    still_works()


def test_network_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    # The plain way: socket creation itself fails.
    plain = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
    scores, res = code_reward([plain])
    assert scores == [0.0] and "network access is disabled" in res[0].reason
    # Around the in-process block (a fresh _socket module): the network namespace still stops it.
    bypass = (f"import sys\ndel sys.modules['_socket']\nimport _socket\ns = _socket.socket()\n"
              f"s.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n")
    res = run_python(bypass, FAST)
    assert not res.passed
    if ROOT:
        assert res.isolation["net"] and "Network is unreachable" in res.reason
    with pytest.raises(socket.timeout):
        server.accept()  # nobody connected
    server.close()
    still_works()


@pytest.mark.skipif(not ROOT, reason="read-only mounts need root (mount namespace)")
def test_writing_outside_the_temp_dir_fails(tmp_path):
    targets = [f"/tmp/tether_escape_{uuid.uuid4().hex}", str(tmp_path / "escape.txt"),
               f"/dev/shm/tether_escape_{uuid.uuid4().hex}"]
    for target in targets:
        res = run_python(f"open({target!r}, 'w').write('x')\n", FAST)
        assert not res.passed and ("Read-only" in res.reason or "Permission" in res.reason)
        assert not os.path.exists(target)
    # Inside its own temp dir it can write, and the dir is gone afterwards.
    res = run_python("import os\nopen('out.txt', 'w').write('ok')\nprint(os.getcwd())\n", FAST)
    assert res.passed and not os.path.exists(res.stdout.strip())
    res = run_python("open('big', 'wb').write(b'x' * (2 * 2**20))\n",
                     SandboxLimits(timeout_s=1.5, file_size_mb=1))
    assert not res.passed and "File too large" in res.reason  # RLIMIT_FSIZE
    still_works()


def test_parent_environment_is_invisible(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("TETHER_TEST_SECRET", secret)
    spy = ("import os\nprint(dict(os.environ))\n"
           f"try:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
           "except OSError as e:\n    print('denied', e)\n"
           "assert 'TETHER_TEST_SECRET' in os.environ\n")
    res = run_python(spy, FAST)
    assert secret not in res.stdout and secret not in res.stderr
    assert not res.passed
    if ROOT:
        assert "denied" in res.stdout  # another uid cannot read our /proc/<pid>/environ
    still_works()


def test_flooding_stdout_is_capped_and_killed():
    t = time.monotonic()
    scores, res = code_reward(["while True:\n    print('spam' * 1000)\n"],
                              limits=SandboxLimits(timeout_s=3, output_bytes=10_000))
    assert time.monotonic() - t < 3.0
    assert scores == [0.0] and res[0].reason == "output limit"
    assert len(res[0].stdout) <= 10_000
    still_works()


def test_killing_its_parent_does_not_reach_the_trainer():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        attack = ("import os, signal\n"
                  "for pid in (os.getppid(), os.getpgid(0), %d, %d):\n"
                  "    try:\n        os.kill(pid, signal.SIGKILL)\n"
                  "    except OSError:\n        pass\n" % (os.getpid(), victim.pid))
        scores, res = code_reward([attack + GOOD], tests=["assert add(1, 2) == 4"])
        assert scores == [0.0] and res[0].reason  # scored 0 with a reason; we are alive
        if ROOT:
            assert victim.poll() is None  # a process of ours it named by pid survived
    finally:
        victim.kill()
        victim.wait()
    still_works()


def test_batch_runs_concurrently_and_keeps_order():
    progs = ["import time\ntime.sleep(0.5)\nprint(%d)\n" % i for i in range(4)]
    t = time.monotonic()
    res = run_batch(progs, FAST, workers=2)
    assert [r.stdout.strip() for r in res] == ["0", "1", "2", "3"]
    assert time.monotonic() - t < 1.9  # 2 workers: about 1 s, not 2
