"""Online RL, the critic-free family: GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++ (+ GSPO, GMPO, clip-higher).

The loop, top to bottom (docs/grpo.md):
    setup_training: model (+ LoRA adapters) + the reference when beta > 0 (a frozen copy; under LoRA
       the same model with its adapters disabled) + tokenizer + encoded prompt rows
    -> for each step: draw `batch_size` prompts, sample `num_generations` completions of each
       (tether.rollout: exact per-token log-probs come with the tokens)
    -> score every completion with the reward functions (weighted sum; None = skipped), + DAPO's
       overlong shaping; with dynamic sampling drop zero-variance groups and refill (online_sampling)
    -> advantages from the registry (tether.objectives.ADVANTAGE_ESTIMATORS), within each group,
       of the score, or of score − β·Σ k1 when the KL goes in the reward (kl_in=reward)
    -> `num_iterations` (μ) optimizer updates on that batch with the clipped surrogate
       (objectives.policy_loss; online_update), + β·k3 KL to the reference in the loss (kl_in=loss)
    -> log (TRL's metric names) / samples / checkpoint (exactly resumable).

Old log-probs: with μ = 1 (and no is_correction) π_old is the update's own forward, detached (the
ratio is 1; the sampler's log-probs differ from it by the training–inference mismatch and, under
the trajectory queue, the staleness: both logged, corrected only on request, prepare_batch); with
μ > 1 or is_correction one no-grad forward before the first update recomputes them, so later
updates are importance-weighted against exactly what the trainer computed.

Under torchrun (tether/distributed.py: ranks are micro-batches) each rank draws its share of the
step's prompts and samples them from a whole copy of the policy (`Training.rollout_model`,
gathered from the shards after each update; its time is logged as gather_time), scores them,
computes its groups' advantages and trains on its rows; the per-sequence sampling streams make
its completions the ones one process draws for those prompts. The loss's denominators, the
whole-batch advantage statistics and every metric are over all ranks (online_global), so the run
logs and learns what one process does with the same config (up to float rounding), except with
dynamic sampling over more than one round (online_sampling).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from tether import distributed
from tether.config import ConfigError, flat_init
from tether.constraints import NonNegative, NonNegativeInt, Positive, PositiveInt
from tether.errors import UserError
from tether.models.logprobs import completion_token_logps
from tether.objectives import ADVANTAGE_ESTIMATORS, IS_CORRECTIONS, IS_LEVELS, SURROGATES, compute_advantages, group_stats
from tether.objectives.policy import kl_penalized_rewards
from tether.rewards.scoring import fn_name, resolve_reward_funcs, score_rollout
from tether.rollout import Sampler
from tether.rollout.types import SEQ_MULTIPLE
from tether.trainers.common import lend_gradients
from tether.trainers.held_out import HeldOut, check_eval, check_keep_best, eval_rewards, generation_metrics
from tether.trainers.online_async import QueueSection, batch_source, check_queue, correct_off_policy
from tether.trainers.online_disaggregated import finish_sampler, sampler_config, serve, split_world
from tether.trainers.online_partial import PartialRollouts, partial_metrics
from tether.trainers.online_global import every_rank, gather_for_advantages, gather_rows, turns, unique_groups
from tether.trainers.online_sampling import StepBatch, collect
from tether.trainers.online_update import _slices, update_policy
from tether.trainers.sections import (ModelSection, OptimSection, PromptSection, RewardSection,
                                      RolloutSection, RunSection)
from tether.trainers.setup import load_prompt_data, setup_training, releases_process_state

# The choices are the registries' names, written once there (config checks and --help read these).
Advantage = Literal[tuple(ADVANTAGE_ESTIMATORS)]
ImportanceLevel = Literal[tuple(SURROGATES)]
ISCorrection = Literal[("none", *IS_CORRECTIONS)]


@dataclass
class GRPOSection:
    advantage: Advantage = "grpo"
    "advantage estimator (objectives.ADVANTAGE_ESTIMATORS); remax costs one greedy rollout per prompt"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    "grpo only: divide by the group std, the batch std, or nothing (= dr_grpo)"
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    "loss aggregation: DAPO token-mean, GRPO seq-mean-token-mean, Dr.GRPO seq-mean-token-sum-norm (/max_new_tokens)"
    clip_low: Positive = 0.2
    "ε_low of the clipped ratio"
    clip_high: Optional[Positive] = None
    "ε_high (default ε_low; DAPO clip-higher uses 0.28)"
    importance_level: ImportanceLevel = "token"
    "ratio + clip (objectives.SURROGATES): per token (PPO/GRPO), one sequence ratio (GSPO: use clip 3e-4/4e-4), or gmpo (geometric mean of token ratios clipped in log space: clip 0.4)"
    beta: NonNegative = 0.0
    "KL-to-reference coefficient (0 = no reference model is loaded); where it goes: kl_in"
    kl_in: Literal["loss", "reward"] = "loss"
    "'loss': + β·k3 per token in the loss (GRPO); 'reward': − β·k1 per token in the reward (PPO, RLOO, REINFORCE++)"
    num_iterations: PositiveInt = 1
    "μ: optimizer updates per sampled batch (>1 recomputes old log-probs once per batch)"
    micro_batch_size: NonNegativeInt = 0
    "sequences per forward/backward (0 = the whole batch at once)"
    mask_truncated_completions: bool = False
    "exclude completions cut at max_new_tokens from the loss (DAPO)"
    skip_zero_advantage: bool = True
    "leave completions whose advantage is 0 at every token out of the forward/backward: their gradient is exactly 0 (not with a KL term in the loss), the update is the same, the step cheaper"
    overlong_buffer: NonNegativeInt = 0
    "DAPO soft overlong punishment: the reward ramps down over the last N tokens before max_new_tokens (0 = off)"
    overlong_penalty: NonNegative = 1.0
    "the overlong punishment at max_new_tokens (it is 0 at max_new_tokens − overlong_buffer)"
    dynamic_sampling: bool = False
    "DAPO dynamic sampling: drop groups whose rewards all agree and sample more prompts to refill the batch"
    max_sampling_rounds: PositiveInt = 3
    "dynamic sampling: most rounds of batch_size prompts per step (then the step trains on what it has)"
    log_entropy: bool = True
    "log the policy's mean token entropy over completions (one extra pass over the logits)"
    is_correction: ISCorrection = "none"
    "off-policy correction of the sampler's tokens (objectives.IS_CORRECTIONS): tis = truncated IS weights min(π_old/μ, cap), mis = masked IS (weights above the cap set to 0); costs one no-grad forward (π_old recomputed)"
    is_level: Literal[tuple(IS_LEVELS)] = "token"
    "IS weight per token, or per sequence (the product of its token ratios)"
    is_cap: Positive = 2.0
    "the IS weight's cap C (TIS truncates to it, MIS rejects above it)"

    def __post_init__(self):
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage must be one of {sorted(ADVANTAGE_ESTIMATORS)}")
        if self.importance_level not in SURROGATES:
            raise ValueError(f"importance_level must be one of {sorted(SURROGATES)}")


@flat_init
@dataclass
class GRPOConfig:
    model: ModelSection = field(default_factory=ModelSection)
    "the policy to train (also the frozen reference when beta > 0) and how it runs"
    data: PromptSection = field(default_factory=PromptSection)
    "prompt-only rows; batch_size prompts per step"
    optim: OptimSection = field(default_factory=lambda: OptimSection(
        lr=1e-6, adam_betas=[0.9, 0.99], schedule="constant", warmup_steps=0, max_steps=100))
    "optimizer, schedule (warmup counts optimizer updates: μ per step), steps (sampled batches)"
    run: RunSection = field(default_factory=lambda: RunSection(name="grpo", log_every=1, num_samples=2))
    "run directory, seed (prompt order and sampling), logging, checkpoints"
    rollout: RolloutSection = field(default_factory=RolloutSection)
    "sampling; num_generations completions per prompt are the group the advantages are relative to"
    reward: RewardSection = field(default_factory=RewardSection)
    "reward functions and weights"
    grpo: GRPOSection = field(default_factory=GRPOSection)
    "the algorithm: estimator, surrogate, KL, reuse, DAPO options, off-policy correction"
    queue: QueueSection = field(default_factory=QueueSection)
    "the trajectory queue: staleness bound and where sampling runs (online_async)"

    def __post_init__(self):
        check_eval(self)
        check_queue(self)  # eval_every / eval_reward_funcs need data.eval_data
        self.rollout.check_release()
        if not 0 <= self.grpo.overlong_buffer < self.rollout.max_new_tokens:
            raise ValueError("overlong_buffer must be in [0, max_new_tokens)")
        if self.grpo.dynamic_sampling and self.rollout.num_generations < 2:
            raise ValueError("dynamic_sampling needs num_generations >= 2")
        if ADVANTAGE_ESTIMATORS[self.grpo.advantage].grouped and self.rollout.num_generations < 2:
            # A lone completion is its own group baseline: every advantage is 0, so is the loss.
            raise ConfigError(f"config key 'rollout.num_generations' must be >= 2 for advantage="
                             f"{self.grpo.advantage!r} (a group of one has advantage 0: nothing "
                             f"would be learned); use advantage=reinforce_pp or remax for one sample")


@flat_init
@dataclass
class RLOOConfig(GRPOConfig):
    """`tether rloo`: REINFORCE leave-one-out (Ahmadian et al. 2024) with a per-token k1 KL penalty
    in the reward, as TRL's RLOOTrainer (whose defaults beta=0.05 these follow)."""
    run: RunSection = field(default_factory=lambda: RunSection(name="rloo", log_every=1, num_samples=2))
    grpo: GRPOSection = field(default_factory=lambda: GRPOSection(advantage="rloo", beta=0.05, kl_in="reward"))


