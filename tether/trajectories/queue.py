"""The trajectory queue between samplers and the trainer.

Producers sample with policy version v (the number of optimizer steps behind the weights they
hold) and put scored trajectories — one training step's batch: tokens, the sampler's log-probs,
rewards — tagged with v; the trainer at version `current` takes the oldest batch whose version is
≥ current − max_staleness, dropping (and counting) older ones. The queue is bounded: a producer
that runs ahead blocks until the trainer has taken a batch.

The schedule that fills it is the sources' (asynchronous.py): batch j is sampled with version
max(start, j − max_staleness), so at max_staleness 0 every batch is sampled with the weights it is
trained on (the synchronous loop), and at 1 batch k+1 is sampled while batch k trains.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass
class Trajectories:
    batch: Any
    "one step's scored rollouts (sampling.StepBatch)"
    version: int
    "the policy version they were sampled with (optimizer steps taken when its weights were copied)"
    index: int
    "the position of the batch in the stream (the step it is meant for)"


class QueueClosed(RuntimeError):
    """The queue was closed (the trainer stopped) while a producer waited to put."""


class TrajectoryQueue:
    """Bounded, thread-safe FIFO of `Trajectories`, taken by version (module doc)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.dropped = 0
        "batches taken out unused because they were too stale"
        self._items: deque[Trajectories] = deque()
        self._cond = threading.Condition()
        self._error: Optional[BaseException] = None
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, item: Trajectories, timeout: Optional[float] = None) -> None:
        """Append `item`, waiting while the queue is full. Raises QueueClosed once closed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity, timeout):
                raise TimeoutError(f"trajectory queue full for {timeout} s")
            if self._closed:
                raise QueueClosed("the trajectory queue was closed")
            self._items.append(item)
            self._cond.notify_all()

    def get(self, current: int, max_staleness: int, timeout: Optional[float] = None) -> Trajectories:
        """The oldest batch of version ≥ current − max_staleness, waiting for one; older batches
        are dropped (counted in `dropped`). Raises the producer's error if it failed (`fail`)."""
        floor = current - max_staleness
        with self._cond:
            while True:
                while self._items and self._items[0].version < floor:
                    self._items.popleft()
                    self.dropped += 1
                    self._cond.notify_all()
                if self._items:
                    item = self._items.popleft()
                    self._cond.notify_all()
                    return item
                if self._error is not None:
                    raise RuntimeError(f"the sampler failed: {self._error}") from self._error
                if self._closed:
                    raise QueueClosed("the trajectory queue was closed")
                if not self._cond.wait(timeout):
                    raise TimeoutError(f"no trajectories of version >= {floor} within {timeout} s")

    @property
    def error(self) -> Optional[BaseException]:
        """A producer's error (`fail`), or None."""
        return self._error

    def fail(self, error: BaseException) -> None:
        """A producer's error: every waiting and later `get` raises it (once the queue is empty)."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter; later puts raise QueueClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


QUEUE_STATE = "queue.pt"
"a checkpoint's file of the queue's state (written by the interleaved placement, and by the synchronous loop with partial rollouts)"


def save_queue_state(directory, position: int, producer: Any, pending: list) -> None:
    """Into checkpoint `directory`: the data position after the last batch sampled (a producer
    thread may have drawn further by the time the trainer saves), the producer's state (partial
    rollouts' groups in flight; None) and the batches sampled but not yet trained (`Trajectories`)
    — what a resumed run cannot sample again with the checkpoint's weights."""
    import torch
    torch.save({"position": position, "producer": producer, "pending": pending}, Path(directory) / QUEUE_STATE)


def load_queue_state(directory) -> Optional[dict]:
    """`save_queue_state`'s dict from checkpoint `directory`, or None (none written, or no checkpoint)."""
    if directory is None or not (Path(directory) / QUEUE_STATE).exists():
        return None
    import torch
    return torch.load(Path(directory) / QUEUE_STATE, map_location="cpu", weights_only=False)
