"""The trajectory queue's sources (online_async's module doc): the base every placement builds on,
and what an eval point gives back. Its own module so that online_async (synchronous, interleaved)
and online_disaggregated share it without importing each other both ways."""

from __future__ import annotations

import contextlib


class Source:
    """What a source does around the trainer's step when it has nothing to do there (module doc)."""
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
