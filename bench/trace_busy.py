"""Is a traced step GPU-bound or CPU-bound? (issue 16: one process vs two.)

    python bench/trace_busy.py /tmp/tr/dpo1-rank0.json.gz /tmp/tr/dpo2-rank0.json.gz ...

For each chrome trace (bench/scale.py --trace): the traced span, the time the GPU was busy with
compute kernels (the union of their intervals, NCCL left out: a waiting NCCL kernel spins and would
count as busy), the same with NCCL, the number of kernels, and the CPU side: the runtime calls
that launch work (cudaLaunchKernel and friends) — their count, summed duration, and the mean CPU
time between two launches. A step whose GPU is idle much of the span while launches follow one
another without pause is CPU-bound: its time is the launch rate, and anything that slows the CPU
per op (hooks, contention) lengthens it one for one.
"""
from __future__ import annotations

import argparse

from trace_skew import load

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
          "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch")


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summary(path: str) -> dict:
    events = load(path)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep")]
    if steps:
        t0, t1 = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    else:
        t0, t1 = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    inside = [e for e in kernels if t0 <= e["ts"] <= t1]
    nccl = [e for e in inside if "nccl" in e["name"].lower()]
    compute = [e for e in inside if "nccl" not in e["name"].lower()]
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in LAUNCH
                       and t0 <= e["ts"] <= t1), key=lambda e: e["ts"])
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(launches, launches[1:])]
    ops = [e for e in events if e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1]
    mm = [e["dur"] for e in ops if e["name"] == "aten::mm"]
    span = (t1 - t0) / 1e3
    # each ProfilerStep#k is recorded twice on CUDA (a CPU and a GPU annotation): count names
    # (until session 15 the events were counted, halving every per-step figure of a scale.py trace)
    return {"trace": path.rsplit("/", 1)[-1], "span_ms": span, "steps": max(1, len({e["name"] for e in steps})),
            "compute_busy_ms": union([(e["ts"], e["ts"] + e["dur"]) for e in compute]) / 1e3,
            "busy_with_nccl_ms": union([(e["ts"], e["ts"] + e["dur"]) for e in inside]) / 1e3,
            "kernels": len(inside), "nccl_kernels": len(nccl), "launches": len(launches),
            "launch_cpu_ms": sum(e["dur"] for e in launches) / 1e3,
            "mean_launch_gap_us": sum(gaps) / len(gaps) if gaps else 0.0,
            "cpu_ops": len(ops), "mm_cpu_us": sum(mm) / len(mm) if mm else 0.0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    a = ap.parse_args(argv)
    print("| trace | span ms / step | compute busy | busy incl. NCCL | kernels / step | launches / step "
          "| launch CPU ms / step | mean gap between launches µs | CPU ops / step | aten::mm CPU µs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in a.traces:
        s = summary(path)
        n = s["steps"]
        print(f"| {s['trace']} | {s['span_ms'] / n:.1f} | {s['compute_busy_ms'] / n:.1f} "
              f"({100 * s['compute_busy_ms'] / s['span_ms']:.0f} %) | {s['busy_with_nccl_ms'] / n:.1f} "
              f"| {s['kernels'] / n:.0f} | {s['launches'] / n:.0f} | {s['launch_cpu_ms'] / n:.1f} "
              f"| {s['mean_launch_gap_us']:.1f} | {s['cpu_ops'] / n:.0f} | {s['mm_cpu_us']:.1f} |")


if __name__ == "__main__":
    main()
