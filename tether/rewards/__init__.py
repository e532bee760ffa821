"""Reward functions: the protocol, composition, built-in verifiers and the code sandbox.

Layer: below trainers, above tasks/data. Nothing here imports a trainer; learned.py and scoring.py
import torch, so this __init__ leaves them out (import them by their module path)."""

from tether.rewards.registry import (RewardBatch, RewardError, RewardSet, builtin_rewards,
                                     compute_rewards, load_reward, reward_name)

__all__ = ["RewardBatch", "RewardError", "RewardSet", "builtin_rewards", "compute_rewards",
           "load_reward", "reward_name"]
