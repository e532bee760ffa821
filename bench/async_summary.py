"""Issue 19 §1's table from real-model GRPO runs (bench/real_model_rl.py's run folders, e.g.
`bench/gpu_session16.sh async5a`'s /tmp/rl/c-sync-s0 and c-disagg1-s0): per run the seconds a
step, the sampler's cycle and the curve; per seed the disaggregated / synchronous ratio.

    python bench/async_summary.py RUN_DIR... [--json out.json] [--note "..."]

s/step = (time(last) − time(2) − evaluation seconds after step 2) / (last − 2): the first two steps
(compilation, graph capture) left out, as in sessions 14-16. gap = the median time between
consecutive steps; step_time, rollout and the sampler's cycle (weights wait / produce / send) are
medians over steps 3..last; overlapped = the fraction of steps whose next version's weights arrived
while the batch was produced (online_disaggregated.Incoming); rq = the mean training reward by
quarter of the run; pass1 = held-out greedy pass@1 at each eval point. Runs are paired by the
`-s<seed>` at the end of their names: `…sync-s<seed>` (c-sync-s0) is the baseline of its seed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def _median(rows: list[dict], key: str):
    values = [r[key] for r in rows if key in r]
    return round(statistics.median(values), 4) if values else None


def summarize(run: Path) -> dict:
    """One run folder's numbers (module doc)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = {r["step"]: r for r in rows if "step_time" in r}
    evals = [r for r in rows if "eval/seconds" in r]
    last = max(steps)
    ev_after = sum(r["eval/seconds"] for r in evals if r["step"] > 2)
    body = [steps[s] for s in sorted(steps) if s >= 3]
    times = [steps[s]["time"] for s in sorted(steps) if s >= 2]
    rewards = [steps[s]["reward"] for s in sorted(steps)]
    q = max(len(rewards) // 4, 1)
    return {
        "steps": last,
        "s_per_step": round((steps[last]["time"] - steps[2]["time"] - ev_after) / (last - 2), 4),
        "gap": round(statistics.median(b - a for a, b in zip(times, times[1:])), 4),
        "step_time": _median(body, "step_time"),
        "rollout": _median(body, "rollout/seconds"),
        "wwait": _median(body, "queue/weights_wait_seconds"),
        "produce": _median(body, "queue/produce_seconds"),
        "send": _median(body, "queue/send_seconds"),
        "qwait": _median(body, "queue/wait_seconds"),
        "overlapped": (round(sum(r["queue/weights_overlapped"] for r in body) / len(body), 3)
                       if "queue/weights_overlapped" in body[0] else None),
        "first": round(steps[1]["time"], 2),
        "evs": round(ev_after, 2),
        "rq": [round(statistics.mean(rewards[i * q:(i + 1) * q]), 3) for i in range(4)],
        "pass1": {str(r["step"]): r["eval/greedy/pass@1"] for r in evals if "eval/greedy/pass@1" in r},
    }


def table(runs: dict) -> str:
    """Markdown: every run, then each seed's ratio to its synchronous run."""
    out = ["| run | s/step | gap | step_time | rollout | weights wait / produce / send | overlapped | reward by quarter | pass@1 |",
           "|---|---:|---:|---:|---:|---|---:|---|---|"]
    for name, r in runs.items():
        cycle = " / ".join("—" if r[k] is None else f"{r[k]:.3f}" for k in ("wwait", "produce", "send"))
        out.append(f"| {name} | {r['s_per_step']:.3f} | {r['gap']:.3f} | {r['step_time']:.3f} | "
                   f"{r['rollout']:.3f} | {cycle} | {'—' if r['overlapped'] is None else r['overlapped']} | "
                   f"{', '.join(f'{x:.3f}' for x in r['rq'])} | "
                   f"{', '.join(f'@{k} {v:.4f}' for k, v in r['pass1'].items())} |")
    by_seed: dict = {}
    for name, r in runs.items():
        m = re.search(r"-s(\d+)$", name)
        if m:
            by_seed.setdefault(m.group(1), {})["sync" if re.search(r"(^|-)sync-s\d+$", name) else name] = r
    ratios = []
    for seed, group in sorted(by_seed.items()):
        if "sync" not in group:
            continue
        for name, r in group.items():
            if name != "sync":
                ratio = r["s_per_step"] / group["sync"]["s_per_step"]
                ratios.append(ratio)
                out.append(f"\nseed {seed}: {name} / sync = {r['s_per_step']:.3f} / "
                           f"{group['sync']['s_per_step']:.3f} = **{ratio:.3f}**")
    if ratios:
        out.append(f"\nratios: mean {statistics.mean(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--note", default="")
    a = p.parse_args()
    # (real_model_rl.py keeps the run itself in <out>/run)
    runs = {d.name: summarize(d / "run" if (d / "run" / "metrics.jsonl").exists() else d) for d in a.runs
            if (d / "metrics.jsonl").exists() or (d / "run" / "metrics.jsonl").exists()}
    print(table(runs))
    if a.json:
        a.json.write_text(json.dumps({"note": a.note, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
