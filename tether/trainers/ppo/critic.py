"""PPO's value model and β: the critic built beside the policy (one optimizer, one guarded step
over both), its checkpoint (`value/`) and the possibly adapted β (`ppo_state.json`) inside every
checkpoint, and both back on resume.

Why the policy and value are two networks: sharing a body makes the value loss pull on the
policy's features (InstructGPT and TRL keep them separate); one AdamW covers both. Under LoRA
only the policy gets adapters; the critic is trained in full.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from torch import nn

from tether import distributed
from tether.models.heads import ScalarHeadModel
from tether.models.load import compile_layers
from tether.objectives import AdaptiveKLController, FixedKLController
from tether.trainers.core.setup import load_policy
from tether.trainers.core.sharding import shard_model
from tether.trainers.ppo.config import PPOConfig, PPOSection


def _rm_dirs(specs: Sequence) -> list[Path]:
    """Model directories of the `rm:` specs (run directories resolve to their newest checkpoint)."""
    from tether.rewards.learned import parse_rm_spec, resolve_rm_path

    return [resolve_rm_path(d) for s in specs if isinstance(s, str) and s.startswith("rm:")
            for d in parse_rm_spec(s)[0]]


def load_value_model(cfg: PPOConfig, ckpt: Path | None) -> ScalarHeadModel:
    """The critic: from the checkpoint on resume; else from a reward model (default when there is
    one: it already reads the responses the way the score does, so early values are informed) or
    from the policy with a fresh head."""
    value_model = cfg.ppo.value_model
    if ckpt is not None:
        src = ckpt / "value"
    elif value_model and value_model != "policy":
        from tether.rewards.learned import resolve_rm_path
        src = resolve_rm_path(value_model)
    else:
        rms = _rm_dirs(cfg.reward.reward_funcs)
        src = Path(rms[0]) if rms and value_model != "policy" else Path(cfg.model.path)
    value = ScalarHeadModel.from_pretrained(src, kind="value", dtype=cfg.model.dtype, device=_load_device(cfg))
    value.offset = 0.0  # reward centering is an RM property; returns are learned from scratch anyway
    return value


def _load_device(cfg: PPOConfig) -> str:
    """Under torchrun on GPUs the models load into CPU memory and sharding moves each rank's shards
    to its GPU (as setup_training's own build does): policy and critic never sit whole on a GPU."""
    return "cpu" if distributed.active() and distributed.uses_cuda() else cfg.model.device


def build_policy_and_critic(cfg: PPOConfig, ckpt: Path | None):
    """(policy, {policy, value}): one optimizer, one clip and one step cover both networks, while
    the checkpoint holds the policy (its adapter under LoRA) and `save_ppo_state` adds the critic."""
    policy = load_policy(dataclasses.replace(cfg.model, device=_load_device(cfg)), ckpt)
    critic = load_value_model(cfg, ckpt)  # a fresh head draws from the RNG after the policy loads
    if cfg.model.compile:  # setup_training compiles the policy and the reference
        compile_layers(critic)
    if distributed.active():  # setup_training shards the policy and the reference, then builds the
        shard_model(critic, cfg)  # optimizer over both networks: the critic's shards must exist by then
    return policy, nn.ModuleDict({"policy": policy, "value": critic})


def kl_controller(spec: PPOSection, ckpt: Path | None):
    """β, fixed or adaptive; on resume the value the checkpoint left (an adaptive β has moved)."""
    control = AdaptiveKLController(spec.kl_coef, spec.kl_target, spec.kl_horizon) if spec.adaptive_kl \
        else FixedKLController(spec.kl_coef)
    if ckpt is not None:
        control.value = json.loads((ckpt / "ppo_state.json").read_text())["kl_coef"]
    return control


def save_ppo_state(path: Path, critic: ScalarHeadModel, control) -> None:
    """The critic and the (possibly adapted) β are part of the state a resume needs. Every rank
    calls this: a sharded critic is gathered (collective), rank 0 writes."""
    gathered = distributed.full_state_dict(critic) if distributed.is_sharded(critic) else None
    if distributed.is_main():
        critic.save_pretrained(path / "value", state_dict=gathered)
        (path / "ppo_state.json").write_text(json.dumps({"kl_coef": control.value}) + "\n")
