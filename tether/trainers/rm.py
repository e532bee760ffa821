"""Reward model: Bradley–Terry on preference pairs (`tether rm`).

The loop, top to bottom:
    load + validate + tokenize pairs (each side exactly as LearnedReward will score it)
    -> reward model = causal-LM body + scalar head read at the last non-pad token
       (tether.models.heads.ScalarHeadModel; a sequence-classification checkpoint is accepted)
    -> for each optimizer step: chosen and rejected of a batch in one forward,
       L = mean −log σ(r_c − r_r − m)  [+ λ·mean (r_c + r_r)²]  (margin m from a `margin` column,
       λ = center_rewards_coefficient), clip, step (finite-checked)
    -> log / eval on held-out pairs / checkpoint (exactly resumable)
    -> centering: the mean reward over the training responses becomes the head's offset, so the
       saved model scores the training distribution at mean 0 (what PPO wants from its RM).

Ensembles: one run is one model. Train k runs with different `seed` (head init + data order; see
`train_rm_ensemble`) and point LearnedReward / `rm:a,b,c` at them; aggregation happens there.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Optional

import torch

from tether.errors import NonFiniteLossError, UserError
from tether.models import load_tokenizer
from tether.models.heads import ScalarHeadModel
from tether.objectives import bradley_terry_loss
from tether.plots import plot_metrics
from tether.rewards.learned import encode_scored
from tether.run import RunDir, latest_checkpoint, seed_everything
from tether.trainers.common import (EpochSampler, Progress, Timer, autocast_context, guarded_step, make_optimizer, make_scheduler, restore_training, save_training)


@dataclass
class RMConfig:
    model: str = ""
    "initial model: a causal LM (the head starts fresh), a saved reward model, or a SequenceClassification checkpoint"
    data: str = ""
    "preference pairs (prompt, chosen, rejected [, margin]): a file, a saved dataset directory, or a hub name"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    eval_data: Optional[str] = None
    "held-out pairs in the same format (default: carve eval_fraction out of `data`)"
    eval_fraction: float = 0.1
    "fraction of `data` held out for the pairwise accuracy when eval_data is not given"
    name: str = "rm"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: str = "runs"
    "parent directory of run directories"
    max_length: int = 1024
    "longest tokenized prompt + response; longer ones keep their start (counted as truncated)"
    batch_size: int = 16
    "pairs per micro-batch"
    grad_accum: int = 1
    "micro-batches per optimizer step"
    max_steps: int = -1
    "optimizer steps to run; -1 = derive from epochs"
    epochs: float = 1.0
    "passes over the pairs when max_steps is -1"
    lr: float = 1e-5
    "peak learning rate (AdamW)"
    weight_decay: float = 0.0
    "AdamW weight decay (never applied to norms and biases)"
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    "AdamW (beta1, beta2)"
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    "learning-rate shape after warmup"
    warmup_steps: int = 0
    "linear warmup steps (0 = use warmup_ratio)"
    warmup_ratio: float = 0.03
    "warmup as a fraction of all steps when warmup_steps is 0"
    min_lr_ratio: float = 0.0
    "final learning rate as a fraction of the peak"
    max_grad_norm: float = 1.0
    "gradient clipping by global norm (0 = off)"
    use_margin: bool = True
    "subtract the `margin` column (Llama-2) inside the sigmoid when the data has one"
    center_rewards_coefficient: float = 0.0
    "λ of the auxiliary loss λ·mean((r_c + r_r)²) that keeps rewards near 0 (Eisenstein et al.)"
    center: bool = True
    "after training, set the head's offset so the mean reward over the training responses is 0"
    dtype: str = "fp32"
    "weight dtype: fp32 | bf16 | fp16 | auto"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    "bf16 autocast on CUDA when supported ('auto'), forced, or off; no effect on CPU"
    device: str = "auto"
    "cuda | cpu | auto"
    log_every: int = 10
    "write metrics every N optimizer steps"
    eval_every: int = 0
    "evaluate on the held-out pairs every N steps (0 = only at the end)"
    save_every: int = 0
    "checkpoint every N steps (0 = only at the end)"
    keep_last: int = 2
    "checkpoints to keep (older ones are deleted)"
    resume: bool = False
    "continue from the latest checkpoint in the run directory"
    seed: int = 0
    "seed for data order and head init (ensemble members differ by seed)"
    eval_seed: int = 0
    "seed of the eval_fraction split (kept apart from `seed` so ensemble members share held-out pairs)"
    log_with: Literal["none", "tensorboard"] = "none"
    "also write TensorBoard event files to <run>/tensorboard"
    progress: bool = True
    "show a progress bar with ETA and live metrics"

    def __post_init__(self):
        if self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("batch_size and grad_accum must be >= 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in [0, 1)")
        if len(self.adam_betas) != 2:
            raise ValueError("adam_betas must be two numbers")


# -- data ----------------------------------------------------------------------------------------

def load_pairs(source: str, tokenizer, max_length: int, split: str | None = None) -> tuple[list[dict], dict]:
    """Validated preference rows -> [{chosen_ids, rejected_ids, margin, gold...}] + report."""
    from tether.data.errors import DataError
    from tether.data.pipeline import load_data

    rows = load_data(source, expect="preference", split=split)
    out, truncated = [], 0
    for i, row in enumerate(rows):
        ex = {}
        for side in ("chosen", "rejected"):
            ids = encode_scored(tokenizer, row["prompt"], row[side])
            if len(ids) > max_length:
                ids, truncated = ids[:max_length], truncated + (side == "chosen")
            ex[f"{side}_ids"] = ids
        m = row.get("margin")
        if m is not None and not isinstance(m, (int, float)):
            raise DataError(rows.source, rows.row_number(i), "margin", f"must be a number, got {m!r}")
        ex["margin"] = float(m or 0.0)
        for k in ("gold_chosen", "gold_rejected", "label_prob"):  # gold-reward lab columns
            if isinstance(row.get(k), (int, float)):
                ex[k] = float(row[k])
        out.append(ex)
    return out, {"rows": len(out), "truncated": truncated, "has_margin": "margin" in rows.columns}


def pair_batch(examples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2B right-padded sequences (chosen rows first), their mask, and the B margins."""
    seqs = [ex["chosen_ids"] for ex in examples] + [ex["rejected_ids"] for ex in examples]
    T = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    return ids, mask, torch.tensor([ex["margin"] for ex in examples])


