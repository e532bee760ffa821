"""What the trainers take of an environment's episodes (tether.envs.rollouts runs them): held-out
episodes at eval points, and what samples.jsonl keeps of an episode."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from tether.envs.rollouts import EnvSection, episode_metrics, sample_episodes
from tether.rollout import Rollout


class EpisodeEval:
    """Held-out episodes at eval points: each row played once, greedily, scored by the run's
    scoring (the environment's reward + reward_funcs). `eval/env/success` is the fraction of
    episodes whose reward is > 0 (the built-in environments give 0 to a failed episode),
    `eval/env/reward` the mean reward, `eval/env/turns` ... as episode_metrics."""

    def __init__(self, rows: list[dict], factory: Callable[[], Any], section: EnvSection, scoring):
        self.rows, self.factory, self.section, self.scoring = rows, factory, section, scoring

    def __call__(self, t, sampler) -> dict:
        if not self.rows:
            return {}
        start = time.perf_counter()
        t.rollout_model()  # (up to date; collective under torchrun: every rank calls)
        ro, kept = sample_episodes(sampler, t.tokenizer, self.factory, self.rows, 1, self.section, temperature=0.0)
        total = self.scoring([self.rows[i] for i in kept], ro)[1]
        reward = torch.nan_to_num(total)
        out = {"eval/env/reward": float(reward.mean()), "eval/env/success": float((reward > 0).float().mean()),
               **{f"eval/{k}": v for k, v in episode_metrics(ro).items()}}
        return {**out, "eval/seconds": time.perf_counter() - start}


def episode_sample(ro: Rollout, i: int) -> dict:
    """What samples.jsonl keeps of episode i beside its prompt and rewards: the transcript, the
    counts, the per-turn rewards and the trained / masked segments."""
    ep = ro.episodes[i]
    keys = ("messages", "turns", "tool_calls", "tool_errors", "turn_rewards", "env_reward", "segments")
    return {**{k: ep[k] for k in keys}, "finish_reason": ro.finish_reasons[i]}
