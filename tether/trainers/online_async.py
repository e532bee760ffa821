"""Where the online trainer's batches come from: the trajectory queue (tether/rollout/queue.py),
its placements, and the off-policy correction of what it hands over (issue 19; docs/grpo.md).

The loop (online.train_grpo) asks a *source* for step k's scored batch (`get`), updates on it
between `before_update` and `after_update` (its GPU work inside `trainer_turn`, its evaluation
inside `alone`: where a sampler thread shares the GPU, no graph capture overlaps the one and no
sampling the other), and the source decides who sampled it, with which weights:

- **synchronous** (max_staleness 0, placement auto): sampled right there, with the weights about to
  be trained — the loop as it always was.
- **interleaved** (one process): a producer thread samples on its own copy of the policy while the
  trainer updates; batch j is sampled with version max(start, j − S) (S = max_staleness), the
  copy refreshed in place between batches. The schedule is fixed, not timing-dependent: the trainer
  does not start update k (which changes the weights) before the producer copied the weights of
  every batch ≤ k + S that needs them, and the producer does not copy before the version it needs
  is published, so each batch's version — and with it the run — is the same whatever the speeds.
  At S = 0 it computes exactly what the synchronous loop does (the test); at S = 1 batch k+1's
  generation overlaps batch k's update. On CUDA the producer runs on its own stream.
- **disaggregated** (torchrun: the first processes train — FSDP2 among them as under plain
  torchrun, each on its share of the sampler's batch — and the last one samples): the sampler
  process runs the same schedule; batches go through torchrun's key-value store (bounded by the
  schedule to S + 1 in flight), weights come back after each update by a broadcast (gloo on CPU,
  NCCL on GPUs) over a process group of their own.

Resume (interleaved, and the synchronous loop with partial rollouts): each checkpoint holds what
its weights cannot reproduce (`save_state`: the batches sampled with older versions but not yet
trained, the data position after them, partial rollouts' groups in flight), so a run that dies and
resumes computes what the uninterrupted run does (tested). A *finished* run extended by a resume
has no batches in flight: its first S batches are sampled with the resumed weights.

Off-policy correction (`correct_off_policy`): with is_correction = tis | mis the sampler's
log-probs μ are the behaviour policy, the trainer's own (recomputed before the update, prepare_batch)
π_old; every advantage is weighted by objectives.importance_weights(π_old / μ), which corrects both
the staleness and the sampler–trainer numeric mismatch.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

from tether import distributed
from tether.config import ConfigError
from tether.constraints import NonNegativeInt, PositiveInt
from tether.errors import UserError
from tether.objectives import importance_weights, is_metrics
from tether.rollout import graphs
from tether.rollout.queue import QueueClosed, Trajectories, TrajectoryQueue, load_queue_state, save_queue_state


@dataclass
class QueueSection:
    max_staleness: NonNegativeInt = 0
    "policy versions a trained batch may lag the trainer (0 = sample, then train on the same weights: the synchronous loop)"
    placement: Literal["auto", "interleaved", "disaggregated"] = "auto"
    "auto: synchronous at max_staleness 0, else interleaved; interleaved: one process, a sampler thread on a copy of the policy; disaggregated: under torchrun the last sampler_ranks processes sample, the others train (FSDP2 among them)"
    sampler_ranks: PositiveInt = 1
    "disaggregated: how many of torchrun's processes sample (the last ones; batch j is sampler j mod sampler_ranks's)"
    partial: bool = False
    "partial rollouts (online_partial): each round generates at most partial_tokens more tokens per unfinished completion; finished groups are the batch, the others continue with the next version's weights, every token tagged with the version that sampled it"
    partial_tokens: PositiveInt = 64
    "partial rollouts: the tokens a completion may grow per round (batch); a completion of L tokens spans ceil(L / partial_tokens) rounds"


def check_queue(cfg) -> None:
    """Config combinations the queue refuses (one-line errors, before anything loads)."""
    q, grpo = cfg.queue, cfg.grpo
    if q.partial:
        for key, bad, why in (("grpo.dynamic_sampling", grpo.dynamic_sampling, "its refill rounds"),
                              ("grpo.advantage", grpo.advantage == "remax", "remax's greedy baseline"),
                              ("queue.sampler_ranks", q.sampler_ranks > 1, "several sampler processes")):
            if bad:
                raise ConfigError(f"config key '{key}': partial rollouts do not work with {why} yet")
        # (PartialRollouts refuses these too, but only once the model has loaded: say it up front)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        trainers = world - q.sampler_ranks if q.placement == "disaggregated" else world
        if trainers > 1:
            raise ConfigError("config key 'queue.partial': partial rollouts run in one process, or "
                              "placement=disaggregated with one trainer process (torchrun --nproc-per-node 2)")
    if cfg.rollout.release_replica and (q.partial or q.placement != "auto" or q.max_staleness > 0):
        raise ConfigError("config key 'rollout.release_replica': only the synchronous loop (placement=auto, "
                          "max_staleness=0, no partial rollouts) leaves the sampler idle during the update")
    if q.placement == "auto" and q.max_staleness == 0:
        return
    if grpo.advantage == "remax":
        raise ConfigError("config key 'queue.placement': advantage=remax needs the synchronous loop "
                          "(max_staleness=0, placement=auto): its greedy baseline is sampled by the trainer")
    if q.placement == "disaggregated" and q.sampler_ranks > 1 and grpo.dynamic_sampling:
        # each sampler skips the others' batches in the data order: it must know how many prompts they draw
        raise ConfigError("config key 'queue.sampler_ranks' must be 1 with dynamic_sampling (its rounds "
                          "draw a data-dependent number of prompts)")


# ---- off-policy correction --------------------------------------------------------------------------

def correct_off_policy(batch, grpo) -> dict:
    """Weight `batch.advantages` by the IS correction of π_old (batch.old_logps, the trainer's)
    against the sampler's log-probs; returns the weights' metrics over every rank's tokens."""
    if grpo.is_correction == "none":
        return {}
    mask = batch.mask
    c = importance_weights(grpo.is_correction, batch.old_logps, batch.tensors["logprobs"], mask,
                           grpo.is_level, grpo.is_cap)
    batch.advantages = batch.advantages * c.weights
    if not distributed.active():
        return {k: float(v) for k, v in is_metrics(grpo.is_correction, c, mask).items()}
    m = mask.bool()
    tokens, total, capped = distributed.sum_floats([m.sum(), c.weights[m].sum(), c.capped[m].sum()])
    top = distributed.max_float(float(c.weights[m].max()) if m.any() else float("-inf"))
    name = [k for k in is_metrics(grpo.is_correction, c, mask) if k.startswith("is_weight/frac")][0]
    return {"is_weight/mean": total / max(tokens, 1), "is_weight/max": top, name: capped / max(tokens, 1)}


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


def _after_eval(t, sampler) -> None:
    """An eval point's memory back: its sampler's graphs and cache, and the trainer's replica
    (rollout_model() brings it back, refreshed, for the next one)."""
    if sampler is not None:
        sampler.release()
    t.free_replica()


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

    def __init__(self, t, produce: Callable, make_sampler: Callable, max_staleness: int):
        if distributed.active():
            raise ConfigError("config key 'queue.placement': interleaved runs in one process; under "
                              "torchrun use placement=disaggregated")
        self.t, self.produce, self.S = t, produce, max_staleness
        self.start, self.total = t.step, t.total_steps
        # its own copy of the policy, in the sampling dtype (t.replica's with rollout.sampler_copy).
        # t.replica stays for held-out evaluation, freed between eval points (alone; a point's
        # peak holds both copies): evaluation must sample with the numerics the policy is trained
        # to sample with. Session 16 (SmolLM2, bf16 copy, staleness 4, 30 steps): the fp32
        # weights scored greedy pass@1 0.1575 where the same weights rounded to bf16 scored
        # 0.4025 (`tether eval` of the bf16 checkpoint: 0.39) — sessions 14-15's "wrong eval points".
        self.model = copy.deepcopy(t.replica if t.replica is not None else t.model).requires_grad_(False).eval()
        t.free_replica()
        self.sampler = make_sampler(self.model)
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
        through training; the next eval point captures anew). Session 15, CUDA: beside the running
        producer an eval point's graph capture failed, and eval points after the first scored
        held-out pass@1 0.14-0.16 where `tether eval` scores the same weights 0.39. Neither was a
        race: evaluation sampled the fp32 weights while training samples a bf16 copy (__init__).
        The pause stays, as does the capture fix (graphs.capture: each Sampler on its own stream):
        two threads' graph captures must not overlap. The replica evaluated is freed again
        afterwards (t.free_replica), as it is outside eval points."""
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: not self.busy)
        try:
            yield
        finally:
            try:
                _after_eval(self.t, sampler)
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


# ---- disaggregated: 1 trainer + sampler processes under torchrun ------------------------------------

@dataclass
class Link:
    """This process's side of the disaggregated placement."""
    samples: bool
    "this process samples (else it trains)"
    store: object
    "torchrun's key-value store (prefixed): the batches travel through it"
    weights: object
    "the process group the weights are broadcast over (trainer rank 0 = its rank 0, the sampler 1); None on other trainer ranks"
    timeout: float
    trainers: int = 1
    "trainer processes (torchrun's first ones; FSDP2 among them as under plain torchrun)"
    samplers: int = 1
    "sampler processes (the last ones)"
    index: int = 0
    "this sampler's number among them (it samples batches j with j mod samplers = index)"


