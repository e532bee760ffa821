"""`tether study prm`: process vs outcome supervision, measured against exact step truth.

Lightman et al. (2023), "Let's Verify Step by Step", shrunk to the quickstart's arithmetic task,
where every step of a worked solution is exactly checkable (tether.tasks.arithmetic.check_steps):
    1. the quickstart's SFT policy (pretrain -> SFT, no RL; reused when already built);
    2. S solutions sampled (T = 1) for each of N training problems: the training budget;
    3. three reward models trained on those same completions with `tether prm`:
       PRM on the exact step labels; PRM on Math-Shepherd labels (hard, K rollouts per step prefix
       from the same policy: tether.labeling.steps); ORM = a one-step PRM labelled by the final
       answer. All share the SFT policy's body as their initialization;
    4. Math-Shepherd's label quality vs the truth for K = 1…K_max (from one set of rollouts: the
       first K of them), hard and soft estimates, and each PRM's step accuracy vs truth on
       held-out solutions;
    5. n = 1…64 solutions per held-out problem; pass@1 of the one picked by PRM (min over steps),
       ORM (its score), majority vote over final answers, and at random, averaged over random
       subsets of the 64; plotted against n.
Everything lands in runs/<name>/ (summary.json, report.md, selection.png); `publish_dir` copies the
report, the figure and the summary there (benchmarks/prm/ in the repository).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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
    "the SFT policy; '' = the quickstart's (rl=false), built into <runs_dir>/<name>/quickstart or reused from there"
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


def _plot(ns: list[int], curves: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    styles = {"prm": ("PRM (min over steps)", "C0", "o"), "prm_ms": ("PRM on Math-Shepherd labels", "C4", "v"),
              "orm": ("ORM", "C1", "s"), "majority": ("majority vote", "C2", "^"),
              "random": ("random", "C7", "x"), "oracle": ("pass@n (oracle)", "k", "")}
    for name, (label, color, marker) in styles.items():
        if name in curves:
            ax.plot(ns, curves[name], marker=marker or None, color=color, label=label,
                    linestyle=":" if name == "oracle" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("n (solutions sampled per problem)")
    ax.set_ylabel("pass@1 of the selected solution")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _train(cfg: PRMStudyConfig, policy: str, name: str, data: Path, eval_data: Path) -> dict:
    from tether.trainers.prm import PRMConfig, train_prm
    return train_prm(PRMConfig(model=policy, data=str(data), eval_data=str(eval_data),
                               name=f"{cfg.name}/{name}", runs_dir=cfg.runs_dir, seed=cfg.seed,
                               step_separator=arithmetic.STEP_SEPARATOR, max_steps=cfg.prm_steps,
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

    # -- the three reward models on the same budget ---------------------------------------------
    data = root / "data"
    prm_true = _write(data / "prm_true.jsonl", (truth[i] for i in keep))
    prm_ms = _write(data / "prm_math_shepherd.jsonl",
                    ({**truth[i], "labels": [sum(o[:cfg.ms_train_k]) > 0 for o in out]}
                     for i, out in zip(keep, outcomes)))
    # the ORM's one step is the whole solution, as `prm:<orm>?aggregate=last` reads it
    orm = _write(data / "orm.jsonl", ({"prompt": truth[i]["prompt"], "completions": ["=".join(truth[i]["completions"])],
                                       "labels": [bool(arithmetic.check_answer(train_rows[i][1], train_rows[i][0].answer))]}
                                      for i in keep))
    # held-out truth: the first 8 candidates of every held-out problem
    held = [arithmetic.stepwise_example(p, c) for p, cs in zip(test_problems, test_samples) for c in cs[:8]]
    held = [r for r in held if all(s for s in r["completions"])]
    prm_eval = _write(data / "prm_eval.jsonl", held)
    orm_eval = _write(data / "orm_eval.jsonl", ({**r, "completions": ["=".join(r["completions"])],
                                                 "labels": [r["labels"][-1]]} for r in held))
    t0 = time.time()
    runs = {"prm": _train(cfg, policy, "prm", prm_true, prm_eval),
            "prm_ms": _train(cfg, policy, "prm-math-shepherd", prm_ms, prm_eval),
            "orm": _train(cfg, policy, "orm", orm, orm_eval)}
    timings["reward_models_s"] = round(time.time() - t0, 1)
    print(f"[study prm] reward_models: {timings['reward_models_s']} s", flush=True)

    # -- selection among n held-out candidates ---------------------------------------------------
    t0 = time.time()
    prompts = [p.prompt for p, cs in zip(test_problems, test_samples) for _ in cs]
    flat = [c for cs in test_samples for c in cs]
    scores = {}
    for name, agg in (("prm", "min"), ("prm_ms", "min"), ("orm", "last")):
        reward = ProcessReward(runs[name]["checkpoint"], aggregate=agg, device="cpu", batch_size=256)
        probs = reward.step_probabilities(prompts, flat)
        s = [aggregate_steps(x, agg) for x in probs]
        scores[name] = [s[i * cfg.max_n:(i + 1) * cfg.max_n] for i in range(len(test_problems))]
    correct = [[bool(arithmetic.check_answer(c, p.answer)) for c in cs] for p, cs in zip(test_problems, test_samples)]
    kinds = [_kind(arithmetic.check_steps(c, p), p.answer) for p, cs in zip(test_problems, test_samples) for c in cs]
    diagnosis = {}  # each reward model's mean score by kind of sample: what does it tell apart?
    for name, per_problem in scores.items():
        flat_scores = [x for row in per_problem for x in row]
        diagnosis[name] = {kind: _mean([x for x, k in zip(flat_scores, kinds) if k == kind])
                           for kind in ("right", "slipped answer line", "wrong chain")}
    diagnosis["samples"] = dict(Counter(kinds))
    answers = [[arithmetic.extract_answer(c) for c in cs] for cs in test_samples]
    ns = [n for n in (2 ** i for i in range(12)) if n <= cfg.max_n]
    curves = selection_curves(correct, answers, scores, ns, cfg.subsets, cfg.seed + 4)
    timings["selection_s"] = round(time.time() - t0, 1)
    print(f"[study prm] selection: {timings['selection_s']} s", flush=True)

    step_truth = [r["labels"] for r in truth]
    summary = {
        "policy": policy, "ns": ns, "selection": curves,
        "target_met_at_n>=16": {str(n): curves["prm"][j] >= curves["orm"][j] >= curves["majority"][j]
                                for j, n in enumerate(ns) if n >= 16},
        "score_by_kind": diagnosis,
        "math_shepherd_quality": quality,
        "prm_step_metrics": {name: {k.split("/", 1)[1]: v for k, v in runs[name].items() if k.startswith("eval/")}
                             for name in runs},
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
    title = f"arithmetic, quickstart SFT policy: {len(test_problems)} held-out problems, RMs on {len(keep)} samples"
    _plot(ns, curves, root / "selection.png", title)
    (root / "report.md").write_text(report(summary))
    print(report(summary))
    if cfg.publish_dir:
        out = Path(cfg.publish_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in ("selection.png", "report.md", "summary.json"):
            shutil.copy(root / f, out / f)
    return summary


def report(s: dict) -> str:
    """The study's tables as markdown."""
    f = lambda x: "-" if x != x else f"{x:.3f}"  # noqa: E731  (NaN: no such steps)
    names = [k for k in ("prm", "prm_ms", "orm", "majority", "random", "oracle") if k in s["selection"]]
    lines = ["# PRM study (tether study prm)", "",
             f"Training budget: {s['train']['samples']} sampled solutions ({s['train']['problems']} problems), "
             f"{s['train']['steps']} steps of which {s['train']['wrong_steps']} wrong; solution accuracy "
             f"{s['train']['solution_accuracy']:.3f}. Held-out: {s['test']['problems']} problems x "
             f"{s['test']['samples_per_problem']} samples, sample accuracy {s['test']['sample_accuracy']:.3f}.", "",
             "## pass@1 of the selected solution vs n", "",
             "| n | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for j, n in enumerate(s["ns"]):
        lines.append(f"| {n} | " + " | ".join(f(s["selection"][k][j]) for k in names) + " |")
    lines += ["", "Target (Lightman et al. 2023) PRM >= ORM >= majority at n >= 16: "
              + ", ".join(f"n={n}: {'met' if ok else 'not met'}" for n, ok in s["target_met_at_n>=16"].items()),
              "", "## Math-Shepherd labels vs the exact step truth (non-final steps)", "",
              "| K | estimate | accuracy | precision (correct) | recall (correct) | precision (wrong) | recall (wrong) |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for q in s["math_shepherd_quality"]:
        lines.append(f"| {q['k']} | {q['estimate']} | {f(q['accuracy'])} | {f(q['precision_correct'])} | "
                     f"{f(q['recall_correct'])} | {f(q['precision_wrong'])} | {f(q['recall_wrong'])} |")
    lines += ["", "## Reward models vs the truth on held-out solutions", "",
              "| model | step accuracy | step F1 | error F1 | first-error accuracy | steps |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, m in s["prm_step_metrics"].items():
        lines.append(f"| {name} | {f(m['step_accuracy'])} | {f(m['step_f1'])} | {f(m['error_f1'])} | "
                     f"{f(m['first_error_accuracy'])} | {m['steps']} |")
    kinds = ("right", "slipped answer line", "wrong chain")
    counts = s["score_by_kind"]["samples"]
    lines += ["", "## Mean score of held-out samples by kind (what each model tells apart)", "",
              "| model | " + " | ".join(f"{k} ({counts.get(k, 0)})" for k in kinds) + " |",
              "|---|" + "---:|" * len(kinds)]
    for name in ("prm", "prm_ms", "orm"):
        lines.append(f"| {name} | " + " | ".join(f(s["score_by_kind"][name][k]) for k in kinds) + " |")
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in s["timings"].items()), ""]
    return "\n".join(lines)
