"""The studio's server without a browser: downsampling and smoothing, the incremental JSONL reader,
run lookup (no path from a request ever reaches the disk), the token / host / origin guard, the
Runs API on real run directories (tether.run.RunDir), a grpo run's samples, the command.
(The labeler: test_studio_labeler.py.)"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("httpx", reason="httpx not installed (fastapi's TestClient; pip install -e '.[test]')")

from studio_support import client, make_app  # noqa: E402

from tether.studio import series  # noqa: E402
from tether.studio.common import JsonlTail  # noqa: E402


# ---- series -------------------------------------------------------------------------------------

def test_ema_is_tensorboards_debiased_average():
    # by hand, w = 0.5: s = 0.5, 1.25, 2.125; debiased by 1 - 0.5^t: 1, 1.25/0.75, 2.125/0.875
    np.testing.assert_allclose(series.ema(np.array([1.0, 2.0, 3.0]), 0.5), [1.0, 1.25 / 0.75, 2.125 / 0.875])
    v = np.array([3.0, -1.0, 7.0])
    np.testing.assert_array_equal(series.ema(v, 0.0), v)
    np.testing.assert_allclose(series.ema(np.full(50, 4.2), 0.9), np.full(50, 4.2))  # debiased: no pull to 0
    with pytest.raises(ValueError):
        series.ema(v, 1.0)
    # the blocked, vectorised form equals the recursion itself, across block edges
    vals = np.random.default_rng(3).normal(size=1000)
    for w in (0.3, 0.95, 0.999):
        s_, debias, expect = 0.0, 1.0, []
        for x in vals:
            s_ = w * s_ + (1 - w) * x
            debias *= w
            expect.append(s_ / (1 - debias))
        np.testing.assert_allclose(series.ema(vals, w, block=64), expect, rtol=1e-10, atol=1e-12)


def test_downsample_keeps_the_envelope():
    rng = np.random.default_rng(0)
    n = 100_000
    x = np.arange(n, dtype=float) * 5
    y = rng.normal(size=n)
    y[31_337] = 50.0   # a spike and a dip the curve must still show
    y[77_001] = -40.0
    dx, dy = series.downsample(x, y, 2000)
    assert len(dx) <= 2000 and len(dx) >= 1000
    assert dx[0] == x[0] and dx[-1] == x[-1] and dy[0] == y[0] and dy[-1] == y[-1]
    assert np.all(np.diff(dx) > 0)                      # in order, no point twice
    idx = (dx / 5).astype(int)
    np.testing.assert_array_equal(y[idx], dy)           # every point is an input point
    assert 50.0 in dy and -40.0 in dy
    # each of the equal buckets of the inner points keeps its own max and min
    for chunk in np.array_split(np.arange(1, n - 1), (2000 - 2) // 2):
        assert y[chunk].max() in dy[(dx >= x[chunk[0]]) & (dx <= x[chunk[-1]])]
        assert y[chunk].min() in dy[(dx >= x[chunk[0]]) & (dx <= x[chunk[-1]])]


def test_downsample_leaves_short_series_alone():
    x, y = np.arange(10.0), np.arange(10.0) ** 2
    dx, dy = series.downsample(x, y, 10)
    np.testing.assert_array_equal(dx, x)
    np.testing.assert_array_equal(dy, y)


def test_columns_add_many_equals_adding_row_by_row():
    import random

    rng = random.Random(0)
    choices = [1.5, 2, float("nan"), float("inf"), None, True, False, "x", -3.25, 7]
    for _ in range(500):
        rows, same = [], rng.random() < 0.5
        for i in range(rng.randrange(30)):
            r = {}
            if rng.random() < 0.9:
                r["step"] = rng.choice([i, float(i), True, None, "x", 2.5]) if rng.random() < 0.2 else i
            for k in ("a", "b", "c", "time"):
                if same or rng.random() < 0.7:
                    r[k] = rng.choice(choices) if rng.random() < 0.3 else rng.random()
            rows.append(r)
        one, many = series.Columns(), series.Columns()
        for r in rows:
            one.add(r)
        many.add_many(rows[:len(rows) // 2])
        many.add_many(rows[len(rows) // 2:])
        assert (one.rows, one.last_step, one.last) == (many.rows, many.last_step, many.last)
        assert {k: (list(one.x[k]), list(one.y[k])) for k in one.x} == {k: (list(many.x[k]), list(many.y[k])) for k in many.x}


def test_columns_skip_bad_values():
    rows = [{"step": 1, "time": 0.1, "loss": 2.0, "kl": None}, {"step": 2, "loss": float("nan"), "kl": 0.5},
            {"loss": 9.0}, {"step": 3, "loss": 1.0, "flag": True, "name": "x"}]
    cols = series.columns(rows)
    assert set(cols) == {"loss", "kl"}
    np.testing.assert_array_equal(cols["loss"][0], [1, 3])
    np.testing.assert_array_equal(cols["loss"][1], [2.0, 1.0])
    np.testing.assert_array_equal(cols["kl"][0], [2])


# ---- the JSONL tail -------------------------------------------------------------------------------

def test_tail_reads_complete_lines_skips_corrupt_ones_and_rereads_a_replaced_file(tmp_path):
    p = tmp_path / "m.jsonl"
    t = JsonlTail(p)
    assert t.read() == []                                 # no file yet
    p.write_text('{"step": 1}\n{"step": 2')                # the second line is still being written
    assert t.read() == [{"step": 1}]
    v1 = t.version
    with open(p, "a") as f:
        f.write(', "loss": 3}\nnot json\n[1, 2]\n{"step": 3}\n')
    assert t.read() == [{"step": 1}, {"step": 2, "loss": 3}, {"step": 3}]
    assert t.bad == 2 and t.version != v1
    v2 = t.version
    assert t.read() == [{"step": 1}, {"step": 2, "loss": 3}, {"step": 3}] and t.version == v2
    tmp = tmp_path / "m.tmp"                               # resume's truncate_after: a new file renamed in
    tmp.write_text('{"step": 1}\n')
    os.replace(tmp, p)
    assert t.read() == [{"step": 1}] and t.bad == 0


# ---- run directories ----------------------------------------------------------------------------

def _run(root, name, rows=(), summary=None, config=None, samples=()):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(config or "lr: 0.001\n")
    if rows is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    if samples:
        (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return d


def test_runs_list_statuses_headlines_and_commands(tmp_path):
    from tether.config import save_config
    from tether.run import RunDir
    from tether.trainers.preference.offline import DPOConfig
    from tether.trainers.grpo import GRPOConfig

    runs = tmp_path / "runs"
    c = client(make_app(runs))
    assert c.get("/api/runs/list").json()["runs"] == []   # empty runs dir

    live = RunDir(runs / "live")                           # holds the run's flock, as a training run does
    save_config(GRPOConfig(model="m", data="d"), live.path / "config.yaml")
    done = _run(runs, "study/dpo", [{"step": 1, "loss": 0.7, "rewards/accuracies": 0.5},
                                    {"step": 2, "loss": 0.6, "rewards/accuracies": 0.75}], summary={"ok": 1})
    save_config(DPOConfig(model="m", data="d"), done / "config.yaml")
    _run(runs, "crashed", [{"step": 10, "reward": 0.25}, {"step": 20, "reward": 0.5}])
    _run(runs, "nothing-yet", rows=None)
    (runs / "notarun").mkdir()                             # no run files: not listed
    got = {r["id"]: r for r in c.get("/api/runs/list").json()["runs"]}
    assert set(got) == {"live", "study/dpo", "crashed", "nothing-yet"}
    assert got["live"]["status"] == "running" and got["live"]["command"] == "grpo"
    assert got["live"]["last_step"] is None and got["live"]["headline"] is None
    assert got["study/dpo"]["status"] == "finished" and got["study/dpo"]["command"] == "dpo"
    assert got["study/dpo"]["headline"] == {"name": "rewards/accuracies", "value": 0.75, "step": 2}
    assert got["crashed"]["status"] == "failed" and got["crashed"]["last_step"] == 20
    assert got["crashed"]["headline"] == {"name": "reward", "value": 0.5, "step": 20}
    live.log(7, {"reward": 1.5})
    live.close()                                           # stopped with no summary: failed
    got = {r["id"]: r for r in c.get("/api/runs/list").json()["runs"]}
    assert got["live"]["status"] == "failed" and got["live"]["last_step"] == 7


def _metrics(c, params, timeout=60.0):
    """/api/runs/metrics, asked again while it answers 'loading' (a big file's first read)."""
    import time

    deadline = time.monotonic() + timeout
    while (r := c.get("/api/runs/metrics", params=params).json()).get("loading"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return r


def test_metrics_downsampled_smoothed_and_robust(tmp_path):
    runs = tmp_path / "runs"
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=100_000)
    d = _run(runs, "big", [{"step": i, "reward": float(r)} for i, r in enumerate(rewards)])
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 100000, "rew\n')                 # a torn line in the middle of the file
        f.write(json.dumps({"step": 100001, "reward": 0.5, "kl": 0.1}) + "\n")
    c = client(make_app(runs))
    r = _metrics(c, {"run": "big", "smooth": 0.9, "max_points": 1000})  # > 4 MB: read in the background first
    assert r["rows"] == 100_001 and r["bad_lines"] == 1
    m = r["metrics"]["reward"]
    x = np.array(list(range(100_000)) + [100_001], dtype=float)
    y = np.append(rewards, 0.5)
    ex, ey = series.downsample(x, series.ema(y, 0.9), 1000)
    assert m["n"] == 100_001 and m["x"] == ex.tolist() and m["y"] == ey.tolist()
    assert r["metrics"]["kl"] == {"x": [100001.0], "y": [0.1], "n": 1}
    assert c.get("/api/runs/metrics", params={"run": "big", "since": r["version"]}).json()["unchanged"] is True
    with open(d / "metrics.jsonl", "a") as f:              # appended while the page watches
        f.write(json.dumps({"step": 100002, "reward": 2.0}) + "\n")
    r2 = c.get("/api/runs/metrics", params={"run": "big", "since": r["version"], "names": "reward"}).json()
    assert r2["rows"] == 100_002 and r2["metrics"]["reward"]["x"][-1] == 100002 and set(r2["metrics"]) == {"reward"}
    _run(runs, "empty", rows=None)
    assert c.get("/api/runs/metrics", params={"run": "empty"}).json()["metrics"] == {}


def test_samples_filter_and_sort(tmp_path):
    runs = tmp_path / "runs"
    samples = [{"step": 5, "prompt": "p1", "completion": "c1", "reward": 0.2},
               {"step": 5, "prompt": "p2", "completion": "c2", "reward": None},
               {"step": 5, "prompt": "p3", "completion": "c3", "reward": 0.9},
               {"step": 10, "prompt": "p4", "completion": "c4", "reward": 0.5, "advantage": 1.0}]
    _run(runs, "r", [{"step": 5, "loss": 1.0}], samples=samples)
    c = client(make_app(runs))
    r = c.get("/api/runs/samples", params={"run": "r", "step": 5, "sort": "reward"}).json()
    assert r["steps"] == [5, 10] and r["total"] == 3
    assert [s["prompt"] for s in r["rows"]] == ["p3", "p1", "p2"]          # missing reward last
    r = c.get("/api/runs/samples", params={"run": "r", "sort": "reward", "descending": False}).json()
    assert [s["prompt"] for s in r["rows"]] == ["p1", "p4", "p3", "p2"]
    assert r["columns"] == ["step", "prompt", "completion", "reward", "advantage"]


# ---- what a request may reach --------------------------------------------------------------------

def test_paths_from_requests_never_reach_the_disk(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "ok", [{"step": 1, "loss": 1.0}])
    secret = tmp_path / "secret"
    _run(tmp_path, "secret", [{"step": 1, "loss": 123456.0}])
    (runs / "linked").symlink_to(secret, target_is_directory=True)     # a symlinked run directory
    sneaky = _run(runs, "sneaky", rows=None)
    (sneaky / "metrics.jsonl").symlink_to(secret / "metrics.jsonl")    # a symlinked file inside a run
    c = client(make_app(runs))
    assert {r["id"] for r in c.get("/api/runs/list").json()["runs"]} == {"ok", "sneaky"}
    for bad in ("../secret", str(secret), "ok/../../secret", "linked", "ok/..", "/etc", "", "ok/"):
        for ep in ("metrics", "samples", "detail"):
            r = c.get(f"/api/runs/{ep}", params={"run": bad})
            assert r.status_code == 404, (bad, ep, r.status_code)
    r = c.get("/api/runs/metrics", params={"run": "sneaky"})
    assert r.status_code == 200 and "123456" not in r.text and r.json()["metrics"] == {}
    assert c.get("/static/../secret/metrics.jsonl").status_code == 404
    assert c.get("/..%2Fsecret").status_code == 404
    assert c.get("/nosuchpage").status_code == 404


def test_loopback_only_without_a_token(tmp_path):
    from fastapi.testclient import TestClient

    app = make_app(tmp_path / "runs")
    assert client(app).get("/api/pages").status_code == 200
    rebinding = TestClient(app, base_url="http://evil.example")       # DNS rebinding: wrong Host
    assert rebinding.get("/api/pages").status_code == 403
    c = client(app)
    r = c.post("/api/labeler/next", json={"session": "x"}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403                                       # cross-site write refused
    r = c.get("/runs")
    assert "script-src 'self'" in r.headers["content-security-policy"]


def test_token_required_when_bound_beyond_loopback(tmp_path):
    from fastapi.testclient import TestClient

    app = make_app(tmp_path / "runs", token="s3cret-token")
    c = TestClient(app, base_url="http://192.0.2.7:7860")
    assert c.get("/api/pages").status_code == 401
    assert c.get("/static/common.js").status_code == 401
    assert c.get("/api/pages", headers={"X-Tether-Token": "wrong"}).status_code == 401
    r = c.get("/api/pages", headers={"X-Tether-Token": "s3cret-token"})
    assert r.status_code == 200 and "set-cookie" not in r.headers
    assert c.get("/runs", params={"token": "wrong"}).status_code == 401
    r = c.get("/runs", params={"token": "s3cret-token"})               # the printed URL sets a cookie
    assert r.status_code == 200 and "tether_token" in r.headers["set-cookie"]
    assert c.get("/api/pages").status_code == 200                      # now the cookie carries it
    from tether.studio.command import is_loopback
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")


# ---- a real run's samples: reward per function and advantage ----------------------------------

def _digits(prompts, completions, completion_ids, **_):
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in completions]


def _length(prompts, completions, completion_ids, **_):
    return [len(t) / 10 for t in completions]


def test_grpo_samples_carry_per_function_rewards_and_advantages(tmp_path):
    import torch

    from tether.models import make_tiny_model
    from tether.objectives import compute_advantages
    from tether.trainers.grpo import GRPOConfig, train_grpo

    make_tiny_model(tmp_path / "model", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=32)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}:"}) + "\n" for i in range(8)))
    G = 4
    train_grpo(GRPOConfig(model=str(tmp_path / "model"), data=str(tmp_path / "p.jsonl"), runs_dir=str(tmp_path / "runs"),
                          name="g", batch_size=2, num_generations=G, max_new_tokens=6, max_steps=2, log_every=1,
                          num_samples=2 * G, device="cpu", progress=False, seed=0, skip_zero_advantage=False),
               reward_funcs=[_digits, _length], reward_weights=[1.0, 0.5])
    r = client(make_app(tmp_path / "runs")).get("/api/runs/samples", params={"run": "g", "step": 1}).json()
    rows = r["rows"]
    assert len(rows) == 2 * G and {"rewards/_digits", "rewards/_length", "advantage"} <= set(r["columns"])
    for row in rows:
        assert row["reward"] == pytest.approx(row["rewards/_digits"] + 0.5 * row["rewards/_length"], abs=1e-6)
    rewards = torch.tensor([row["reward"] for row in rows])
    expect = compute_advantages("grpo", rewards, torch.arange(2).repeat_interleave(G))
    assert [row["advantage"] for row in rows] == pytest.approx(expect.tolist(), abs=1e-5)


