"""Process reward model: per-step binary cross-entropy on stepwise data (`tether prm`).

The loop, top to bottom:
    load + validate + tokenize stepwise rows (TRL's format: `prompt`, `completions` = the steps,
    `labels` = one bool per step): prompt, then each step followed by `step_separator`; the label
    sits on the separator's last token, every other position is ignored
    (tether.data.encode_stepwise, as TRL's PRMTrainer)
    -> PRM = causal-LM body + scalar head (tether.models.heads.ScalarHeadModel, the module the
       reward model and PPO's critic share), read at every separator
    -> for each optimizer step: L = mean over the batch's steps of BCE(σ(s_i), y_i), y_i the bool
       label or, with prm.targets=soft, the row's `soft_labels` value
       (:func:`process_reward_loss`), clip, step (finite-checked)
    -> log / eval on held-out rows: step accuracy, step F1, first-error accuracy
       (:func:`step_metrics`) / checkpoint (+ prm.json: the separator the reward cuts text at)

An outcome reward model (ORM) is the same trainer on one-step rows (the whole completion, labelled
by its final answer), read with `prm:<run>?aggregate=last`.

Why a scalar head and BCE rather than TRL's two-class token classifier with cross-entropy: the
two are the same model (a 2-way softmax is a sigmoid of the logit difference), and one head serves
the RM, the critic and the PRM, so a PRM can also initialise PPO's value model.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F

from tether import distributed
from tether.config import flat_init
from tether.constraints import Range, Seed
from tether.errors import UserError
from tether.models.heads import ScalarHeadModel
from tether.rewards.process import PRM_CONFIG, step_logits
from tether.trainers.core.common import StepClock
from tether.trainers.core.held_out import check_keep_best
from tether.trainers.core.sections import DataSection, ModelSection, OptimSection, RunSection
from tether.trainers.core.setup import Data, setup_training, releases_process_state

IGNORE = -100  # a position that carries no step label


@dataclass
class PRMSection:
    step_separator: str = "\n"
    "string appended to every step; the step's label is read at its last token (TRL's default '\\n'; the arithmetic task's steps use '=')"
    threshold: Annotated[float, Range(gt=0, lt=1)] = 0.5
    "a step is predicted correct when P(correct) > threshold (accuracy, F1, first error)"
    eval_seed: Seed = 0
    "seed of the eval_fraction split"
    targets: Literal["hard", "soft"] = "hard"
    "BCE target y_i: hard = the bool `labels`; soft = each step's `soft_labels` (Math-Shepherd's soft estimate c_i/K, Wang et al. 2024 eq. 2); metrics use `labels`"


@flat_init
@dataclass
class PRMConfig:
    model: ModelSection = field(default_factory=ModelSection)
    "initial model: a causal LM (the head starts fresh) or a saved reward/process reward model"
    data: DataSection = field(default_factory=lambda: DataSection(eval_fraction=0.1, batch_size=16))
    "stepwise rows (prompt, completions: list of steps, labels: list of bool, + soft_labels with prm.targets=soft); an over-long row keeps its whole first steps"
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5, warmup_ratio=0.03))
    "optimizer, schedule, length"
    run: RunSection = field(default_factory=lambda: RunSection(name="prm"))
    "run directory, seed (head init + data order), logging, eval, checkpoints"
    prm: PRMSection = field(default_factory=PRMSection)
    "the step separator, the BCE targets and the metrics' threshold"

    def __post_init__(self):
        if self.model.lora_r > 0:  # ScalarHeadModel has no adapters: refused, not ignored
            raise ValueError("prm: lora_r is not supported for process reward models (full fine-tuning only)")
        if not self.prm.step_separator:
            raise ValueError("config key 'prm.step_separator' must be a non-empty string")
        if self.prm.targets not in ("hard", "soft"):  # the CLI checks the Literal; Python callers too
            raise ValueError(f"config key 'prm.targets' must be 'hard' or 'soft'; got {self.prm.targets!r}")


# -- the objective and the metrics ---------------------------------------------------------------

def process_reward_loss(logits: torch.Tensor, labels: torch.Tensor):
    """Per-step binary cross-entropy over a batch, at the labelled positions only:

        L = −(1/N) Σ_(b,t): y_bt ≠ −100  [ y_bt·log σ(s_bt) + (1 − y_bt)·log(1 − σ(s_bt)) ]

    s [B, T]: the head's per-token logits; y [B, T]: the step label (0/1, or a Math-Shepherd soft
    label in [0, 1]) at each step's separator token, −100 elsewhere; N: the labelled positions
    (Lightman et al. 2023, §2.6: the PRM predicts each step's correctness at its last token; the
    Math-Shepherd PRM, Wang et al. 2024 eq. 3, is the same loss). Returns (loss, {accuracy, steps})."""
    mask = labels != IGNORE
    s, y = logits[mask].float(), labels[mask].float()
    if s.numel() == 0:
        raise ValueError("no labelled step in the batch")
    loss = F.binary_cross_entropy_with_logits(s, y)
    accuracy = ((s > 0) == (y > 0.5)).float().mean()
    return loss, {"accuracy": accuracy.detach(), "steps": int(s.numel())}


def step_metrics(probs: list[torch.Tensor], labels: list[list[bool]], threshold: float = 0.5) -> dict:
    """Held-out PRM metrics from each row's step probabilities and true labels:
    step_accuracy (over all steps), step_f1 (F1 of "correct", the positive label), error_f1 (F1 of
    "incorrect": finding the mistakes), first_error_accuracy (rows whose first predicted wrong step
    is their first wrong step, "none" matching "none"; ProcessBench's task, Zheng et al. 2024)."""
    tp = fp = fn = tn = first = 0
    for p, y in zip(probs, labels):
        pred = [float(x) > threshold for x in p]
        y = [bool(v) for v in y[:len(pred)]]
        for a, b in zip(pred, y):
            tp += a and b
            fp += a and not b
            fn += b and not a
            tn += not a and not b
        first += next((i for i, ok in enumerate(pred) if not ok), None) == \
            next((i for i, ok in enumerate(y) if not ok), None)
    n = tp + fp + fn + tn

    def f1(t, f_pos, f_neg):
        return 2 * t / (2 * t + f_pos + f_neg) if t + f_pos + f_neg else 1.0
    return {"step_accuracy": (tp + tn) / n if n else float("nan"), "step_f1": f1(tp, fp, fn),
            "error_f1": f1(tn, fn, fp), "first_error_accuracy": first / len(probs) if probs else float("nan"),
            "steps": n, "rows": len(probs)}


# -- data ----------------------------------------------------------------------------------------

def load_stepwise(source: str, tokenizer, spec: DataSection, separator: str,
                  targets: str = "hard") -> tuple[list[dict], dict]:
    """Validated stepwise rows -> [{input_ids, step_labels (the BCE targets: 0/1, or `soft_labels`
    with targets="soft"), labels (the row's, as bools: the metrics' truth)}] + report."""
    from tether.data import encode_stepwise, load_data

    rows = load_data(source, expect="stepwise", split=spec.split, rename=spec.columns)
    examples, report = encode_stepwise(rows, tokenizer, spec.max_length, spec.truncation,
                                       step_separator=separator, source=rows.source, soft=targets == "soft")
    for ex, i in zip(examples, report.kept_index):
        ex["labels"] = [bool(v) for v in rows[i]["labels"]]
        ex["text"] = {"prompt": rows[i]["prompt"], "completions": rows[i]["completions"]}
    return examples, {"rows": len(examples), "truncated": report.truncated, "dropped": report.dropped}


def load_prm_data(cfg: PRMConfig, tokenizer) -> Data:
    spec, sep, targets = cfg.data, cfg.prm.step_separator, cfg.prm.targets
    train, report = load_stepwise(spec.path, tokenizer, spec, sep, targets)
    if spec.eval_data:
        held_out, _ = load_stepwise(spec.eval_data, tokenizer, spec, sep, targets)
    elif spec.eval_fraction > 0:
        order = list(range(len(train)))
        random.Random(cfg.prm.eval_seed).shuffle(order)
        held = set(order[:max(1, int(len(order) * spec.eval_fraction))])
        held_out = [ex for i, ex in enumerate(train) if i in held]
        train = [ex for i, ex in enumerate(train) if i not in held]
    else:
        held_out = []
    if not train:
        raise UserError(f"prm: no training rows left in '{spec.path}' after the eval split")
    return Data(train, held_out, report)


def step_batch(examples: list[dict], pad_id: int):
    """Right-padded ids, mask and per-token labels (−100 off the separators and on padding)."""
    T = max(len(ex["input_ids"]) for ex in examples)
    ids = torch.tensor([ex["input_ids"] + [pad_id] * (T - len(ex["input_ids"])) for ex in examples])
    mask = torch.tensor([[1] * len(ex["input_ids"]) + [0] * (T - len(ex["input_ids"])) for ex in examples])
    labels = torch.tensor([ex["step_labels"] + [IGNORE] * (T - len(ex["step_labels"])) for ex in examples])
    return ids, mask, labels


def batch_loss(model, examples: list[dict], pad_id: int, device, amp):
    """:func:`process_reward_loss` of the model on one micro-batch of encoded rows."""
    ids, mask, labels = step_batch(examples, pad_id)
    with amp:
        logits = model(ids.to(device), mask.to(device))
    return process_reward_loss(logits, labels.to(device))


def evaluate_steps(model, examples: list[dict], pad_id: int, threshold: float, amp=None,
                   batch_size: int = 64, prefix: str = "eval/") -> dict:
    """:func:`step_metrics` (+ the BCE) of the model on encoded rows ({} when there are none)."""
    if not examples:
        return {}
    ends = [[t for t, y in enumerate(ex["step_labels"]) if y != IGNORE] for ex in examples]
    logits = step_logits(model, [ex["input_ids"] for ex in examples], ends, pad_id, batch_size, amp)
    targets = [torch.tensor([float(ex["step_labels"][t]) for t in e]) for ex, e in zip(examples, ends)]
    bce = F.binary_cross_entropy_with_logits(torch.cat(logits), torch.cat(targets))
    probs = [torch.sigmoid(x) for x in logits]
    out = {"loss": float(bce), **step_metrics(probs, [ex["labels"] for ex in examples], threshold)}
    return {prefix + k: v for k, v in out.items()}


EVAL_METRICS = ("loss", "step_accuracy", "step_f1", "error_f1", "first_error_accuracy", "steps", "rows")


def load_prm(cfg: PRMConfig, ckpt) -> ScalarHeadModel:
    """The model to train, from the checkpoint on resume (a fresh head draws from the seeded RNG)."""
    return ScalarHeadModel.from_pretrained(str(ckpt) if ckpt else cfg.model.path, kind="reward",
                                           dtype=cfg.model.dtype, device=cfg.model.device,
                                           attn_implementation=cfg.model.attn_implementation)


@releases_process_state
def train_prm(cfg: PRMConfig) -> dict:
    """Train a process reward model per `cfg`; returns the summary (also summary.json)."""
    if distributed.world_size() > 1:
        raise UserError("prm: one process only for now (its held-out metrics are not gathered over ranks)")
    check_keep_best(cfg, [f"eval/{k}" for k in EVAL_METRICS],
                    held_out=bool(cfg.data.eval_data or cfg.data.eval_fraction > 0))
    t = setup_training(cfg, lambda tokenizer: load_prm_data(cfg, tokenizer), build=load_prm)
    model, device, amp, batch_size, sep = t.model, t.device, t.amp, cfg.data.batch_size, cfg.prm.step_separator
    pad_id = t.tokenizer.pad_token_id if t.tokenizer.pad_token_id is not None else 0
    # the separator travels with every checkpoint: `prm:<run>` cuts completions at it
    def save_separator(path) -> None:
        (Path(path) / PRM_CONFIG).write_text(json.dumps({"separator": sep}) + "\n")
    t.save_extra = save_separator

    def evaluate(examples, prefix="eval/"):
        return evaluate_steps(model, examples, pad_id, cfg.prm.threshold, amp, batch_size * 4, prefix)

    clock, started, last = StepClock(), time.time(), {}
    while t.step < t.total_steps:
        rows = [t.data.train[j] for j in t.order.next()]
        n_steps = sum(sum(y != IGNORE for y in ex["step_labels"]) for ex in rows)
        loss_sum = accuracy = 0.0
        for start in distributed.accumulation(model, range(0, len(rows), batch_size)):
            loss, stats = batch_loss(model, rows[start:start + batch_size], pad_id, device, amp)
            weight = stats["steps"] / n_steps  # the mean over every step of the accumulated batch
            (loss * weight).backward()
            loss_sum += float(loss.detach()) * weight
            accuracy += float(stats["accuracy"]) * weight
        grad_norm = t.optimizer_step(loss_sum)
        t.step += 1
        clock.tick()
        last = {"loss": loss_sum, "accuracy": accuracy, "grad_norm": grad_norm, "lr": t.lr}
        if t.log_due():
            t.log({**last, "epoch": t.order.epoch, "skipped_steps": t.skipped, **clock.lap()})
        if t.due(cfg.run.eval_every):
            t.log_eval(evaluate(t.data.eval))
        if t.due(cfg.run.save_every):
            t.checkpoint()
        t.bar.update({"loss": loss_sum, "acc": accuracy, **t.eval_shown})

    final_eval = evaluate(t.data.eval)
    train_eval = evaluate(t.data.train[:len(t.data.eval) or 512], prefix="train/")
    t.log_eval({**final_eval, **train_eval})
    summary = t.finish({"train_rows": len(t.data.train), "eval_rows": len(t.data.eval),
                     "separator": sep, "final_loss": last.get("loss"),
                     "train_seconds": round(time.time() - started, 2), **t.data.report,
                     **final_eval, "train/step_accuracy": train_eval.get("train/step_accuracy")})
    best = Path(t.run.path) / "checkpoints" / "best"  # keep_best's copy is written without save_extra
    if best.is_dir():
        save_separator(best)
    return summary
