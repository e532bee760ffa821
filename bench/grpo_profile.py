"""Where one GRPO step spends its time: bench/grpo_step.py's step (ours only) under torch.profiler,
cut into the loop's phases, each with its wall time, its GPU busy time and its top kernels.

    python bench/grpo_profile.py --device cuda --micro-batch 16 --compile     # the benchmark's best row
    python bench/grpo_profile.py --device cpu                                  # tiny model (a smoke run)

The step is the one bench/grpo_step.py times (Qwen2.5-0.5B shape, 8 prompts × 8 generations,
128 + 256 tokens, token-mean loss, β 0, gradient checkpointing on); the last of --warmup + 1 steps
runs under the profiler. The phases are record_function ranges this script puts around the
loop's calls (nothing in tether is changed):

- sample: the engine's `Sampler.sample` (prefill, decode, the batch's tensors);
- score: the reward functions and the batch's detokenization (`Scoring.__call__`);
- prepare: masks, old log-probs and advantages (`prepare_batch`, `assign_advantages`);
- forward: `completion_token_logps` of each micro-batch (the policy's forward and its head);
- loss: `policy_loss`;
- backward: `Tensor.backward` (with checkpointing: the recomputed forward too);
- optimizer: `Training.optimizer_step` (clip, AdamW, zero_grad, the sampler copy's refresh is
  not here: it runs at the next sample);
- refresh: `Training.rollout_model` (the bf16 sampler copy brought up to date);
- metrics: `step_metrics` and the update's metric reads.

Per phase: wall = the CPU range's duration; gpu = the summed duration of the kernels (and
memcpy / memset) that start inside the range's GPU window (the profiler's projection of the range
onto the stream: the first to the last kernel it launched); idle = the step's wall − the union of
all its GPU work. --trace FILE writes the chrome trace; --json FILE every number.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import grpo_step  # noqa: E402  (bench/grpo_step.py: the model, the prompts, the config)
from rollout import device_name  # noqa: E402

PHASES = ("sample", "score", "prepare", "forward", "loss", "backward", "optimizer", "refresh", "metrics")
STEP = "tether::grpo_step"


def ranged(label, fn):
    """`fn` run inside a record_function range named tether::<label>."""
    def wrapper(*args, **kwargs):
        with record_function(f"tether::{label}"):
            return fn(*args, **kwargs)
    return wrapper


def instrument(prof, profiled_step: int, sync):
    """Put the phase ranges around the GRPO loop's calls, and run `prof` over step
    `profiled_step`: from its source's get to the end of its step_metrics (the span the loop's
    step_time measures). Returns a function that takes the ranges off."""
    import tether.trainers.grpo.loop as loop
    import tether.trainers.grpo.update as update
    from tether.rollout import Sampler
    from tether.trainers.core.setup import Training
    from tether.trajectories.sampling import Scoring

    patches = [(Sampler, "sample", "sample"), (Scoring, "__call__", "score"),
               (loop, "prepare_batch", "prepare"), (loop, "assign_advantages", "prepare"),
               (update, "completion_token_logps", "forward"), (update, "policy_loss", "loss"),
               (torch.Tensor, "backward", "backward"), (Training, "optimizer_step", "optimizer"),
               (Training, "rollout_model", "refresh"), (update, "_mismatch", "metrics")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    saved += [(loop, "batch_source", loop.batch_source), (loop, "step_metrics", loop.step_metrics)]
    for owner, name, label in patches:
        setattr(owner, name, ranged(label, getattr(owner, name)))
    real_source, real_metrics, step_range = loop.batch_source, loop.step_metrics, record_function(STEP)

    def batch_source(*args, **kwargs):
        source = real_source(*args, **kwargs)
        get = source.get

        def profiled_get(step):
            if step == profiled_step:
                sync()
                prof.__enter__()
                step_range.__enter__()
            return get(step)
        source.get = profiled_get
        return source

    def step_metrics(t, *args, **kwargs):
        with record_function("tether::metrics"):
            out = real_metrics(t, *args, **kwargs)
        if t.step == profiled_step + 1:
            sync()
            step_range.__exit__(None, None, None)
            prof.__exit__(None, None, None)
        return out
    loop.batch_source, loop.step_metrics = batch_source, step_metrics

    def undo():
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return undo


def analyse(trace: dict) -> dict:
    """Per phase wall / GPU time over the profiled step, from the chrome trace's events. A kernel
    (memcpy, memset) belongs to the innermost phase range around the host call that launched it
    (matched by the trace's correlation ids; a CUDA graph's kernels to its cudaGraphLaunch)."""
    events = trace["traceEvents"]
    cpu = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("tether::")]
    step = next(e for e in cpu if e["name"] == STEP)
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    ranges = sorted(((e["ts"], e["ts"] + e["dur"], e["name"].split("::", 1)[1]) for e in cpu
                     if e["name"].split("::", 1)[1] in PHASES and t0 <= e["ts"] <= t1), key=lambda r: r[1] - r[0])
    wall, calls = defaultdict(float), defaultdict(int)
    for a, b, label in ranges:
        wall[label] += (b - a) / 1e3
        calls[label] += 1
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    busy, top = defaultdict(float), defaultdict(lambda: defaultdict(float))
    inside = []
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        at = launch.get(k.get("args", {}).get("correlation"))
        if at is None or not t0 <= at <= t1:
            continue
        inside.append((k["ts"], k["ts"] + k["dur"]))
        label = next((r[2] for r in ranges if r[0] <= at <= r[1]), "other")
        busy[label] += k["dur"] / 1e3
        top[label][k["name"][:90]] += k["dur"] / 1e3
    inside.sort()
    union, end = 0.0, float("-inf")
    for a, b in inside:
        if b > end:
            union += b - max(a, end)
            end = b
    out = {"step_ms": step["dur"] / 1e3, "gpu_busy_ms": sum(busy.values()), "gpu_union_ms": union / 1e3,
           "kernels": len(inside), "phases": {}}
    for label in (*PHASES, "other"):
        if label in wall or label in busy:
            kernels = sorted(top[label].items(), key=lambda kv: -kv[1])[:8]
            out["phases"][label] = {"wall_ms": wall.get(label, 0.0), "calls": calls.get(label, 0),
                                    "gpu_ms": busy.get(label, 0.0),
                                    "top": [{"name": n, "ms": round(ms, 3)} for n, ms in kernels]}
    out["idle_ms"] = out["step_ms"] - out["gpu_union_ms"]
    out["host"] = host_self_times(events, ranges, ("forward", "backward"))
    return out


def host_self_times(events, ranges, labels, top: int = 12) -> dict:
    """Where the host's time goes inside the `labels` phases: each host event's *self* time (its
    duration less that of the events nested in it on the same thread), summed by name, largest
    first. A launch-bound phase shows it here: the launch calls, the compiled graphs' wrappers and
    the Python between them, against the phase's wall time."""
    spans = [(a, b, label) for a, b, label in ranges if label in labels]
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation",
                                                   "python_function") and "dur" in e:
            by_thread[e["tid"]].append(e)
    out = {label: defaultdict(lambda: [0.0, 0]) for label in labels}
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []  # [end, name, self_us, label]

        def close(entry):
            if entry[3] is not None:
                row = out[entry[3]][entry[1]]
                row[0] += entry[2]
                row[1] += 1
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                close(stack.pop())
            if stack:
                stack[-1][2] -= e["dur"]
            label = next((r[2] for r in spans if r[0] <= e["ts"] <= r[1]), None)
            name = str(e["name"])
            if name.startswith("tether::"):  # a phase range's self time: the Python between its ops
                name = "(Python between ops)"
            stack.append([e["ts"] + e["dur"], name[:80], e["dur"], label])
        while stack:
            close(stack.pop())
    return {label: [{"name": n, "self_ms": round(v[0] / 1e3, 2), "calls": v[1]}
                    for n, v in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]]
            for label, rows in out.items()}