def split_world(cfg) -> Optional[Link]:
    """placement=disaggregated: join torchrun's store, make the weights' process group (trainer rank
    0 + the sampler), give the trainer processes a process group of their own (the default one, as
    plain torchrun would: FSDP2 and tether.distributed work among them unchanged) and leave the
    sampler a world of its own (WORLD_SIZE=1). Call before anything loads. None for the other
    placements."""
    if cfg.queue.placement != "disaggregated":
        return None
    import datetime
    import torch.distributed as dist
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    trainers = world - cfg.queue.sampler_ranks
    if trainers < 1:
        raise UserError(f"{cfg.run.name}: placement=disaggregated runs trainer processes + {cfg.queue.sampler_ranks} "
                        f"sampler process(es): torchrun --nproc-per-node {1 + cfg.queue.sampler_ranks} or "
                        f"more (this is {world} process(es))")
    if cfg.run.resume:
        raise ConfigError("config key 'run.resume': placement=disaggregated does not resume yet")
    timeout = float(os.environ.get("TETHER_DIST_TIMEOUT", "600"))
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=datetime.timedelta(seconds=timeout)))
    cuda = torch.cuda.is_available() and os.environ.get("TETHER_DIST_BACKEND", "") != "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    prefixed = dist.PrefixStore("tether/queue", store)
    group = None
    if rank == 0 or rank >= trainers:  # trainer rank 0 (link rank 0) and the sampler (link rank 1)
        pg_store, link_rank = dist.PrefixStore("tether/weights", store), 0 if rank == 0 else rank - trainers + 1
        size = 1 + cfg.queue.sampler_ranks
        group = dist.ProcessGroupNCCL(pg_store, link_rank, size) if cuda else \
            dist.ProcessGroupGloo(pg_store, link_rank, size, datetime.timedelta(seconds=timeout))
    samples = rank >= trainers
    # From here each side is what tether.distributed expects: the trainers a torchrun world of
    # their own (distributed.init joins it over the same store), the sampler one process.
    os.environ["WORLD_SIZE"] = "1" if samples else str(trainers)
    if not samples and trainers > 1:
        distributed.init(store=dist.PrefixStore("tether/trainers", store))
    return Link(samples=samples, store=prefixed, weights=group, timeout=timeout, trainers=trainers,
                samplers=cfg.queue.sampler_ranks, index=max(rank - trainers, 0))


