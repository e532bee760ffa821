"""The code sandbox. Hostile programs (tests/hostile/*.py, one attack each, none solving its task)
must score 0 and leave no trace outside; benign programs must score what they deserve.

No wall-clock bounds here beyond "it came back": timings belong in benchmarks, not tests.
Guarantees that need root (namespaces, own uids, cgroups) are asserted when the sandbox reports
it obtained them; the unprivileged path is exercised by running as `nobody` where possible."""

import ctypes
import json
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
        tests = json.loads(head["tests"]) if "tests" in head else TASKS[head["mode"]]
        out.append(pytest.param(path, head["class"], tests, id=path.stem))
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


@pytest.mark.parametrize("path, cls, tests", hostile_programs())
def test_hostile_program_scores_zero_and_stays_inside(path, cls, tests, bait):
    code = path.read_text()
    for k, v in bait["tokens"].items():
        code = code.replace(k, v)
    fn = load_reward("code", limits=LIMITS)
    scores = fn([""], [f"```python\n{code}```"], None, tests=[tests])
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


# --- benign programs: scored for what they do ----------------------------------------------------

HUMANEVAL_TESTS = '''
def check(candidate):
    assert candidate([1.0, 2.0, 3.0], 0.5) is False
    assert candidate([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) is True
check(has_close_elements)
'''
HUMANEVAL = '''
def has_close_elements(numbers, threshold):
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
'''
BENIGN = [  # (id, code, tests, deserves a pass)
    ("asserts", GOOD, TASKS["asserts"], True),
    ("asserts-wrong", "def add(a, b):\n    return a - b\n", TASKS["asserts"], False),
    ("asserts-syntax-error", "def add(a, b) return", TASKS["asserts"], False),
    ("asserts-one-string", GOOD, "\n".join(TASKS["asserts"]), True),
    ("fenced-with-prose", f"Here:\n```python\n{GOOD}```\nDone.", TASKS["asserts"], True),
    ("humaneval-check", HUMANEVAL, HUMANEVAL_TESTS, True),
    ("humaneval-wrong", "def has_close_elements(n, t):\n    return True\n", HUMANEVAL_TESTS,
     False),
    ("tuple-result", "def mm(xs):\n    return (min(xs), max(xs))\n",
     ["assert mm([3, 1, 2]) == (1, 3)"], True),
    ("tuple-vs-list", "def mm(xs):\n    return [min(xs), max(xs)]\n",
     ["assert mm([3, 1, 2]) == (1, 3)"], False),
    ("set-dict-results", "def f(s):\n    return set(s), {c: s.count(c) for c in s}\n",
     ["assert f('aab') == ({'a', 'b'}, {'a': 2, 'b': 1})"], True),
    ("float-isclose", "import math\ndef area(r):\n    return math.pi * r * r\n",
     ["import math", "assert math.isclose(area(2), 12.566370614359172)",
      "assert abs(area(1) - 3.14159) < 1e-4"], True),
    ("big-int", "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n",
     ["import math", "assert fact(500) == math.factorial(500)"], True),
    ("raises-expected", "def div(a, b):\n    if b == 0:\n        raise ValueError('b')\n"
     "    return a // b\n",
     ["assert div(7, 2) == 3", "try:\n    div(1, 0)\nexcept ValueError:\n    pass\n"
      "else:\n    assert False"], True),
    ("in-place-mutation", "def sort_in_place(xs):\n    xs.sort()\n",
     ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]"], True),
    ("class-solution", "class Solution:\n    def twoSum(self, nums, target):\n"
     "        seen = {}\n        for i, x in enumerate(nums):\n"
     "            if target - x in seen:\n                return [seen[target - x], i]\n"
     "            seen[x] = i\n",
     ["assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]"], True),
    ("generator-result", "def evens(n):\n    return (i for i in range(n) if i % 2 == 0)\n",
     ["assert list(evens(7)) == [0, 2, 4, 6]"], True),
    ("helpers-and-imports", "from collections import Counter\nimport itertools\n"
     "def top(s):\n    return Counter(s).most_common(1)[0][0]\n"
     "def pairs(xs):\n    return list(itertools.combinations(xs, 2))\n",
     ["assert top('abbccc') == 'c'", "assert pairs([1, 2, 3]) == [(1, 2), (1, 3), (2, 3)]"],
     True),
    ("test-helper-function", GOOD,
     ["def twice(f, x):\n    return f(x, x)", "assert twice(add, 4) == 8"], True),
    ("prints-while-working", "def add(a, b):\n    print('adding', a, b)\n    return a + b\n",
     TASKS["asserts"], True),
    ("main-guard-and-exit", GOOD + "if __name__ == '__main__':\n    import sys\n"
     "    print(add(2, 2))\n    sys.exit(0)\n", TASKS["asserts"], True),
    ("recursion-and-strings", "def rev(s):\n    return s if len(s) < 2 else rev(s[1:]) + s[0]\n",
     ["assert rev('hello') == 'olleh'", "assert rev('') == ''"], True),
    ("bytes-and-none", "def f(x):\n    return None if x is None else bytes(x, 'ascii')\n",
     ["assert f(None) is None", "assert f('ab') == b'ab'"], True),
    ("nan-result", "def f():\n    return float('nan')\n",
     ["import math", "assert math.isnan(f())"], True),
    ("truthiness", "def is_even(n):\n    return n % 2 == 0\n",
     ["assert is_even(4)", "assert not is_even(3)"], True),
    ("truthiness-wrong", "def is_even(n):\n    return True\n",
     ["assert is_even(4)", "assert not is_even(3)"], False),
    ("uses-tmp-files", "import os\ndef roundtrip(s):\n    with open('x.txt', 'w') as f:\n"
     "        f.write(s)\n    return open('x.txt').read()\n",
     ["assert roundtrip('hi') == 'hi'"], True),
    ("multiprocessing-pool", "from multiprocessing import Pool\ndef sq(x):\n    return x * x\n"
     "def squares(xs):\n    with Pool(2) as p:\n        return p.map(sq, xs)\n",
     ["assert squares([1, 2, 3]) == [1, 4, 9]"], True),
    ("threads", "import threading\ndef total(xs):\n    out = []\n"
     "    ts = [threading.Thread(target=out.append, args=(x,)) for x in xs]\n"
     "    [t.start() for t in ts]\n    [t.join() for t in ts]\n    return sum(out)\n",
     ["assert total([1, 2, 3]) == 6"], True),
    ("tests-use-the-programs-import", "import math as m\ndef area(r):\n    return m.pi * r * r\n",
     ["assert m.isclose(area(2), 12.566370614359172)"], True),
    ("function-named-like-a-module", "def copy(x):\n    return list(x)\n",
     ["assert copy((1, 2)) == [1, 2]"], True),
    ("stdio", "a, b = map(int, input().split())\nprint(a + b)\n", TASKS["stdio"], True),
    ("stdio-sys-stdin", "import sys\ndata = sys.stdin.read().split()\n"
     "print(int(data[0]) + int(data[1]))\n", TASKS["stdio"], True),
    ("stdio-wrong", "a, b = map(int, input().split())\nprint(a * b)\n", TASKS["stdio"], False),
    ("stdio-main-function", "def main():\n    a, b = map(int, input().split())\n"
     "    print(a + b)\nif __name__ == '__main__':\n    main()\n", TASKS["stdio"], True),
    ("stdio-float-tolerance", "print(f'{2 / 3:.9f}')\n",
     [{"input": "", "output": "0.666666667"}], True),
    ("stdio-crash-after-output", "print(3)\nraise RuntimeError\n",
     [{"input": "1 2", "output": "3"}], False),
    ("stdio-apps-dict", "n = int(input())\nprint(n * 2)\n",
     {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}, True),
    ("stdio-code-contests-json", "n = int(input())\nprint(n * 2)\n",
     '{"input": ["3\\n"], "output": ["6\\n"]}', True),
    ("calls", GOOD, TASKS["calls"], True),
    ("calls-wrong", "def add(a, b):\n    return a * b\n", TASKS["calls"], False),
    ("calls-apps-fn-name", "def add(a, b):\n    return [a + b, a - b]\n",
     {"fn_name": "add", "inputs": [[3, 1]], "outputs": [[[4, 2]]]}, True),
    ("calls-tuple-as-json-list", "def f(x):\n    return (x, x)\n",
     [{"fn": "f", "args": [1], "expected": [1, 1]}], True),
    ("calls-kwargs", "def f(a, b=0):\n    return a - b\n",
     [{"fn": "f", "args": [5], "kwargs": {"b": 2}, "expected": 3}], True),
    ("calls-raises", "def f(a):\n    raise ValueError\n",
     [{"fn": "f", "args": [1], "expected": 1}], False),
]


