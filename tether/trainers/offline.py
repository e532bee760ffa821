"""Offline preference optimization: DPO (+ cDPO, rDPO, IPO, hinge), KTO, SimPO, ORPO (docs/dpo.md).

The loop, top to bottom:
    load tokenizer -> load, validate and tokenize pairs (or KTO's unpaired rows; errors before any
       model is loaded) -> load the policy
    -> reference log-probs of every example, computed once and cached in the run directory: at
       step 0 the policy *is* the reference, so a fresh run needs no second model; a resumed run
       reads the cache (LoRA without a cache: the base with adapters disabled). SimPO and ORPO
       have no reference.
    -> for each optimizer step: draw a batch, split into micro-batches; chosen and rejected go
       through the policy in one concatenated forward; per-sequence log-probs -> the method's pure
       loss (tether.objectives.preference) -> backward; KTO first estimates its reference point
       z0 from mismatched prompt/completion pairs (no grad); clip, step (finite-checked)
    -> log (TRL's metric names) / held-out implicit-reward accuracy / checkpoint (exact resume).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from tether.errors import NonFiniteLossError, UserError
from tether.models import load_model, load_tokenizer
from tether.objectives import (kto_kl_reference_point, kto_loss, orpo_loss, preference_loss,
                               simpo_loss)
from tether.plots import plot_metrics
from tether.run import RunDir, latest_checkpoint, seed_everything
from tether.models.logprobs import completion_token_logps
from tether.trainers.common import (EpochSampler, Progress, Timer, autocast_context, guarded_step, make_optimizer, make_scheduler, restore_training, save_training)
from tether.trainers.offline_data import (cache_fingerprint, collate, collate_mismatched,
                                          kl_partners, load_cache, load_offline_data, save_cache)

METHODS = ("dpo", "kto", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass
class OfflineConfig:
    method: Literal["dpo", "kto", "simpo", "orpo"] = "dpo"
    "dpo (pairs, reference) | kto (unpaired labels, reference) | simpo, orpo (pairs, no reference)"
    loss: Literal["sigmoid", "robust", "ipo", "hinge"] = "sigmoid"
    "dpo only: sigmoid (DPO; cDPO with label_smoothing > 0), robust (rDPO), ipo, hinge (SLiC)"
    beta: float = 0.1
    "β: DPO/IPO/hinge/KTO temperature, SimPO's reward scale, ORPO's λ (weight of the odds-ratio term)"
    label_smoothing: float = 0.0
    "ε: assumed label-flip rate for sigmoid (cDPO), robust (rDPO, < 0.5) and simpo"
    gamma_beta_ratio: float = 0.5
    "simpo only: target margin as γ/β (the paper's γ = gamma_beta_ratio · beta)"
    desirable_weight: float = 1.0
    "kto only: λ_D, weight of desirable examples"
    undesirable_weight: float = 1.0
    "kto only: λ_U, weight of undesirable examples"
    model: str = ""
    "policy to train: a local HF directory or a hub id (also the reference unless ref_model is set)"
    ref_model: Optional[str] = None
    "reference model (default: the initial policy); only read when its log-probs are not cached"
    data: str = ""
    "preference data (prompt, chosen, rejected); kto also takes unpaired (prompt, completion, label)"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    eval_data: Optional[str] = None
    "held-out data in the same format (default: carve eval_fraction out of `data`)"
    eval_fraction: float = 0.0
    "fraction of `data` held out for eval when eval_data is not given"
    name: str = "dpo"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: str = "runs"
    "parent directory of run directories"
    max_length: int = 1024
    "longest prompt + response in tokens (longer: response end cut, or row dropped; both counted)"
    max_prompt_length: Optional[int] = None
    "longest prompt in tokens (longer ones keep their end); null = only max_length applies"
    truncation: Literal["truncate", "drop"] = "truncate"
    "what to do with an example over max_length: cut the responses' ends, or drop it"
    batch_size: int = 8
    "pairs (kto: rows) per micro-batch"
    grad_accum: int = 1
    "micro-batches per optimizer step (effective batch = batch_size * grad_accum)"
    max_steps: int = -1
    "optimizer steps to run; -1 = derive from epochs"
    epochs: float = 1.0
    "passes over the data when max_steps is -1"
    lr: float = 1e-6
    "peak learning rate (AdamW)"
    weight_decay: float = 0.0
    "AdamW weight decay (never applied to norms and biases)"
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    "AdamW (beta1, beta2)"
    schedule: Literal["cosine", "linear", "constant"] = "linear"
    "learning-rate shape after warmup"
    warmup_steps: int = 0
    "linear warmup steps (0 = use warmup_ratio)"
    warmup_ratio: float = 0.1
    "warmup as a fraction of all steps when warmup_steps is 0"
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
    "write metrics (means over the steps since the last write) every N optimizer steps"
    eval_every: int = 0
    "evaluate on held-out data every N steps (0 = only at the end)"
    save_every: int = 0
    "checkpoint every N steps (0 = only at the end)"
    keep_last: int = 2
    "checkpoints to keep (older ones are deleted)"
    resume: bool = False
    "continue from the latest checkpoint in the run directory (reference log-probs from the cache)"
    seed: int = 0
    "seed for data order and the held-out split"
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
        if self.beta <= 0:
            raise ValueError("beta must be > 0")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError("label_smoothing must be in [0, 0.5)")


# Presets: the four commands. Defaults follow the papers / TRL for real models.
@dataclass
class DPOConfig(OfflineConfig):
    method: Literal["dpo", "kto", "simpo", "orpo"] = "dpo"
    name: str = "dpo"


@dataclass
class KTOConfig(OfflineConfig):
    method: Literal["dpo", "kto", "simpo", "orpo"] = "kto"
    name: str = "kto"


@dataclass
class SimPOConfig(OfflineConfig):
    method: Literal["dpo", "kto", "simpo", "orpo"] = "simpo"
    name: str = "simpo"
    beta: float = 2.0  # SimPO paper: β ∈ [2, 10], γ/β ∈ [0.3, 0.8]; TRL's CPO simpo default 2 / 0.5
    lr: float = 1e-6


@dataclass
class ORPOConfig(OfflineConfig):
    method: Literal["dpo", "kto", "simpo", "orpo"] = "orpo"
    name: str = "orpo"
    beta: float = 0.1  # λ in Hong et al. 2024
    lr: float = 8e-6  # ORPO trains from the base (it includes SFT): larger lr, as in the paper


# ---- the policy's per-sequence log-probs -----------------------------------------------------------

def completion_logps(model, batch: dict, device, amp) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-prob [R], completion length [R]) for every row of a padded batch.

    Only completion positions get logits (`common.completion_token_logps`: the LM head over the
    completion tokens, chunked when the logits are large), which saves the LM head's matmul and the
    largest activation on the prompt part.
    """
    on = {k: batch[k].to(device, non_blocking=True) for k in ("input_ids", "attention_mask", "completion_mask")}
    logps, _ = completion_token_logps(model, on, 1.0, amp)  # 0 outside the completions
    return logps.sum(-1).float(), on["completion_mask"][:, 1:].sum(-1).float()


