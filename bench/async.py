"""GRPO through the trajectory queue, side by side: synchronous vs asynchronous sampling
(max_staleness 0 / 1 / 4; one process interleaved or a sampler process beside the trainer), the
off-policy correction (TIS / MIS) on vs off, and partial rollouts, on the arithmetic task's
verifier reward. `summary` reports the same comparison for real-model runs on GPUs.

    python bench/async.py --dry-run                    # CPU: a tiny untrained model, a few steps (does it run)
    python bench/async.py --model runs/quickstart/sft/checkpoints/step-400 --steps 80 --seeds 0 \\
        --configs sync:0:none,disaggregated:1:none,disaggregated:1:tis,interleaved:4:none,interleaved:4:tis,interleaved:4:mis
    OMP_NUM_THREADS=1 python bench/async.py --model runs/quickstart/sft/checkpoints/step-400 --eos-scale 0.6 \\
        --max-new-tokens 256 --steps 60 --seeds 0,1,2 \\
        --configs sync:0:none,sync:0:none:p64,sync:0:none:p32,interleaved:1:none,interleaved:1:none:p64
    python bench/async.py --model M --device cuda --configs sync:0:none,disaggregated:1:none \\
        --seeds 0,1,2                                   # 2 GPUs: the sampler process on the second
    python bench/async.py summary RUN_DIR... [--json out.json]   # real-model runs (bench/gpu.sh async)

The model of the CPU rows is the quickstart's SFT checkpoint (`tether quickstart rl=false`). The
GPU rows (SmolLM2-135M-Instruct, synchronous vs 1 sampler + 1 trainer at staleness 1, compiled,
sampling from a bf16 copy; and the 384-token long tail with and without partial rollouts) come
from `bash bench/gpu.sh async` on the device machine, which runs bench/real_model_rl.py once per
configuration and seed and then `python bench/async.py summary` over the run folders.

A configuration is placement:staleness:correction[:pN] — placement sync (the synchronous loop, one
process), interleaved (one process, a sampler thread on a copy of the policy) or disaggregated
(torchrun, 2 processes: trainer + sampler; on CUDA each on its own GPU); correction none | tis |
mis (``--level``, ``--cap``); pN: partial rollouts of N tokens a round (queue.partial_tokens=N).
Every configuration runs the same prompts, seeds and steps as an ordinary `tether grpo` run (its
metrics.jsonl is what is read), so reward-vs-samples curves are comparable: samples = trained
completions (steps × prompts × generations, except with partial rollouts, whose batches hold the
groups that finished: `partial/groups` a step).

A long tail of lengths (partial rollouts' case): ``--eos-scale 0.6`` samples from a copy of the
model whose end-of-sequence logit is scaled by 0.6 (its tied embedding row): on the quickstart's
SFT model most completions still end after their answer line (~43 tokens) and a few ramble on,
some to max_new_tokens; the verifier reads the first answer line, so the rambling costs time, not
reward.

Reported per configuration (means over seeds; ± the std over seeds where there are several):
step time (median over the steps after --warmup, wall clock of the trainer's step, its wait for
the batch included) and its ratio to the synchronous one's; the reward in each quarter of the run
(by samples); the IS weights' mean, max and the fraction truncated / masked; the staleness of the
trained batches; the sampler–trainer log-prob mismatch (max |Δ|). Prints a markdown section and
writes it to <work>/async.md; --results FILE also appends it there.

`summary` (real-model run folders, bench/real_model_rl.py's <out>, or tether run folders): per run
s/step = (time(last) − time(2) − evaluation seconds after step 2) / (last − 2), the first two steps
(compilation, graph capture) left out; gap = the median time between consecutive steps; step_time,
rollout and the sampler's cycle (weights wait / produce / send) are medians over steps 3..last;
overlapped = the fraction of steps whose next version's weights arrived while the batch was
produced; rq = the mean training reward by quarter of the run; pass1 = held-out greedy pass@1 at
each eval point. Runs are paired by the `-s<seed>` at the end of their names: `…sync-s<seed>`
(c-sync-s0) is the baseline of its seed, and each other run of that seed gets its ratio to it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REWARD = '''from tether.tasks import arithmetic

def verifier(prompts, completions, completion_ids, answer, **_):
    return [arithmetic.check_answer(c, a) for c, a in zip(completions, answer)]
'''
DEFAULT_CONFIGS = "sync:0:none,interleaved:1:none,disaggregated:1:none,interleaved:4:none,interleaved:4:tis,interleaved:4:mis"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(work: Path, args) -> tuple[str, Path, Path]:
    """(model path, prompts file, reward file): the arithmetic task's training problems as RL rows."""
    from tether.tasks import arithmetic
    train, _ = arithmetic.make_splits(args.prompts + 200, 200, args.level, 0)
    data = work / "rl.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for p in train[:args.prompts]:
            f.write(json.dumps(arithmetic.rl_example(p)) + "\n")
    reward = work / "reward.py"
    reward.write_text(REWARD)
    model = args.model
    if args.dry_run and not model:  # an untrained tiny model: checks the plumbing, not learning
        from tether.models import make_tiny_model
        make_tiny_model(work / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                        intermediate_size=64)
        model = str(work / "model")
    if model and args.eos_scale != 1.0:
        model = long_tail_copy(model, work / "model-long-tail", args.eos_scale)
    if not model:
        sys.exit("--model is required (e.g. the quickstart's SFT checkpoint: tether quickstart rl=false), or --dry-run")
    return model, data, reward


