"""The disaggregated placement of the trajectory queue (asynchronous.py's module doc): under torchrun
the first processes train (FSDP2 among them, as under plain torchrun) and the last
`queue.sampler_ranks` sample; batches travel through torchrun's key-value store, weights come back
after each update by a bucketed broadcast over a process group of their own (gloo on CPU, NCCL on
GPUs). `split_world` divides the processes before anything loads; `serve` is a sampler process's
loop; `Disaggregated` the trainers' source of batches."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tether import distributed
from tether.config import ConfigError
from tether.errors import UserError
from tether.trajectories.queue import Trajectories
from tether.trajectories.sampling import StepBatch, select_groups
from tether.trajectories.source import Source, after_eval


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
    t.release()  # what Training.finish() puts back, for a process that goes on
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


def _tensors(model) -> list:
    """The model's parameters and buffers in state_dict order, each once (a tied weight is listed
    under two names: sent once — SmolLM2-135M's fp32 embeddings are 113 MB of its 538). The tensors
    themselves (keep_vars), so both sides see the tie and cut the same list into the same buckets."""
    return list({id(v): v for v in model.state_dict(keep_vars=True).values()}.values())


def _broadcast(link: Link, model) -> None:
    """The trainers' side of the weight broadcast: from trainer rank 0 to the sampler(s) in
    state_dict order (the same names on both sides: FSDP2 keeps them), a bucket of tensors a
    broadcast: one flat buffer each instead of one collective per tensor (~270 for SmolLM2, whose
    launch costs make most of a 15-20 ms wait for the weights on the sampler's side). Each sharded
    tensor is gathered first (collective among the trainers, every rank in the same order). The
    samplers' side is Incoming."""
    for bucket in _buckets(_tensors(model)):
        full = [distributed.full(v.detach()) for v in bucket]
        if link.weights is not None:  # trainer rank 0
            link.weights.broadcast(torch.cat([f.reshape(-1) for f in full]), 0).wait()


class Incoming:
    """A sampler's side of the weight broadcast. Its model's parameters and buffers are re-homed,
    once, as views of one flat buffer per bucket (_buckets' cut of the same state_dict as the
    trainer's), so a bucket is received in place: no staging buffer, no copy, no memory beyond the
    model's.

    `post()` starts receiving the next version and returns at once (NCCL queues the broadcast on
    its own stream; gloo runs it on a thread of its own); `wait()` completes it. In between the
    sampler produces a batch, which takes the weights' transfer off its critical path — allowed
    (`overlaps`) only where that batch never reads this model: it samples from a copy
    (rollout.sampler_copy, kept all run), refreshed from the model after `wait()`."""

    def __init__(self, link: Link, t):
        self.link, self.t, self.flats, self.pending = link, t, [], None
        self.version = -1  # the version in place (posted ones count once complete)
        with torch.no_grad():
            for bucket in _buckets(_tensors(t.model)):
                flat = torch.empty(sum(v.numel() for v in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                offset = 0
                for v in bucket:
                    flat[offset:offset + v.numel()].copy_(v.detach().reshape(-1))
                    v.data = flat[offset:offset + v.numel()].view_as(v)
                    offset += v.numel()
                self.flats.append(flat)
        # release_replica rebuilds the copy from the model inside a batch (ReMax's greedy pass), and
        # with several samplers each version's broadcast waits for all of them, some mid-batch
        self.overlaps = t.replica is not None and not t.cfg.rollout.release_replica and link.samplers == 1

    def post(self) -> None:
        assert self.pending is None, "one version in flight at a time"
        self.pending = [self.link.weights.broadcast(flat, 0) for flat in self.flats]

    def wait(self) -> None:
        """The posted version in place (on CUDA: ordered before what the current stream does next);
        the sampling copy, if any, is refreshed from it before the next batch."""
        for work in self.pending:
            work.wait()
        self.pending, self.version = None, self.version + 1
        self.t.replica_stale = True

    def up_to(self, version: int) -> None:
        """A posted version completed, then the versions in order, now, until `version` is in place."""
        if self.pending is not None:
            self.wait()
        while self.version < version:
            self.post()
            self.wait()


def _my_part(collected, G: int):
    """This trainer rank's groups of the sampler's whole batch (every world_size-th group, as
    EpochSampler.part hands prompts out): ranks are micro-batches of the one batch, so any split
    trains the same update. A rank left without a group keeps the batch as its filler. The counts
    step_metrics adds over the ranks (tokens, dynamic sampling's groups) stay with rank 0."""
    if not distributed.active():
        return collected
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
            after_eval(self.t, sampler)

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
    samplers: each joins it when it needs the version, or at the end). With a sampling copy
    (Incoming.overlaps) the next version is received while a batch is produced. Returns its counts."""
    incoming = Incoming(link, t)
    incoming.up_to(0)
    produced, seconds, last = 0, 0.0, max(0, t.total_steps - 1 - max_staleness)
    cuda = next(t.model.parameters()).is_cuda
    sent = 0.0  # seconds packing + storing the previous batch
    for j in range(t.total_steps):
        if j % link.samplers != link.index:
            t.order.next()  # another sampler's batch (no dynamic sampling: one batch of prompts)
            continue
        waiting = time.perf_counter()
        incoming.up_to(j - max_staleness)  # (first the one received during the previous batch, if any)
        version = incoming.version
        t.rollout_model()  # the sampler's copy (rollout.sampler_copy) brought up to the version
        if cuda:  # the weights are here before the clock starts: NCCL's receive only queues on the
            torch.cuda.current_stream().synchronize()  # stream (not the device: a posted one may be pending)
        started = time.perf_counter()
        # The next version, received while this batch is produced — if the next batch needs it (it
        # samples with version j + 1 − S: receiving earlier would sample fresher weights than the
        # schedule's). The trainer makes it from batch `version`, already in the store (version <
        # j), so its broadcast waits for nothing of this batch's: even a device-wide sync inside it
        # (a graph capture) only waits for the trainer's step.
        overlapped = incoming.overlaps and version < min(j + 1 - max(max_staleness, 1), last)
        if overlapped:
            incoming.post()
        batch = produce(j, sampler)
        seconds += time.perf_counter() - started
        # the sampler's cycle, for the trainer's log: its wait for the weights, this batch's
        # sampling + scoring, and the packing + storing of its previous batch (this one's is not
        # known before it is packed)
        batch.rollout.stats.update(weights_wait_s=started - waiting, produce_s=time.perf_counter() - started,
                                   send_s=sent, weights_overlapped=float(overlapped))
        sending = time.perf_counter()
        link.store.set(f"batch/{j}", _pack(Trajectories(batch, version, j)))
        sent = time.perf_counter() - sending
        produced += 1
    incoming.up_to(last)  # the trainer broadcasts every version a batch needs: join the rest
    return {"batches": produced, "sampling_seconds": seconds, "last_version": incoming.version}