def _pair_scores(model, examples, pad_id, device, amp):
    ids, mask, margin = pair_batch(examples, pad_id)
    with amp:
        r = model.score(ids.to(device), mask.to(device)).float()
    B = len(examples)
    return r[:B], r[B:], margin.to(device)


@torch.no_grad()
def evaluate_pairs(model, examples: list[dict], batch_size: int, pad_id: int, device, amp,
                   prefix: str = "eval/") -> dict:
    """Held-out pairwise accuracy, BT loss, margin, reward stats; Bayes-optimal accuracy and
    agreement with the gold ordering when the pairs carry the gold-reward lab's columns."""
    if not examples:
        return {}
    was = model.training
    model.eval()
    rc, rr = [], []
    for i in range(0, len(examples), batch_size):
        c, r, _ = _pair_scores(model, examples[i:i + batch_size], pad_id, device, amp)
        rc.append(c.cpu())
        rr.append(r.cpu())
    model.train(was)
    rc, rr = torch.cat(rc), torch.cat(rr)
    loss, m = bradley_terry_loss(rc, rr)
    both = torch.cat([rc, rr])
    out = {"loss": float(loss), "accuracy": float(m["accuracy"]), "margin": float(m["margin"]),
           "reward_mean": float(both.mean()), "reward_std": float(both.std()),
           "reward_min": float(both.min()), "reward_max": float(both.max())}
    if all("label_prob" in ex for ex in examples):
        out["bayes_accuracy"] = sum(max(ex["label_prob"], 1 - ex["label_prob"]) for ex in examples) / len(examples)
    if all("gold_chosen" in ex and "gold_rejected" in ex for ex in examples):
        g = torch.tensor([ex["gold_chosen"] - ex["gold_rejected"] for ex in examples])
        d = rc - rr
        untied = g != 0
        if untied.any():
            out["gold_agreement"] = float(((d > 0) == (g > 0))[untied].float().mean())
    return {prefix + k: v for k, v in out.items()}


# -- training ------------------------------------------------------------------------------------

