"""`tether study prm`: process vs outcome supervision, measured against exact step truth.

Lightman et al. (2023), "Let's Verify Step by Step", shrunk to the quickstart's arithmetic task,
where every step of a worked solution is exactly checkable (tether.tasks.arithmetic.check_steps):
    1. the policy (reused when already built): policy_errors=answer, the quickstart's SFT policy
       (pretrain -> SFT, no RL), whose main error is its demonstrations' answer-line slip (a right
       chain under a wrong `#### n`); policy_errors=steps, the same pretrained model fine-tuned on
       the same demonstrations with the error moved into the chain (:func:`step_error_solution`:
       a dropped carry or borrow at a middle step, the rest of the chain and the answer line
       following it);
    2. S solutions sampled (T = 1) for each of N training problems: the training budget;
    3. four reward models trained on those same completions with `tether prm`, `rm_seeds` times:
       PRM on the exact step labels; PRM on Math-Shepherd labels (K rollouts per step prefix from
       the same policy: tether.labeling.steps), hard, and soft (prm.targets=soft on c_i/K); ORM = a
       one-step PRM labelled by the final answer. All share the SFT policy's body as their
       initialization;
    4. Math-Shepherd's label quality vs the truth for K = 1…K_max (from one set of rollouts: the
       first K of them), hard and soft estimates, and each PRM's step accuracy vs truth on
       held-out solutions;
    5. n = 1…64 solutions per held-out problem; pass@1 of the one picked by each PRM (min and
       product over steps), the ORM (its score), majority vote over final answers, and at random,
       averaged over random subsets of the 64; plotted against n (mean over reward-model seeds);
       each model's step metrics on all those candidates against the truth.
Everything lands in runs/<name>/ (summary.json, report.md, selection.png); `publish_dir` copies the
report, the figure and the summary there (benchmarks/prm/ in the repository; policy_errors=steps
publishes them with the suffix -steps: report-steps.md, ...).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tether.config import ConfigError, check_values
from tether.constraints import DirPath, Positive, PositiveInt, Seed
from tether.run import RunDir, latest_checkpoint
from tether.tasks import arithmetic


@dataclass
class PRMStudyConfig:
    name: str = "study-prm"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: DirPath = "runs"
    "parent directory of run directories"
    seed: Seed = 0
    "seed of the quickstart policy, the samples, the rollouts and the reward models"
    policy: str = ""
    "the SFT policy; '' = built from the quickstart (rl=false, into <runs_dir>/<name>/quickstart) per policy_errors, or reused from there"
    policy_errors: Literal["answer", "steps"] = "answer"
    "policy='': answer = the quickstart's SFT policy (its demonstrations slip on the answer line under a right chain); steps = SFT of the quickstart's pretrained model on the same demonstrations with the slip moved into the chain (a dropped carry/borrow at a middle step, the answer line following the chain), into <runs_dir>/<name>/policy-steps"
    n_train: PositiveInt = 400
    "training problems (the quickstart's training split) whose sampled solutions train every reward model"
    samples_per_problem: PositiveInt = 4
    "solutions sampled per training problem (the budget shared by PRM and ORM)"
    n_test: PositiveInt = 100
    "held-out problems (the quickstart's held-out split: never seen by the policy or the reward models)"
    max_n: PositiveInt = 64
    "solutions sampled per held-out problem; selection is measured for n = 1, 2, 4, ... max_n"
    subsets: PositiveInt = 32
    "random subsets of size n per problem the selection accuracy is averaged over"
    temperature: Positive = 1.0
    "sampling temperature of solutions and rollouts"
    ms_k: list[PositiveInt] = field(default_factory=lambda: [1, 2, 4, 8])
    "Math-Shepherd rollouts per step prefix to measure (one set of max(ms_k) rollouts, the first K used)"
    ms_train_k: PositiveInt = 8
    "K of the hard Math-Shepherd labels the MS-PRM is trained on (one of ms_k)"
    rm_seeds: PositiveInt = 1
    "reward-model seeds (seed, seed+1, ...: head init and data order; same samples and labels): curves and metrics are their mean, with the spread"
    prm_steps: PositiveInt = 300
    "optimizer steps of each reward model"
    prm_lr: Positive = 1e-3
    "reward-model learning rate (tiny model: far above the 1e-5 used for real models)"
    batch_size: PositiveInt = 32
    "stepwise rows per optimizer step"
    publish_dir: str = ""
    "also copy report.md, selection.png and summary.json here (e.g. benchmarks/prm)"
    progress: bool = False
    "progress bars of the inner runs"

    def __post_init__(self):
        check_values(self)
        if self.ms_train_k not in self.ms_k:
            raise ConfigError(f"config key 'ms_train_k' must be one of ms_k {self.ms_k}; got {self.ms_train_k}")


def step_error_solution(p: arithmetic.Problem) -> str | None:
    """A completion whose error is *in the chain*: the worked solution with the ones carry
    (addition) or borrow (subtraction) dropped at a middle step, every later expression and the
    answer line following the wrong value:

        47 + 8 = 40 + 7 + 8 = 40 + 5 = 45      dropped carry: the ones' 15 written as 5 (step 2 wrong)
        75 - 7 = 70 + 15 - 7 = 70 + 8 = 78     dropped borrow: ten lent to the ones, not taken from
                                               the tens (step 1 wrong)

    The final answer is `arithmetic.slipped_answer`'s: the same wrong numbers as the quickstart's
    answer-line slip, the error moved from the answer line into the chain. None where the problem
    has no ones carry/borrow, or its chain no middle step to hold one (13 - 7 = 6), or is not of
    these two forms (the level-2 solutions of `arithmetic.worked_solution`; the 2-digit additions of
    level 3 too)."""
    wrong = arithmetic.slipped_answer(p)
    chain = p.solution.split(" = ")  # [question, ..., answer]
    if wrong is None or len(chain) != 4:
        return None
    if p.op == "+" and (m := re.fullmatch(r"(\d+) \+ (\d+)", chain[2])):  # tens + ones sum
        chain[2:] = [f"{m[1]} + {int(m[2]) - 10}", str(wrong)]
    elif p.op == "-" and (m := re.fullmatch(r"(\d+) \+ (\d+) - (\d+)", chain[1])):  # lowered tens + ones - b
        tens = int(m[1]) + 10
        chain[1:] = [f"{tens} + {m[2]} - {m[3]}", f"{tens} + {int(m[2]) - int(m[3])}", str(wrong)]
    else:
        return None
    return f" {' = '.join(chain)}\n{arithmetic.ANSWER_PREFIX}{wrong}"


def step_error_demonstrations(problems: list[arithmetic.Problem], rate: float, seed: int) -> list[dict]:
    """SFT rows (prompt, completion) whose errors are in the chain: `rate` of the demonstrations
    that can hold one carry :func:`step_error_solution`, the rest are right. The draws are the
    quickstart's (`random.Random(f"{seed}/slip")`, one per problem in order, `rate` = its
    sft_slip): the same demonstrations err as slip there, except the few with no middle step."""
    draws = random.Random(f"{seed}/slip")
    rows = []
    for p in problems:
        wrong = step_error_solution(p) if draws.random() < rate else None
        rows.append(arithmetic.sft_example(p) if wrong is None else {"prompt": p.prompt, "completion": wrong})
    return rows


def _step_error_policy(cfg: PRMStudyConfig, qs, root: Path) -> str:
    """SFT of the quickstart's pretrained model on :func:`step_error_demonstrations`, with the
    quickstart's stage-2 settings (same problems, steps, learning rate, batch, seed)."""
    from tether.trainers.sft import SFTConfig, train_sft

    train, _ = arithmetic.make_splits(qs.n_train, qs.n_test, qs.level, qs.seed)
    data = _write(root / "quickstart" / "data" / "sft-steps.jsonl",
                  step_error_demonstrations(train, qs.sft_slip, qs.seed))
    out = train_sft(SFTConfig(model=str(latest_checkpoint(root / "quickstart" / "pretrain")), data=str(data),
                              name=f"{cfg.name}/policy-steps", runs_dir=cfg.runs_dir, max_steps=qs.sft_steps,
                              lr=qs.sft_lr, completion_only=True, batch_size=qs.batch_size, seed=qs.seed,
                              device="cpu", max_length=256, log_every=25, num_samples=4,
                              sample_max_new_tokens=qs.max_new_tokens, progress=cfg.progress,
                              adam_betas=[0.9, 0.95], warmup_steps=30, weight_decay=0.0, fused_adamw="off",
                              overwrite=True))
    return out["checkpoint"]


