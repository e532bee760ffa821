"""The GRPO family (`tether grpo`, `rloo`, `remax`; docs/grpo.md): config.py (the `grpo` section,
the presets, the refusals), loop.py (`train_grpo`: produce -> score -> advantages -> update -> log,
over one `Batch`), update.py (the off-policy correction and the μ optimizer updates)."""

from tether.trainers.grpo.config import GRPOConfig, GRPOSection, ReMaxConfig, RLOOConfig
from tether.trainers.grpo.loop import train_grpo

__all__ = ["GRPOConfig", "GRPOSection", "RLOOConfig", "ReMaxConfig", "train_grpo"]
