"""Which rank reaches each collective last? (issue 16: a 2-GPU step is ~0.22 s slower than one GPU's
whatever the number of collectives; the links are fast, so some rank waits.)

    python bench/scale.py --shape qwen0.5b --gpus 2 --algos dpo --trace /tmp/tr ...
    python bench/trace_skew.py /tmp/tr/dpo2-rank0.json.gz /tmp/tr/dpo2-rank1.json.gz

Reads the ranks' chrome traces (bench/scale.py --trace; one host, so their timestamps share the
monotonic clock) and pairs each rank's collectives with rank 0's: NCCL kernels by kind (all-gather,
reduce-scatter, all-reduce, ... each kind in its own order, since FSDP2 runs them on different
streams that interleave differently per rank), aligned by the offset (within ±3) that makes the
pairs' *end* times agree best — a collective ends at the same moment on every rank, so the median
end-time spread printed is the check that the pairing is right (tens of µs; much more means it is
not). On CPU (gloo) the c10d calls are paired in order instead. For each pair the last start is when
the collective could begin; every other rank's kernel waited the difference.

Printed per rank: how often it was last, its total wait, its GPU time in compute kernels (NCCL
left out: a waiting NCCL kernel spins) and the profiled span; then the largest skews, and for the
late rank's kernel its launch-to-start delay: near zero = the kernel was launched late, the rank
was CPU-bound (the outermost CPU op around the launch is named); large = its stream was busy (the
kernel before it on that stream is named). The first --skip collectives are left out: each rank's
profiler starts at its own step boundary and that start-up lands on the first pair.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys

KINDS = ("allgather", "reducescatter", "allreduce", "broadcast", "sendrecv", "reduce")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]


def kind(name: str) -> str:
    flat = name.lower().replace("_", "")
    return next((k for k in KINDS if k in flat), flat[:40])


def collectives(events: list[dict]) -> tuple[dict[str, list[dict]], bool]:
    """{kind: its collectives in start order}, and whether they are GPU kernels (else CPU c10d calls)."""
    gpu = [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    found = gpu or [e for e in events if e.get("cat") == "cpu_op" and
                    any(k in e["name"] for k in ("c10d::", "gloo:"))]
    by: dict[str, list[dict]] = {}
    for e in sorted(found, key=lambda e: e["ts"]):
        by.setdefault(kind(e["name"]) if gpu else "c10d", []).append(e)
    return by, bool(gpu)


def align(a: list[dict], b: list[dict]) -> int:
    """The offset o (|o| <= 3) pairing a[i] with b[i + o] whose end times agree best."""
    def spread(o):
        ends = [abs((x["ts"] + x["dur"]) - (b[i + o]["ts"] + b[i + o]["dur"]))
                for i, x in enumerate(a) if 0 <= i + o < len(b)]
        return statistics.median(ends) if ends else float("inf")
    return min(range(-3, 4), key=spread)


def compute_busy(events: list[dict]) -> float:
    """Microseconds the GPU ran a non-NCCL kernel (overlapping kernels merged)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "kernel" and "nccl" not in e["name"].lower())
    total, end = 0.0, float("-inf")
    for s, t in spans:
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def why_late(events: list[dict], k: dict) -> str:
    """For kernel `k`: launched late (CPU-bound: the outermost CPU op around its launch) or queued
    behind another kernel on its stream."""
    corr = (k.get("args") or {}).get("correlation")
    launch = next((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                   and (e.get("args") or {}).get("correlation") == corr), None) if corr is not None else None
    if launch is None:
        return "no launch event found"
    delay = k["ts"] - launch["ts"]
    if delay < 50:
        around = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
                  and e.get("tid") == launch.get("tid") and e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
        outer = max(around, key=lambda e: e["dur"])["name"][:50] if around else "-"
        return f"launched {delay:.0f} µs before it ran (CPU-bound), inside {outer}"
    stream = (k.get("args") or {}).get("stream")
    before = [e for e in events if e.get("cat") == "kernel" and (e.get("args") or {}).get("stream") == stream
              and e["ts"] < k["ts"]]
    prev = max(before, key=lambda e: e["ts"])["name"][:50] if before else "-"
    return f"waited {delay / 1e3:.2f} ms on its stream after launch, behind {prev}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="one chrome trace per rank, in rank order")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--skip", type=int, default=1, help="collectives of each kind left out at the start")
    a = ap.parse_args(argv)
    ranks = [load(p) for p in a.traces]
    found = [collectives(ev) for ev in ranks]
    on_gpu = found[0][1]
    pairs, spreads = [], []
    for k, zero in found[0][0].items():
        zero = zero[a.skip:]
        others = [f[0].get(k, [])[a.skip:] for f in found]
        offs = [0 if r == 0 or not on_gpu else align(zero, others[r]) for r in range(len(ranks))]
        for i, x in enumerate(zero):
            idx = [i + o for o in offs]
            if all(0 <= j < len(others[r]) for r, j in enumerate(idx)):
                evs = [others[r][j] if r else x for r, j in enumerate(idx)]
                pairs.append((k, evs))
                ends = [e["ts"] + e["dur"] for e in evs]
                spreads.append(max(ends) - min(ends))
    if not pairs:
        sys.exit("no collectives paired")
    last, wait = [0] * len(ranks), [0.0] * len(ranks)
    skews = []
    for k, evs in pairs:
        starts = [e["ts"] for e in evs]
        late = max(range(len(ranks)), key=lambda r: starts[r])
        last[late] += max(starts) > min(starts)  # a tie has no last rank
        for r, s in enumerate(starts):
            wait[r] += starts[late] - s
        skews.append((starts[late] - min(starts), k, late, evs[late]))
    print(f"{len(pairs)} collectives paired over {len(ranks)} ranks "
          f"({', '.join(sorted({k for k, _ in pairs}))}); median end-time spread {statistics.median(spreads):.0f} µs"
          + ("" if on_gpu else " (CPU calls: paired in order)"))
    print("| rank | last to arrive | waited (ms) | GPU compute kernels (ms) | profiled span (ms) |")
    print("|---|---|---|---|---|")
    for r, ev in enumerate(ranks):
        span = (max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)) / 1e3
        print(f"| {r} | {last[r]} of {len(pairs)} | {wait[r] / 1e3:.1f} | {compute_busy(ev) / 1e3:.1f} | {span:.1f} |")
    print(f"\nlargest skews (top {a.top}):")
    for skew, k, late, ev in sorted(skews, key=lambda s: -s[0])[:a.top]:
        detail = why_late(ranks[late], ev) if on_gpu else f"CPU op {ev['name'][:40]}"
        print(f"  {k}: {skew / 1e3:.2f} ms, rank {late} last; {detail}")


if __name__ == "__main__":
    main()
