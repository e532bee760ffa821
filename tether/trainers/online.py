"""Online RL, the critic-free family: GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++ (+ GSPO, clip-higher).

The loop, top to bottom (docs/grpo.md):
    load model (+ LoRA adapters) + the reference when beta > 0 (a frozen copy; under LoRA the same
       model with its adapters disabled) + tokenizer -> load and encode prompt rows
    -> for each step: draw `batch_size` prompts, sample `num_generations` completions of each
       (tether.rollout: exact per-token log-probs come with the tokens)
    -> score every completion with the reward functions (weighted sum; None = skipped), + DAPO's
       overlong shaping; with dynamic sampling drop zero-variance groups and refill (online_sampling)
    -> advantages from the registry (tether.objectives.ADVANTAGE_ESTIMATORS), within each group,
       of the score, or of score − β·Σ k1 when the KL goes in the reward (kl_in=reward)
    -> `num_iterations` (μ) optimizer updates on that batch with the clipped surrogate
       (objectives.policy_loss), + β·k3 KL to the reference in the loss (kl_in=loss)
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
from typing import Literal, Optional, Sequence

import torch

from tether.data import encode_prompts, load_data
from tether.errors import NonFiniteLossError, UserError
from tether.models import load_model, load_tokenizer
from tether.objectives import ADVANTAGE_ESTIMATORS, compute_advantages, group_stats, policy_loss
from tether.objectives.policy import kl_penalized_rewards
from tether.plots import plot_metrics
from tether.rewards.scoring import (RewardFn, fn_name, resolve_reward_funcs,  # noqa: F401
                                    score, score_rollout)
from tether.rollout import Sampler, SamplingConfig, logprob_mismatch
from tether.run import RunDir, latest_checkpoint, seed_everything
from tether.models.logprobs import completion_token_logps
from tether.models.load import compile_layers
from tether.trainers.common import (EpochSampler, Progress, autocast_context, guarded_step, lend_gradients, make_optimizer, make_scheduler, restore_training, save_training)
from tether.trainers.online_sampling import collect


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
    "KL-to-reference coefficient (0 = no reference model is loaded); where it goes: kl_in"
    kl_in: Literal["loss", "reward"] = "loss"
    "'loss': + β·k3 per token in the loss (GRPO); 'reward': − β·k1 per token in the reward (PPO, RLOO, REINFORCE++)"
    num_iterations: int = 1
    "μ: optimizer updates per sampled batch (>1 recomputes old log-probs once per batch)"
    micro_batch_size: int = 0
    "sequences per forward/backward (0 = the whole batch at once)"
    mask_truncated_completions: bool = False
    "exclude completions cut at max_new_tokens from the loss (DAPO)"
    skip_zero_advantage: bool = True
    "leave completions whose advantage is 0 at every token out of the forward/backward: their gradient is exactly 0 (not with a KL term in the loss), the update is the same, the step cheaper"
    overlong_buffer: int = 0
    "DAPO soft overlong punishment: the reward ramps down over the last N tokens before max_new_tokens (0 = off)"
    overlong_penalty: float = 1.0
    "the overlong punishment at max_new_tokens (it is 0 at max_new_tokens − overlong_buffer)"
    dynamic_sampling: bool = False
    "DAPO dynamic sampling: drop groups whose rewards all agree and sample more prompts to refill the batch"
    max_sampling_rounds: int = 3
    "dynamic sampling: most rounds of batch_size prompts per step (then the step trains on what it has)"
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
    compile: bool = False
    "torch.compile each decoder layer of the policy and reference (H100, Qwen2.5-0.5B shape: training forward+backward -30 %, less memory; the first step pays 5-15 s of compilation, a new sequence length once more)"
    lora_r: int = 0
    "LoRA rank (0 = full fine-tuning); the reference is then the base with adapters disabled (no copy)"
    lora_alpha: int = 16
    "LoRA scaling numerator (the update is scaled by alpha / r)"
    lora_dropout: float = 0.0
    "dropout on the LoRA input"
    lora_targets: str = "all-linear"
    "modules to adapt: 'all-linear' or comma-separated names (q_proj,v_proj)"
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
        if not 0 <= self.overlong_buffer < self.max_new_tokens:
            raise ValueError("overlong_buffer must be in [0, max_new_tokens)")
        if self.dynamic_sampling and (self.num_generations < 2 or self.max_sampling_rounds < 1):
            raise ValueError("dynamic_sampling needs num_generations >= 2 and max_sampling_rounds >= 1")


@dataclass
class RLOOConfig(GRPOConfig):
    """`tether rloo`: REINFORCE leave-one-out (Ahmadian et al. 2024) with a per-token k1 KL penalty
    in the reward, as TRL's RLOOTrainer (whose defaults beta=0.05 these follow)."""
    name: str = "rloo"
    "run name: everything is written to <runs_dir>/<name>/"
    advantage: Literal["grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"] = "rloo"
    "advantage estimator: rloo = r_i − mean of the other completions of the same prompt"
    beta: float = 0.05
    "KL-to-reference coefficient (0 = no reference model is loaded)"
    kl_in: Literal["loss", "reward"] = "reward"
    "'reward': − β·k1 per token in the reward (RLOO); 'loss': + β·k3 in the loss"