@flat_init
@dataclass
class ReMaxConfig(GRPOConfig):
    """`tether remax`: REINFORCE with the greedy completion's reward as baseline (Li et al. 2023):
    one sample per prompt (no group), one extra greedy rollout per prompt, KL in the reward; 64
    prompts a step, as many sequences as GRPO's 8 × 8, plus as many greedy ones."""
    data: PromptSection = field(default_factory=lambda: PromptSection(batch_size=64))
    run: RunSection = field(default_factory=lambda: RunSection(name="remax", log_every=1, num_samples=2))
    rollout: RolloutSection = field(default_factory=lambda: RolloutSection(num_generations=1))
    grpo: GRPOSection = field(default_factory=lambda: GRPOSection(advantage="remax", beta=0.05, kl_in="reward"))


@dataclass
class Batch:
    """One step's training batch: the kept rollouts with their rewards, the masks, the log-probs the
    ratio and the KL are taken against, and the advantages (filled in that order)."""
    collected: StepBatch
    "rollouts and rewards (+ everything sampled this step, dropped groups included)"
    tensors: dict
    "rollout.training_batch() on the model's device (input ids, masks, the sampler's log-probs)"
    valid: torch.Tensor
    "[N] bool (CPU): scored by at least one reward function (else out of its group and the loss)"
    mask: torch.Tensor
    "[N, T] the completion tokens trained on"
    truncated: torch.Tensor
    "[N] bool (CPU): cut at max_new_tokens"
    old_logps: torch.Tensor
    "[N, T] the ratio's denominator"
    ref_logps: Optional[torch.Tensor] = None
    "[N, T] the frozen reference's (beta > 0)"
    advantages: Optional[torch.Tensor] = None
    "[N, T]"
    kl_penalty: Optional[torch.Tensor] = None
    "[N] −β·Σ_t k1 added to the reward (kl_in=reward)"
    filler: Optional[dict] = None
    "one sampled row (training_batch form): the input of the forwards that count for nothing (torchrun)"
    on_policy: bool = False
    "μ = 1 and no IS correction (whatever the staleness): the ratio's π_old is the update's own forward, detached"


