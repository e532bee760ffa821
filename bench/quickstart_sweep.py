"""How robust is the quickstart? Every combination of seeds × torch threads × fused AdamW on/off.

    python bench/quickstart_sweep.py                          # 3 seeds × {1, 2} threads × fused {off, on}
    python bench/quickstart_sweep.py --parallel 2             # the benchmark rows (benchmarks/quickstart/), 2 cores
    python bench/quickstart_sweep.py --parallel 6 -- rl_steps=400    # extra quickstart keys after --

The quickstart's stage accuracies must not hang on float rounding: SFT accuracy in
[0.3, 0.7] and RL at least 15 points above it in *every* run. Each combination is one ordinary
`tether quickstart` process (its own runs dir under --work); with --parallel > 1 several run at
once, each pinned to its own CPU cores (taskset, as many cores as it has threads) so that the
threads setting means what it does on a 2-core machine (--no-pin runs them unpinned: more runs
than cores; the accuracies do not change, since a run's rounding depends on its thread count, not
on how the OS schedules it). Seconds are only comparable between runs of the same sweep on an
otherwise idle machine; --parallel 1 on the target machine gives the honest time. A combination
whose summary.json is already in --work is not run again (an interrupted sweep resumes; a final
call over all combinations builds the whole table). Writes a markdown table (stdout and --md) and
--json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _name(combo) -> str:
    seed, threads, fused = combo
    return f"s{seed}-t{threads}-{'fused' if fused else 'loop'}"


def _launch(combo, work: Path, extra: list[str], cores: list[int] | None):
    seed, threads, fused = combo
    name = _name(combo)
    cmd = [sys.executable, "-m", "tether", "quickstart", f"runs_dir={work}", f"name={name}",
           f"seed={seed}", f"threads={threads}", f"fused_adamw={str(fused).lower()}", "progress=false",
           *extra]
    if cores:
        cmd = ["taskset", "-c", ",".join(map(str, cores))] + cmd
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log = open(work / f"{name}.log", "w")
    return name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), time.time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--fused", default="off,on")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (each pinned to its own cores)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin runs to cores (allows more runs than cores)")
    ap.add_argument("--work", default="/tmp/quickstart_sweep")
    ap.add_argument("--md", default=None, help="also write the table here")
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="quickstart keys (after --), e.g. rl_steps=400")
    args = ap.parse_args()

    combos = list(itertools.product([int(s) for s in args.seeds.split(",")],
                                    [int(t) for t in args.threads.split(",")],
                                    [f == "on" for f in args.fused.split(",")]))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ncpu = os.cpu_count() or 1
    pending, running, results = [], [], {}
    for combo in combos:  # already done in this work dir: read, not rerun
        name = _name(combo)
        summary = work / name / "summary.json"
        if summary.exists():
            done = json.loads(summary.read_text())
            results[name] = {"seed": combo[0], "threads": combo[1], "fused_adamw": combo[2], "returncode": 0,
                             "wall_s": None, "stages": done["stages"], "seconds": done["seconds"]}
        else:
            pending.append(combo)
    pin = args.parallel > 1 and not args.no_pin
    free = list(range(ncpu))
    while pending or running:
        while pending and len(running) < args.parallel:
            threads = pending[0][1]
            if pin and len(free) < threads:
                break
            cores = [free.pop(0) for _ in range(threads)] if pin else None
            combo = pending.pop(0)
            running.append((combo, cores, *_launch(combo, work, args.extra, cores)))
        time.sleep(2)
        for item in list(running):
            combo, cores, name, proc, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            free += cores or []
            summary = work / name / "summary.json"
            done = json.loads(summary.read_text()) if proc.returncode == 0 and summary.exists() else None
            stages = done and done["stages"]
            results[name] = {"seed": combo[0], "threads": combo[1], "fused_adamw": combo[2],
                             "returncode": proc.returncode, "wall_s": round(time.time() - t0, 1),
                             "stages": stages, "seconds": done and done["seconds"]}
            print(f"[sweep] {name}: rc={proc.returncode} {stages and {k: v['accuracy'] for k, v in stages.items()}}",
                  flush=True)

    head = (f"quickstart sweep, {time.strftime('%Y-%m-%d')}, {_cpu_name()}, {ncpu} logical CPUs, "
            f"{args.parallel} run(s) at a time; extra keys: {' '.join(args.extra) or '(defaults)'}")
    lines = [head, "", "| seed | threads | fused AdamW | pretrain | SFT | RL | RL − SFT | seconds |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    ok = True
    for name in sorted(results):
        r = results[name]
        st = r["stages"]
        if st is None:
            ok = False
            lines.append(f"| {r['seed']} | {r['threads']} | {r['fused_adamw']} | failed (rc {r['returncode']}) | | | | |")
            continue
        pre, sft, rl = (st[k]["accuracy"] for k in ("pretrain", "sft", "rl"))
        gain = rl - sft
        ok &= 0.3 <= sft <= 0.7 and gain >= 0.15
        secs = r["seconds"]
        lines.append(f"| {r['seed']} | {r['threads']} | {'on' if r['fused_adamw'] else 'off'} | {pre:.3f} | "
                     f"{sft:.3f} | {rl:.3f} | {gain:+.3f} | {secs:.0f} |")
    sfts = [r["stages"]["sft"]["accuracy"] for r in results.values() if r["stages"]]
    gains = [r["stages"]["rl"]["accuracy"] - r["stages"]["sft"]["accuracy"] for r in results.values() if r["stages"]]
    if sfts:
        lines += ["", f"SFT {min(sfts):.3f}–{max(sfts):.3f}; RL − SFT {min(gains):+.3f} to {max(gains):+.3f}; "
                      f"every run in target (SFT in [0.3, 0.7], RL ≥ SFT + 0.15): {'yes' if ok else 'NO'}"]
    table = "\n".join(lines)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": head, "runs": results}, indent=1) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