@dataclass
class ReMaxConfig(GRPOConfig):
    """`tether remax`: REINFORCE with the greedy completion's reward as baseline (Li et al. 2023):
    one sample per prompt (no group), one extra greedy rollout per prompt, KL in the reward."""
    name: str = "remax"
    "run name: everything is written to <runs_dir>/<name>/"
    advantage: Literal["grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"] = "remax"
    "advantage estimator: remax = r_i − r(greedy completion of the same prompt)"
    num_generations: int = 1
    "completions sampled per prompt (ReMax needs no group: the greedy completion is the baseline)"
    batch_size: int = 64
    "prompts per step (as many sequences as GRPO's 8 × 8, plus as many greedy ones)"
    beta: float = 0.05
    "KL-to-reference coefficient (0 = no reference model is loaded)"
    kl_in: Literal["loss", "reward"] = "reward"
    "'reward': − β·k1 per token in the reward (ReMax, as RLHF-PPO); 'loss': + β·k3 in the loss"


def _slices(n: int, size: int) -> list[slice]:
    size = size if size > 0 else max(n, 1)  # n == 0: no slices
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def _agg_weight(mask: torch.Tensor, rows, agg: str, n_tok: int) -> float:
    """Share of the whole batch's loss carried by the micro-batch of `rows` (a slice or indices), so
    that accumulated gradients equal the full-batch loss's whatever micro_batch_size is."""
    if agg == "token-mean":
        return float(mask[rows].sum()) / max(n_tok, 1)
    return mask[rows].shape[0] / mask.shape[0]