def reward_functions(cfg: GRPOConfig, funcs: Optional[Sequence], weights: Optional[Sequence[float]]):
    """(functions, weights, metric names): the callables given, else cfg.reward's, resolved."""
    funcs = resolve_reward_funcs(funcs if funcs is not None else cfg.reward.reward_funcs)
    if not funcs:
        raise UserError(f"{cfg.run.name}: at least one reward function is required (reward_funcs=module:function)")
    weights = list(weights if weights is not None else cfg.reward.reward_weights) or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise UserError(f"{cfg.run.name}: {len(weights)} reward_weights for {len(funcs)} reward functions")
    return funcs, weights, [fn_name(f) for f in funcs] + (["overlong_penalty"] if cfg.grpo.overlong_buffer else [])


def prepare_batch(t, collected: StepBatch, cfg: GRPOConfig) -> Batch:
    """Masks, and the old / reference log-probs (no grad), for a step's collected rollouts."""
    grpo, rollout, device = cfg.grpo, collected.rollout, t.device
    valid = ~collected.rewards.isnan()  # None from every function = skipped
    # Under torchrun a rank may keep no rows (dynamic sampling) and still takes every forward turn
    # (sharded forwards are collective): idle turns run on one sampled row, the filler.
    source = rollout if len(rollout) else collected.filler
    full = {k: v.to(device) for k, v in source.training_batch(SEQ_MULTIPLE).items()}
    tensors = full if len(rollout) else {k: v[:0] for k, v in full.items()}
    filler = {k: v[:1] for k, v in full.items()}
    mask = tensors["completion_mask"] & valid.to(device).unsqueeze(1)
    truncated = torch.tensor([f == "length" for f in rollout.finish_reasons], dtype=torch.bool)
    if grpo.mask_truncated_completions:
        mask &= ~truncated.to(device).unsqueeze(1)
    micro_batches = [{k: v[part] for k, v in tensors.items()} for part in _slices(len(rollout), grpo.micro_batch_size)]

    def forwards(fn) -> torch.Tensor:  # fn's outputs on the micro-batches, concatenated
        out = []
        for micro in turns(micro_batches):
            result = fn(filler if micro is None else micro)
            if micro is not None:
                out.append(result)
        return torch.cat(out) if out else tensors["logprobs"]
    with torch.no_grad():
        old = tensors["logprobs"]
        if grpo.num_iterations > 1 or grpo.is_correction != "none":  # π_old: the trainer's own
            old = forwards(lambda micro: completion_token_logps(t.model, micro, rollout.logprob_temperature,
                                                                t.amp)[0].float())
        ref = forwards(lambda micro: t.reference_logps(micro, cfg.rollout.temperature).float()) \
            if grpo.beta > 0 else None
    # On-policy (one update on samples of the current weights, no IS correction) π_old is π_θ itself:
    # the loss takes the update's own log-probs, detached (ratio ≡ 1; TRL does the same). Not the
    # sampler's: on CUDA they differ by the training–inference mismatch (bf16 autocast vs the
    # sampler's kernels), and a ratio against them reweighs every token by exp(mismatch) — on
    # SmolLM2-135M (fp32 master weights, bf16 autocast) that fed back into the policy and collapsed
    # it within 50 steps (mismatch max 0.3 -> 16 nats, clip fraction 0.28), while TRL's identical
    # recipe learned. The mismatch stays logged (sampling/*); grpo.is_correction corrects for it.
    # The same holds for a stale batch (queue.max_staleness > 0, partial rollouts): a ratio against
    # the sampler's log-probs mixes the staleness with the mismatch, and the trajectory queue's
    # disaggregated placement collapsed SmolLM2 just so on 2 H200s (staleness 1: clipped on 25 % of
    # tokens, held-out pass@1 0.42 -> 0.00 in 100 steps, 2 of 3 seeds). So with one update and no
    # correction the ratio is 1 whatever the staleness (it goes uncorrected, as in the synchronous
    # loop's mismatch); is_correction = tis | mis weights by π_old / μ for both (decoupled PPO).
    on_policy = grpo.num_iterations == 1 and grpo.is_correction == "none"
    return Batch(collected, tensors, valid, mask, truncated, old, ref, filler=filler, on_policy=on_policy)


