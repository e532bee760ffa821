"""The trajectory queue's synchronous and interleaved sources, and `batch_source`, which picks a
trainer's source from its `queue` section (docs/grpo.md).

The trainer's loop asks a *source* for step k's scored batch (`get`), updates on it between
`before_update` and `after_update` (its GPU work inside `trainer_turn`, its evaluation inside
`alone`: where a sampler thread shares the GPU, no graph capture overlaps the one and no sampling
the other), and the source decides who sampled it, with which weights:

- **synchronous** (max_staleness 0, placement auto): sampled right there, with the weights about to
  be trained.
- **interleaved** (one process): a producer thread samples on its own copy of the policy while the
  trainer updates; batch j is sampled with version max(start, j − S) (S = max_staleness), the
  copy refreshed in place between batches. The schedule is fixed, not timing-dependent: the trainer
  does not start update k (which changes the weights) before the producer copied the weights of
  every batch ≤ k + S that needs them, and the producer does not copy before the version it needs
  is published, so each batch's version — and with it the run — is the same whatever the speeds.
  At S = 0 it computes exactly what the synchronous loop does (tested); at S = 1 batch k+1's
  generation overlaps batch k's update. On CUDA the producer runs on its own stream.
- **disaggregated** (disaggregated.py; torchrun: the first processes train — FSDP2 among them as
  under plain torchrun, each on its share of the sampler's batch — and the last one samples): the
  sampler process runs the same schedule; batches go through torchrun's key-value store (bounded
  by the schedule to S + 1 in flight), weights come back after each update by a broadcast (gloo on
  CPU, NCCL on GPUs) over a process group of their own.

Resume (interleaved, and the synchronous loop with partial rollouts): each checkpoint holds what
its weights cannot reproduce (`save_state`: the batches sampled with older versions but not yet
trained, the data position after them, partial rollouts' groups in flight), so a run that dies and
resumes computes what the uninterrupted run does (tested). A *finished* run extended by a resume
has no batches in flight: its first S batches are sampled with the resumed weights.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Callable

import torch

from tether import distributed
from tether.config import ConfigError
from tether.rollout import Sampler, graphs, native
from tether.rollout.fuse import fuse_projections
from tether.trajectories.disaggregated import Disaggregated
from tether.trajectories.queue import QueueClosed, Trajectories, TrajectoryQueue, load_queue_state, save_queue_state
from tether.trajectories.source import Source, after_eval


# ---- sources ------------------------------------------------------------------------------------

def _restore(t, produce) -> list:
    """On resume: the data position and the producer's state (partial rollouts' groups in flight)
    as the checkpoint's source saved them (`save_state`); returns the batches it had in flight."""
    state = load_queue_state(t.ckpt)
    if state is None:  # nothing was in flight
        return []
    t.order.position = state["position"]
    if state["producer"] is not None:
        produce.load_state_dict(state["producer"], t.tokenizer)
    return state["pending"]


def _state(produce):
    return produce.state_dict() if hasattr(produce, "state_dict") else None


class Synchronous(Source):
    """Sample step k's batch when the trainer asks for it, with the weights it is about to train."""
    lends_gradients = True  # sampling and the update never overlap: the KV cache may sit in the gradients

    def __init__(self, t, produce: Callable, sampler):
        self.t, self.produce, self.sampler = t, produce, sampler
        _restore(t, produce)

    def save_state(self, directory) -> None:
        """Into a checkpoint: the producer's state (partial rollouts' pool; nothing otherwise)."""
        if _state(self.produce) is not None:  # else the data position in the checkpoint is exact
            save_queue_state(directory, self.t.order.position, _state(self.produce), [])

    def get(self, step: int):
        self.t.rollout_model()  # the sampler's copy of the policy brought up to date (torchrun; collective)
        return self.produce(step, self.sampler), {}