# ---- the objective: per-sequence numbers -> the method's pure loss ---------------------------------

def objective(cfg, pol: dict, ref: Optional[dict], z0=None):
    """The method's loss and metrics. `pol` / `ref`: per-sequence summed log-probs — pairs
    {"chosen", "rejected", "chosen_len", "rejected_len"}, unpaired {"completion", "label"}."""
    if "completion" in pol:  # KTO
        loss, m = kto_loss(pol["completion"], ref["completion"], pol["label"], z0, cfg.beta,
                           cfg.desirable_weight, cfg.undesirable_weight)
        d = pol["label"]
        lp = pol["completion"].detach()
        m = {**m, "logps/chosen": lp[d].mean(), "logps/rejected": lp[~d].mean(),
             "rewards/margins": m["rewards/chosen"] - m["rewards/rejected"]}
        # a group absent from the batch has no mean: drop it rather than log a fake 0
        for side in ("chosen", "rejected"):
            if int(m[f"count/{side}"]) == 0:
                for k in (f"rewards/{side}", f"logps/{side}", "rewards/margins"):
                    m.pop(k, None)
        return loss, m
    pc, pr = pol["chosen"], pol["rejected"]
    avg_c, avg_r = pc / pol["chosen_len"].clamp(min=1), pr / pol["rejected_len"].clamp(min=1)
    if cfg.method == "dpo" and cfg.loss == "ipo":
        # IPO's authors (and TRL) use length-averaged log-probs, for the policy and the reference
        loss, m = preference_loss(avg_c, avg_r, ref["chosen"] / pol["chosen_len"].clamp(min=1),
                                  ref["rejected"] / pol["rejected_len"].clamp(min=1), cfg.beta, "ipo")
    elif cfg.method in ("dpo", "kto"):  # kto here: held-out pairs, scored with the same implicit reward
        loss, m = preference_loss(pc, pr, ref["chosen"], ref["rejected"], cfg.beta,
                                  cfg.loss if cfg.method == "dpo" else "sigmoid", cfg.label_smoothing)
    elif cfg.method == "simpo":
        loss, m = simpo_loss(avg_c, avg_r, cfg.beta, cfg.gamma_beta_ratio * cfg.beta, cfg.label_smoothing)
    else:  # orpo: NLL of the chosen answer, per sequence (token mean), + λ · odds-ratio term
        loss, m = orpo_loss(avg_c, avg_r, -avg_c, cfg.beta)
        m["rewards/margins"] = m["rewards/chosen"] - m["rewards/rejected"]
    m.setdefault("logps/chosen", pc.detach().mean())
    m.setdefault("logps/rejected", pr.detach().mean())
    return loss, m