def sampler_config(cfg, link: Link):
    """A sampler process's config: no progress bar, no evaluation, and a scratch runs_dir (removed by
    `finish_sampler`): it writes nothing there (tether.run leaves writing to RANK 0), but would
    check the trainer's run directory and its lock, which the trainer is taking at that moment."""
    import tempfile
    return dataclasses.replace(cfg, run=dataclasses.replace(
        cfg.run, progress=False, save_every=0, eval_every=0, runs_dir=tempfile.mkdtemp(prefix="tether-sampler-")))


def finish_sampler(t, counts: dict) -> dict:
    """A sampler process's end: its run closed, its scratch runs_dir removed; returns `counts`."""
    import shutil
    t.bar.close()
    t.run.close()
    shutil.rmtree(t.cfg.run.runs_dir, ignore_errors=True)
    return counts


BROADCAST_BUCKET_BYTES = 256 << 20  # a weight broadcast's unit: consecutive same-dtype tensors up to this


def _buckets(values: list) -> list[list]:
    """`values` cut into runs of one dtype and at most BROADCAST_BUCKET_BYTES (a larger tensor alone),
    in order: both sides cut the same state_dict (same names, shapes, dtypes) the same way."""
    out, size = [], 0
    for v in values:
        nbytes = v.numel() * v.element_size()
        if not out or v.dtype != out[-1][0].dtype or size + nbytes > BROADCAST_BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(v)
        size += nbytes
    return out


