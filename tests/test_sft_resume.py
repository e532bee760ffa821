"""A run killed with SIGKILL mid-way and resumed writes the same metrics as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tether.models import make_tiny_model
from tether.tasks import arithmetic

VOLATILE = {"time", "step_time", "tokens_per_second"}  # wall-clock readings differ by nature


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    make_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    train, _ = arithmetic.make_splits(400, 10, seed=1)
    with open(root / "data.jsonl", "w") as f:
        for p in train:
            f.write(json.dumps(arithmetic.sft_example(p)) + "\n")
    return root


def _cmd(root: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tether", "sft", f"model={root / 'model'}",
            f"data={root / 'data.jsonl'}", f"runs_dir={root / 'runs'}", f"name={name}",
            "max_steps=120", "batch_size=4", "grad_accum=2", "lr=3e-3", "log_every=1",
            "save_every=4", "eval_every=8", "eval_fraction=0.05", "num_samples=2",
            "sample_max_new_tokens=8", "device=cpu", "progress=false", *extra]


def _metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


@pytest.mark.slow  # kept out of the default suite's 10 minutes (run with -m slow)
def test_sigkill_then_resume_matches_uninterrupted(setup):
    root = setup
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # same thread count in every run: same float sums
    ref = subprocess.run(_cmd(root, "ref"), env=env, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]

    proc = subprocess.Popen(_cmd(root, "killed"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckpts = root / "runs" / "killed" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpts / "step-12").exists():
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to clean up: the hard case
    proc.wait()
    assert (ckpts / "step-12").exists(), "run never reached its step-12 checkpoint"
    assert not (root / "runs" / "killed" / "summary.json").exists(), "killed too late to test resume"

    res = subprocess.run(_cmd(root, "killed", "resume=true"), env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    a = _metrics(root / "runs" / "ref" / "metrics.jsonl")
    b = _metrics(root / "runs" / "killed" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert a == b
    sa = [json.loads(x) for x in (root / "runs" / "ref" / "samples.jsonl").read_text().splitlines()]
    sb = [json.loads(x) for x in (root / "runs" / "killed" / "samples.jsonl").read_text().splitlines()]
    assert sa == sb