def assign_advantages(batch: Batch, grpo: GRPOSection, greedy_scores) -> None:
    """Advantages within each prompt's group over the scored completions, as the estimator's
    registry entry asks. KL in the reward: r_t = −β·(log π_old − log π_ref)_t + [t = last]·R (k1, as
    PPO/REINFORCE++); estimators of sequence rewards take its sum R − β·Σ_t k1_t, those of token
    rewards the per-token rewards. `greedy_scores(prompt_rows)` -> [prompts]: ReMax's baseline."""
    estimator, rollout, valid = ADVANTAGE_ESTIMATORS[grpo.advantage], batch.collected.rollout, batch.valid
    completion_mask, device = batch.tensors["completion_mask"], batch.mask.device
    rewards = batch.collected.rewards.to(device)
    if grpo.kl_in == "reward" and batch.ref_logps is not None:
        token_rewards = kl_penalized_rewards(torch.nan_to_num(rewards), batch.old_logps, batch.ref_logps,
                                             completion_mask, grpo.beta)
        batch.kl_penalty = torch.where(completion_mask, token_rewards, 0.0).sum(1) - torch.nan_to_num(rewards)
        rewards = token_rewards if estimator.token_rewards else rewards + batch.kl_penalty
    batch.advantages = torch.zeros(len(rollout), batch.mask.shape[1], device=device)
    options = {"scale": grpo.scale_rewards} if estimator.scaled else {}
    # Under torchrun a rank holds whole groups, so group statistics are its own; statistics over
    # the batch (REINFORCE++'s whitening, scale=batch) are taken over every rank's rows.
    whole = distributed.active() and (estimator.whitened or options.get("scale") == "batch")
    if not (valid.any() or whole):
        return
    on_device = valid.to(device)
    if estimator.needs_greedy:  # the scores come back on the CPU, the rollout's indices may not
        scores = torch.as_tensor(greedy_scores(batch.collected.prompt_rows)).to(device)
        options["greedy_rewards"] = scores[rollout.group.to(device)][on_device]
    groups = rollout.group[valid].to(device) if estimator.grouped else None
    inputs = (rewards[on_device], groups, batch.mask[on_device], options)
    if whole:
        *inputs, mine = gather_for_advantages(*inputs)
        if not len(inputs[0]):  # no rank has a scored row
            return
    advantages = compute_advantages(grpo.advantage, *inputs[:3], **inputs[3])
    if whole:
        advantages = mine(advantages)
    batch.advantages[on_device] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) \
        .expand(-1, batch.mask.shape[1]).float()