def long_tail_copy(src: str, out: Path, scale: float) -> str:
    """A copy of the model whose end-of-sequence logit is scaled by `scale` (module doc)."""
    import torch
    from tether.models.load import load_model, load_tokenizer
    model, tok = load_model(src, device="cpu"), load_tokenizer(src)
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= scale
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def run_one(spec: str, seed: int, model: str, data: Path, reward: Path, work: Path, args) -> Path:
    placement, staleness, correction, *partial = spec.split(":")
    name = f"{placement}-s{staleness}-{correction}{''.join('-' + p for p in partial)}-seed{seed}"
    kw = dict(model=model, data=data, runs_dir=work / "runs", name=name, batch_size=args.batch,
              num_generations=args.generations, max_new_tokens=args.max_new_tokens, max_steps=args.steps,
              lr=args.lr, warmup_steps=args.warmup_steps, temperature=1.0, device=args.device, seed=seed,
              progress="false", overwrite="true", log_every=1, log_entropy="false", save_every=0,
              reward_funcs=f"[{reward}:verifier]", max_staleness=staleness,
              placement="auto" if placement == "sync" else placement, is_correction=correction,
              is_level=args.level_is, is_cap=args.cap, **({"compile": "true"} if args.compile else {}),
              **({"partial": "true", "partial_tokens": int(partial[0][1:])} if partial else {}))
    argv = [f"{k}={v}" for k, v in kw.items()]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if placement == "disaggregated":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "-m", "tether", "grpo", *argv]
    else:
        cmd = [sys.executable, "-m", "tether", "grpo", *argv]
    print(f"[async bench] {name}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.run_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return work / "runs" / name


def summarize(run: Path, warmup: int, per_step: int, G: int) -> dict:
    """`per_step`: the completions a step trains without partial rollouts (the quarters' unit)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "reward" in r]
    times = [r["step_time"] for r in rows[warmup:]] or [r["step_time"] for r in rows]
    # reward by quarters of the samples a run without partial rollouts trains (weighted by each
    # step's completions: a partial batch holds the groups that finished)
    n = [r.get("partial/groups", per_step // G) * G for r in rows]
    edge, seen, sums = len(rows) * per_step / 4, 0, [[0.0, 0] for _ in range(4)]
    for r, k in zip(rows, n):
        i = min(int(seen // edge), 3)
        sums[i][0] += r["reward"] * k
        sums[i][1] += k
        seen += k
    quarters = [s / k for s, k in sums if k]
    waits = [r.get("queue/wait_seconds", r.get("rollout/seconds", 0.0)) for r in rows[warmup:]]
    late = rows[warmup:] or rows

    def mean(key):
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else None
    frac = mean("is_weight/frac_truncated")
    return {"step_time": statistics.median(times), "quarters": quarters, "is_mean": mean("is_weight/mean"),
            "wait": statistics.median(waits) if waits else 0.0, "samples": sum(n),
            "s_per_1k": 1000 * sum(r["step_time"] for r in late) / max(sum(n[len(rows) - len(late):]), 1),
            "token_lag": mean("partial/token_staleness/mean"), "spanning": mean("partial/spanning_completions"),
            "is_max": max((r["is_weight/max"] for r in rows if "is_weight/max" in r), default=None),
            "is_capped": frac if frac is not None else mean("is_weight/frac_masked"),
            "staleness": mean("queue/staleness") or 0.0,
            "mismatch": mean("sampling/sampling_logp_difference/max")}


def _fmt(vals, digits=3):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    m = statistics.fmean(vals)
    return f"{m:.{digits}f}" + (f" ± {statistics.stdev(vals):.{digits}f}" if len(vals) > 1 else "")


def table(results: dict, args, samples_per_step: int) -> str:
    base = statistics.fmean(s["step_time"] for s in results.get("sync:0:none", [])) if "sync:0:none" in results else None
    steps = args.steps
    q = max(steps // 4, 1)
    head = [f"quarter {i + 1} (≤{(i + 1) * q * samples_per_step} samples)" for i in range(4)]
    lines = ["| config | step s | × sync | " + " | ".join(f"reward {h}" for h in head)
             + " | IS mean | IS max | frac capped | staleness | max abs Δlogp | wait s | s / 1k samples"
             " | samples | token lag | spanning |",
             "|---" * (13 + len(head)) + "|"]
    for spec, runs in results.items():
        st = statistics.fmean(r["step_time"] for r in runs)
        ratio = f"{st / base:.2f}" if base else "–"
        rewards = [_fmt([r["quarters"][i] for r in runs if len(r["quarters"]) > i]) for i in range(4)]
        lines.append(f"| {spec} | {_fmt([r['step_time'] for r in runs])} | {ratio} | " + " | ".join(rewards)
                     + f" | {_fmt([r['is_mean'] for r in runs])} | {_fmt([r['is_max'] for r in runs])}"
                     f" | {_fmt([r['is_capped'] for r in runs])} | {_fmt([r['staleness'] for r in runs], 2)}"
                     f" | {_fmt([r['mismatch'] for r in runs], 4)} | {_fmt([r['wait'] for r in runs])}"
                     f" | {_fmt([r['s_per_1k'] for r in runs], 2)} | {_fmt([r['samples'] for r in runs], 0)}"
                     f" | {_fmt([r['token_lag'] for r in runs], 2)} | {_fmt([r['spanning'] for r in runs], 3)} |")
    return "\n".join(lines)


# -- summary: real-model runs (bench/gpu.sh async) ------------------------------------------------

def _median(rows: list[dict], key: str):
    values = [r[key] for r in rows if key in r]
    return round(statistics.median(values), 4) if values else None


def summarize_run(run: Path) -> dict:
    """One real-model run folder's numbers (the module doc's `summary`)."""
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


def runs_table(runs: dict) -> str:
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


def summary_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench/async.py summary",
                                description="the queue's comparison from real-model run folders (module doc)")
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    # (bench/real_model_rl.py keeps the run itself in <out>/run)
    runs = {d.name: summarize_run(d / "run" if (d / "run" / "metrics.jsonl").exists() else d) for d in a.runs
            if (d / "metrics.jsonl").exists() or (d / "run" / "metrics.jsonl").exists()}
    print(runs_table(runs))
    if a.json:
        a.json.write_text(json.dumps({"note": a.note, "runs": runs}, indent=1) + "\n")



def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["summary"]:
        return summary_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="python bench/async.py summary RUN_DIR... [--json FILE]: real-model runs")
    ap.add_argument("--model", default="", help="HF model directory (an SFT'd arithmetic model)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny untrained model, 6 steps")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="placement:staleness:correction, comma-separated")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    ap.add_argument("--batch", type=int, default=4, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--level", type=int, default=2, help="arithmetic difficulty (the quickstart's default)")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--level-is", default="token", choices=["token", "sequence"], help="is_level")
    ap.add_argument("--cap", type=float, default=2.0, help="is_cap")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--eos-scale", type=float, default=1.0,
                    help="sample from a copy of the model with its EOS logit row scaled (a long tail of lengths)")
    ap.add_argument("--run-timeout", type=float, default=3600)
    ap.add_argument("--work", default="", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--results", default=None, help="append the markdown section to this file (default: printed only)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.steps, args.warmup, args.max_new_tokens, args.batch, args.generations = 6, 1, 16, 2, 4
        args.warmup_steps, args.lr = 0, 1e-3
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tether-async-"))
    work.mkdir(parents=True, exist_ok=True)
    model, data, reward = prepare(work, args)
    results: dict = {}
    for seed in (int(s) for s in args.seeds.split(",")):  # configs inner: a busy machine's noise spread over all
        for spec in args.configs.split(","):
            run = run_one(spec, seed, model, data, reward, work, args)
            results.setdefault(spec, []).append(summarize(run, args.warmup, args.batch * args.generations,
                                                          args.generations))
    import torch
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    section = (f"\n## GRPO through the trajectory queue (bench/async.py), {datetime.date.today()}\n\n"
               f"{device}; model {model}{' (dry run: untrained)' if args.dry_run else ''}; arithmetic level "
               f"{args.level}; {args.batch} prompts × {args.generations} generations × ≤{args.max_new_tokens} "
               f"tokens, {args.steps} steps, lr {args.lr:g}, seeds {args.seeds}; IS level {args.level_is}, cap "
               f"{args.cap:g}.\n`python bench/async.py {' '.join(sys.argv[1:])}`\n\n"
               + table(results, args, args.batch * args.generations) + "\n")
    print(section)
    (work / "async.md").write_text(section)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(section)


if __name__ == "__main__":
    main()