def test_benign_programs_score_what_they_deserve():
    fn = load_reward("code", limits=SandboxLimits(timeout_s=10))
    scores = fn([""] * len(BENIGN), [c for _, c, _, _ in BENIGN], None,
                tests=[t for _, _, t, _ in BENIGN])
    wrong = [(name, fn.last_results[i].reason) for i, (name, _, _, want) in enumerate(BENIGN)
             if scores[i] != float(want)]
    assert not wrong
    assert fn([""] * 2, [GOOD, GOOD], None, tests=[None, "assert add(2, 2) == 4"]) == [None, 1.0]


def test_run_python_reports_exit_status_and_isolation():
    res = run_python("import os\nprint(os.getcwd(), sorted(os.listdir('/')))\n", LIMITS)
    assert res.passed and res.reason == "ok" and res.returncode == 0
    res = run_python("import sys\nsys.exit(3)\n", LIMITS)
    assert not res.passed and res.reason.startswith("exit code 3")
    res = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=1))
    assert res.reason == "timeout"
    assert missing_isolation(res.isolation) == res.missing
    if ROOT:
        assert res.isolation["uids"] and res.isolation["cgroup_limits"] and not res.missing


def test_batch_keeps_order():
    progs = ["print(%d)\n" % i for i in range(5)]
    assert [r.stdout.strip() for r in run_batch(progs, LIMITS, workers=2)] == list("01234")
    graded = run_batch([GOOD, "def add(a, b):\n    return 0\n"], LIMITS, 2,
                       tests=[TASKS["calls"]] * 2)
    assert [r.passed for r in graded] == [True, False]


