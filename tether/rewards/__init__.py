"""Reward functions: the protocol, composition, built-in verifiers and the code sandbox.

Layer: below trainers, above data/tasks. Nothing here imports torch or a trainer."""

from tether.rewards.registry import (RewardBatch, RewardError, RewardSet, builtin_rewards,
                                     compute_rewards, load_reward, reward_name)

__all__ = ["RewardBatch", "RewardError", "RewardSet", "builtin_rewards", "compute_rewards",
           "load_reward", "reward_name"]
