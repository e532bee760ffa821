"""Online RL, the critic-free family: GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++ (+ GSPO, clip-higher).

The loop, top to bottom (docs/grpo.md):
    load model (+ a frozen reference copy when beta > 0) + tokenizer -> load and encode prompt rows
    -> for each step: draw `batch_size` prompts, sample `num_generations` completions of each
       (tether.rollout: exact per-token log-probs come with the tokens)
    -> score every completion with the reward functions (weighted sum; None = skipped)
    -> advantages from the registry (tether.objectives.ADVANTAGE_ESTIMATORS), within each group
    -> `num_iterations` (μ) optimizer updates on that batch with the clipped surrogate
       (objectives.policy_loss), + β·k3 KL to the reference in the loss
    -> log (TRL's metric names) / samples / checkpoint (exactly resumable).

Old log-probs: with μ = 1 the ratio's denominator is the sampler's own log-probs (same weights,
so the ratio is 1 up to the training–inference mismatch, which is logged); with μ > 1 one
no-grad forward before the first update recomputes them, so later updates are importance-weighted
against exactly what the trainer computed.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

import torch

from tether.data import encode_prompts, load_data
from tether.errors import NonFiniteLossError, UserError
from tether.models import load_model, load_tokenizer
from tether.objectives import (ADVANTAGE_ESTIMATORS, compute_advantages, entropy_from_logits,
                               group_stats, policy_loss, token_logps)
from tether.plots import plot_metrics
from tether.rollout import Sampler, SamplingConfig, logprob_mismatch
from tether.run import RunDir, latest_checkpoint, seed_everything
from tether.trainers.common import (EpochSampler, Progress, autocast_context, guarded_step,
                                    make_optimizer, make_scheduler, restore_training,
                                    save_training)

RewardFn = Callable[..., list]


@dataclass
class GRPOConfig:
    model: str = ""
    "policy to train: a local HF directory or a hub id (also the frozen reference when beta > 0)"
    data: str = ""
    "prompt-only data: a `prompt` column (+ extra columns, passed to reward functions by name)"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    reward_funcs: list[str] = field(default_factory=list)
    "reward functions: built-in names (math, arithmetic, format, length_penalty, code) or 'module:function'"
    reward_weights: list[float] = field(default_factory=list)
    "weight of each reward function (default: all 1.0)"
    name: str = "grpo"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: str = "runs"
    "parent directory of run directories"
    max_prompt_length: int = 512
    "longest prompt in tokens (longer ones keep their end, or are dropped per `truncation`)"
    truncation: Literal["truncate", "drop"] = "truncate"
    "what to do with a prompt over max_prompt_length"
    batch_size: int = 8
    "prompts per step (each gets num_generations completions)"
    num_generations: int = 8
    "completions sampled per prompt: the group the advantages are relative to"
    max_new_tokens: int = 256
    "most tokens generated per completion"
    temperature: float = 1.0
    "sampling temperature; log-probs (sampler and trainer) are taken at this temperature"
    top_p: float = 1.0
    "nucleus sampling (1 = off); note the trained log-probs are then over the full vocabulary"
    top_k: int = 0
    "top-k sampling (0 = off)"
    stop: list[str] = field(default_factory=list)
    "stop strings ending a completion (besides EOS)"
    advantage: Literal["grpo", "dr_grpo", "rloo", "remax", "reinforce_pp",
                       "reinforce_pp_baseline"] = "grpo"
    "advantage estimator (objectives.ADVANTAGE_ESTIMATORS); remax costs one greedy rollout per prompt"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    "grpo only: divide by the group std, the batch std, or nothing (= dr_grpo)"
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    "loss aggregation: DAPO token-mean, GRPO seq-mean-token-mean, Dr.GRPO seq-mean-token-sum-norm (/max_new_tokens)"
    clip_low: float = 0.2
    "ε_low of the clipped ratio"
    clip_high: Optional[float] = None
    "ε_high (default ε_low; DAPO clip-higher uses 0.28)"
    importance_level: Literal["token", "sequence"] = "token"
    "per-token ratios (PPO/GRPO) or one sequence ratio (GSPO: use clip 3e-4/4e-4)"
    beta: float = 0.0
    "k3 KL-to-reference coefficient in the loss (0 = no reference model is loaded)"
    num_iterations: int = 1
    "μ: optimizer updates per sampled batch (>1 recomputes old log-probs once per batch)"
    micro_batch_size: int = 0
    "sequences per forward/backward (0 = the whole batch at once)"
    mask_truncated_completions: bool = False
    "exclude completions cut at max_new_tokens from the loss (DAPO)"
    max_steps: int = 100
    "steps (sampled batches) to run"
    lr: float = 1e-6
    "peak learning rate (AdamW)"
    weight_decay: float = 0.0
    "AdamW weight decay (never applied to norms and biases)"
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    "AdamW (beta1, beta2)"
    schedule: Literal["cosine", "linear", "constant"] = "constant"
    "learning-rate shape after warmup"
    warmup_steps: int = 0
    "linear warmup, in optimizer updates"
    max_grad_norm: float = 1.0
    "gradient clipping by global norm (0 = off)"
    dtype: str = "fp32"
    "weight dtype: fp32 | bf16 | fp16 | auto"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    "bf16 autocast on CUDA for the training forward ('auto'), forced, or off; no effect on CPU"
    device: str = "auto"
    "cuda | cpu | auto"
    attn_implementation: Optional[str] = None
    "attention kernel passed to from_pretrained (sdpa, eager, flash_attention_2)"
    gradient_checkpointing: bool = False
    "recompute activations in backward to save memory"
    log_entropy: bool = True
    "log the policy's mean token entropy over completions (one extra pass over the logits)"
    log_every: int = 1
    "write metrics every N steps"
    num_samples: int = 2
    "completions (with rewards) written to samples.jsonl at each log point"
    save_every: int = 0
    "checkpoint every N steps (0 = only at the end)"
    keep_last: int = 2
    "checkpoints to keep (older ones are deleted)"
    resume: bool = False
    "continue from the latest checkpoint in the run directory"
    seed: int = 0
    "seed for prompt order and sampling"
    log_with: Literal["none", "tensorboard"] = "none"
    "also write TensorBoard event files to <run>/tensorboard"
    progress: bool = True
    "show a progress bar with ETA and live metrics"

    def __post_init__(self):
        if self.batch_size < 1 or self.num_generations < 1 or self.num_iterations < 1:
            raise ValueError("batch_size, num_generations and num_iterations must be >= 1")
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage must be one of {sorted(ADVANTAGE_ESTIMATORS)}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (RL needs sampled completions)")
        if len(self.adam_betas) != 2:
            raise ValueError("adam_betas must be two numbers")


# ---- reward functions ---------------------------------------------------------------------------

def resolve_reward_funcs(specs: Sequence) -> list[RewardFn]:
    """Callables pass through; strings are built-in names ('math', 'arithmetic', 'format',
    'length_penalty', 'code') or 'module:function' (tether.rewards.load_reward)."""
    from tether.rewards import load_reward

    return [load_reward(s) for s in specs]


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def score(funcs: list[RewardFn], weights: list[float], rows: list[dict], texts: list[str],
          completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every function on every completion → (per-function rewards [N, F] with NaN for None,
    weighted reward [N] = Σ_f w_f r_f over the functions that scored it; NaN if none did)."""
    prompts = [r["prompt"] for r in rows]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "prompt_ids")}
    per_fn = torch.full((len(rows), len(funcs)), float("nan"))
    for j, fn in enumerate(funcs):
        try:
            out = fn(prompts=prompts, completions=texts, completion_ids=completion_ids, **columns)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise UserError(f"reward function {_fn_name(fn)!r} failed: {type(e).__name__}: {first}") from e
        if len(out) != len(rows):
            raise UserError(f"reward function {_fn_name(fn)!r} returned {len(out)} rewards "
                             f"for {len(rows)} completions")
        per_fn[:, j] = torch.tensor([float("nan") if v is None else float(v) for v in out])
    w = torch.tensor(weights, dtype=per_fn.dtype)
    scored = ~per_fn.isnan()
    total = torch.where(scored, per_fn * w, 0.0).sum(1)
    return per_fn, torch.where(scored.any(1), total, float("nan"))