def split_rows(cfg, paired: bool, examples: list[dict], logps, lens, ref_all: Optional[dict],
               prefix: str) -> tuple[dict, Optional[dict]]:
    """Per-sequence tensors of one forward, split into the objective's named inputs."""
    idx = torch.tensor([ex["idx"] for ex in examples])
    if paired:
        B = len(examples)
        pol = {"chosen": logps[:B], "rejected": logps[B:], "chosen_len": lens[:B], "rejected_len": lens[B:]}
        keys = ("chosen", "rejected")
    else:
        pol = {"completion": logps, "label": torch.tensor([ex["label"] for ex in examples], device=logps.device)}
        keys = ("completion",)
    ref = None
    if ref_all is not None:
        ref = {k: ref_all[f"{prefix}.{k}"][idx].to(logps.device) for k in keys}
    return pol, ref


def _cat(parts: list[dict]) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# ---- reference log-probs: once per run ----------------------------------------------------------

@torch.no_grad()
def reference_logps(net, splits: dict, paired: dict, cfg, pad_id: int, device, amp) -> dict:
    """Summed completion log-probs of every example of every split under `net` (eval mode)."""
    was = net.training
    net.eval()
    out = {}
    for name, examples in splits.items():
        if not examples:
            continue
        parts: dict[str, list] = {}
        partners = None if paired[name] else kl_partners(len(examples))
        for i in range(0, len(examples), cfg.batch_size):
            chunk = examples[i:i + cfg.batch_size]
            lp, _ = completion_logps(net, collate(chunk, paired[name], pad_id), device, amp)
            if paired[name]:
                parts.setdefault("chosen", []).append(lp[:len(chunk)])
                parts.setdefault("rejected", []).append(lp[len(chunk):])
            else:
                parts.setdefault("completion", []).append(lp)
                kl = collate_mismatched(chunk, examples, partners, pad_id, cfg.max_length)
                parts.setdefault("kl", []).append(completion_logps(net, kl, device, amp)[0])
        out.update({f"{name}.{k}": torch.cat(v).cpu() for k, v in parts.items()})
    net.train(was)
    return out


def get_reference(cfg, run_path: Path, model, fresh: bool, splits: dict, paired: dict, pad_id,
                  device, amp) -> tuple[dict, str]:
    """The cached reference log-probs, computing (and caching) them if needed. Returns (tensors,
    where they came from)."""
    ref_source = cfg.ref_model or cfg.model
    precision = f"{cfg.dtype}/{cfg.mixed_precision if device.type == 'cuda' else 'no'}/{device.type}"
    fp = cache_fingerprint(ref_source, splits, precision)
    cached = load_cache(run_path, fp)
    if cached is not None:
        return cached, "cache"
    if fresh and not cfg.ref_model:
        # Step 0: the policy is the initial model, i.e. the reference (LoRA: B = 0, adapters are a no-op).
        tensors, how = reference_logps(model, splits, paired, cfg, pad_id, device, amp), "policy at step 0"
    elif cfg.lora_r > 0 and not cfg.ref_model:
        with model.disable_adapter():
            tensors = reference_logps(model, splits, paired, cfg, pad_id, device, amp)
        how = "base with adapters disabled"
    else:
        net = load_model(ref_source, dtype=cfg.dtype, device=cfg.device,
                         attn_implementation=cfg.attn_implementation)
        tensors, how = reference_logps(net, splits, paired, cfg, pad_id, device, amp), "reference model"
        del net  # not held during training
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save_cache(run_path, tensors, fp, {"reference": ref_source, "computed_with": how,
                                       "rows": {k: len(v) for k, v in splits.items()}})
    return tensors, how