def _policy(cfg: PRMStudyConfig, root: Path):
    """(policy dir, the quickstart config whose splits it was trained on)."""
    from tether.quickstart import QuickstartConfig, run_quickstart

    qs = QuickstartConfig(name=f"{cfg.name}/quickstart", runs_dir=cfg.runs_dir, seed=cfg.seed, rl=False,
                          progress=cfg.progress)
    if cfg.policy:
        return cfg.policy, qs
    ckpt = latest_checkpoint(root / "quickstart" / "sft")
    if ckpt is None or not (root / "quickstart" / "summary.json").exists():
        run_quickstart(qs)
        ckpt = latest_checkpoint(root / "quickstart" / "sft")
    if cfg.policy_errors == "steps":
        ckpt = latest_checkpoint(root / "policy-steps")
        if ckpt is None or not (root / "policy-steps" / "summary.json").exists():
            ckpt = _step_error_policy(cfg, qs, root)
    return str(ckpt), qs


def _write(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def label_quality(truth: list[list[bool]], outcomes: list[list[list[bool]]], ks: list[int]) -> list[dict]:
    """Math-Shepherd labels vs the truth, per K and estimate (hard: any right rollout; soft: more
    than half), over the non-final steps (the final step's label is its verdict, exact for any K):
    precision and recall of "correct", and of "wrong" (the errors a PRM must find), accuracy."""
    out = []
    for k in ks:
        for estimate in ("hard", "soft"):
            tp = fp = fn = tn = 0
            for y_row, o_row in zip(truth, outcomes):
                for y, o in zip(y_row[:-1], o_row[:-1]):
                    c = sum(o[:k])
                    pred = c > 0 if estimate == "hard" else c / k > 0.5
                    tp += pred and y
                    fp += pred and not y
                    fn += y and not pred
                    tn += not pred and not y
            ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
            out.append({"k": k, "estimate": estimate, "steps": tp + fp + fn + tn,
                        "accuracy": ratio(tp + tn, tp + fp + fn + tn),
                        "precision_correct": ratio(tp, tp + fp), "recall_correct": ratio(tp, tp + fn),
                        "precision_wrong": ratio(tn, tn + fn), "recall_wrong": ratio(tn, tn + fp)})
    return out


def selection_curves(correct: list[list[bool]], answers: list[list], scores: dict[str, list[list[float]]],
                     ns: list[int], subsets: int, seed: int) -> dict[str, list[float]]:
    """pass@1 of the pick among n of each problem's samples, averaged over `subsets` random
    subsets per problem (the same subsets for every selector): by each score (argmax, first on a
    tie), majority vote over final answers (no answer line: no vote; tie: first in the subset),
    random (the expected value: the subset's share of right samples) and the oracle (pass@n)."""
    rng = random.Random(seed)
    names = list(scores) + ["majority", "random", "oracle"]
    out = {name: [] for name in names}
    for n in ns:
        total = {name: 0.0 for name in names}
        count = 0
        for i, ok in enumerate(correct):
            for _ in range(subsets):
                pick = rng.sample(range(len(ok)), n)
                for name, s in scores.items():
                    total[name] += ok[max(pick, key=lambda j: s[i][j])]
                votes = Counter(answers[i][j] for j in pick if answers[i][j] is not None)
                if votes:
                    best = max(votes.values())
                    winner = next(answers[i][j] for j in pick if votes.get(answers[i][j]) == best)
                    total["majority"] += ok[next(j for j in pick if answers[i][j] == winner)]
                total["random"] += sum(ok[j] for j in pick) / n
                total["oracle"] += any(ok[j] for j in pick)
                count += 1
        for name in names:
            out[name].append(total[name] / count)
    return out


def _kind(checks, answer: int) -> str:
    """A held-out sample's kind: right; a right chain (every expression equals the answer) under
    a wrong answer line (the SFT demonstrations' slip); or a wrong chain."""
    if checks[-1].correct:
        return "right"
    chain = all(c.correct for c in checks[:-1]) and checks[-1].value == answer
    return "slipped answer line" if chain else "wrong chain"


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def error_positions(checks: list[list]) -> dict:
    """Where the wrong solutions first go wrong (`checks`: `arithmetic.check_steps` of each
    solution): of those whose last step is incorrect, how many are first wrong at step 0 (the
    question restated), at a middle step, or only at the last step (the answer line, or the
    chain's last link); `before_last` = the share first wrong before the last step, the errors a
    PRM can point at before the answer."""
    where = Counter()
    for cs in checks:
        if not cs[-1].correct:
            i = arithmetic.first_error([c.correct for c in cs])
            where["last" if i == len(cs) - 1 else "question" if i == 0 else "middle"] += 1
    wrong = sum(where.values())
    return {"solutions": len(checks), "wrong": wrong, **{k: where[k] for k in ("question", "middle", "last")},
            "before_last": (wrong - where["last"]) / wrong if wrong else float("nan")}


def candidate_metrics(probs: list, labels: list[list[bool]], correct: list[bool], aggregate: str) -> dict:
    """A reward model's verdicts on held-out candidates vs the exact truth: the step metrics over
    every step (`trainers.prm.step_metrics`: step accuracy, step F1, error F1, first-error
    accuracy), first-error accuracy among the wrong candidates only (does it find *where* they go
    wrong?) and outcome accuracy (the aggregated score > 1/2 against the exact answer). For an ORM
    (aggregate "last") only the outcome accuracy: it was trained on whole solutions, not steps."""
    from tether.rewards.process import aggregate_steps
    from tether.trainers.prm import step_metrics

    out = {"outcome_accuracy": _mean([(aggregate_steps(p, aggregate) > 0.5) == ok for p, ok in zip(probs, correct)])}
    if aggregate == "last":
        return out
    wrong = [i for i, ok in enumerate(correct) if not ok]
    m = step_metrics(probs, labels)
    m["first_error_accuracy_wrong"] = step_metrics([probs[i] for i in wrong],
                                                   [labels[i] for i in wrong])["first_error_accuracy"]
    return {**{k: m[k] for k in ("step_accuracy", "step_f1", "error_f1", "first_error_accuracy",
                                 "first_error_accuracy_wrong")}, **out}


def across_seeds(per_seed: list[dict]) -> tuple[dict, dict]:
    """(mean, sample standard deviation) over seeds, key by key, of dicts holding numbers, lists of
    numbers or such dicts (one seed: sd 0)."""
    def sd(xs):
        m = _mean(xs)
        return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    mean, spread = {}, {}
    for k, v in per_seed[0].items():
        values = [d[k] for d in per_seed]
        if isinstance(v, dict):
            mean[k], spread[k] = across_seeds(values)
        elif isinstance(v, list):
            mean[k], spread[k] = [_mean(c) for c in zip(*values)], [sd(c) for c in zip(*values)]
        else:
            mean[k], spread[k] = _mean(values), sd(values)
    return mean, spread


CURVES = {  # selection curve -> (label, colour, marker, line style)
    "prm": ("PRM, true labels (min)", "C0", "o", "-"), "prm_prod": ("PRM, true labels (prod)", "C0", "o", "--"),
    "prm_ms": ("PRM, Math-Shepherd hard (min)", "C4", "v", "-"),
    "prm_ms_prod": ("PRM, Math-Shepherd hard (prod)", "C4", "v", "--"),
    "prm_ms_soft": ("PRM, Math-Shepherd soft (min)", "C5", "D", "-"),
    "prm_ms_soft_prod": ("PRM, Math-Shepherd soft (prod)", "C5", "D", "--"),
    "orm": ("ORM", "C1", "s", "-"), "majority": ("majority vote", "C2", "^", "-"),
    "random": ("random", "C7", "x", "-"), "oracle": ("pass@n (oracle)", "k", "", ":")}


def _plot(ns: list[int], curves: dict, spread: dict, path: Path, title: str) -> None:
    """Mean selection curves, shaded ± one sd over reward-model seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 5.0))
    for name, (label, color, marker, style) in CURVES.items():
        if name in curves:
            ax.plot(ns, curves[name], marker=marker or None, color=color, label=label, linestyle=style,
                    markersize=4)
            if any(spread.get(name, [])):
                lo = [m - d for m, d in zip(curves[name], spread[name])]
                hi = [m + d for m, d in zip(curves[name], spread[name])]
                ax.fill_between(ns, lo, hi, color=color, alpha=0.12, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("n (solutions sampled per problem)")
    ax.set_ylabel("pass@1 of the selected solution")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _train(cfg: PRMStudyConfig, policy: str, name: str, data: Path, eval_data: Path, seed: int,
           targets: str = "hard") -> dict:
    from tether.trainers.prm import PRMConfig, train_prm
    return train_prm(PRMConfig(model=policy, data=str(data), eval_data=str(eval_data),
                               name=f"{cfg.name}/{name}", runs_dir=cfg.runs_dir, seed=seed,
                               step_separator=arithmetic.STEP_SEPARATOR, targets=targets, max_steps=cfg.prm_steps,
                               lr=cfg.prm_lr, batch_size=cfg.batch_size, warmup_ratio=0.05,
                               device="cpu", log_every=25, progress=cfg.progress, overwrite=True))


def run_prm_study(cfg: PRMStudyConfig) -> dict:
    from tether.data.steps import encode_steps
    from tether.labeling.steps import mc_outcomes, sampler_completer
    from tether.models import load_model, load_tokenizer
    from tether.rewards.process import ProcessReward, aggregate_steps

    t_start, timings = time.time(), {}
    root = Path(cfg.runs_dir) / cfg.name
    policy, qs = _policy(cfg, root)
    timings["policy_s"] = round(time.time() - t_start, 1)
    print(f"[study prm] policy: {timings['policy_s']} s", flush=True)
    run = RunDir(root, overwrite=True)  # a study regenerates itself from its seed (its quickstart is kept)
    run.write_config(cfg)
    train_problems, test_problems = arithmetic.make_splits(qs.n_train, qs.n_test, qs.level, qs.seed)
    train_problems = random.Random(cfg.seed).sample(train_problems, cfg.n_train)
    test_problems = test_problems[:cfg.n_test]

    # -- samples: the training budget and the held-out candidates -------------------------------
    t0 = time.time()
    tokenizer, model = load_tokenizer(policy), load_model(policy, device="cpu").eval()
    complete = sampler_completer(model, tokenizer, qs.max_new_tokens, cfg.temperature)
    encode = lambda ps: [encode_steps(tokenizer, p.prompt, [], "")[0] for p in ps]  # noqa: E731  (BOS + prompt)
    train_samples = complete(encode(train_problems), cfg.samples_per_problem, cfg.seed + 1)
    test_samples = complete(encode(test_problems), cfg.max_n, cfg.seed + 2)
    timings["sampling_s"] = round(time.time() - t0, 1)
    print(f"[study prm] sampling: {timings['sampling_s']} s", flush=True)

    train_rows = [(p, c) for p, cs in zip(train_problems, train_samples) for c in cs]
    truth = [arithmetic.stepwise_example(p, c) for p, c in train_rows]
    keep = [i for i, r in enumerate(truth) if all(s for s in r["completions"])]  # no empty step ('==')

    # -- Math-Shepherd labels on the same completions -------------------------------------------
    t0 = time.time()
    k_max = max(cfg.ms_k)

    def verify(rows, texts):
        return [arithmetic.check_answer(t, r["answer"]) > 0 for r, t in zip(rows, texts)]
    outcomes = mc_outcomes([{"prompt": train_rows[i][0].prompt, "answer": train_rows[i][0].answer} for i in keep],
                           [train_rows[i][1] for i in keep], complete, verify, tokenizer,
                           arithmetic.STEP_SEPARATOR, k_max, cfg.seed + 3)
    timings["math_shepherd_s"] = round(time.time() - t0, 1)
    print(f"[study prm] math_shepherd: {timings['math_shepherd_s']} s", flush=True)
    quality = label_quality([truth[i]["labels"] for i in keep], outcomes, sorted(cfg.ms_k))

    # -- the four reward models on the same budget ----------------------------------------------
    data = root / "data"
    prm_true = _write(data / "prm_true.jsonl", (truth[i] for i in keep))
    prm_ms = _write(data / "prm_math_shepherd.jsonl",  # hard labels; soft_labels = c_i/K (prm.targets=soft)
                    ({**truth[i], "labels": [sum(o[:cfg.ms_train_k]) > 0 for o in out],
                      "soft_labels": [sum(o[:cfg.ms_train_k]) / cfg.ms_train_k for o in out]}
                     for i, out in zip(keep, outcomes)))
    # the ORM's one step is the whole solution, as `prm:<orm>?aggregate=last` reads it
    orm = _write(data / "orm.jsonl", ({"prompt": truth[i]["prompt"], "completions": ["=".join(truth[i]["completions"])],
                                       "labels": [bool(arithmetic.check_answer(train_rows[i][1], train_rows[i][0].answer))]}
                                      for i in keep))
    # held-out truth: the first 8 candidates of every held-out problem (soft_labels = the truth: the
    # soft model's eval/loss is its BCE against it)
    held = [arithmetic.stepwise_example(p, c) for p, cs in zip(test_problems, test_samples) for c in cs[:8]]
    held = [{**r, "soft_labels": [float(y) for y in r["labels"]]} for r in held if all(s for s in r["completions"])]
    prm_eval = _write(data / "prm_eval.jsonl", held)
    orm_eval = _write(data / "orm_eval.jsonl", ({**r, "completions": ["=".join(r["completions"])],
                                                 "labels": [r["labels"][-1]]} for r in held))
    models = {  # key -> (run dir, data, held-out data, BCE targets)
        "prm": ("prm", prm_true, prm_eval, "hard"), "prm_ms": ("prm-math-shepherd", prm_ms, prm_eval, "hard"),
        "prm_ms_soft": ("prm-math-shepherd-soft", prm_ms, prm_eval, "soft"), "orm": ("orm", orm, orm_eval, "hard")}

    # -- per reward-model seed: train, score the held-out candidates, select among n -------------
    prompts = [p.prompt for p, cs in zip(test_problems, test_samples) for _ in cs]
    flat = [c for cs in test_samples for c in cs]
    correct = [[bool(arithmetic.check_answer(c, p.answer)) for c in cs] for p, cs in zip(test_problems, test_samples)]
    flat_correct = [ok for row in correct for ok in row]
    test_checks = [arithmetic.check_steps(c, p) for p, cs in zip(test_problems, test_samples) for c in cs]
    test_labels = [[c.correct for c in cs] for cs in test_checks]
    kinds = [_kind(cs, p.answer) for cs, p in zip(test_checks, (p for p in test_problems for _ in range(cfg.max_n)))]
    answers = [[arithmetic.extract_answer(c) for c in cs] for cs in test_samples]
    ns = [n for n in (2 ** i for i in range(12)) if n <= cfg.max_n]
    seeds = list(range(cfg.seed, cfg.seed + cfg.rm_seeds))
    timings["reward_models_s"] = timings["selection_s"] = 0.0
    per_seed = []
    for seed in seeds:
        t0 = time.time()
        runs = {key: _train(cfg, policy, run_name + ("" if seed == cfg.seed else f"-seed{seed}"), d, e, seed, targets)
                for key, (run_name, d, e, targets) in models.items()}
        timings["reward_models_s"] = round(timings["reward_models_s"] + time.time() - t0, 1)
        t0 = time.time()
        scores, metrics, diagnosis = {}, {}, {}
        for key in models:
            aggregates = {key: "last"} if key == "orm" else {key: "min", f"{key}_prod": "prod"}
            reward = ProcessReward(runs[key]["checkpoint"], aggregate="min", device="cpu", batch_size=256)
            probs = reward.step_probabilities(prompts, flat)
            for name, agg in aggregates.items():
                s = [aggregate_steps(x, agg) for x in probs]
                scores[name] = [s[i * cfg.max_n:(i + 1) * cfg.max_n] for i in range(len(test_problems))]
                diagnosis[name] = {kind: _mean([x for x, k in zip(s, kinds) if k == kind])
                                   for kind in ("right", "slipped answer line", "wrong chain")}
            metrics[key] = {"train_prm_eval": {k.split("/", 1)[1]: v for k, v in runs[key].items()
                                               if k.startswith("eval/")},
                            "candidates": candidate_metrics(probs, test_labels, flat_correct, aggregates[key])}
        curves = selection_curves(correct, answers, scores, ns, cfg.subsets, cfg.seed + 4)
        timings["selection_s"] = round(timings["selection_s"] + time.time() - t0, 1)
        per_seed.append({"selection": curves, "metrics": metrics, "score_by_kind": diagnosis})
        print(f"[study prm] reward-model seed {seed}: "
              + ", ".join(f"{k} {curves[k][ns.index(16)]:.3f}" for k in curves if 16 in ns) + " at n=16", flush=True)
    mean, sd = across_seeds(per_seed)
    curves = mean["selection"]

    step_truth = [r["labels"] for r in truth]
    summary = {
        "policy": policy, "policy_errors": "custom" if cfg.policy else cfg.policy_errors,
        "rm_seeds": seeds, "ns": ns, "selection": curves, "selection_sd": sd["selection"],
        "target_met_at_n>=16": {str(n): curves["prm"][j] >= curves["orm"][j] >= curves["majority"][j]
                                for j, n in enumerate(ns) if n >= 16},
        "error_positions": {"train": error_positions([arithmetic.check_steps(c, p) for p, c in train_rows]),
                            "test": error_positions(test_checks)},
        "score_by_kind": {**mean["score_by_kind"], "samples": dict(Counter(kinds))},
        "math_shepherd_quality": quality,
        "prm_step_metrics": {k: m["train_prm_eval"] for k, m in mean["metrics"].items()},
        "candidate_metrics": {k: m["candidates"] for k, m in mean["metrics"].items()},
        "candidate_metrics_sd": {k: m["candidates"] for k, m in sd["metrics"].items()},
        "per_seed": per_seed,
        "train": {"problems": cfg.n_train, "samples": len(train_rows), "rows": len(keep),
                  "solution_accuracy": sum(r["labels"][-1] for r in truth) / len(truth),
                  "steps": sum(map(len, step_truth)),
                  "wrong_steps": sum(not y for r in step_truth for y in r),
                  "rollouts": sum(len(o) - 1 for o in outcomes) * k_max},
        "test": {"problems": len(test_problems), "samples_per_problem": cfg.max_n,
                 "sample_accuracy": sum(map(sum, correct)) / sum(map(len, correct))},
        "timings": {**timings, "total_s": round(time.time() - t_start, 1)},
    }
    run.write_summary(summary)
    policy_name = {"answer": "quickstart SFT policy (answer-line slips)", "steps": "SFT policy with step errors",
                   "custom": "given policy"}[summary["policy_errors"]]
    title = (f"arithmetic, {policy_name}: {len(test_problems)} held-out problems, RMs on {len(keep)} samples"
             + (f"\nmean ± sd over {len(seeds)} reward-model seeds" if len(seeds) > 1 else ""))
    _plot(ns, curves, sd["selection"], root / "selection.png", title)
    (root / "report.md").write_text(report(summary))
    print(report(summary))
    if cfg.publish_dir:
        out = Path(cfg.publish_dir)
        out.mkdir(parents=True, exist_ok=True)
        suffix = "-steps" if summary["policy_errors"] == "steps" else ""
        for f in ("selection.png", "report.md", "summary.json"):
            stem, ext = f.split(".")
            shutil.copy(root / f, out / f"{stem}{suffix}.{ext}")
    return summary


def report(s: dict) -> str:
    """The study's tables as markdown (reward-model numbers: mean ± sd over its seeds)."""
    f = lambda x: "-" if x != x else f"{x:.3f}"  # noqa: E731  (NaN: no such steps)
    several = len(s.get("rm_seeds", [0])) > 1

    def pm(x, d):
        return f(x) + (f" ± {d:.3f}" if several and d == d and d > 0 else "")
    names = [k for k in CURVES if k in s["selection"]]
    sd = s.get("selection_sd", {})
    lines = ["# PRM study (tether study prm)", "",
             f"Policy: {s['policy']} (policy_errors={s.get('policy_errors', 'answer')}). "
             f"Reward-model seeds: {s.get('rm_seeds', [0])}.", "",
             f"Training budget: {s['train']['samples']} sampled solutions ({s['train']['problems']} problems), "
             f"{s['train']['steps']} steps of which {s['train']['wrong_steps']} wrong; solution accuracy "
             f"{s['train']['solution_accuracy']:.3f}. Held-out: {s['test']['problems']} problems x "
             f"{s['test']['samples_per_problem']} samples, sample accuracy {s['test']['sample_accuracy']:.3f}.", ""]
    if "error_positions" in s:
        lines += ["## Where the policy's wrong solutions first go wrong (check_steps)", "",
                  "| samples | wrong | step 0 (question) | middle step | last step | first wrong before the last |",
                  "|---|---:|---:|---:|---:|---:|"]
        for split, e in s["error_positions"].items():
            lines.append(f"| {split} | {e['wrong']} | {e['question']} | {e['middle']} | {e['last']} | "
                         f"{f(e['before_last'])} |")
        lines.append("")
    lines += ["## pass@1 of the selected solution vs n" + (" (mean ± sd over reward-model seeds)" if several else ""),
              "", "| n | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for j, n in enumerate(s["ns"]):
        lines.append(f"| {n} | " + " | ".join(pm(s["selection"][k][j], sd.get(k, [0] * len(s["ns"]))[j])
                                             for k in names) + " |")
    lines += ["", "Target (Lightman et al. 2023) PRM >= ORM >= majority at n >= 16: "
              + ", ".join(f"n={n}: {'met' if ok else 'not met'}" for n, ok in s["target_met_at_n>=16"].items()),
              "", "## Math-Shepherd labels vs the exact step truth (non-final steps)", "",
              "| K | estimate | accuracy | precision (correct) | recall (correct) | precision (wrong) | recall (wrong) |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for q in s["math_shepherd_quality"]:
        lines.append(f"| {q['k']} | {q['estimate']} | {f(q['accuracy'])} | {f(q['precision_correct'])} | "
                     f"{f(q['recall_correct'])} | {f(q['precision_wrong'])} | {f(q['recall_wrong'])} |")
    if "candidate_metrics" in s:
        cols = ("step_accuracy", "step_f1", "error_f1", "first_error_accuracy", "first_error_accuracy_wrong",
                "outcome_accuracy")
        msd = s["candidate_metrics_sd"]
        lines += ["", "## Reward models vs the truth on every held-out candidate", "",
                  "| model | step accuracy | step F1 | error F1 | first-error accuracy | first-error accuracy (wrong ones) "
                  "| outcome accuracy |", "|---|" + "---:|" * len(cols)]
        for name, m in s["candidate_metrics"].items():
            lines.append(f"| {name} | " + " | ".join(pm(m[c], msd[name][c]) if c in m else "-" for c in cols) + " |")
    lines += ["", "## Reward models vs the truth on 8 held-out solutions per problem (tether prm's eval/)", "",
              "| model | step accuracy | step F1 | error F1 | first-error accuracy | steps |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, m in s["prm_step_metrics"].items():
        lines.append(f"| {name} | {f(m['step_accuracy'])} | {f(m['step_f1'])} | {f(m['error_f1'])} | "
                     f"{f(m['first_error_accuracy'])} | {m['steps']:.0f} |")
    kinds = ("right", "slipped answer line", "wrong chain")
    counts = s["score_by_kind"]["samples"]
    lines += ["", "## Mean score of held-out samples by kind (what each model tells apart)", "",
              "| model | " + " | ".join(f"{k} ({counts.get(k, 0)})" for k in kinds) + " |",
              "|---|" + "---:|" * len(kinds)]
    for name in (k for k in CURVES if k in s["score_by_kind"]):
        lines.append(f"| {name} | " + " | ".join(f(s["score_by_kind"][name][k]) for k in kinds) + " |")
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in s["timings"].items()), ""]
    return "\n".join(lines)
