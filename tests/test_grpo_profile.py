"""bench/grpo_profile.py: a kernel goes to the innermost phase around the host call that launched
it (a CUDA graph's kernels to its cudaGraphLaunch), the GPU union does not double-count overlaps,
and one CPU run of the script profiles every phase of a real step (no timing is asserted)."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import grpo_profile as G  # noqa: E402


def _range(name, ts, dur):
    return {"cat": "user_annotation", "name": f"tether::{name}", "ts": ts, "dur": dur}


def _launch(name, ts, corr):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": corr}}


def _kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_kernels_go_to_the_phase_that_launched_them():
    events = [
        _range("grpo_step", 0, 1000), _range("sample", 10, 300), _range("forward", 400, 100),
        _range("backward", 500, 300), _range("forward", 550, 50),  # the recompute inside backward
        _launch("cudaGraphLaunch", 20, 1), _kernel("_decode_attn", 30, 40, 1), _kernel("gemm_a", 70, 60, 1),
        _launch("cudaLaunchKernel", 410, 2), _kernel("gemm_b", 420, 30, 2),
        _launch("cudaLaunchKernel", 560, 3), _kernel("gemm_c", 600, 20, 3),  # innermost: forward
        _launch("cudaLaunchKernel", 700, 4), _kernel("gemm_d", 610, 30, 4),  # overlaps gemm_c by 10
        _launch("cudaLaunchKernel", 900, 5), _kernel("memset", 905, 5, 5),  # in the step, no phase
        _launch("cudaLaunchKernel", 1200, 6), _kernel("after", 1210, 50, 6),  # after the step: left out
    ]
    r = G.analyse({"traceEvents": events})
    p = r["phases"]
    assert p["sample"]["gpu_ms"] == pytest.approx(0.100) and p["sample"]["calls"] == 1
    assert p["forward"]["gpu_ms"] == pytest.approx(0.050) and p["forward"]["calls"] == 2
    assert p["forward"]["wall_ms"] == pytest.approx(0.150)
    assert p["backward"]["gpu_ms"] == pytest.approx(0.030)
    assert p["other"]["gpu_ms"] == pytest.approx(0.005)
    assert r["kernels"] == 6 and r["gpu_busy_ms"] == pytest.approx(0.185)
    assert r["gpu_union_ms"] == pytest.approx(0.175)  # gemm_c and gemm_d overlap by 10 us
    assert r["idle_ms"] == pytest.approx(1.0 - 0.175)
    assert [k["name"] for k in p["sample"]["top"]] == ["gemm_a", "_decode_attn"]


def test_one_cpu_run_profiles_every_phase(tmp_path):
    out = tmp_path / "p.json"
    threads = torch.get_num_threads()
    try:
        G.main(["--device", "cpu", "--warmup", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # (the script runs on one thread)
    r = json.loads(out.read_text())
    from tether.models import load_tokenizer
    from tether.trainers.core import setup
    assert setup.load_tokenizer is load_tokenizer  # the benchmark's word-level tokenizer is not left behind
    phases = r["phases"]
    assert {"sample", "score", "prepare", "forward", "loss", "backward", "optimizer", "metrics"} <= set(phases)
    assert phases["forward"]["calls"] == phases["backward"]["calls"] == 2  # 8 rows, micro-batches of 4
    assert sum(p["wall_ms"] for k, p in phases.items() if k != "forward") <= r["step_ms"]
    assert len(r["step_time_s"]) == 2 and r["gpu_union_ms"] == 0.0
