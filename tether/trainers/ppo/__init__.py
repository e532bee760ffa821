"""PPO-RLHF (`tether ppo`; docs/ppo.md): config.py (the `ppo` section), critic.py (the value model
and β: built beside the policy, checkpointed, resumed), loop.py (`train_ppo`: rollouts -> scores
-> storage -> GAE -> epochs of minibatch updates -> β, log), update.py (whitening and the
minibatch passes over the global batch under torchrun), process.py (a PRM's step scores as
dense rewards)."""

from tether.trainers.ppo.config import PPOConfig, PPOSection
from tether.trainers.ppo.loop import train_ppo

__all__ = ["PPOConfig", "PPOSection", "train_ppo"]