def _broadcast(link: Link, model) -> None:
    """The weights from trainer rank 0 to the sampler in state_dict order (the same names on both
    sides: FSDP2 keeps them), a bucket of tensors a broadcast: one flat buffer each instead of one
    collective per tensor (~270 for SmolLM2: their launch costs were most of the sampler's 15-20 ms
    wait for the weights, session 16). On the trainers each sharded tensor is gathered first
    (collective among them, every trainer rank in the same order)."""
    values = list(model.state_dict().values())
    for bucket in _buckets(values):
        if not link.samples:
            full = [distributed.full(v) for v in bucket]
            if link.weights is not None:  # trainer rank 0
                flat = torch.cat([f.detach().reshape(-1) for f in full])
                link.weights.broadcast(flat, 0).wait()
            continue
        flat = torch.empty(sum(v.numel() for v in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        link.weights.broadcast(flat, 0).wait()
        offset = 0
        with torch.no_grad():
            for v in bucket:
                v.copy_(flat[offset:offset + v.numel()].view_as(v))
                offset += v.numel()


def _receive(link: Link, t) -> None:
    """A sampler process takes the next version's weights into its policy (the trainer's dtype, as
    sent); a sampling copy of it (rollout.sampler_copy) is refreshed from them before the next batch."""
    _broadcast(link, t.model)
    t.replica_stale = True


def _my_part(collected, G: int):
    """This trainer rank's groups of the sampler's whole batch (every world_size-th group, as
    EpochSampler.part hands prompts out): ranks are micro-batches of the one batch, so any split
    trains the same update. A rank left without a group keeps the batch as its filler. The counts
    step_metrics adds over the ranks (tokens, dynamic sampling's groups) stay with rank 0."""
    if not distributed.active():
        return collected
    from tether.trainers.online_sampling import StepBatch, select_groups
    rank, world = distributed.rank(), distributed.world_size()
    groups = list(range(len(collected.prompt_rows)))[rank::world]
    rows = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
    sampled = torch.arange(len(collected.sampled_rewards))
    mine = sampled[(collected.sampled_groups % world) == rank]  # the metrics' rows: each rank its own
    rollout = select_groups(collected.rollout, groups, G)
    rollout.stats = dict(collected.rollout.stats)
    return StepBatch(rollout, [collected.prompt_rows[g] for g in groups], collected.per_fn[rows],
                     collected.rewards[rows], collected.sampled_rewards[mine], collected.sampled_per_fn[mine],
                     collected.sampled_groups[mine], collected.sampled_tokens if rank == 0 else 0,
                     {k: v if k == "num_sampling_rounds" or rank == 0 else 0 for k, v in collected.metrics.items()},
                     None if groups else collected.rollout, collected.epoch)


def _pack(item: Trajectories) -> bytes:
    buf = io.BytesIO()
    torch.save(item, buf)
    return buf.getvalue()


def _unpack(raw: bytes) -> Trajectories:
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)


class Disaggregated(Source):
    """The trainer's side: batches from the sampler process, weights broadcast back (module doc)."""
    lends_gradients = True  # this process only trains and evaluates
    refreshes_replica = False  # its replica serves evaluation only: refreshed and freed around eval points

    def __init__(self, t, link: Link, max_staleness: int, generations: int):
        self.t, self.link, self.S, self.total, self.G = t, link, max_staleness, t.total_steps, generations
        _broadcast(link, t.model)  # version 0: the sampler starts from exactly these weights
        t.free_replica()  # (rollout_model() brings it back, refreshed, for each eval point)

    @contextlib.contextmanager
    def alone(self, sampler=None):
        """An eval point: its sampler's graphs and cache and the trainer's replica freed after it."""
        try:
            yield
        finally:
            _after_eval(self.t, sampler)

    def get(self, step: int):
        started = time.perf_counter()
        key = f"batch/{step}"
        self.link.store.wait([key])
        item = _unpack(self.link.store.get(key))
        if self.link.store.add(f"read/{step}", 1) == self.link.trainers:  # the last trainer to read it
            self.link.store.delete_key(key)
        assert item.index == step, (item.index, step)
        return _my_part(item.batch, self.G), {"queue/staleness": step - item.version,
                                              "queue/wait_seconds": time.perf_counter() - started}

    def after_update(self, version: int) -> None:
        if version <= self.total - 1 - self.S:  # a later batch is sampled with it
            _broadcast(self.link, self.t.model)


def serve(t, link: Link, produce: Callable, sampler, max_staleness: int) -> dict:
    """A sampler process: its batches of the run (j mod samplers = its index; the others' prompts
    skipped in the data order), batch j with version max(0, j − S), put in the store for the
    trainer; every version's weights received in order (the broadcast is collective over all the
    samplers: each joins it when it needs the version, or at the end). Returns its counts."""
    _receive(link, t)
    version, produced, seconds, last = 0, 0, 0.0, max(0, t.total_steps - 1 - max_staleness)
    cuda = next(t.model.parameters()).is_cuda
    sent = 0.0  # seconds packing + storing the previous batch
    for j in range(t.total_steps):
        if j % link.samplers != link.index:
            t.order.next()  # another sampler's batch (no dynamic sampling: one batch of prompts)
            continue
        waiting = time.perf_counter()
        while version < j - max_staleness:  # the versions in order, each broadcast once
            _receive(link, t)
            version += 1
        t.rollout_model()  # the sampler's copy (rollout.sampler_copy) brought up to the version
        if cuda:  # the weights are here before the clock starts: NCCL's receive only queues on the
            torch.cuda.synchronize()  # stream, and would count the trainer's update as sampling time
        started = time.perf_counter()
        batch = produce(j, sampler)
        seconds += time.perf_counter() - started
        # the sampler's cycle, for the trainer's log: its wait for the weights, this batch's
        # sampling + scoring, and the packing + storing of its previous batch (this one's is not
        # known before it is packed)
        batch.rollout.stats.update(weights_wait_s=started - waiting, produce_s=time.perf_counter() - started,
                                   send_s=sent)
        sending = time.perf_counter()
        link.store.set(f"batch/{j}", _pack(Trajectories(batch, version, j)))
        sent = time.perf_counter() - sending
        produced += 1
    while version < last:  # the trainer broadcasts every version a batch needs: join the rest
        _receive(link, t)
        version += 1
    return {"batches": produced, "sampling_seconds": seconds, "last_version": version}


def batch_source(cfg, t, produce: Callable, sampler, make_sampler: Callable, link: Optional[Link]):
    """The source the loop takes its batches from, per cfg.queue (module doc). It also becomes the
    run's `save_extra`: what a source has in flight goes into each checkpoint (exact resume), for
    every trainer that samples through it."""
    q = cfg.queue
    if q.partial and not hasattr(produce, "state_dict"):  # a trainer whose rounds are not PartialRollouts
        raise ConfigError("config key 'queue.partial': this trainer does not sample partial rollouts")
    if link is not None:
        source = Disaggregated(t, link, q.max_staleness, cfg.rollout.num_generations)
    elif q.placement == "interleaved" or q.max_staleness > 0:
        source = Interleaved(t, produce, make_sampler, q.max_staleness)
    else:
        source = Synchronous(t, produce, sampler)
    t.save_extra = getattr(source, "save_state", None)
    return source