# ---- one optimizer step ---------------------------------------------------------------------------

def train_step(cfg, model, optimizer, scheduler, micro: list[list[dict]], paired: bool,
               ref_all: Optional[dict], pad_id: int, device, amp,
               kl_pool: Optional[list[dict]] = None, partners: Optional[list[int]] = None) -> dict:
    """Forward/backward every micro-batch, then one guarded optimizer step. Returns the metrics
    (loss, method metrics, grad_norm, tokens) or raises NonFiniteLossError (step skipped)."""
    n_total = sum(len(m) for m in micro)
    z0 = None
    if cfg.method == "kto":
        # Reference point from mismatched pairs under the current policy, no grad (it is detached
        # in the loss anyway). Under data parallelism this mean would be all-reduced across ranks.
        with torch.no_grad():
            kl = torch.cat([completion_logps(model, collate_mismatched(m, kl_pool, partners, pad_id,
                                                                       cfg.max_length), device, amp)[0]
                            for m in micro])
        ref_kl = ref_all["train.kl"][torch.tensor([ex["idx"] for m in micro for ex in m])].to(device)
        z0 = kto_kl_reference_point(kl, ref_kl)
    pols, refs, tokens = [], [], 0
    for m in micro:
        batch = collate(m, paired, pad_id)
        tokens += int(batch["attention_mask"].sum())
        logps, lens = completion_logps(model, batch, device, amp)
        pol, ref = split_rows(cfg, paired, m, logps, lens, ref_all, "train")
        loss, _ = objective(cfg, pol, ref, z0)
        # batch-mean losses: weight each micro-batch by its share, so accumulation = one big batch
        (loss * (len(m) / n_total)).backward()
        pols.append({k: v.detach() for k, v in pol.items()})
        refs.append(ref)
    loss, metrics = objective(cfg, _cat(pols), None if refs[0] is None else _cat(refs), z0)
    loss = float(loss)
    grad_norm = guarded_step(model, optimizer, scheduler, cfg.max_grad_norm, loss)
    return {"loss": loss, **{k: float(v) for k, v in metrics.items()}, "grad_norm": grad_norm,
            "tokens": tokens}


@torch.no_grad()
def evaluate(cfg, model, examples: list[dict], paired: bool, ref_all, pad_id, device, amp) -> dict:
    """Held-out metrics over the whole eval set: implicit-reward accuracy and margins."""
    was = model.training
    model.eval()
    pols, refs = [], []
    for i in range(0, len(examples), cfg.batch_size):
        chunk = examples[i:i + cfg.batch_size]
        logps, lens = completion_logps(model, collate(chunk, paired, pad_id), device, amp)
        pol, ref = split_rows(cfg, paired, chunk, logps, lens, ref_all, "eval")
        pols.append(pol)
        refs.append(ref)
    model.train(was)
    pol, ref = _cat(pols), None if refs[0] is None else _cat(refs)
    if not paired:  # unpaired held-out rows: reward means per label (z0 does not enter them)
        loss, m = objective(cfg, pol, ref, 0.0)
        m = {k: v for k, v in m.items() if k != "kl"}
    else:
        loss, m = objective(cfg, pol, ref)
    return {"eval/loss": float(loss), **{f"eval/{k}": float(v) for k, v in m.items()}}


# ---- the run -------------------------------------------------------------------------------------

