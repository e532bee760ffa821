"""The GRPO family's config: the algorithm's section (`grpo`: estimator, surrogate, KL, reuse,
DAPO options, off-policy correction), the run's sections, the `rloo` and `remax` presets, and the
combinations the loop refuses before anything loads (docs/grpo.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from tether.config import ConfigError, flat_init
from tether.constraints import NonNegative, NonNegativeInt, Positive, PositiveInt
from tether.objectives import ADVANTAGE_ESTIMATORS, IS_CORRECTIONS, IS_LEVELS, SURROGATES
from tether.trainers.core.held_out import check_eval
from tether.trainers.core.sections import (check_env, ModelSection, OptimSection, PromptSection, RewardSection,
                                           RolloutSection, RunSection)
from tether.envs.rollouts import EnvSection
from tether.trajectories.source import QueueSection

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
    "the trajectory queue: staleness bound and where sampling runs (tether/trajectories)"
    environment: EnvSection = field(default_factory=EnvSection)
    "multi-turn episodes of an environment instead of one completion per prompt (docs/environments.md)"

    def __post_init__(self):
        check_eval(self)  # eval_every / eval_reward_funcs need data.eval_data
        check_queue(self)
        check_env(self)
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


def check_queue(cfg: GRPOConfig) -> None:
    """The trajectory queue's settings the GRPO loop refuses (one-line errors, before anything loads)."""
    q, grpo = cfg.queue, cfg.grpo
    if q.partial:
        for key, bad, why in (("grpo.dynamic_sampling", grpo.dynamic_sampling, "its refill rounds"),
                              ("grpo.advantage", grpo.advantage == "remax", "remax's greedy baseline"),
                              ("queue.sampler_ranks", q.sampler_ranks > 1, "several sampler processes")):
            if bad:
                raise ConfigError(f"config key '{key}': partial rollouts do not work with {why} yet")
        # (PartialRollouts refuses these too, but only once the model has loaded: say it up front)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        trainers = world - q.sampler_ranks if q.placement == "disaggregated" else world
        if trainers > 1:
            raise ConfigError("config key 'queue.partial': partial rollouts run in one process, or "
                              "placement=disaggregated with one trainer process (torchrun --nproc-per-node 2)")
    if cfg.rollout.release_replica and (q.partial or q.placement != "auto" or q.max_staleness > 0):
        raise ConfigError("config key 'rollout.release_replica': only the synchronous loop (placement=auto, "
                          "max_staleness=0, no partial rollouts) leaves the sampler idle during the update")
    if q.placement == "auto" and q.max_staleness == 0:
        return
    if grpo.advantage == "remax":
        raise ConfigError("config key 'queue.placement': advantage=remax needs the synchronous loop "
                          "(max_staleness=0, placement=auto): its greedy baseline is sampled by the trainer")
    if q.placement == "disaggregated" and q.sampler_ranks > 1 and grpo.dynamic_sampling:
        # each sampler skips the others' batches in the data order: it must know how many prompts they draw
        raise ConfigError("config key 'queue.sampler_ranks' must be 1 with dynamic_sampling (its rounds "
                          "draw a data-dependent number of prompts)")
