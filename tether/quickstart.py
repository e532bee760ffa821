"""`tether quickstart`: watch post-training work in minutes on a CPU.

Stage 1 pretrains a tiny Llama-family model from scratch on raw worked arithmetic; stage 2
fine-tunes it (SFT) to answer "What is 47 + 8?" with a worked solution and a final "#### 55"
line, imitating demonstrations from a hurried annotator who forgets the ones carry or borrow on
most answer lines that need one (`sft_slip`); stage 3 (GRPO with the verifier reward, `rl=true`)
runs in `_rl_stage` and unlearns the slip, because the verifier checks the answer rather than the
imitation. After each stage the model is scored on held-out problems by exact match (pass@1,
greedy), and a table shows the accuracy, the misses by kind and example completions.

The accuracies are a plateau set by the data, not a moment of a run: docs/quickstart.md explains
why, and gives the spread over seeds, thread counts and fused AdamW (bench/quickstart_sweep.py).

Everything goes through the same code a real run uses: the tiny model is saved in HF format and
reloaded, data is written as jsonl and read back through the data layer, and each stage is an
ordinary `tether sft` run with its own run directory under runs/quickstart/.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch

from tether.config import ConfigError, check_values
from tether.constraints import DirPath, Fraction, NonNegative, NonNegativeInt, Positive, PositiveInt, Range, Seed
from tether.models import load_model, load_tokenizer, make_tiny_model
from tether.rollout.hf import generate
from tether.run import RunDir
from tether.tasks import arithmetic
from tether.trainers.sft import SFTConfig, train_sft


@dataclass
class QuickstartConfig:
    name: str = "quickstart"
    "run name: stages are written to <runs_dir>/<name>/{pretrain,sft,rl}"
    runs_dir: DirPath = "runs"
    "parent directory of run directories"
    level: Literal[tuple(sorted(arithmetic.LEVELS))] = arithmetic.DEFAULT_LEVEL
    "arithmetic difficulty: 1 one-digit ±; 2 two-digit ± one-digit; 3 adds two-digit ± two-digit, × one-digit; 4, 5 harder"
    n_train: PositiveInt = 20000
    "training problems generated (pretraining text and SFT pairs are drawn from them)"
    n_test: PositiveInt = 200
    "held-out problems for exact-match accuracy (never seen in training)"
    seed: Seed = 0
    "seed for problems, model init and data order"
    hidden_size: PositiveInt = 128
    "tiny model width: 32 or a multiple of 64 (32-wide attention heads, two per KV head)"
    num_layers: PositiveInt = 4
    "tiny model depth"
    pretrain_steps: PositiveInt = 1000
    "stage 1 optimizer steps"
    pretrain_lr: Positive = 3e-3
    "stage 1 peak learning rate"
    sft_steps: PositiveInt = 400
    "stage 2 optimizer steps (400: past the sudden jump in which the model learns to copy the result into the answer line, on every seed and rounding tried)"
    sft_eval_every: NonNegativeInt = 100
    "score held-out accuracy every N SFT steps (metrics.jsonl: eval/accuracy; 0 = off)"
    sft_lr: Positive = 5e-4
    "stage 2 peak learning rate"
    sft_slip: Fraction = 0.75
    "fraction of SFT demonstrations with a carry or borrow whose answer line forgets it (47 + 8 -> '#### 45' under a right worked solution): SFT imitates the annotator's slip, RL with the verifier unlearns it; 0 = clean demonstrations"
    batch_size: PositiveInt = 32
    "examples per step in both stages"
    max_new_tokens: PositiveInt = 64
    "generation budget when scoring"
    threads: NonNegativeInt = 0
    "torch CPU threads (0 = leave torch's default)"
    fused_adamw: bool = False
    "AdamW's fused kernel on CPU in every stage (faster; rounds differently; the stage accuracies are checked with both)"
    rl: bool = True
    "run stage 3 (GRPO with the verifier reward, about a minute on 2 CPU cores; rl=false stops after SFT)"
    rl_steps: PositiveInt = 400
    "stage 3 GRPO steps (each samples rl_batch_size x rl_generations completions); many small steps beat few big ones here (docs/quickstart.md, 'What moves GRPO on a tiny model')"
    rl_lr: Positive = 5e-5
    "stage 3 peak learning rate (warmup, then cosine)"
    rl_warmup_steps: NonNegativeInt = 10
    "stage 3 linear warmup steps (Adam's first steps are sign steps: without warmup they wreck a tiny model)"
    rl_batch_size: PositiveInt = 4
    "stage 3 prompts per step"
    rl_generations: Annotated[int, Range(ge=2)] = 8
    "stage 3 completions per prompt (the GRPO group)"
    rl_temperature: Positive = 1.0
    "stage 3 sampling temperature (1.0 keeps the right answer line, a quarter of the demonstrations on carry problems, sampled in most groups)"
    rl_beta: NonNegative = 0.0
    "stage 3 KL-to-SFT coefficient (0 = no reference model)"
    rl_prompts: PositiveInt = 2000
    "stage 3 training prompts, taken from the training problems (never the held-out ones)"
    progress: bool = True
    "show progress bars"

    def __post_init__(self):
        check_values(self)  # the ranges above, for Python callers too (the CLI checks them as it reads)
        if self.level not in arithmetic.LEVELS:
            raise ConfigError(f"config key 'level' must be one of {sorted(arithmetic.LEVELS)}; got {self.level!r}")
        if not (self.hidden_size == 32 or self.hidden_size % 64 == 0):
            raise ConfigError(f"config key 'hidden_size' must be 32 or a multiple of 64; got {self.hidden_size}")
        space = arithmetic.problem_space_size(self.level)
        if self.n_test > space // 2:  # the held-out set must leave problems to train on
            raise ConfigError(f"config key 'n_test' must be at most {space // 2} at level {self.level} "
                             f"(half its {space} distinct problems); got {self.n_test}")


def accuracy(model, tokenizer, problems, max_new_tokens: int) -> tuple[float, list[str]]:
    """Greedy pass@1 by exact match of the final '#### n' line."""
    comps = generate(model, tokenizer, [p.prompt for p in problems], max_new_tokens,
                     do_sample=False, batch_size=100)
    score = sum(arithmetic.check_answer(c, p.answer) for c, p in zip(comps, problems))
    return score / len(problems), comps


def misses(problems, completions) -> dict[str, int]:
    """Held-out misses by kind (`arithmetic.diagnose`): how many answer lines carry the
    demonstrations' slip, how many solutions are wrong, ..."""
    kinds = Counter(arithmetic.diagnose(c, p) for c, p in zip(completions, problems))
    kinds.pop("correct", None)
    return dict(sorted(kinds.items()))