def train_offline(cfg: OfflineConfig) -> dict:
    """Run DPO / KTO / SimPO / ORPO per `cfg`; returns the summary (also written to summary.json),
    whose `model` is the final checkpoint's path (the adapter's under LoRA)."""
    if cfg.method not in METHODS:
        raise UserError(f"method must be one of {', '.join(METHODS)}; got {cfg.method!r}")
    if not cfg.model:
        raise UserError(f"{cfg.method}: `model` is required (a local HF directory or hub id)")
    if not cfg.data:
        raise UserError(f"{cfg.method}: `data` is required (preference rows: prompt, chosen, rejected)")
    run_path = Path(cfg.runs_dir) / cfg.name
    ckpt = latest_checkpoint(run_path) if cfg.resume else None
    seed_everything(cfg.seed)

    tokenizer = load_tokenizer(str(ckpt) if ckpt else cfg.model)
    pad_id = tokenizer.pad_token_id
    # Data is read, validated and tokenized before the model is loaded: bad input fails fast.
    train_ex, eval_ex, paired, eval_paired, report = load_offline_data(cfg, tokenizer)
    if cfg.lora_r > 0:
        from tether.models.lora import apply_lora  # the base always comes from cfg.model
        model = apply_lora(load_model(cfg.model, dtype=cfg.dtype, device=cfg.device,
                                      attn_implementation=cfg.attn_implementation), cfg, ckpt)
    else:
        model = load_model(str(ckpt) if ckpt else cfg.model, dtype=cfg.dtype, device=cfg.device,
                           attn_implementation=cfg.attn_implementation)
    device = next(model.parameters()).device
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    run = RunDir(run_path, resume=ckpt is not None, log_with=cfg.log_with)
    amp = autocast_context(device, cfg.mixed_precision)

    ref_all, ref_from = None, "none (reference-free)"
    if cfg.method not in REFERENCE_FREE:
        ref_all, ref_from = get_reference(cfg, run_path, model, ckpt is None,
                                          {"train": train_ex, "eval": eval_ex},
                                          {"train": paired, "eval": eval_paired}, pad_id, device, amp)
    model.train()

    per_step = cfg.batch_size * cfg.grad_accum
    total_steps = cfg.max_steps if cfg.max_steps > 0 else \
        max(1, math.ceil(cfg.epochs * len(train_ex) / per_step))
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, betas=tuple(cfg.adam_betas))
    scheduler = make_scheduler(optimizer, cfg.schedule, warmup, total_steps)
    sampler = EpochSampler(len(train_ex), per_step, cfg.seed)
    step, time_offset, skipped = 0, 0.0, 0
    if ckpt:
        step, time_offset, skipped = restore_training(ckpt, run, optimizer, scheduler, sampler)
    run.write_config(cfg)

    def checkpoint():
        return save_training(run, step, model, tokenizer, optimizer, scheduler, sampler, skipped,
                             time_offset, cfg.keep_last)

    def do_eval() -> dict:
        if not eval_ex:
            return {}
        return evaluate(cfg, model, eval_ex, eval_paired, ref_all, pad_id, device, amp)

    partners = kl_partners(len(train_ex)) if cfg.method == "kto" else None
    bar = Progress(total_steps, step, cfg.name, enabled=cfg.progress and run.is_main)
    timer, acc, n_acc, tokens_since = Timer(), {}, 0, 0
    last: dict = {}
    while step < total_steps:
        idx = sampler.next()
        micro = [[train_ex[j] for j in idx[i:i + cfg.batch_size]] for i in range(0, len(idx), cfg.batch_size)]
        try:
            out = train_step(cfg, model, optimizer, scheduler, micro, paired, ref_all, pad_id, device,
                             amp, kl_pool=train_ex, partners=partners)
        except NonFiniteLossError:
            skipped += 1
            out = {"loss": float("nan"), "grad_norm": float("nan"), "tokens": 0}
        step += 1
        tokens_since += out.pop("tokens")
        n_acc += 1
        for k, v in out.items():  # metrics are means over the steps since the last write
            acc[k] = acc.get(k, 0.0) + v
        last = out
        if step % cfg.log_every == 0 or step == total_steps:
            dt = timer.lap()
            run.log(step, {**{k: v / n_acc for k, v in acc.items()}, "lr": scheduler.get_last_lr()[0],
                           "epoch": sampler.epoch, "skipped_steps": skipped,
                           "step_time": dt / n_acc, "tokens_per_second": tokens_since / dt},
                    time_offset=time_offset)
            acc, n_acc, tokens_since = {}, 0, 0
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
            run.log(step, do_eval(), time_offset=time_offset)
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            checkpoint()
        bar.update({"loss": out["loss"], "acc": out.get("rewards/accuracies", float("nan"))})
    bar.close()

    final_eval = do_eval()
    run.log(step, final_eval, time_offset=time_offset)
    path = checkpoint()
    summary = {"method": cfg.method, "loss_type": cfg.loss if cfg.method == "dpo" else cfg.method,
               "steps": step, "train_examples": len(train_ex), "eval_examples": len(eval_ex),
               "final_loss": last.get("loss"), "skipped_steps": skipped, "reference": ref_from,
               "data": report, "model": str(path), "checkpoint": str(path),
               "train": {k: v for k, v in last.items() if k.startswith(("rewards/", "logps/", "kl"))},
               **final_eval}
    run.write_summary(summary)
    if run.is_main:
        plot_metrics(run.path)
    run.close()
    return summary