def test_test_specs_and_output_comparison():
    assert parse_tests(None) is None and parse_tests([]) is None and parse_tests("  ") is None
    assert parse_tests(["assert f()", "assert g()"]).source == "assert f()\nassert g()"
    spec = parse_tests({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"})
    assert spec.kind == "calls" and spec.inputs == [("add", [1, 2], {})]
    with pytest.raises(ValueError):
        parse_tests([1, 2])
    assert same_stdout("3\n4 5\n", "3 4\n5") and not same_stdout("3", "3 4")
    assert same_stdout("0.3333333", "0.333333333") and not same_stdout("1", "2")
    assert not same_stdout("1.0", "1")      # a tolerance only where the reference has decimals


def test_cleanup_survives_a_deep_tree_and_never_follows_links(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    work = tmp_path / "work"
    work.mkdir()
    fd = os.open(work, os.O_RDONLY)
    for _ in range(3000):                    # deeper than any path or recursion limit
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.symlink(str(tmp_path), "link", dir_fd=nfd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    (work / "out").symlink_to(keep)
    remove_tree(str(work))
    assert not work.exists() and keep.read_text() == "precious"
    remove_tree(str(tmp_path / "missing"))   # nothing there: no error either


NOBODY = ROOT and os.path.exists("/usr/bin/setpriv")
DEGRADED = '''
import json, sys
sys.path.insert(0, {repo!r})
from tether.rewards.sandbox import SandboxLimits, run_tests
limits = SandboxLimits(timeout_s=3, isolate={isolate})
out = []
for code, tests in json.loads(sys.stdin.read()):
    r = run_tests(code, tests, limits)
    out.append([r.passed, r.reason, r.missing])
print(json.dumps(out))
'''


@pytest.mark.skipif(not NOBODY, reason="needs root and setpriv to run as an unprivileged user")
@pytest.mark.parametrize("isolate", [True, False], ids=["userns", "no-namespaces"])
def test_without_root_the_verdict_still_comes_from_outside(isolate, tmp_path):
    """As `nobody`: with a user namespace (most isolation, no separate uids, a watchdog for
    cgroups) and with no namespaces at all (the weakest setting). Hostile programs still score 0
    and the result says what is missing."""
    names = ["fp_os_exit_0", "fp_atexit_exit_0", "fp_always_equal", "fp_reexec_O",
             "hc_deep_tree_3000", "hc_daemon_double_fork", "lim_disk_total", "lim_memory_tree"]
    jobs = [[GOOD, TASKS["asserts"]]] + [[(HOSTILE / f"{n}.py").read_text(), TASKS["asserts"]]
                                         for n in names]
    os.chmod(tmp_path, 0o777)
    repo = str(Path(__file__).resolve().parent.parent)
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
           "-c", DEGRADED.format(repo=repo, isolate=isolate)]
    p = subprocess.run(cmd, input=json.dumps(jobs), capture_output=True, text=True,
                       cwd=tmp_path, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    if p.returncode != 0 and ("ModuleNotFoundError" in p.stderr or "denied" in p.stderr):
        pytest.skip("the checkout is not importable by nobody: " + p.stderr[-200:])
    results = json.loads(p.stdout)
    # Work dirs lived in TMPDIR (on disk without a mount namespace): all removed.
    assert results[0][0] is True, results[0]
    assert [r[0] for r in results[1:]] == [False] * len(names), list(zip(names, results[1:]))
    missing = results[0][2]
    assert "separate uids for the program and the grader" in missing
    assert ("pid namespace" in missing) == (not isolate)
    assert not any(p.name.startswith("tether_sandbox_") for p in tmp_path.iterdir())