def render(r: dict, a) -> str:
    lines = [f"## grpo step profile — {device_name(a.device)}, {r['date']}, {r['commit']}",
             "", f"Command: `python bench/grpo_profile.py {' '.join(sys.argv[1:])}`. Step {r['step_ms']:.1f} ms "
             f"(the profiled step; profiler on), GPU busy {r['gpu_union_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms, "
             f"{r['kernels']} kernels. The steps' own timers (s): "
             f"{', '.join(f'{x:.3f}' for x in r['step_time_s'])}; rollout "
             f"{', '.join(f'{x:.3f}' for x in r['rollout_s'])}.", "", "| phase | calls | wall (ms) | GPU (ms) | top kernels (ms) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for label, p in r["phases"].items():
        tops = "; ".join(f"{k['name'][:50]} {k['ms']:.1f}" for k in p["top"][:3])
        lines.append(f"| {label} | {p['calls']} | {p['wall_ms']:.1f} | {p['gpu_ms']:.1f} | {tops} |")
    for label, rows in r.get("host", {}).items():
        lines += ["", f"Host self time in {label} (ms, calls): "
                  + "; ".join(f"{x['name']} {x['self_ms']:.1f} ({x['calls']})" for x in rows)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="model.compile=true (the benchmark's 16c row)")
    ap.add_argument("--grad-ckpt", choices=["on", "off"], default="on")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the profiled one")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--results", default=None, help="append the markdown table to this file")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None)
    a = ap.parse_args(argv)
    gpu = a.device == "cuda"
    kind = "qwen0.5b" if gpu else "tiny"
    a.prompts, a.generations = (8, 8) if gpu else (2, 4)
    a.prompt_len = 128 if gpu else 16
    a.new_tokens = a.new_tokens or (256 if gpu else 16)
    a.micro_batch = a.micro_batch or (16 if gpu else 4)
    a.steps = 1
    if not gpu:
        torch.set_num_threads(1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    prof = profile(activities=activities)
    undo = instrument(prof, a.warmup, torch.cuda.synchronize if gpu else (lambda: None))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vocab = grpo_step.build(kind, work / "model")
        prompts = grpo_step.make_prompts(a.prompts * (a.warmup + 1), a.prompt_len, vocab)
        try:
            ours = grpo_step.run_ours(a, work / "model", prompts, work / "ours", a.micro_batch, compile=a.compile)
        finally:
            undo()
        path = Path(a.trace) if a.trace else work / "trace.json"
        prof.export_chrome_trace(str(path))
        r = analyse(json.loads(path.read_text()))
        rows = [json.loads(x) for x in (work / "ours" / "runs" / "ours" / "metrics.jsonl").read_text().splitlines()]
    # the steps' own timers: the warm-up steps' (no profiler) and the profiled one's
    r["step_time_s"] = [row["step_time"] for row in rows]
    r["rollout_s"] = [row["rollout/seconds"] for row in rows]
    r["peak_reserved_gb"] = ours["peak_gb"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    r.update(date=datetime.date.today().isoformat(), commit=commit, device=device_name(a.device),
             torch=torch.__version__, args=vars(a))
    table = render(r, a)
    print(table)
    if a.results:
        with open(a.results, "a") as f:
            f.write(table + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
