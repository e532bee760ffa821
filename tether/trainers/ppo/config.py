"""PPO-RLHF's config: the algorithm's section (`ppo`: reward shaping, GAE, the update, β), the
run's sections (docs/ppo.md) and, for multi-turn episodes, the environment (docs/environments.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tether.config import ConfigError, flat_init
from tether.constraints import Fraction, NonNegative, Positive, PositiveInt
from tether.envs.rollouts import EnvSection
from tether.trainers.core.held_out import check_eval
from tether.trainers.core.sections import (check_env, ModelSection, OptimSection, PromptSection, RewardSection,
                                           RolloutSection, RunSection)


@dataclass
class PPOSection:
    value_model: str = ""
    "value init: a reward-model dir, 'policy' (fresh head on the policy), or '' = first rm:<dir> else policy"
    kl_coef: NonNegative = 0.05
    "β: per-token KL penalty in the reward, r̃_t = −β·KL_t (+ the score at the last token)"
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    "KL estimator in the reward: k1 = log π − log π_ref (classic RLHF), k3 = non-negative, low variance"
    adaptive_kl: bool = False
    "adapt β toward kl_target (Ziegler et al. 2019) instead of keeping it fixed"
    kl_target: Positive = 6.0
    "adaptive β: target mean sequence KL (nats)"
    kl_horizon: Positive = 10000.0
    "adaptive β: horizon in samples"
    kl_budget: NonNegative = 0.0
    "stop the run early once the mean sequence KL to the reference exceeds this (nats; 0 = no budget)"
    length_penalty: float = 0.0
    "subtract this × completion length (tokens) from each score"
    process_reward: bool = False
    "dense rewards from the one 'prm:<run>' reward: each step's score at the step's last token instead of one score at the end (tether/trainers/ppo/process.py)"
    gamma: Fraction = 1.0
    "GAE discount γ"
    lam: Fraction = 0.95
    "GAE λ"
    whiten_advantages: bool = True
    "normalize advantages to mean 0, std 1 over the batch's completion tokens"
    ppo_epochs: PositiveInt = 4
    "passes over each rollout batch"
    num_minibatches: PositiveInt = 4
    "minibatches per pass (one optimizer step each)"
    cliprange: Positive = 0.2
    "ε of the clipped policy ratio"
    cliprange_value: Positive = 0.2
    "clip of the value update around V_old"
    vf_coef: NonNegative = 0.1
    "weight of the value loss"
    ent_coef: NonNegative = 0.0
    "entropy bonus weight (loss −= ent_coef · mean token entropy)"


@flat_init
@dataclass
class PPOConfig:
    model: ModelSection = field(default_factory=ModelSection)
    "the policy to train (the SFT model), also the frozen reference; compile also compiles the critic"
    data: PromptSection = field(default_factory=lambda: PromptSection(batch_size=32))
    "prompts; batch_size prompts per step (the rollout batch)"
    rollout: RolloutSection = field(default_factory=lambda: RolloutSection(num_generations=1, max_new_tokens=128))
    "sampling"
    reward: RewardSection = field(default_factory=RewardSection)
    "rewards: 'rm:<dir>[,<dir>...]' (learned RM / ensemble), built-in names, or 'module:function'"
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5, schedule="constant", max_steps=100))
    "one AdamW over policy and critic; max_steps counts rollout batches, warmup counts optimizer updates"
    run: RunSection = field(default_factory=lambda: RunSection(name="ppo", log_every=1, num_samples=2))
    "run directory, seed (prompt order, sampling, minibatch shuffling), logging, checkpoints"
    ppo: PPOSection = field(default_factory=PPOSection)
    "reward shaping, GAE, the PPO update, β"
    environment: EnvSection = field(default_factory=EnvSection)
    "multi-turn episodes of an environment instead of one completion per prompt (docs/environments.md)"

    def __post_init__(self):
        check_eval(self, funcs_need_data=False)  # eval_every needs data.eval_data
        check_env(self)
        if self.environment.env and self.ppo.process_reward:
            raise ConfigError("config key 'ppo.process_reward': a PRM scores the steps of one completion's "
                              "text; an episode's transcript holds the environment's messages too")
        self.rollout.check_release()
        if self.ppo.num_minibatches > self.data.batch_size * self.rollout.num_generations:
            raise ValueError("num_minibatches cannot exceed batch_size × num_generations")