def _write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _rl_stage(cfg: QuickstartConfig, model_path: str, root: Path) -> dict:
    """Stage 3: GRPO on the arithmetic task's *training* problems from the SFT checkpoint, rewarded
    by the exact-match verifier; scored by greedy pass@1 on the held-out problems. Returns the
    stage's {"accuracy", "seconds", "model"}."""
    from tether.trainers.grpo import GRPOConfig, train_grpo  # here: stages 1-2 do not need the RL stack

    t0 = time.time()
    train, test = arithmetic.make_splits(cfg.n_train, cfg.n_test, cfg.level, cfg.seed)
    data = Path(root) / "data" / "rl.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    with open(data, "w", encoding="utf-8") as f:  # json.dumps' ASCII escapes, as the stage always wrote
        for p in train[:cfg.rl_prompts]:
            f.write(json.dumps(arithmetic.rl_example(p)) + "\n")

    def verifier(prompts, completions, completion_ids, answer, **_):
        return [arithmetic.check_answer(c, a) for c, a in zip(completions, answer)]

    rl = GRPOConfig(model=model_path, data=str(data), name=f"{cfg.name}/rl", runs_dir=cfg.runs_dir,
                    batch_size=cfg.rl_batch_size, num_generations=cfg.rl_generations,
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.rl_temperature,
                    max_steps=cfg.rl_steps, lr=cfg.rl_lr, beta=cfg.rl_beta, advantage="grpo",
                    warmup_steps=cfg.rl_warmup_steps, schedule="cosine",
                    loss_agg="token-mean", device="cpu", seed=cfg.seed, log_every=5,
                    adam_betas=[0.9, 0.99], fused_adamw="on" if cfg.fused_adamw else "off",
                    progress=cfg.progress, log_entropy=False, overwrite=True)
    out = train_grpo(rl, reward_funcs=[verifier])
    model, tok = load_model(out["checkpoint"], device="cpu"), load_tokenizer(out["checkpoint"])
    acc, comps = accuracy(model, tok, test, cfg.max_new_tokens)
    return {"accuracy": acc, "misses": misses(test, comps), "seconds": round(time.time() - t0, 1),
            "model": out["checkpoint"]}