def train_rm(cfg: RMConfig) -> dict:
    """Train a Bradley–Terry reward model per `cfg`; returns the summary (also summary.json)."""
    if not cfg.model:
        raise UserError("rm: `model` is required (a causal LM or reward-model directory)")
    if not cfg.data:
        raise UserError("rm: `data` is required (preference pairs: prompt, chosen, rejected)")
    run_path = Path(cfg.runs_dir) / cfg.name
    ckpt = latest_checkpoint(run_path) if cfg.resume else None
    seed_everything(cfg.seed)

    tokenizer = load_tokenizer(str(ckpt) if ckpt else cfg.model)
    train_ex, report = load_pairs(cfg.data, tokenizer, cfg.max_length, cfg.split)
    if cfg.eval_data:
        eval_ex, _ = load_pairs(cfg.eval_data, tokenizer, cfg.max_length)
    elif cfg.eval_fraction > 0:
        order = list(range(len(train_ex)))
        random.Random(cfg.eval_seed).shuffle(order)
        held = set(order[:max(1, int(len(order) * cfg.eval_fraction))])
        eval_ex = [ex for i, ex in enumerate(train_ex) if i in held]
        train_ex = [ex for i, ex in enumerate(train_ex) if i not in held]
    else:
        eval_ex = []
    if not train_ex:
        raise UserError(f"rm: no training pairs left in '{cfg.data}' after the eval split")
    if not cfg.use_margin:
        for ex in train_ex:
            ex["margin"] = 0.0

    # The head's init draws from torch's RNG, seeded above: ensemble members differ by seed.
    model = ScalarHeadModel.from_pretrained(str(ckpt) if ckpt else cfg.model, kind="reward",
                                            dtype=cfg.dtype, device=cfg.device)
    device = next(model.parameters()).device
    model.train()
    run = RunDir(run_path, resume=ckpt is not None, log_with=cfg.log_with)
    amp = autocast_context(device, cfg.mixed_precision)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    per_step = cfg.batch_size * cfg.grad_accum
    total_steps = cfg.max_steps if cfg.max_steps > 0 else \
        max(1, math.ceil(cfg.epochs * len(train_ex) / per_step))
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, betas=tuple(cfg.adam_betas))
    scheduler = make_scheduler(optimizer, cfg.schedule, warmup, total_steps, cfg.min_lr_ratio)
    sampler = EpochSampler(len(train_ex), per_step, cfg.seed)
    step, time_offset, skipped = 0, 0.0, 0
    if ckpt:
        step, time_offset, skipped = restore_training(ckpt, run, optimizer, scheduler, sampler)
    run.write_config(cfg)

    def checkpoint():
        return save_training(run, step, model, tokenizer, optimizer, scheduler, sampler,
                             skipped, time_offset, cfg.keep_last)

    bar = Progress(total_steps, step, cfg.name, enabled=cfg.progress and run.is_main)
    timer, steps_since, t_start = Timer(), 0, time.time()
    last: dict = {}
    while step < total_steps:
        idx = sampler.next()
        micro = [idx[i:i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]
        loss_sum, acc, margin, rewards = 0.0, 0.0, 0.0, []
        for m_idx in micro:
            rc, rr, m = _pair_scores(model, [train_ex[j] for j in m_idx], pad, device, amp)
            loss, met = bradley_terry_loss(rc, rr, m)
            if cfg.center_rewards_coefficient:
                loss = loss + cfg.center_rewards_coefficient * ((rc + rr) ** 2).mean()
            w = len(m_idx) / len(idx)  # a mean over the whole accumulated batch
            (loss * w).backward()
            loss_sum += float(loss.detach()) * w
            acc += float(met["accuracy"]) * w
            margin += float(met["margin"]) * w
            rewards.append(torch.cat([rc, rr]).detach().cpu())
        try:
            grad_norm = guarded_step(model, optimizer, scheduler, cfg.max_grad_norm, loss_sum)
        except NonFiniteLossError:
            skipped += 1
            grad_norm = float("nan")
        step += 1
        steps_since += 1
        r = torch.cat(rewards)
        last = {"loss": loss_sum, "accuracy": acc, "margin": margin, "reward_mean": float(r.mean()),
                "reward_min": float(r.min()), "reward_max": float(r.max()), "grad_norm": grad_norm,
                "lr": scheduler.get_last_lr()[0]}
        if step % cfg.log_every == 0 or step == total_steps:
            dt = timer.lap()
            run.log(step, {**last, "epoch": sampler.epoch, "skipped_steps": skipped,
                           "step_time": dt / steps_since}, time_offset=time_offset)
            steps_since = 0
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
            run.log(step, evaluate_pairs(model, eval_ex, cfg.batch_size * 4, pad, device, amp),
                    time_offset=time_offset)
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            checkpoint()
        bar.update({"loss": loss_sum, "acc": acc})
    bar.close()

    if cfg.center:
        # Mean reward over (a sample of) the training responses -> offset; forward subtracts it.
        # Idempotent: re-centering a centered model adds ~0, so a resume at the end is harmless.
        sample = train_ex[:2048]
        with torch.no_grad():
            was = model.training
            model.eval()
            rs = [torch.cat(_pair_scores(model, sample[i:i + 64], pad, device, amp)[:2]).cpu()
                  for i in range(0, len(sample), 64)]
            model.train(was)
        model.offset += float(torch.cat(rs).mean())
    final_eval = evaluate_pairs(model, eval_ex, cfg.batch_size * 4, pad, device, amp)
    train_eval = evaluate_pairs(model, train_ex[:len(eval_ex) or 512], cfg.batch_size * 4, pad,
                                device, amp, prefix="train/")
    run.log(step, {**final_eval, **train_eval}, time_offset=time_offset)
    path = checkpoint()
    summary = {"steps": step, "train_pairs": len(train_ex), "eval_pairs": len(eval_ex),
               "final_loss": last.get("loss"), "skipped_steps": skipped, "offset": model.offset,
               "truncated": report["truncated"], "has_margin": report["has_margin"] and cfg.use_margin,
               "train_seconds": round(time.time() - t_start, 2), "checkpoint": str(path),
               **final_eval, **{k: train_eval[k] for k in ("train/accuracy",) if k in train_eval}}
    run.write_summary(summary)
    if run.is_main:
        plot_metrics(run.path)
    run.close()
    return summary


def train_rm_ensemble(cfg: RMConfig, seeds: list[int]) -> list[str]:
    """k reward models differing only by seed (runs <name>-s<seed>); returns their checkpoints,
    ready for LearnedReward(paths, aggregate=...). The held-out split is shared (eval_seed)."""
    return [train_rm(replace(cfg, name=f"{cfg.name}-s{s}", seed=s))["checkpoint"] for s in seeds]