def _trained_rows(adv: torch.Tensor, mask: torch.Tensor, skip_zero: bool, quantum: int = 1) -> torch.Tensor:
    """Indices of the rows the update trains on. A row whose advantage is 0 at every token it
    has contributes −min(r·0, clip(r)·0) = 0 to the surrogate and so exactly 0 to the gradient:
    with `skip_zero` (never with a KL term in the loss, which pulls on every row) it is left out of
    the forward and backward. In GRPO that is every group whose rewards all agree (a third to two
    thirds of the batch in the quickstart's RL stage) and any completion scored exactly its group's
    mean. The loss weights still count it. The count is rounded up to a multiple of `quantum` with
    skipped rows (compiled layers: whole micro-batches keep shapes static; a new batch size would
    recompile, measured +0.2-0.3 s a step on an H100)."""
    n = mask.shape[0]
    if not skip_zero:
        return torch.arange(n, device=mask.device)
    # on the batch's device: a CPU index into CUDA tensors is a synchronous copy per tensor indexed
    active = ((adv != 0) & mask).any(1)
    k = int(active.sum())
    fill = min(n, -(-k // quantum) * quantum) - k
    if fill > 0:
        active[(~active).nonzero().squeeze(1)[:fill]] = True
    return active.nonzero().squeeze(1)


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
    names = [fn_name(f) for f in funcs] + (["overlong_penalty"] if cfg.overlong_buffer else [])

    run_path = Path(cfg.runs_dir) / cfg.name
    ckpt = latest_checkpoint(run_path) if cfg.resume else None
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(str(ckpt) if ckpt else cfg.model)
    rows, report = encode_prompts(load_data(cfg.data, expect="prompt-only", split=cfg.split),
                                  tokenizer, cfg.max_prompt_length, cfg.truncation, source=cfg.data)
    if not rows:
        raise UserError(f"grpo: no prompts left in {cfg.data} after encoding")
    if cfg.lora_r > 0:  # the base always comes from cfg.model; a checkpoint holds the adapter only
        from tether.models.lora import apply_lora
        model = apply_lora(load_model(cfg.model, dtype=cfg.dtype, device=cfg.device,
                                      attn_implementation=cfg.attn_implementation), cfg, ckpt)
    else:
        model = load_model(str(ckpt) if ckpt else cfg.model, dtype=cfg.dtype, device=cfg.device,
                           attn_implementation=cfg.attn_implementation)
    device = next(model.parameters()).device
    amp = autocast_context(device, cfg.mixed_precision)
    # The reference is the *initial* policy, also on resume. Under LoRA that is the base model under
    # the adapters, so it is the same module with its adapters disabled: no second copy of the weights.
    ref_model = None
    if cfg.beta > 0 and cfg.lora_r == 0:
        ref_model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device,
                               attn_implementation=cfg.attn_implementation) if ckpt else copy.deepcopy(model)
        ref_model.eval().requires_grad_(False)

    def ref_logps(mb):
        if ref_model is not None:
            return completion_token_logps(ref_model, mb, cfg.temperature, amp)[0]
        with model.disable_adapter():
            return completion_token_logps(model, mb, cfg.temperature, amp)[0]
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        if cfg.lora_r > 0:  # frozen embeddings: inputs must require grad for checkpointed blocks
            model.enable_input_require_grads()
    if cfg.compile:
        compile_layers(model)
        if ref_model is not None:  # its no-grad forward each step is as launch-bound
            compile_layers(ref_model)
    model.train()
    run = RunDir(run_path, resume=ckpt is not None, log_with=cfg.log_with)

    updates = cfg.max_steps * cfg.num_iterations
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, betas=tuple(cfg.adam_betas))
    scheduler = make_scheduler(optimizer, cfg.schedule, cfg.warmup_steps, updates)
    prompt_order = EpochSampler(len(rows), cfg.batch_size, cfg.seed)
    sampler = Sampler(model, tokenizer, SamplingConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, stop=list(cfg.stop)))
    # Sampling and the update never overlap: the KV cache lives in the gradient buffer (one of the
    # two held, not both; common.flat_grad_buffer), which is zeroed after sampling. Only if it fits.
    grad_buf = lend_gradients(sampler, model, cfg.batch_size * cfg.num_generations,
                              max(len(r["prompt_ids"]) for r in rows) + cfg.max_new_tokens)

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

    def next_prompts():
        return [rows[i] for i in prompt_order.next()]

    def sample(prompt_ids, seed):
        return sampler.sample(prompt_ids, n=G, seed=seed)

    def scorer(seq_rows, ro):
        return score_rollout(funcs, weights, seq_rows, ro, cfg)

    while step < cfg.max_steps:
        t_step = time.perf_counter()
        # 1-2. sample G completions per prompt and score them (+ overlong shaping). The seed is a
        #    function of (seed, step) so a resumed run draws the same completions. Dynamic sampling
        #    drops groups with no reward variance and samples more prompts (online_sampling.collect).
        b = collect(sample, next_prompts, scorer, cfg.batch_size, G, seed=cfg.seed * 1_000_003 + step,
                    dynamic=cfg.dynamic_sampling, max_rounds=cfg.max_sampling_rounds)
        ro, rewards, seq_rows = b.rollout, b.rewards, b.seq_rows
        valid = ~rewards.isnan()  # None from every function = skipped: out of its group and the loss
        tb = {k: v.to(device) for k, v in ro.training_batch().items()}
        mask = tb["completion_mask"] & valid.to(device).unsqueeze(1)
        truncated = torch.tensor([f == "length" for f in ro.finish_reasons])
        if cfg.mask_truncated_completions:
            mask &= ~truncated.to(device).unsqueeze(1)

        # 3. old / reference log-probs (no grad)
        parts = _slices(len(ro), cfg.micro_batch_size)
        n_tok = int(mask.sum())
        with torch.no_grad():
            old = tb["logprobs"]
            if cfg.num_iterations > 1:
                old = torch.cat([completion_token_logps(model, {k: v[s] for k, v in tb.items()},
                                                        ro.logprob_temperature, amp)[0].float() for s in parts])
            ref = None
            if cfg.beta > 0:
                ref = torch.cat([ref_logps({k: v[s] for k, v in tb.items()}).float() for s in parts])

        # 4. advantages within each prompt's group, over the scored completions only. KL in the
        #    reward: r_t = −β·(log π_old − log π_ref)_t + [t = last]·R (k1, as PPO/REINFORCE++);
        #    group estimators take its sequence sum R − β·Σ_t k1_t, REINFORCE++ the token rewards.
        adv = torch.zeros(len(ro), mask.shape[1], device=device)
        r, kl_pen = rewards.to(device), None
        if cfg.kl_in == "reward" and ref is not None:
            tok_r = kl_penalized_rewards(torch.nan_to_num(r), old, ref, tb["completion_mask"], cfg.beta)
            kl_pen = torch.where(tb["completion_mask"], tok_r, 0.0).sum(1) - torch.nan_to_num(r)
            r = tok_r if cfg.advantage.startswith("reinforce_pp") else r + kl_pen
        vd = valid.to(device)
        if valid.any():
            kw = {"scale": cfg.scale_rewards} if cfg.advantage == "grpo" else {}
            if cfg.advantage == "remax":
                greedy = sampler.sample([p["prompt_ids"] for p in b.prompt_rows], n=1, temperature=0.0)
                kw["greedy_rewards"] = torch.nan_to_num(
                    scorer(b.prompt_rows, greedy)[1])[ro.group][valid].to(device)
            a = compute_advantages(cfg.advantage, r[vd], ro.group[valid].to(device), mask[vd], **kw)
            adv[vd] = (a.unsqueeze(1) if a.dim() == 1 else a).expand(-1, mask.shape[1]).float()

        # 5. μ updates on this batch (the gradient buffer held the sampler's KV cache until now)
        if grad_buf is not None:
            grad_buf.zero_()
        rows_t = _trained_rows(adv, mask, cfg.skip_zero_advantage and not (cfg.beta > 0 and cfg.kl_in == "loss"),
                               quantum=(cfg.micro_batch_size or len(ro)) if cfg.compile else 1)
        skipping = len(rows_t) < len(ro)  # else slices: views instead of gathered copies
        trained = rows_t if skipping else slice(None)  # the rows the metrics are over
        train_parts = [rows_t[s] for s in _slices(len(rows_t), cfg.micro_batch_size)] if skipping \
            else _slices(len(ro), cfg.micro_batch_size)
        stats: dict[str, float] = {"frac_zero_advantage_skipped": 1.0 - len(rows_t) / len(ro)}
        for it in range(cfg.num_iterations):
            acc: dict[str, float] = {}
            loss_value, share, train_logps, ents = 0.0, 0.0, [], []
            for s in train_parts:
                mb = {k: v[s] for k, v in tb.items()}
                logps, ent = completion_token_logps(model, mb, ro.logprob_temperature, amp,
                                                    want_entropy=cfg.log_entropy and it == 0)
                loss, m = policy_loss(logps, old[s], adv[s], mask[s], clip_low=cfg.clip_low,
                                      clip_high=cfg.clip_high, agg=cfg.loss_agg,
                                      ref_logps=None if ref is None else ref[s],
                                      beta=cfg.beta if cfg.kl_in == "loss" else 0.0,
                                      importance_level=cfg.importance_level,
                                      norm_length=cfg.max_new_tokens)
                w = _agg_weight(mask, s, cfg.loss_agg, n_tok)
                (loss * w).backward()
                loss_value += float(loss.detach()) * w
                share += w
                for k, v in m.items():
                    acc[k] = acc.get(k, 0.0) + float(v) * w
                if it == 0:
                    train_logps.append(logps.detach())
                    if ent is not None:
                        ents.append(float(ent) * w)
            if not train_parts:  # nothing to train on: the zero gradient still moves AdamW's moments,
                for p in model.parameters():  # as the full batch's backward would have
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
            try:
                grad_norm = guarded_step(model, optimizer, scheduler, cfg.max_grad_norm, loss_value,
                                         keep_grads=grad_buf is not None)
            except NonFiniteLossError:
                skipped += 1
                grad_norm = float("nan")
            # Metrics are means over the trained rows (weights renormalized by their share of the
            # batch); pg_loss, like loss, is the full batch's (skipped rows add exactly 0 to both).
            acc = {k: v if k == "pg_loss" else v / share for k, v in acc.items()} if share else acc
            if it == 0 and train_parts:
                stats.update(logprob_mismatch(tb["logprobs"][trained], torch.cat(train_logps), mask[trained]))
                if ents:
                    stats["entropy"] = sum(ents) / share
            stats.update({**acc, "loss": loss_value, "grad_norm": grad_norm})
        step += 1

        # 6. metrics, TRL's names; the reward statistics are over everything sampled this step
        #    (with dynamic sampling the kept groups are a biased subset), the rest over the trained batch
        sr, sv = b.sampled_rewards, ~b.sampled_rewards.isnan()
        gs = group_stats(torch.nan_to_num(sr[sv]), b.sampled_groups[sv]) if sv.any() else None
        lengths = ro.lengths.float()
        dt = time.perf_counter() - t_step
        mean_reward = float(sr[sv].mean()) if sv.any() else float("nan")
        history.append(mean_reward)
        last = {"reward": mean_reward,
                "reward_std": float(gs["std"].mean()) if gs else float("nan"),
                "frac_reward_zero_std": float(gs["constant"].float().mean()) if gs else float("nan"),
                **{f"rewards/{n}/mean": float(b.sampled_per_fn[:, j].nanmean()) for j, n in enumerate(names)},
                **({"rewards/kl_penalty/mean": float(kl_pen[vd].mean())} if kl_pen is not None and valid.any() else {}),
                **b.metrics, "frac_skipped": float((~valid).float().mean()),
                "completions/mean_length": float(lengths.mean()),
                "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(truncated.float().mean()),
                **stats, "lr": scheduler.get_last_lr()[0], "skipped_steps": skipped,
                "epoch": prompt_order.epoch, "step_time": dt,
                "tokens_per_second": b.sampled_tokens / dt,
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