def step_metrics(t, batch: Batch, update: dict, names: list[str], seconds: float) -> dict:
    """TRL's names. The reward statistics are over everything sampled this step (with dynamic
    sampling the kept groups are a biased subset); the rest over the trained batch."""
    collected, rollout = batch.collected, batch.collected.rollout
    # Under torchrun every rank's rows (gather_rows) and counts: the whole batch's statistics.
    sampled, per_fn = gather_rows(collected.sampled_rewards), gather_rows(collected.sampled_per_fn)
    valid, truncated, lengths = (gather_rows(x) for x in (batch.valid, batch.truncated, rollout.lengths))
    lengths, scored = lengths.float(), ~sampled.isnan()
    counts = dict(collected.metrics, tokens=collected.sampled_tokens)
    if distributed.active():  # kept / dropped groups, generated tokens (the rounds are every rank's)
        summed = distributed.sum_floats(counts.values())
        counts = {k: v if k == "num_sampling_rounds" else int(x) for (k, v), x in zip(counts.items(), summed)}
    tokens = counts.pop("tokens")
    group_ids = gather_rows(unique_groups(collected.sampled_groups))
    groups = group_stats(torch.nan_to_num(sampled[scored]), group_ids[scored]) if scored.any() else None
    penalty = None if batch.kl_penalty is None else gather_rows(batch.kl_penalty)
    kl_penalty = {"rewards/kl_penalty/mean": float(penalty[valid.to(penalty.device)].mean())} \
        if penalty is not None and valid.any() else {}
    return {"reward": float(sampled[scored].mean()) if scored.any() else float("nan"),
            "reward_std": float(groups["std"].mean()) if groups else float("nan"),
            "frac_reward_zero_std": float(groups["constant"].float().mean()) if groups else float("nan"),
            **{f"rewards/{n}/mean": float(per_fn[:, j].nanmean()) for j, n in enumerate(names)},
            **kl_penalty, **counts, "frac_skipped": float((~valid).float().mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            **update, "lr": t.lr, "skipped_steps": t.skipped, "epoch": collected.epoch, "step_time": seconds,
            "tokens_per_second": tokens / seconds,
            "rollout/tokens_per_second": rollout.stats.get("tokens_per_s", 0.0),
            "rollout/seconds": rollout.stats.get("total_s", 0.0),
            # a sampler process: its wait for this batch's weights (the trainer's update and the
            # broadcast), kept out of rollout/seconds; its sampling + scoring of the batch; the
            # packing + storing of its previous batch — together its cycle (online_disaggregated.serve);
            # 1 where the next version's weights arrived while this batch was produced (Incoming)
            **{f"queue/{k}_seconds": rollout.stats[f"{k}_s"] for k in ("weights_wait", "produce", "send")
               if f"{k}_s" in rollout.stats},
            **({"queue/weights_overlapped": rollout.stats["weights_overlapped"]}
               if "weights_overlapped" in rollout.stats else {})}


def samples(batch: Batch, count: int, names: Sequence[str] = ()) -> list[dict]:
    """The first `count` completions with their prompts, rewards (total and per function,
    `rewards/<name>`) and advantage (mean over the completion's tokens), for samples.jsonl."""
    collected = batch.collected
    rows, texts = collected.seq_rows, collected.rollout.texts
    n = min(count, len(texts))
    adv = None
    if batch.advantages is not None and n:
        m = batch.mask[:n].float()
        adv = ((batch.advantages[:n].float() * m).sum(1) / m.sum(1).clamp(min=1)).cpu()
    per_fn = collected.per_fn[:n].cpu()

    def num(v) -> float | None:
        v = float(v)
        return None if math.isnan(v) else v
    return [{"prompt": rows[i]["prompt"], "completion": texts[i],
             "reward": None if not batch.valid[i] else float(collected.rewards[i]),
             **{f"rewards/{name}": num(per_fn[i, j]) for j, name in enumerate(names)},
             **({} if adv is None or not batch.valid[i] else {"advantage": float(adv[i])})}
            for i in range(n)]


@releases_process_state
def train_grpo(cfg: GRPOConfig, reward_funcs: Optional[Sequence] = None,
               reward_weights: Optional[Sequence[float]] = None) -> dict:
    """Run GRPO-family RL per `cfg`; returns the summary dict (also written to summary.json).

    `reward_funcs`: callables `fn(prompts, completions, completion_ids, **columns) -> list[float |
    None]` (default: cfg.reward.reward_funcs imported). A completion no function scores is skipped:
    it takes no part in its group's statistics and gets no gradient.
    """
    grpo, rollout_cfg, prompts_per_step = cfg.grpo, cfg.rollout, cfg.data.batch_size
    funcs, weights, names = reward_functions(cfg, reward_funcs, reward_weights)
    # held-out scoring (held_out.py): eval_reward_funcs, else the training rewards
    eval_funcs, eval_weights = eval_rewards(cfg.reward.eval_reward_funcs, funcs, weights)
    check_keep_best(cfg, generation_metrics(eval_funcs), held_out=bool(cfg.data.eval_data))

    # placement=disaggregated: torchrun's processes split into the trainer and a sampler (online_disaggregated)
    link = split_world(cfg)
    # Under torchrun each rank samples, scores and trains its share of each step's prompts (whole
    # groups), sampling from a whole copy of the policy (rollout_model: gathered after each update)
    t = setup_training(sampler_config(cfg, link) if link and link.samples else cfg,
                       lambda tokenizer: load_prompt_data(cfg, tokenizer),
                       reference=grpo.beta > 0, rows_per_step=prompts_per_step,
                       updates_per_step=grpo.num_iterations, rollout_replica=True)
    prompts, share = t.data.train, prompts_per_step // distributed.world_size()

    def make_sampler(model):
        return Sampler(model, t.tokenizer, rollout_cfg.sampling())
    sampler = make_sampler(t.rollout_model())

    def score_completions(seq_rows, rollout):
        return score_rollout(funcs, weights, seq_rows, rollout, max_new_tokens=rollout_cfg.max_new_tokens,
                             buffer=grpo.overlong_buffer, coef=grpo.overlong_penalty)

    def greedy_scores(prompt_rows):  # ReMax's baseline: the greedy completion's score, no KL term
        t.rollout_model()  # (rollout.release_replica: the copy brought back, same weights)
        greedy = sampler.sample([p["prompt_ids"] for p in prompt_rows], n=1, temperature=0.0)
        return torch.nan_to_num(score_completions(prompt_rows, greedy)[1])

    def next_prompts():  # the global batch and, under torchrun, this rank's share of it
        batch = [prompts[i] for i in t.order.global_batch_at(t.order.position)]
        t.order.next()
        mine = t.order.part(list(range(len(batch))), distributed.rank()) if distributed.active() else None
        return batch, mine

    def produce(step, sampler):
        # 1-2. sample G completions per prompt and score them (+ overlong shaping). The seed is a
        #    function of (seed, step) so a resumed run draws the same completions. Dynamic sampling
        #    drops groups with no reward variance and samples more prompts (online_sampling.collect).
        def sample(prompt_ids, seed, mine):
            return sampler.sample(prompt_ids, n=rollout_cfg.num_generations, seed=seed, only=mine)
        collected = collect(sample, next_prompts, score_completions, share, rollout_cfg.num_generations,
                            seed=cfg.run.seed * 1_000_003 + step, dynamic=grpo.dynamic_sampling,
                            max_rounds=grpo.max_sampling_rounds, every_rank=every_rank)
        collected.epoch = t.order.epoch
        return collected
    # partial rollouts: completions continue across weight updates (online_partial)
    produce = PartialRollouts(next_prompts, score_completions, cfg, start=t.step, epoch=lambda: t.order.epoch) \
        if cfg.queue.partial else produce

    if link is not None and link.samples:  # a sampler process: batches to the trainer until the last
        return finish_sampler(t, serve(t, link, produce, sampler, cfg.queue.max_staleness))
    # Where step k's batch comes from: sampled here and now (max_staleness 0), by a thread ahead of
    # the trainer (interleaved) or by another process (disaggregated); online_async.
    source = batch_source(cfg, t, produce, sampler, make_sampler, link)  # (and its in-flight batches in each checkpoint)
    # Sampling and the update never overlap: the KV cache lives in the gradient buffer (one of the
    # two held, not both; common.flat_grad_buffer), which is zeroed after sampling. Only if it fits.
    grad_buffer = lend_gradients(sampler, t.model, prompts_per_step * rollout_cfg.num_generations,
                                 max(len(p["prompt_ids"]) for p in prompts) + rollout_cfg.max_new_tokens) \
        if source.lends_gradients else None

    held_out = HeldOut.of_prompts(cfg, t.data.eval, eval_funcs, eval_weights)  # {} without eval_data
    history = t.history.setdefault("reward", [])  # checkpointed: a resume keeps the earlier steps'
    last: dict = {}
    try:
        while t.step < t.total_steps:
            started, gathered = time.perf_counter(), t.gather_seconds
            collected, queue_stats = source.get(t.step)  # 1-2. step k's scored rollouts (produce)
            # rollout.release_replica: the copy's memory to the reference's forward and the update
            t.lend_rollout_memory(sampler)
            with source.trainer_turn():  # (the GPU work; the waits for the source stay outside)
                # 3. masks, old / reference log-probs (no grad);  4. advantages, as the estimator
                #    asks, weighted by the off-policy correction (is_correction)
                batch = prepare_batch(t, collected, cfg)
                assign_advantages(batch, grpo, greedy_scores)
                correction = correct_off_policy(batch, grpo)
                if grad_buffer is not None:  # (it held the sampler's KV cache until now)
                    grad_buffer.zero_()
            source.before_update(t.step)
            t.lend_rollout_memory(sampler)  # (again, if ReMax's baseline brought the copy back)
            with source.trainer_turn():
                # 5. μ updates on this batch
                update = update_policy(t, batch, grpo, norm_length=rollout_cfg.max_new_tokens,
                                       keep_grads=grad_buffer is not None)
                t.step += 1
                source.after_update(t.step)  # the samplers' weights: version t.step
                # 6. log / samples / checkpoint
                last = {**step_metrics(t, batch, update, names, time.perf_counter() - started), **correction,
                        **queue_stats, **partial_metrics(batch, t.step - 1)}
            if t.replica is not None and source.refreshes_replica:
                last["gather_time"] = t.gather_seconds - gathered
            history.append(last["reward"])
            if t.log_due():
                t.log(last)
                with source.trainer_turn():  # (its GPU reads)
                    t.add_samples(samples(batch, cfg.run.num_samples, names))
            if t.due(cfg.run.eval_every):
                with source.alone(sampler):  # (interleaved: the sampler thread paused meanwhile)
                    t.log_eval(held_out(t, sampler))
            if t.due(cfg.run.save_every):
                t.checkpoint()
            t.bar.update({"reward": last["reward"], "kl": last.get("kl", 0.0), **t.eval_shown})
    finally:
        source.close()

    final_eval = held_out(t, sampler)
    t.log_eval(final_eval)
    report = t.data.report
    return t.finish({**final_eval, "prompts": len(prompts), "final_reward": last.get("reward"),
                     "reward_history": history, "data": {"summary": report.summary(), "rows": report.total,
                                                         "truncated": report.truncated, "dropped": report.dropped}})