def run_quickstart(cfg: QuickstartConfig) -> dict:
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    root = Path(cfg.runs_dir) / cfg.name
    # The quickstart is a demo regenerated from its seed: running it again replaces the last one
    # (its stages too, overwrite=True below); config validation has already passed by now.
    run = RunDir(root, overwrite=True)
    run.write_config(cfg)
    train, test = arithmetic.make_splits(cfg.n_train, cfg.n_test, cfg.level, cfg.seed)
    data = root / "data"
    _write_jsonl(data / "pretrain.jsonl", ({"text": arithmetic.pretrain_text(p)} for p in train))
    slips = random.Random(f"{cfg.seed}/slip")  # its own stream: the problems do not move with sft_slip
    _write_jsonl(data / "sft.jsonl", (arithmetic.sft_example(p, slip=slips.random() < cfg.sft_slip)
                                      for p in train))
    _write_jsonl(data / "rl.jsonl", (arithmetic.rl_example(p) for p in train))
    _write_jsonl(data / "test.jsonl", (arithmetic.rl_example(p) for p in test))
    make_tiny_model(root / "init", seed=cfg.seed, hidden_size=cfg.hidden_size,
                    num_layers=cfg.num_layers, num_heads=max(2, cfg.hidden_size // 32),
                    num_kv_heads=max(1, cfg.hidden_size // 64),
                    intermediate_size=3 * cfg.hidden_size)

    stages: dict[str, dict] = {}
    examples: dict[str, list[str]] = {}
    shown = test[:3]

    def score(stage: str, model_dir: str, seconds: float) -> None:
        model, tok = load_model(model_dir, device="cpu"), load_tokenizer(model_dir)
        acc, comps = accuracy(model, tok, test, cfg.max_new_tokens)
        stages[stage] = {"accuracy": acc, "misses": misses(test, comps), "seconds": round(seconds, 1),
                         "model": model_dir}
        examples[stage] = comps[:len(shown)]
        print(f"[quickstart] {stage}: held-out accuracy {acc:.3f} ({seconds:.0f} s)", flush=True)

    common = dict(runs_dir=cfg.runs_dir, batch_size=cfg.batch_size, seed=cfg.seed, device="cpu",
                  max_length=256, log_every=25, num_samples=4, sample_max_new_tokens=cfg.max_new_tokens,
                  progress=cfg.progress, adam_betas=[0.9, 0.95], warmup_steps=30, weight_decay=0.0,
                  fused_adamw="on" if cfg.fused_adamw else "off",
                  overwrite=True)
    # Stage 1: raw worked equations, loss on every token.
    t0 = time.time()
    pre = train_sft(SFTConfig(model=str(root / "init"), data=str(data / "pretrain.jsonl"),
                              name=f"{cfg.name}/pretrain", max_steps=cfg.pretrain_steps,
                              lr=cfg.pretrain_lr, completion_only=False, **common))
    score("pretrain", pre["checkpoint"], time.time() - t0)

    # Stage 2: question -> worked solution + final answer, loss on the completion only.
    t0 = time.time()
    def accuracy_hook(model, tokenizer, step):  # the learning curve a person wants to see
        return {"eval/accuracy": accuracy(model, tokenizer, test[:100], cfg.max_new_tokens)[0]}

    sft = train_sft(SFTConfig(model=pre["checkpoint"], data=str(data / "sft.jsonl"),
                              name=f"{cfg.name}/sft", max_steps=cfg.sft_steps, lr=cfg.sft_lr,
                              completion_only=True, eval_every=cfg.sft_eval_every, **common),
                    eval_hook=accuracy_hook if cfg.sft_eval_every else None)
    score("sft", sft["checkpoint"], time.time() - t0)

    # Stage 3: RL with the verifier reward.
    rl = _rl_stage(cfg, sft["checkpoint"], root) if cfg.rl else None
    if rl is not None:
        stages["rl"] = rl
        model, tok = load_model(rl["model"], device="cpu"), load_tokenizer(rl["model"])
        examples["rl"] = accuracy(model, tok, shown, cfg.max_new_tokens)[1]
    else:
        stages["rl"] = {"accuracy": None, "seconds": 0.0,
                        "status": "not run (rl=false; rl=true adds GRPO, see docs/grpo.md)"}

    summary = {"stages": stages, "seconds": round(time.time() - t_start, 1), "level": cfg.level,
               "n_test": len(test)}
    run.write_summary(summary)
    print(_table(stages, shown, examples))
    print(f"[quickstart] total {summary['seconds']:.0f} s; summary: {root / 'summary.json'}")
    return summary


def _table(stages: dict, shown, examples: dict) -> str:
    lines = ["", f"{'stage':<10} {'held-out pass@1':>16} {'seconds':>8}   misses by kind", "-" * 72]
    for name, s in stages.items():
        acc = "-" if s.get("accuracy") is None else f"{s['accuracy']:.3f}"
        kinds = ", ".join(f"{k} {n}" for k, n in s.get("misses", {}).items())
        lines.append(f"{name:<10} {acc:>16} {s.get('seconds', 0):>8.0f}   {kinds}")
    for i, p in enumerate(shown):
        lines += ["", f"{p.question}   (answer {p.answer})"]
        for name, comps in examples.items():
            text = comps[i].strip().replace("\n", " | ")
            lines.append(f"  {name:<9} {text[:90]}")
    return "\n".join(lines)