class Interleaved(Source):
    """A producer thread on a copy of the policy, `max_staleness` batches ahead (module doc)."""
    lends_gradients = False
    refreshes_replica = False  # the thread's copy is; the trainer's replica only at eval points

    def __init__(self, t, produce: Callable, sampler: Sampler, max_staleness: int):
        """`sampler`: the trainer's; the thread samples with its settings on a copy of its own."""
        if distributed.active():
            raise ConfigError("config key 'queue.placement': interleaved runs in one process; under "
                              "torchrun use placement=disaggregated")
        self.t, self.produce, self.S = t, produce, max_staleness
        self.start, self.total = t.step, t.total_steps
        # its own copy of the policy, in the sampling dtype (t.replica's with rollout.sampler_copy).
        # t.replica stays for held-out evaluation, freed between eval points (alone; a point's
        # peak holds both copies): evaluation must sample with the numerics the policy is trained
        # to sample with (SmolLM2, bf16 copy, staleness 4, 30 steps: the fp32 weights score greedy
        # pass@1 0.1575 where the same weights rounded to bf16 score 0.4025; `tether eval` of the
        # bf16 checkpoint: 0.39).
        self.model = copy.deepcopy(t.replica if t.replica is not None else t.model).requires_grad_(False).eval()
        if native.FUSE_PROJECTIONS:  # deepcopy clones each parameter apart: one buffer per group again
            fuse_projections(self.model)  # (refreshed in place by copy_full_weights, never saved)
        t.free_replica()
        self.sampler = Sampler(self.model, sampler.tokenizer, sampler.config)
        self.queue = TrajectoryQueue(max_staleness + 1)
        # On resume the batches the checkpoint had in flight (sampled with versions older than its
        # weights) go back in the queue, and sampling goes on after them (save_state).
        pending = _restore(t, produce)
        for item in pending:
            self.queue.put(item)
        self.first = self.start + len(pending)
        # j -> (data position, producer state, the batch) once batch j is produced: a checkpoint's view
        self.snaps: dict = {self.first - 1: (t.order.position, _state(produce), None)}
        self.cond = threading.Condition()
        self.version, self.copied, self.stopped = self.start, self.first - 1, False
        self.paused = self.busy = False  # alone(): the trainer has the GPU to itself
        cuda = next(t.model.parameters()).is_cuda
        self.stream = torch.cuda.Stream() if cuda else None
        self.thread = threading.Thread(target=self._produce_all, name="tether-sampler", daemon=True)
        self.thread.start()

    def _produce_all(self) -> None:
        try:
            held = None  # the version the copy holds
            for j in range(self.first, self.total):
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or (
                        not self.paused and self.version >= max(self.start, j - self.S)))
                    if self.stopped:
                        return
                    self.busy = True  # on the GPU until the batch is done (alone() waits for it)
                    version = self.version
                    if version != held:  # the trainer waits in before_update: its weights are still
                        with self._on_stream():
                            distributed.copy_full_weights(self.t.model, self.model)
                        if self.stream is not None:  # copied, not just queued, before the trainer
                            self.stream.synchronize()  # may change its weights again
                        held = version
                    self.copied = j
                    self.cond.notify_all()
                with self._on_stream():
                    batch = self.produce(j, self.sampler)
                if self.stream is not None:
                    self.stream.synchronize()  # the batch's tensors complete before the trainer reads them
                item = Trajectories(batch, version, j)
                with self.cond:
                    self.busy = False
                    self.snaps[j] = (self.t.order.position, _state(self.produce), item)
                    self.cond.notify_all()
                self.queue.put(item)
        except QueueClosed:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            self.queue.fail(e)
            with self.cond:
                self.copied = self.total
                self.cond.notify_all()
        finally:
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def trainer_turn(self):
        # on CUDA: the producer's graph captures wait for the trainer's GPU work and vice versa
        return graphs.CAPTURE_LOCK if self.stream is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def alone(self, sampler=None):
        """The producer paused between batches (its current one finished) while the trainer
        evaluates with `sampler`, whose graphs and cache are released afterwards (they are not held
        through training; the next eval point captures anew). Two threads' CUDA graph captures must
        not overlap (graphs.capture: each Sampler captures on a stream of its own), and evaluation
        samples the numerics training samples with (the bf16 copy, __init__). The replica evaluated
        is freed again afterwards (t.free_replica), as it is outside eval points."""
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: not self.busy)
        try:
            yield
        finally:
            try:
                after_eval(self.t, sampler)
            finally:
                with self.cond:
                    self.paused = False
                    self.cond.notify_all()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def get(self, step: int):
        started = time.perf_counter()
        item = self.queue.get(step, self.S)
        assert item.index == step, (item.index, step)
        with self.cond:
            for j in [j for j in self.snaps if j < step - 1]:
                del self.snaps[j]
        return item.batch, {"queue/staleness": step - item.version, "queue/wait_seconds": time.perf_counter() - started,
                            "queue/dropped": self.queue.dropped}

    def save_state(self, directory) -> None:
        """Into the checkpoint of step s (weights: version s): the batches s .. s+S−1, sampled with
        older versions (s−S .. s−1) and so not reproducible from it, and the data position and
        producer state after the last of them; batch s+S on needs version s or later: a resumed
        run samples them as this one does. Waits for the producer to finish batch s+S−1 (if it
        fails first, raises: the checkpoint is not written)."""
        s = self.t.step
        last = min(s + self.S, self.total) - 1
        with self.cond:
            self.cond.wait_for(lambda: last in self.snaps or self.queue.error is not None)
            if last not in self.snaps:  # no checkpoint that a resume could not continue exactly
                raise RuntimeError(f"the sampler failed: {self.queue.error}") from self.queue.error
            position, state, _ = self.snaps[last]
            pending = [self.snaps[j][2] for j in range(s, last + 1)]
        save_queue_state(directory, position, state, pending)

    def before_update(self, step: int) -> None:
        """Block until every batch that needs the current weights has copied them."""
        with self.cond:
            self.cond.wait_for(lambda: self.copied >= min(step + self.S, self.total - 1))

    def after_update(self, version: int) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().synchronize()  # the update done before the producer copies it
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.queue.close()
        self.thread.join(timeout=60)


def batch_source(cfg, t, produce: Callable, sampler: Sampler, link=None):
    """The source the loop takes its batches from, per cfg.queue (module doc): `produce(step,
    sampler)` makes step j's batch, `sampler` is the trainer's, `link` this process's side of the
    disaggregated placement (disaggregated.split_world). The source also becomes the run's
    `save_extra`: what it has in flight goes into each checkpoint (exact resume), for every
    trainer that samples through it."""
    q = cfg.queue
    if q.partial and not hasattr(produce, "state_dict"):  # a trainer whose rounds are not PartialRollouts
        raise ConfigError("config key 'queue.partial': this trainer does not sample partial rollouts")
    if link is not None:  # (disaggregated.Link)
        source = Disaggregated(t, link, q.max_staleness, cfg.rollout.num_generations)
    elif q.placement == "interleaved" or q.max_staleness > 0:
        source = Interleaved(t, produce, sampler, q.max_staleness)
    else:
        source = Synchronous(t, produce, sampler)
    t.save_extra = getattr(source, "save_state", None)
    return source
