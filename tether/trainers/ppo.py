"""PPO-RLHF: policy + frozen reference + frozen reward model(s) / reward functions + value model.

The loop, top to bottom (docs/ppo.md; Ziegler et al. 2019, Stiennon et al. 2020, InstructGPT):
    load policy, a frozen reference (the initial policy), the value model (from the reward model
    or the policy: `value_model`), reward functions (a learned RM is `rm:<dir>`)
    -> for each step: draw `batch_size` prompts, sample completions (tether.rollout)
    -> score: R = Σ_f w_f r_f(x, y) − length_penalty·|y|   (a sequence-level scalar)
    -> no-grad forwards: log π_old (the policy as sampled), log π_ref, V_old
    -> per-token reward  r̃_t = 1[t = last]·R − β·(log π_old,t − log π_ref,t)   (k1 in the reward)
    -> GAE(γ, λ) → advantages A_t and returns R_t = A_t + V_old,t; A whitened over the batch
    -> `ppo_epochs` passes over shuffled minibatches:
           loss = clipped surrogate(A) + vf_coef · clipped value loss(R) − ent_coef · entropy
    -> β update (fixed, or adaptive toward `kl_target`), KL-budget early stop, log, checkpoint.

Why the value is read one position early: log π at input position t is the probability of token t
given tokens < t, so the state that chooses token t is the hidden state at t − 1. V is taken
there too (as TRL/OpenRLHF do), so V_t and log π_t describe the same decision.

Why the policy and value are two networks: sharing a body makes the value loss pull on the
policy's features (InstructGPT and TRL keep them separate); one AdamW covers both.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
from torch import nn

from tether.data import encode_prompts, load_data
from tether.errors import NonFiniteLossError, UserError
from tether.models import load_model, load_tokenizer
from tether.models.heads import ScalarHeadModel
from tether.objectives import (AdaptiveKLController, FixedKLController, gae, kl_penalized_rewards,
                               masked_whiten, policy_loss, value_loss)
from tether.plots import plot_metrics
from tether.rewards.scoring import resolve_reward_funcs, score
from tether.rollout import Sampler, SamplingConfig, logprob_mismatch
from tether.run import RunDir, latest_checkpoint, seed_everything
from tether.models.logprobs import completion_token_logps
from tether.models.load import compile_layers
from tether.trainers.common import (EpochSampler, Progress, autocast_context, guarded_step, lend_gradients, make_optimizer, make_scheduler, restore_training, save_training)


@dataclass
class PPOConfig:
    model: str = ""
    "policy to train (the SFT model): a local HF directory or hub id; also the frozen reference"
    data: str = ""
    "prompt-only data: a `prompt` column (+ extra columns, passed to reward functions by name)"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    reward_funcs: list[str] = field(default_factory=list)
    "rewards: 'rm:<dir>[,<dir>...]' (learned RM / ensemble), built-in names, or 'module:function'"
    reward_weights: list[float] = field(default_factory=list)
    "weight of each reward function (default: all 1.0)"
    eval_reward_funcs: list[str] = field(default_factory=list)
    "rewards only logged (eval_rewards/<fn>/mean), never optimized — e.g. the gold reward"
    value_model: str = ""
    "value init: a reward-model dir, 'policy' (fresh head on the policy), or '' = first rm:<dir> else policy"
    name: str = "ppo"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: str = "runs"
    "parent directory of run directories"
    max_prompt_length: int = 512
    "longest prompt in tokens (longer ones keep their end, or are dropped per `truncation`)"
    truncation: Literal["truncate", "drop"] = "truncate"
    "what to do with a prompt over max_prompt_length"
    batch_size: int = 32
    "prompts per step (rollout batch); each gets num_generations completions"
    num_generations: int = 1
    "completions sampled per prompt"
    max_new_tokens: int = 128
    "most tokens generated per completion"
    temperature: float = 1.0
    "sampling temperature; the trained log-probs are taken at the same temperature"
    top_k: int = 0
    "top-k sampling (0 = off)"
    top_p: float = 1.0
    "nucleus sampling (1 = off)"
    stop: list[str] = field(default_factory=list)
    "stop strings ending a completion (besides EOS)"
    kl_coef: float = 0.05
    "β: per-token KL penalty in the reward, r̃_t = −β·KL_t (+ the score at the last token)"
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    "KL estimator in the reward: k1 = log π − log π_ref (classic RLHF), k3 = non-negative, low variance"
    adaptive_kl: bool = False
    "adapt β toward kl_target (Ziegler et al. 2019) instead of keeping it fixed"
    kl_target: float = 6.0
    "adaptive β: target mean sequence KL (nats)"
    kl_horizon: float = 10000.0
    "adaptive β: horizon in samples"
    kl_budget: float = 0.0
    "stop the run early once the mean sequence KL to the reference exceeds this (nats; 0 = no budget)"
    length_penalty: float = 0.0
    "subtract this × completion length (tokens) from each score"
    gamma: float = 1.0
    "GAE discount γ"
    lam: float = 0.95
    "GAE λ"
    whiten_advantages: bool = True
    "normalize advantages to mean 0, std 1 over the batch's completion tokens"
    ppo_epochs: int = 4
    "passes over each rollout batch"
    num_minibatches: int = 4
    "minibatches per pass (one optimizer step each)"
    cliprange: float = 0.2
    "ε of the clipped policy ratio"
    cliprange_value: float = 0.2
    "clip of the value update around V_old"
    vf_coef: float = 0.1
    "weight of the value loss"
    ent_coef: float = 0.0
    "entropy bonus weight (loss −= ent_coef · mean token entropy)"
    max_steps: int = 100
    "steps (rollout batches) to run"
    lr: float = 1e-5
    "peak learning rate (AdamW), policy and value"
    weight_decay: float = 0.0
    "AdamW weight decay (never on norms and biases)"
    schedule: Literal["cosine", "linear", "constant"] = "constant"
    "learning-rate shape after warmup"
    warmup_steps: int = 0
    "linear warmup, in optimizer updates"
    max_grad_norm: float = 1.0
    "gradient clipping by global norm (0 = off)"
    dtype: str = "fp32"
    "weight dtype: fp32 | bf16 | fp16 | auto"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    "bf16 autocast on CUDA for the training forwards ('auto'), forced, or off"
    compile: bool = False
    "torch.compile each decoder layer of the policy, reference and critic (as grpo's compile: launch-bound forwards fused; 5-15 s of compilation at the first step)"
    device: str = "auto"
    "cuda | cpu | auto"
    log_every: int = 1
    "write metrics every N steps"
    num_samples: int = 2
    "completions (with scores) written to samples.jsonl at each log point"
    save_every: int = 0
    "checkpoint every N steps (0 = only at the end)"
    keep_last: int = 2
    "checkpoints to keep"
    resume: bool = False
    "continue from the latest checkpoint in the run directory"
    seed: int = 0
    "seed for prompt order, sampling and minibatch shuffling"
    log_with: Literal["none", "tensorboard"] = "none"
    "also write TensorBoard event files"
    progress: bool = True
    "show a progress bar"

    def __post_init__(self):
        if min(self.batch_size, self.num_generations, self.ppo_epochs, self.num_minibatches) < 1:
            raise ValueError("batch_size, num_generations, ppo_epochs and num_minibatches must be >= 1")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (PPO needs sampled completions)")
        if self.num_minibatches > self.batch_size * self.num_generations:
            raise ValueError("num_minibatches cannot exceed batch_size × num_generations")


def _rm_dirs(specs: Sequence) -> list[Path]:
    """Model directories of the `rm:` specs (run directories resolve to their newest checkpoint)."""
    from tether.rewards.learned import parse_rm_spec, resolve_rm_path

    return [resolve_rm_path(d) for s in specs if isinstance(s, str) and s.startswith("rm:")
            for d in parse_rm_spec(s)[0]]


def load_value_model(cfg: PPOConfig, ckpt: Path | None) -> ScalarHeadModel:
    """The critic: from the checkpoint on resume; else from a reward model (default when there is
    one: it already reads the responses the way the score does, so early values are informed) or
    from the policy with a fresh head."""
    if ckpt is not None:
        src = ckpt / "value"
    elif cfg.value_model and cfg.value_model != "policy":
        from tether.rewards.learned import resolve_rm_path
        src = resolve_rm_path(cfg.value_model)
    else:
        rms = _rm_dirs(cfg.reward_funcs)
        src = Path(rms[0]) if rms and cfg.value_model != "policy" else Path(cfg.model)
    value = ScalarHeadModel.from_pretrained(src, kind="value", dtype=cfg.dtype, device=cfg.device)
    value.offset = 0.0  # reward centering is an RM property; returns are learned from scratch anyway
    return value


def _values(value_model, batch: dict, amp) -> torch.Tensor:
    """V aligned with input_ids: position t holds V(state before token t) = head at t − 1."""
    with amp:
        v = value_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]).float()
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1)


def ppo_advantages(scores, old_logps, ref_logps, old_values, mask, beta: float, estimator: str = "k1",
                   gamma: float = 1.0, lam: float = 0.95, whiten: bool = True):
    """Scores → per-token rewards with the KL inside → GAE → (whitened) advantages, returns.

    r̃_t = 1[t = last]·R − β·KL_t;  (A, R_t) = GAE_{γ,λ}(r̃, V_old);  A ← whiten(A) (returns are
    not whitened: the critic regresses the real return). All [B, T] aligned with input_ids.
    """
    token_rewards = kl_penalized_rewards(scores, old_logps, ref_logps, mask, beta, estimator)
    advantages, returns = gae(token_rewards, old_values, mask, gamma, lam)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return token_rewards, advantages, returns


def train_ppo(cfg: PPOConfig, reward_funcs: Optional[Sequence] = None,
              reward_weights: Optional[Sequence[float]] = None,
              eval_reward_funcs: Optional[Sequence] = None) -> dict:
    """Run PPO-RLHF per `cfg`; returns the summary dict (also written to summary.json).

    `reward_funcs` / `eval_reward_funcs`: callables with TRL's reward signature, overriding the
    config's lists (how the over-optimization study passes the world's gold reward)."""
    if not cfg.model:
        raise UserError("ppo: `model` is required (the SFT policy: a local HF directory or hub id)")
    if not cfg.data:
        raise UserError("ppo: `data` is required (prompt-only rows: a `prompt` column)")
    funcs = resolve_reward_funcs(reward_funcs if reward_funcs is not None else cfg.reward_funcs)
    if not funcs:
        raise UserError("ppo: at least one reward is required (reward_funcs=rm:<dir> or a function)")
    weights = list(reward_weights if reward_weights is not None else cfg.reward_weights) or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise UserError(f"ppo: {len(weights)} reward_weights for {len(funcs)} reward functions")
    evals = resolve_reward_funcs(eval_reward_funcs if eval_reward_funcs is not None else cfg.eval_reward_funcs)
    names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
    eval_names = [getattr(f, "__name__", type(f).__name__) for f in evals]

    run_path = Path(cfg.runs_dir) / cfg.name
    ckpt = latest_checkpoint(run_path) if cfg.resume else None
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(str(ckpt) if ckpt else cfg.model)
    rows, report = encode_prompts(load_data(cfg.data, expect="prompt-only", split=cfg.split),
                                  tokenizer, cfg.max_prompt_length, cfg.truncation, source=cfg.data)
    if not rows:
        raise UserError(f"ppo: no prompts left in {cfg.data} after encoding")
    policy = load_model(str(ckpt) if ckpt else cfg.model, dtype=cfg.dtype, device=cfg.device)
    # The reference is the *initial* policy, also on resume.
    ref = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device) if ckpt else copy.deepcopy(policy)
    ref.eval().requires_grad_(False)
    value = load_value_model(cfg, ckpt)
    device = next(policy.parameters()).device
    policy.train()
    value.train()
    both = nn.ModuleDict({"policy": policy, "value": value})  # one optimizer, one clip, one step
    if cfg.compile:
        for m in (policy, ref, value):
            compile_layers(m)
    run = RunDir(run_path, resume=ckpt is not None, log_with=cfg.log_with)
    amp = autocast_context(device, cfg.mixed_precision)

    N = cfg.batch_size * cfg.num_generations
    updates = cfg.max_steps * cfg.ppo_epochs * cfg.num_minibatches
    optimizer = make_optimizer(both, cfg.lr, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.schedule, cfg.warmup_steps, updates)
    prompt_order = EpochSampler(len(rows), cfg.batch_size, cfg.seed)
    sampler = Sampler(policy, tokenizer, SamplingConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
        top_p=cfg.top_p, stop=list(cfg.stop)))
    # The KV cache lives in the (policy + value) gradient buffer, idle while sampling, when it fits
    # (common.flat_grad_buffer); zeroed before the PPO epochs.
    grad_buf = lend_gradients(sampler, both, N, max(len(r["prompt_ids"]) for r in rows) + cfg.max_new_tokens)
    kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl \
        else FixedKLController(cfg.kl_coef)

    step, time_offset, skipped = 0, 0.0, 0
    if ckpt:
        step, time_offset, skipped = restore_training(ckpt, run, optimizer, scheduler, prompt_order)
        kl_ctl.value = json.loads((ckpt / "ppo_state.json").read_text())["kl_coef"]
    run.write_config(cfg)

    def extra(path: Path):  # the critic and the (possibly adapted) β are part of the state
        value.save_pretrained(path / "value")
        (path / "ppo_state.json").write_text(json.dumps({"kl_coef": kl_ctl.value}) + "\n")

    def checkpoint():
        save_training(run, step, policy, tokenizer, optimizer, scheduler, prompt_order,
                      skipped, time_offset, cfg.keep_last, extra=extra)

    bar = Progress(cfg.max_steps, step, cfg.name, enabled=cfg.progress and run.is_main)
    last: dict = {}
    stopped_early = None
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        # 1. rollouts; the seed is a function of (seed, step) so a resumed run draws the same ones
        batch_rows = [rows[i] for i in prompt_order.next()]
        policy.eval()
        ro = sampler.sample([r["prompt_ids"] for r in batch_rows], n=cfg.num_generations,
                            seed=cfg.seed * 1_000_003 + step)
        policy.train()
        seq_rows = [batch_rows[i // cfg.num_generations] for i in range(len(ro))]
        comp_ids = [ids[m].tolist() for ids, m in zip(ro.completion_ids, ro.completion_mask)]
        t_gen = time.perf_counter() - t0

        # 2. scores: one scalar per completion (None from every function = no score: 0, logged)
        per_fn, scores = score(funcs, weights, seq_rows, ro.texts, comp_ids)
        unscored = scores.isnan()
        scores = torch.nan_to_num(scores) - cfg.length_penalty * ro.lengths.float().cpu()  # rollout: model's device
        eval_per_fn = score(evals, [1.0] * len(evals), seq_rows, ro.texts, comp_ids)[0] if evals else None
        tb = {k: v.to(device) for k, v in ro.training_batch().items()}
        mask = tb["completion_mask"]

        # 3. old log-probs, reference log-probs, old values (no grad)
        with torch.no_grad():
            policy.eval()  # dropout off: π_old must be the policy that sampled
            old_logps = completion_token_logps(policy, tb, ro.logprob_temperature, amp)[0].float()
            policy.train()
            ref_logps = completion_token_logps(ref, tb, ro.logprob_temperature, amp)[0].float()
            old_values = _values(value, tb, amp)
            beta = kl_ctl.value
            _, advantages, returns = ppo_advantages(scores.to(device), old_logps, ref_logps, old_values,
                                                    mask, beta, cfg.kl_estimator, cfg.gamma, cfg.lam,
                                                    cfg.whiten_advantages)
            seq_kl = torch.where(mask, old_logps - ref_logps, 0.0).sum(1)  # k1 per sequence

        # 4. PPO epochs over shuffled minibatches (the gradient buffer held the KV cache until now)
        if grad_buf is not None:
            grad_buf.zero_()
        g = torch.Generator().manual_seed(cfg.seed * 7_919 + step)
        acc: dict[str, list[float]] = {}
        for _ in range(cfg.ppo_epochs):
            for idx in torch.randperm(N, generator=g).chunk(cfg.num_minibatches):
                idx = idx.to(device)
                mb = {k: v[idx] for k, v in tb.items()}
                logps, ent = completion_token_logps(policy, mb, ro.logprob_temperature, amp, True,
                                                   entropy_grad=True)
                pg, pm = policy_loss(logps, old_logps[idx], advantages[idx], mask[idx],
                                     clip_low=cfg.cliprange)
                vl, vm = value_loss(_values(value, mb, amp), old_values[idx], returns[idx], mask[idx],
                                    clip=cfg.cliprange_value)
                loss = pg + cfg.vf_coef * vl - cfg.ent_coef * ent
                loss.backward()
                try:
                    gn = guarded_step(both, optimizer, scheduler, cfg.max_grad_norm, float(loss.detach()),
                                      keep_grads=grad_buf is not None)
                except NonFiniteLossError:
                    skipped += 1
                    gn = float("nan")
                for k, v in {"policy/approxkl_avg": pm["approx_kl"], "policy/clipfrac_avg": pm["clip_ratio/region_mean"],
                             "loss/policy_avg": pg, "loss/value_avg": vl, "val/clipfrac_avg": vm["clipfrac"],
                             "policy/entropy_avg": ent, "val/ratio": pm["ratio/mean"], "grad_norm": gn}.items():
                    acc.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else float(v))
        step += 1
        mean_kl = float(seq_kl.mean())
        kl_ctl.update(mean_kl, N)

        # 5. metrics (TRL's PPO names where they exist)
        dt = time.perf_counter() - t0
        non_score = float(-(beta * seq_kl).mean())
        last = {"objective/kl": mean_kl, "objective/kl_coef": beta,
                "objective/entropy": float(-torch.where(mask, old_logps, 0.0).sum(1).mean()),
                "objective/scores": float(scores.mean()), "objective/non_score_reward": non_score,
                "objective/rlhf_reward": float(scores.mean()) + non_score,
                **{k: sum(v) / len(v) for k, v in acc.items()},
                **{f"rewards/{n}/mean": float(per_fn[:, j].nanmean()) for j, n in enumerate(names)},
                "frac_unscored": float(unscored.float().mean()),
                **logprob_mismatch(tb["logprobs"], old_logps, mask),
                "val/num_eos_tokens": sum(f == "eos" for f in ro.finish_reasons),
                "completions/mean_length": float(ro.lengths.float().mean()),
                "completions/clipped_ratio": sum(f == "length" for f in ro.finish_reasons) / len(ro),
                "lr": scheduler.get_last_lr()[0], "skipped_steps": skipped, "episode": step * N,
                "step_time": dt, "rollout/seconds": t_gen,
                "tokens_per_second": float(ro.lengths.sum()) / dt}
        if eval_per_fn is not None:
            last.update({f"eval_rewards/{n}/mean": float(eval_per_fn[:, j].nanmean())
                         for j, n in enumerate(eval_names)})
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            run.log(step, last, time_offset=time_offset)
            run.add_samples(step, [{"prompt": seq_rows[i]["prompt"], "completion": ro.texts[i],
                                    "score": float(scores[i])} for i in range(min(cfg.num_samples, len(ro)))])
        bar.update({"score": last["objective/scores"], "kl": mean_kl})
        if cfg.kl_budget > 0 and mean_kl > cfg.kl_budget:
            stopped_early = step  # the policy left the region the reward model can be trusted in
            if step % cfg.log_every:
                run.log(step, last, time_offset=time_offset)
            break
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            checkpoint()
    bar.close()

    checkpoint()
    summary = {"steps": step, "prompts": len(rows), "skipped_steps": skipped,
               "stopped_early_at": stopped_early, "final_kl": last.get("objective/kl"),
               "final_scores": last.get("objective/scores"),
               "final_rlhf_reward": last.get("objective/rlhf_reward"),
               "final_kl_coef": kl_ctl.value,
               "final_eval_rewards": {n: last.get(f"eval_rewards/{n}/mean") for n in eval_names},
               "data": {"summary": report.summary(), "rows": report.total,
                        "truncated": report.truncated, "dropped": report.dropped},
               "checkpoint": str(run.checkpoint_dir(step))}
    run.write_summary(summary)
    if run.is_main:
        plot_metrics(run.path)
    run.close()
    return summary