# ---- one forward: per-token log-probs aligned with input_ids ------------------------------------

def _forward_logps(model, mb: dict, temperature: float, amp, want_entropy: bool = False):
    with amp:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                       position_ids=mb["position_ids"]).logits
    logps = token_logps(logits, mb["input_ids"], temperature)
    ent = None
    if want_entropy:
        with torch.no_grad():
            ent = entropy_from_logits(logits[:, :-1].detach(), mb["completion_mask"][:, 1:], temperature)
    return logps, ent


def _slices(n: int, size: int) -> list[slice]:
    size = size if size > 0 else n
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def _agg_weight(mask: torch.Tensor, sl: slice, agg: str, n_tok: int) -> float:
    """Share of the whole batch's loss carried by micro-batch `sl`, so that accumulated gradients
    equal the full-batch loss's whatever micro_batch_size is."""
    if agg == "token-mean":
        return float(mask[sl].sum()) / max(n_tok, 1)
    return (sl.stop - sl.start) / mask.shape[0]


def train_grpo(cfg: GRPOConfig, reward_funcs: Optional[Sequence] = None,
               reward_weights: Optional[Sequence[float]] = None) -> dict:
    """Run GRPO-family RL per `cfg`; returns the summary dict (also written to summary.json).

    `reward_funcs`: callables `fn(prompts, completions, completion_ids, **columns) -> list[float |
    None]` (default: cfg.reward_funcs imported). A completion no function scores is skipped: it
    takes no part in its group's statistics and gets no gradient.
    """
    if not cfg.model:
        raise UserError("grpo: `model` is required (a local HF directory or hub id)")
    if not cfg.data:
        raise UserError("grpo: `data` is required (prompt-only rows: a `prompt` column)")
    funcs = resolve_reward_funcs(reward_funcs if reward_funcs is not None else cfg.reward_funcs)
    if not funcs:
        raise UserError("grpo: at least one reward function is required (reward_funcs=module:function)")
    weights = list(reward_weights if reward_weights is not None else cfg.reward_weights) or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise UserError(f"grpo: {len(weights)} reward_weights for {len(funcs)} reward functions")
    names = [_fn_name(f) for f in funcs]

    run_path = Path(cfg.runs_dir) / cfg.name
    ckpt = latest_checkpoint(run_path) if cfg.resume else None
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(str(ckpt) if ckpt else cfg.model)
    rows, report = encode_prompts(load_data(cfg.data, expect="prompt-only", split=cfg.split),
                                  tokenizer, cfg.max_prompt_length, cfg.truncation, source=cfg.data)
    if not rows:
        raise UserError(f"grpo: no prompts left in {cfg.data} after encoding")
    model = load_model(str(ckpt) if ckpt else cfg.model, dtype=cfg.dtype, device=cfg.device,
                       attn_implementation=cfg.attn_implementation)
    device = next(model.parameters()).device
    ref_model = None
    if cfg.beta > 0:  # the reference is the *initial* policy, also on resume
        ref_model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device,
                               attn_implementation=cfg.attn_implementation) if ckpt else copy.deepcopy(model)
        ref_model.eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    run = RunDir(run_path, resume=ckpt is not None, log_with=cfg.log_with)
    amp = autocast_context(device, cfg.mixed_precision)

    updates = cfg.max_steps * cfg.num_iterations
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, betas=tuple(cfg.adam_betas))
    scheduler = make_scheduler(optimizer, cfg.schedule, cfg.warmup_steps, updates)
    prompt_order = EpochSampler(len(rows), cfg.batch_size, cfg.seed)
    sampler = Sampler(model, tokenizer, SamplingConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, stop=list(cfg.stop)))

    step, time_offset, skipped = 0, 0.0, 0
    if ckpt:
        step, time_offset, skipped = restore_training(ckpt, run, optimizer, scheduler, prompt_order)
    run.write_config(cfg)

    def checkpoint():
        save_training(run, step, model, tokenizer, optimizer, scheduler, prompt_order, skipped,
                      time_offset, cfg.keep_last)

    G = cfg.num_generations
    bar = Progress(cfg.max_steps, step, cfg.name, enabled=cfg.progress and run.is_main)
    history: list[float] = []
    last: dict = {}
    while step < cfg.max_steps:
        t_step = time.perf_counter()
        # 1. sample: G completions per prompt; the seed is a function of (seed, step) so a resumed
        #    run draws the same completions as an uninterrupted one.
        batch_rows = [rows[i] for i in prompt_order.next()]
        ro = sampler.sample([r["prompt_ids"] for r in batch_rows], n=G,
                            seed=cfg.seed * 1_000_003 + step)
        seq_rows = [batch_rows[i // G] for i in range(len(ro))]
        comp_ids = [ids[m].tolist() for ids, m in zip(ro.completion_ids, ro.completion_mask)]

        # 2. score (None = skipped: such a completion leaves its group and the loss)
        per_fn, rewards = score(funcs, weights, seq_rows, ro.texts, comp_ids)
        valid = ~rewards.isnan()
        tb = {k: v.to(device) for k, v in ro.training_batch().items()}
        mask = tb["completion_mask"] & valid.to(device).unsqueeze(1)
        truncated = torch.tensor([f == "length" for f in ro.finish_reasons])
        if cfg.mask_truncated_completions:
            mask &= ~truncated.to(device).unsqueeze(1)

        # 3. advantages within each prompt's group, over the scored completions only
        adv = torch.zeros(len(ro), mask.shape[1], device=device)
        if valid.any():
            kw = {"scale": cfg.scale_rewards} if cfg.advantage == "grpo" else {}
            if cfg.advantage == "remax":
                greedy = sampler.sample([r["prompt_ids"] for r in batch_rows], n=1, temperature=0.0)
                g_ids = [ids[m].tolist() for ids, m in zip(greedy.completion_ids, greedy.completion_mask)]
                kw["greedy_rewards"] = torch.nan_to_num(
                    score(funcs, weights, batch_rows, greedy.texts, g_ids)[1])[ro.group][valid]
            a = compute_advantages(cfg.advantage, rewards[valid].to(device), ro.group[valid].to(device),
                                   mask[valid.to(device)], **kw)
            adv[valid.to(device)] = (a.unsqueeze(1) if a.dim() == 1 else a).expand(-1, mask.shape[1]).float()

        # 4. old / reference log-probs (no grad)
        parts = _slices(len(ro), cfg.micro_batch_size)
        n_tok = int(mask.sum())
        with torch.no_grad():
            old = tb["logprobs"]
            if cfg.num_iterations > 1:
                old = torch.cat([_forward_logps(model, {k: v[s] for k, v in tb.items()},
                                                ro.logprob_temperature, amp)[0].float() for s in parts])
            ref = None
            if ref_model is not None:
                ref = torch.cat([_forward_logps(ref_model, {k: v[s] for k, v in tb.items()},
                                                ro.logprob_temperature, amp)[0].float() for s in parts])

        # 5. μ updates on this batch
        stats: dict[str, float] = {}
        for it in range(cfg.num_iterations):
            acc: dict[str, float] = {}
            loss_value, train_logps, ents = 0.0, [], []
            for s in parts:
                mb = {k: v[s] for k, v in tb.items()}
                logps, ent = _forward_logps(model, mb, ro.logprob_temperature, amp,
                                            want_entropy=cfg.log_entropy and it == 0)
                loss, m = policy_loss(logps, old[s], adv[s], mask[s], clip_low=cfg.clip_low,
                                      clip_high=cfg.clip_high, agg=cfg.loss_agg,
                                      ref_logps=None if ref is None else ref[s], beta=cfg.beta,
                                      importance_level=cfg.importance_level,
                                      norm_length=cfg.max_new_tokens)
                w = _agg_weight(mask, s, cfg.loss_agg, n_tok)
                (loss * w).backward()
                loss_value += float(loss.detach()) * w
                for k, v in m.items():
                    acc[k] = acc.get(k, 0.0) + float(v) * w
                if it == 0:
                    train_logps.append(logps.detach())
                    if ent is not None:
                        ents.append(float(ent) * w)
            try:
                grad_norm = guarded_step(model, optimizer, scheduler, cfg.max_grad_norm, loss_value)
            except NonFiniteLossError:
                skipped += 1
                grad_norm = float("nan")
            if it == 0:
                stats.update(logprob_mismatch(tb["logprobs"], torch.cat(train_logps), mask))
                if ents:
                    stats["entropy"] = sum(ents)
            stats.update({**acc, "loss": loss_value, "grad_norm": grad_norm})
        step += 1

        # 6. metrics, TRL's names
        gs = group_stats(torch.nan_to_num(rewards[valid]), ro.group[valid]) if valid.any() else None
        lengths = ro.lengths.float()
        dt = time.perf_counter() - t_step
        mean_reward = float(rewards[valid].mean()) if valid.any() else float("nan")
        history.append(mean_reward)
        last = {"reward": mean_reward,
                "reward_std": float(gs["std"].mean()) if gs else float("nan"),
                "frac_reward_zero_std": float(gs["constant"].float().mean()) if gs else float("nan"),
                **{f"rewards/{n}/mean": float(per_fn[:, j].nanmean()) for j, n in enumerate(names)},
                "frac_skipped": float((~valid).float().mean()),
                "completions/mean_length": float(lengths.mean()),
                "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(truncated.float().mean()),
                **stats, "lr": scheduler.get_last_lr()[0], "skipped_steps": skipped,
                "epoch": prompt_order.epoch, "step_time": dt,
                "tokens_per_second": float(lengths.sum()) / dt,
                "rollout/tokens_per_second": ro.stats.get("tokens_per_s", 0.0),
                "rollout/seconds": ro.stats.get("total_s", 0.0)}
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            run.log(step, last, time_offset=time_offset)
            run.add_samples(step, [{"prompt": seq_rows[i]["prompt"], "completion": ro.texts[i],
                                    "reward": None if not valid[i] else float(rewards[i])}
                                   for i in range(min(cfg.num_samples, len(ro)))])
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            checkpoint()
        bar.update({"reward": mean_reward, "kl": last.get("kl", 0.0)})
    bar.close()

    checkpoint()
    summary = {"steps": step, "prompts": len(rows), "skipped_steps": skipped,
               "data": {"summary": report.summary(), "rows": report.total,
                        "truncated": report.truncated, "dropped": report.dropped},
               "final_reward": last.get("reward"), "reward_history": history,
               "checkpoint": str(run.checkpoint_dir(step))}
    run.write_summary(summary)
    if run.is_main:
        plot_metrics(run.path)
    run.close()
    return summary


# ---- the quickstart's stage 3 --------------------------------------------------------------------

def quickstart_stage(qcfg, model_path: str, root: Path) -> dict:
    """GRPO on the arithmetic task's *training* problems from the SFT checkpoint, rewarded by the
    exact-match verifier; scored by greedy pass@1 on the held-out problems."""
    import json

    from tether.quickstart import accuracy
    from tether.tasks import arithmetic

    t0 = time.time()
    train, test = arithmetic.make_splits(qcfg.n_train, qcfg.n_test, qcfg.level, qcfg.seed)
    data = Path(root) / "data" / "rl.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    with open(data, "w", encoding="utf-8") as f:
        for p in train[:qcfg.rl_prompts]:
            f.write(json.dumps(arithmetic.rl_example(p)) + "\n")

    def verifier(prompts, completions, completion_ids, answer, **_):
        return [arithmetic.check_answer(c, a) for c, a in zip(completions, answer)]

    cfg = GRPOConfig(model=model_path, data=str(data), name=f"{qcfg.name}/rl", runs_dir=qcfg.runs_dir,
                     batch_size=qcfg.rl_batch_size, num_generations=qcfg.rl_generations,
                     max_new_tokens=qcfg.max_new_tokens, temperature=qcfg.rl_temperature,
                     max_steps=qcfg.rl_steps, lr=qcfg.rl_lr, beta=qcfg.rl_beta, advantage="grpo",
                     warmup_steps=qcfg.rl_warmup_steps, schedule="cosine",
                     loss_agg="token-mean", device="cpu", seed=qcfg.seed, log_every=5,
                     adam_betas=[0.9, 0.99], progress=qcfg.progress, log_entropy=False)
    out = train_grpo(cfg, reward_funcs=[verifier])
    model, tok = load_model(out["checkpoint"], device="cpu"), load_tokenizer(out["checkpoint"])
    acc, _ = accuracy(model, tok, test, qcfg.max_new_tokens)
    return {"accuracy": acc, "seconds": round(time.time() - t0, 1), "model": out["checkpoint"]}