def test_a_big_file_is_listed_from_its_last_lines_and_parsed_in_the_background(tmp_path, monkeypatch):
    import time

    from tether.studio import runs as runs_page

    monkeypatch.setattr(runs_page, "BIG", 1000)  # bytes: this file is "big"
    rows = [{"step": i, "loss": 1.0 / (i + 1)} for i in range(2000)] + [{"step": 2000, "reward": 0.25}]
    _run(tmp_path / "runs", "big", rows)
    c = client(make_app(tmp_path / "runs"))
    first = c.get("/api/runs/list").json()["runs"][0]
    assert first["last_step"] == 2000 and first["headline"] == {"name": "reward", "value": 0.25, "step": 2000}
    deadline = time.monotonic() + 20
    while (r := c.get("/api/runs/list").json()["runs"][0])["rows"] is None:  # read in the background
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert r["rows"] == 2001 and r["bad_lines"] == 0 and r["last_step"] == 2000


# ---- the command -------------------------------------------------------------------------------

def _start(args, tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tether", "studio", f"runs_dir={tmp_path / 'runs'}", "port=0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, proc.stdout.readline().strip()


def test_command_prints_the_url_and_asks_for_a_token_beyond_loopback(tmp_path):
    import re
    import urllib.error
    import urllib.request

    proc, line = _start([], tmp_path)
    try:
        url = re.fullmatch(r"tether studio: (http://127\.0\.0\.1:\d+/)", line).group(1)
        assert json.load(urllib.request.urlopen(url + "api/runs/list", timeout=30))["runs"] == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, line = _start(["host=0.0.0.0"], tmp_path)
    try:
        m = re.fullmatch(r"tether studio: http://0\.0\.0\.0:(\d+)/\?token=(\S+)", line)
        port, token = m.groups()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/pages", timeout=30)
        assert e.value.code == 401
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/pages", headers={"X-Tether-Token": token})
        assert urllib.request.urlopen(req, timeout=30).status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_command_port_in_use_is_one_line(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tether", "studio", f"runs_dir={tmp_path}", f"port={port}"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"tether studio: error: studio: cannot bind 127.0.0.1:{port}: Address already in use"]


def test_a_big_first_read_never_holds_the_metrics_request(tmp_path, monkeypatch):
    import time

    from tether.studio import runs as runs_page

    monkeypatch.setattr(runs_page, "BIG", 1000)
    _run(tmp_path / "runs", "big", [{"step": i, "reward": float(i)} for i in range(3000)])
    c = client(make_app(tmp_path / "runs"))
    r = c.get("/api/runs/metrics", params={"run": "big"}).json()
    deadline = time.monotonic() + 20
    while r.get("loading"):                                           # answered at once, then polled
        # meanwhile a preview: real rows spread over the file (reward = step in every row), in
        # order, none twice, through to the last one
        x, y = r["metrics"]["reward"]["x"], r["metrics"]["reward"]["y"]
        assert r["preview"] and x == y and x[0] == 0 and x[-1] == 2999 and x == sorted(set(x))
        assert time.monotonic() < deadline
        time.sleep(0.05)
        r = c.get("/api/runs/metrics", params={"run": "big", "since": r["version"]}).json()
    assert r["rows"] == 3000 and r["metrics"]["reward"]["n"] == 3000 and r["metrics"]["reward"]["y"][-1] == 2999.0


def test_strided_rows_are_real_rows_spread_over_the_file_in_order(tmp_path):
    from tether.studio.common import last_rows, strided_rows

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "loss": 1.0 / (i + 1), "name": "x" * (i % 7)} for i in range(20000)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = strided_rows(path, 100, window=4096)
    steps = [r["step"] for r in got]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == 19999   # in order, none twice
    assert all(r == rows[r["step"]] for r in got)                                 # whole, unaltered rows
    assert got[-len(last_rows(path, 4096)):] == last_rows(path, 4096)              # ends with the last lines
    body = steps[:len(got) - len(last_rows(path, 4096))]                           # one per offset before them
    assert 90 <= len(body) <= 100 and max(b - a for a, b in zip(body, body[1:])) < 2 * 20000 / 100  # even
    assert strided_rows(tmp_path / "none.jsonl", 10) == []
