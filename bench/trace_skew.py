"""Which rank reaches each collective last? (issue 16: a 2-GPU step is ~0.22 s slower than one GPU's
whatever the number of collectives; the links are fast, so some rank waits.)

    python bench/scale.py --shape qwen0.5b --gpus 2 --algos dpo --trace /tmp/tr ...
    python bench/trace_skew.py /tmp/tr/dpo2-rank0.json.gz /tmp/tr/dpo2-rank1.json.gz

Reads the ranks' chrome traces (bench/scale.py --trace; one host, so their timestamps share the
monotonic clock) and pairs the collectives in order: the n-th NCCL kernel of rank 0 with the n-th of
rank 1 (on CPU: the n-th gloo/c10d call). For each pair, the later start is when the collective
could really begin; the earlier rank's kernel spent the difference waiting. Prints, per rank: how
often it was last, its total wait, its GPU busy time (kernels, overlaps merged) and the span of the
profiled steps; and the pairs with the largest skew, with the CPU op each rank was in just before
(what held the late rank up). The first --skip collectives are left out: each rank's profiler
starts tracing at its own step boundary, and that start-up (tens of ms on CPU) lands on the first
pair (on CPU/gloo, 35 ms at pair 0 and under 9 ms after).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]


def collectives(events: list[dict]) -> list[dict]:
    """The collective operations in start order: NCCL kernels on the GPU, else the CPU-side c10d calls."""
    gpu = [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    if gpu:
        return sorted(gpu, key=lambda e: e["ts"])
    cpu = [e for e in events if e.get("cat") == "cpu_op" and
           any(k in e["name"] for k in ("c10d::", "gloo:", "record_param_comms"))]
    return sorted([e for e in cpu if e["name"] != "record_param_comms"] or cpu, key=lambda e: e["ts"])


def busy(events: list[dict]) -> float:
    """Microseconds the GPU ran any kernel (overlapping kernels merged)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    total, end = 0.0, float("-inf")
    for s, t in spans:
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def cpu_before(events: list[dict], ts: float) -> str:
    """The top-level CPU op that ended last before `ts` (what the rank was doing)."""
    ops = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")
           and e["ts"] + e["dur"] <= ts]
    return max(ops, key=lambda e: e["ts"] + e["dur"])["name"][:60] if ops else "-"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="one chrome trace per rank, in rank order")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--skip", type=int, default=1, help="collectives left out at the start (profiler start-up)")
    a = ap.parse_args(argv)
    ranks = [load(p) for p in a.traces]
    colls = [collectives(ev)[a.skip:] for ev in ranks]
    n = min(len(c) for c in colls)
    if n == 0:
        sys.exit("no collectives found in the traces")
    if len({len(c) for c in colls}) > 1:
        print(f"note: collective counts differ by rank {[len(c) for c in colls]}; pairing the first {n}")
    last = [0] * len(ranks)
    wait = [0.0] * len(ranks)
    pairs = []
    for i in range(n):
        starts = [c[i]["ts"] for c in colls]
        late = max(range(len(ranks)), key=lambda r: starts[r])
        last[late] += 1
        for r, s in enumerate(starts):
            wait[r] += starts[late] - s
        pairs.append((starts[late] - min(starts), i, late, starts))
    print(f"{n} collectives paired over {len(ranks)} ranks ({colls[0][0]['name'][:50]} ...)")
    print("| rank | last to arrive | waited (ms) | GPU busy (ms) | profiled span (ms) |")
    print("|---|---|---|---|---|")
    for r, ev in enumerate(ranks):
        span = (max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)) / 1e3
        print(f"| {r} | {last[r]} of {n} | {wait[r] / 1e3:.1f} | {busy(ev) / 1e3:.1f} | {span:.1f} |")
    print(f"\nlargest skews (top {a.top}):")
    for skew, i, late, starts in sorted(pairs, reverse=True)[:a.top]:
        before = cpu_before(ranks[late], starts[late])
        print(f"  #{i}: {skew / 1e3:.2f} ms, rank {late} last; its CPU was in: {before}")


if __name__ == "__main__":
    main()
