"""Where a trainer's scored batches come from: the trajectory queue's config section
(`QueueSection`), the base every source builds on (`Source`: what it does around the trainer's
step), and what an eval point gives back (`after_eval`). The sources themselves live in
asynchronous.py (synchronous, interleaved) and disaggregated.py, which both import this module and
not each other both ways.

A source hands the loop step k's batch (`get`) from a *producer*: an object called as
`produce(step, sampler) -> sampling.StepBatch` (sampling.GroupSampler; partial.PartialRollouts);
with a `state_dict` it has state that goes into each checkpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

from tether.constraints import NonNegativeInt, PositiveInt


@dataclass
class QueueSection:
    max_staleness: NonNegativeInt = 0
    "policy versions a trained batch may lag the trainer (0 = sample, then train on the same weights: the synchronous loop)"
    placement: Literal["auto", "interleaved", "disaggregated"] = "auto"
    "auto: synchronous at max_staleness 0, else interleaved; interleaved: one process, a sampler thread on a copy of the policy; disaggregated: under torchrun the last sampler_ranks processes sample, the others train (FSDP2 among them)"
    sampler_ranks: PositiveInt = 1
    "disaggregated: how many of torchrun's processes sample (the last ones; batch j is sampler j mod sampler_ranks's)"
    partial: bool = False
    "partial rollouts (tether/trajectories/partial.py): each round generates at most partial_tokens more tokens per unfinished completion; finished groups are the batch, the others continue with the next version's weights, every token tagged with the version that sampled it"
    partial_tokens: PositiveInt = 64
    "partial rollouts: the tokens a completion may grow per round (batch); a completion of L tokens spans ceil(L / partial_tokens) rounds"


class Source:
    """What a source does around the trainer's step when it has nothing to do there."""
    refreshes_replica = True  # the trainer's replica is brought up to date for each batch (gather_time)

    def before_update(self, step: int) -> None:
        pass

    def after_update(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass

    def trainer_turn(self):
        """Around the trainer's GPU work (not its waits for the source): exclusive of the sampler
        thread's CUDA graph captures where there is one (Interleaved)."""
        return contextlib.nullcontext()

    def alone(self, sampler=None):
        """Around work on the GPU that no sampling may overlap at all (held-out evaluation with
        `sampler`)."""
        return contextlib.nullcontext()


def after_eval(t, sampler) -> None:
    """An eval point's memory back: its sampler's graphs and cache, and the trainer's replica
    (rollout_model() brings it back, refreshed, for the next one)."""
    if sampler is not None:
        sampler.release()
    t.free_replica()
