"""Running a tether command in N processes (torchrun, gloo on CPU) and comparing it with one
process: the helpers of the multi-process tests (tests/test_distributed*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

# Wall-clock and throughput are not results; the rest of a metrics row must match.
TIMING = {"time", "step_time", "tokens_per_second", "gather_time", "sample_time", "update_time", "queue/wait_seconds",
          "eval/seconds", "sampling_time", "rollout_time", "samples_per_second", "rollout/seconds",
          "rollout/tokens_per_second"}


def run_tether(command: str, args: list[str], nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """`tether <command> <args>` in `nproc` processes (torchrun, one node, gloo) or in this Python
    (nproc=1, no torchrun). Threads pinned to 1 per process: the same arithmetic in both."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TETHER_DIST_TIMEOUT": "120",
           "TORCHELASTIC_ERROR_FILE": ""}
    env.pop("TORCHELASTIC_ERROR_FILE")
    if nproc == 1:
        argv = [sys.executable, "-m", "tether", command, *args]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--master-port", str(_free_port()), "-m", "tether", command, *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def assert_same_metrics(a: Path, b: Path, rel: float = 1e-5, keys_may_differ: bool = False) -> int:
    """Every logged value of run `a` equals run `b`'s within `rel` (relative, with an absolute
    floor of `rel` for values near 0). Returns how many values were compared."""
    ra, rb = metrics(a), metrics(b)
    assert len(ra) == len(rb), f"{len(ra)} vs {len(rb)} metric rows"
    n = 0
    for x, y in zip(ra, rb):
        if not keys_may_differ:
            assert set(x) == set(y), f"step {x.get('step')}: keys differ: {set(x) ^ set(y)}"
        for k in set(x) & set(y):
            u, v = x[k], y[k]
            if u is None or v is None:
                assert u is v, f"step {x['step']} {k}: {u} vs {v}"
                continue
            assert abs(u - v) <= rel * max(1.0, abs(u), abs(v)), f"step {x['step']} {k}: {u} vs {v}"
            n += 1
    return n


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        if f.name != "master_weights.safetensors":
            out.update(load_file(str(f)))
    return out


def assert_same_weights(a: Path, b: Path, atol: float = 1e-5) -> float:
    """The checkpoints' tensors: same names, equal within `atol`. Returns the largest difference."""
    wa, wb = weights(a), weights(b)
    assert wa and set(wa) == set(wb), set(wa) ^ set(wb)
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    assert worst <= atol, f"largest weight difference {worst}"
    return worst
