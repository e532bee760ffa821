"""Supervised fine-tuning: language modelling, or prompt -> completion with completion-only loss.

The loop, top to bottom:
    load model + tokenizer  ->  load, validate and tokenize data (errors before any training)
    -> for each optimizer step: draw a batch, split into micro-batches, token-mean NLL over the
       completion mask of the *whole* accumulated batch, clip, step (finite-checked)
    -> log / eval (loss + sampled completions) / checkpoint (exactly resumable).
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import torch

from tether.errors import NonFiniteLossError, UserError
from tether.models import load_model, load_tokenizer
from tether.objectives import sft_loss
from tether.plots import plot_metrics
from tether.rollout.hf import generate
from tether.run import RunDir, latest_checkpoint, seed_everything
from tether.trainers.common import (EpochSampler, Progress, Timer, autocast_context, guarded_step, make_optimizer, make_scheduler, restore_training, save_training)
from tether.trainers.sft_data import load_sft_data, pad_batch


@dataclass
class SFTConfig:
    model: str = ""
    "model to fine-tune: a local HF directory or a hub id"
    data: str = ""
    "training data: .jsonl/.json/.parquet/.csv file, a save_to_disk directory, or a hub dataset name"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    eval_data: Optional[str] = None
    "held-out data in the same format (default: carve eval_fraction out of `data`)"
    eval_fraction: float = 0.0
    "fraction of `data` held out for eval when eval_data is not given"
    name: str = "sft"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: str = "runs"
    "parent directory of run directories"
    max_length: int = 1024
    "longest tokenized example (prompt + completion)"
    truncation: Literal["truncate", "drop"] = "truncate"
    "what to do with an example over max_length: cut its end, or drop it (both are counted)"
    completion_only: bool = True
    "train only on completion / assistant tokens (prompt tokens are masked out of the loss)"
    batch_size: int = 8
    "examples per micro-batch"
    grad_accum: int = 1
    "micro-batches per optimizer step (effective batch = batch_size * grad_accum)"
    max_steps: int = -1
    "optimizer steps to run; -1 = derive from epochs"
    epochs: float = 1.0
    "passes over the data when max_steps is -1"
    lr: float = 2e-5
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
    dtype: str = "fp32"
    "weight dtype: fp32 (master weights; use with mixed_precision) | bf16 | fp16 | auto"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    "bf16 autocast on CUDA when supported ('auto'), forced, or off; no effect on CPU"
    device: str = "auto"
    "cuda | cpu | auto"
    attn_implementation: Optional[str] = None
    "attention kernel passed to from_pretrained (sdpa, eager, flash_attention_2)"
    gradient_checkpointing: bool = False
    "recompute activations in backward to save memory"
    lora_r: int = 0
    "LoRA rank (0 = full fine-tuning); checkpoints then hold the adapter only"
    lora_alpha: int = 16
    "LoRA scaling numerator (the update is scaled by alpha / r)"
    lora_dropout: float = 0.0
    "dropout on the LoRA input"
    lora_targets: str = "all-linear"
    "modules to adapt: 'all-linear' or comma-separated names (q_proj,v_proj)"
    log_every: int = 10
    "write metrics every N optimizer steps"
    eval_every: int = 0
    "evaluate every N steps (0 = only at the end)"
    num_samples: int = 4
    "completions sampled from eval prompts at each eval, written to samples.jsonl"
    sample_max_new_tokens: int = 128
    "generation length for those samples"
    save_every: int = 0
    "checkpoint every N steps (0 = only at the end)"
    keep_last: int = 2
    "checkpoints to keep (older ones are deleted)"
    resume: bool = False
    "continue from the latest checkpoint in the run directory"
    seed: int = 0
    "seed for data order, init of new heads, and sampling"
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


def _micro_loss(model, batch: dict, device, amp) -> tuple[torch.Tensor, int]:
    """Summed completion-token NLL of one micro-batch and its token count."""
    ids = batch["input_ids"].to(device)
    mask = batch["completion_mask"].to(device)
    with amp:
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"].to(device)).logits
    # sft_loss is the token mean over `mask` (shifted inside); scale back to a sum so the
    # accumulated batch is one token mean, not a mean of micro-batch means.
    n_tok = int(mask[:, 1:].sum())
    return sft_loss(logits, ids, mask)[0] * n_tok, n_tok


@torch.no_grad()
def evaluate_loss(model, examples: list[dict], batch_size: int, pad_id: int, device, amp) -> float:
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = pad_batch(examples[i:i + batch_size], pad_id)
        loss_sum, n = _micro_loss(model, batch, device, amp)
        total, count = total + float(loss_sum), count + n
    model.train(was)
    return total / max(count, 1)


def apply_lora(model, cfg, ckpt=None):
    """Wrap `model` with LoRA adapters (peft); from `ckpt` when resuming. Only adapters train."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise UserError("lora_r > 0 needs peft: pip install 'tether[lora]'") from None
    if ckpt is not None:
        return PeftModel.from_pretrained(model, str(ckpt), is_trainable=True)
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else \
        [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                            lora_dropout=cfg.lora_dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


def train_sft(cfg: SFTConfig, *, eval_hook: Optional[Callable] = None) -> dict:
    """Run SFT per `cfg`; returns the summary dict (also written to summary.json).

    `eval_hook(model, tokenizer, step) -> dict` adds task metrics (e.g. accuracy) at eval points.
    """
    if not cfg.model:
        raise UserError("sft: `model` is required (a local HF directory or hub id)")
    if not cfg.data:
        raise UserError("sft: `data` is required (a file, a saved dataset directory, or a hub name)")
    run_path = Path(cfg.runs_dir) / cfg.name
    ckpt = latest_checkpoint(run_path) if cfg.resume else None
    seed_everything(cfg.seed)

    tokenizer = load_tokenizer(str(ckpt) if ckpt else cfg.model)
    # Data is read, validated and tokenized before the model is even loaded: bad input fails fast.
    train_ex, eval_ex, eval_prompts, report = load_sft_data(cfg, tokenizer)
    if cfg.lora_r > 0:
        # The base always comes from cfg.model; a checkpoint holds only the adapter.
        model = apply_lora(load_model(cfg.model, dtype=cfg.dtype, device=cfg.device,
                                      attn_implementation=cfg.attn_implementation), cfg, ckpt)
    else:
        model = load_model(str(ckpt) if ckpt else cfg.model, dtype=cfg.dtype, device=cfg.device,
                           attn_implementation=cfg.attn_implementation)
    device = next(model.parameters()).device
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    # Only now, with data and model known good, does the run directory get touched.
    run = RunDir(run_path, resume=ckpt is not None, log_with=cfg.log_with)
    amp = autocast_context(device, cfg.mixed_precision)

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
        save_training(run, step, model, tokenizer, optimizer, scheduler, sampler, skipped,
                      time_offset, cfg.keep_last)

    def do_eval() -> dict:
        out = {}
        if eval_ex:
            out["eval/loss"] = evaluate_loss(model, eval_ex, cfg.batch_size, tokenizer.pad_token_id,
                                             device, amp)
        if cfg.num_samples and eval_prompts:
            prompts = eval_prompts[:cfg.num_samples]
            # Sampling uses its own seeded RNG so evaluating never shifts the training RNG stream
            # (a resumed run must see the same random numbers as an uninterrupted one).
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(cfg.seed + step)
                comps = generate(model, tokenizer, prompts, cfg.sample_max_new_tokens,
                                 do_sample=True, temperature=1.0)
            run.add_samples(step, [{"prompt": p, "completion": c} for p, c in zip(prompts, comps)])
        if eval_hook is not None:
            out.update(eval_hook(model, tokenizer, step))
        return out

    bar = Progress(total_steps, step, cfg.name, enabled=cfg.progress and run.is_main)
    timer, tokens_since, steps_since = Timer(), 0, 0
    last: dict = {}
    while step < total_steps:
        idx = sampler.next()
        micro = [idx[i:i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]
        batches = [pad_batch([train_ex[j] for j in m], tokenizer.pad_token_id) for m in micro]
        n_total = sum(int(b["completion_mask"][:, 1:].sum()) for b in batches)
        loss_sum = 0.0
        for b in batches:
            part, _ = _micro_loss(model, b, device, amp)
            (part / max(n_total, 1)).backward()
            loss_sum += float(part.detach())
        loss = loss_sum / max(n_total, 1)
        try:
            grad_norm = guarded_step(model, optimizer, scheduler, cfg.max_grad_norm, loss)
        except NonFiniteLossError:
            skipped += 1
            grad_norm = float("nan")
        step += 1
        tokens_since += sum(int(b["attention_mask"].sum()) for b in batches)
        steps_since += 1
        last = {"loss": loss, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0]}
        if step % cfg.log_every == 0 or step == total_steps:
            dt = timer.lap()
            run.log(step, {**last, "epoch": sampler.epoch, "skipped_steps": skipped,
                           "step_time": dt / steps_since, "tokens_per_second": tokens_since / dt},
                    time_offset=time_offset)
            tokens_since, steps_since = 0, 0
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
            run.log(step, do_eval(), time_offset=time_offset)
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            checkpoint()
        bar.update({"loss": loss, "lr": last["lr"]})
    bar.close()

    final_eval = do_eval()
    run.log(step, final_eval, time_offset=time_offset)
    checkpoint()
    summary = {"steps": step, "train_examples": len(train_ex), "eval_examples": len(eval_ex),
               "final_loss": last.get("loss"), "skipped_steps": skipped, "data": report,
               "checkpoint": str(run.checkpoint_dir(step)), **final_eval}
    run.write_summary(summary)
    if run.is_main:
        plot_metrics(run.path)
    run.close()
    return summary
