"""Where a traced step's GPU time goes, and where its compute stands idle (issue 16: the 7B DPO step).

    python bench/trace_gaps.py /tmp/t7/dpo4-...-rank0.json.gz [--step -1] [--top 20]

For one ProfilerStep of a chrome trace (bench/scale.py --trace): the kernels by kind (GEMM, NCCL,
attention, copies/casts, the rest), the largest non-GEMM kernels with the CPU op that launched
them, and the gaps where no compute kernel runs (NCCL left out) with what NCCL does meanwhile —
the exposed communication and the host syncs around a step's edges. The profiler writes each
ProfilerStep twice (a CPU and a GPU annotation): a step here spans both.
"""
from __future__ import annotations

import argparse
import bisect
from collections import defaultdict

from trace_skew import load


def kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "xmma", "sm90_xmma")):
        return "gemm"
    if any(k in low for k in ("flash", "fmha", "sdpa")):
        return "attention"
    if any(k in name for k in ("copy", "Copy", "cast", "chunk_cat", "split_with_sizes")):
        return "copy/cast"
    return "other"


def merged(intervals):
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, default=-1, help="which traced step (index among the distinct steps)")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    events = load(a.trace)
    by_name = defaultdict(list)
    for e in events:
        if e.get("name", "").startswith("ProfilerStep"):
            by_name[e["name"]].append(e)
    name = sorted(by_name, key=lambda n: int(n.split("#")[1]))[a.step]
    t0 = min(e["ts"] for e in by_name[name])
    t1 = max(e["ts"] + e["dur"] for e in by_name[name])
    kernels = [e for e in events if e.get("cat") == "kernel" and t0 <= e["ts"] < t1]
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    ops = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append(e)

    def launcher(k) -> str:
        r = launches.get(k["args"].get("correlation"))
        if r is None:
            return "?"
        inside = [e["name"] for e in ops[r["tid"]] if e["ts"] <= r["ts"] and e["ts"] + e["dur"] >= r["ts"] + r["dur"]]
        return " > ".join(inside[-3:]) or "?"

    span = (t1 - t0) / 1e3
    print(f"{name}: span {span:.1f} ms, {len(kernels)} kernels")
    total = defaultdict(float)
    for k in kernels:
        total[kind(k["name"])] += k["dur"] / 1e3
    for kd, ms in sorted(total.items(), key=lambda x: -x[1]):
        print(f"  {kd:10s} {ms:8.1f} ms (summed; NCCL overlaps compute)")
    align1 = sum(k["dur"] for k in kernels if "align1" in k["name"]) / 1e3
    print(f"  of the GEMMs, align-1 kernels (an unaligned operand: cuBLAS's slow path): {align1:.1f} ms")
    biggest = defaultdict(float)
    for k in kernels:
        if kind(k["name"]) not in ("gemm", "nccl"):
            biggest[(k["name"][:60], launcher(k)[-90:])] += k["dur"] / 1e3
    print("largest non-GEMM, non-NCCL kernels (by the op that launched them):")
    for (kn, op), ms in sorted(biggest.items(), key=lambda x: -x[1])[:a.top]:
        print(f"  {ms:7.1f} ms  {kn}  <- {op}")
    busy = merged((k["ts"], k["ts"] + k["dur"]) for k in kernels if kind(k["name"]) != "nccl")
    nccl = [(k["ts"], k["ts"] + k["dur"], k["name"][:40]) for k in kernels if kind(k["name"]) == "nccl"]
    gaps, prev = [], t0
    for s, e in busy:
        if s > prev:
            gaps.append((prev, s))
        prev = max(prev, e)
    gaps.append((prev, t1))
    idle = sum(e - s for s, e in gaps) / 1e3
    print(f"compute idle {idle:.1f} ms of {span:.1f} ({100 * idle / span:.0f} %); the largest gaps:")
    starts = [n[0] for n in nccl]
    for s, e in sorted(sorted(gaps, key=lambda g: g[0] - g[1])[:a.top]):
        i = bisect.bisect_left(starts, s - 1e6)
        during = {n[2] for n in nccl[i:] if n[0] < e and n[1] > s}
        print(f"  at {(s - t0) / 1e3:7.1f} ms: {(e - s) / 1e3:6.1f} ms idle; NCCL meanwhile: {', '.join(sorted(during)) or 'none'}")


if __name__ == "__main__":
    main()
