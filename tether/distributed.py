"""Many processes, one run: torch.distributed under `torchrun`, models sharded with FSDP2.

    torchrun --nproc-per-node 4 -m tether grpo model=... data=...

Every trainer runs unchanged in each process (rank); what differs is said here once:

- **Ranks are micro-batches.** A global batch (the config's sizes mean what they mean in one
  process) is cut into per-rank parts (`EpochSampler(rank, world_size)`). Each rank backpropagates
  its part's *sum* divided by the *global* count (tokens, rows, sequences: `sum_floats`), and FSDP2
  sums the gradients across ranks (gradient divide factor 1, see `shard`; replicated models:
  `sum_gradients`, called by every optimizer step). That is exactly the
  gradient accumulation a single process does over micro-batches, so 1 and N processes compute the
  same update (up to the order of float additions).
- **Sharding** (`shard`): FSDP2's `fully_shard` on every decoder layer, then the root; parameters
  gathered for a layer's forward and freed after. On CUDA with fp32 master weights, bf16 compute
  and fp32 gradient reduction (`MixedPrecisionPolicy`); optional CPU offload. Frozen models (the
  reference, a reward model) are sharded the same way: their forwards are collective too.
- **Or replication** (`replicate`, the trainers' `fsdp=false`): every rank holds the whole model
  exactly as one process does (same dtype, autocast), with no hooks in its forward or backward,
  and each optimizer step first sums the gradients over ranks in a few bucketed all-reduces
  (`sum_gradients`). Why it exists beside FSDP2: FSDP2's per-layer Python hooks cost CPU time on
  every forward and backward of every layer; a model small enough to be GPU-light is CPU-bound
  already (Qwen2.5-0.5B DPO on an H200: the GPU computes 30 % of a step), so those hooks are the
  whole of the 2-GPU slowdown (measured in docs/distributed.md).
- **Collectives need every rank.** A sharded forward all-gathers, so every rank must run the same
  number of forwards of a sharded model; trainers keep per-rank batch counts equal. What only rank 0
  does (writing files, printing) never touches a sharded model.
- **Checkpoints**: the consolidated model gathered to rank 0 and written as a Hugging Face folder
  (loadable by `from_pretrained`; also what a resume loads its weights from), the optimizer's
  sharded state through torch.distributed.checkpoint (`save_optimizer` / `load_optimizer`), which
  reshards on load: a checkpoint of N processes resumes in M. A single process writes the same
  format (DCP without a process group), so 1 <-> N resumes both ways.

Off torchrun (WORLD_SIZE unset or 1) nothing here does anything: `active()` is False, sums are the
values themselves, no model is wrapped.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist

OPTIMIZER_DIR = "optimizer"  # inside a checkpoint directory: the optimizer state (DCP format)


def init(store=None) -> bool:
    """Join the process group torchrun describes (WORLD_SIZE > 1); idempotent. NCCL on CUDA (each
    rank on cuda:LOCAL_RANK) with gloo for CPU tensors, gloo alone on CPU. The timeout bounds how long a rank waits in a collective
    for a peer that died (TETHER_DIST_TIMEOUT seconds, default 600); torchrun normally stops the
    job much sooner, when it sees the dead process exit."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    cuda = torch.cuda.is_available() and os.environ.get("TETHER_DIST_BACKEND", "") != "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=float(os.environ.get("TETHER_DIST_TIMEOUT", "600")))
    # gloo beside NCCL for CPU tensors: FSDP2's CPU offload keeps gradients (and their norm) there
    # store: a key-value store to meet in instead of torchrun's (a part of torchrun's processes
    # forming a world of their own, WORLD_SIZE of them: trajectories.disaggregated.split_world)
    where = {} if store is None else dict(store=store, rank=int(os.environ["RANK"]),
                                           world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", timeout=timeout, **where)
    return True


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def uses_cuda() -> bool:
    """The process group runs on GPUs (NCCL): each rank on cuda:LOCAL_RANK."""
    return active() and "nccl" in str(dist.get_backend())


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if uses_cuda() else torch.device("cpu")


_device = device  # where collectives' tensors live


def sum_floats(values: Iterable[float]) -> list[float]:
    """Each value summed over all ranks (float64, one all-reduce). Unchanged in one process."""
    values = [float(v) for v in values]
    if not active():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.tolist()


def sum_dict(values: dict) -> dict:
    """`sum_floats` over a dict's values (same keys, in the same order, on every rank)."""
    return dict(zip(values, sum_floats(values.values())))


def max_float(value: float) -> float:
    """The largest of the ranks' values (NaN if any rank's is NaN)."""
    if not active():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device())
    nan = torch.isnan(t).to(torch.float64)
    both = torch.cat([t.nan_to_num(nan=-float("inf")), nan])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # both entries are maxima: one collective
    value, any_nan = both.tolist()  # one sync
    return float("nan") if any_nan > 0 else value


def all_gather_object(obj) -> list:
    if not active():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()


_FINAL_BARRIER: list = []  # leave()'s barrier, freed by the interpreter's own teardown: see leave()


def leave() -> None:
    """Leave the process group this process joined (torchrun), so that it exits cleanly: every rank
    meets at a barrier (a rank whose peer already tore its gloo pairs down can abort in its own
    teardown), then the group is destroyed. No-op outside a group.

    Why the barrier's Work is kept to the end: a gloo worker thread drops its reference to a
    collective after the waiting caller has already gone on; if that is the last reference, the
    worker frees the collective's tensors, which needs the GIL, and a thread asking for the GIL
    while the interpreter finalizes kills the process ("terminate called without an active
    exception", SIGABRT at exit: 3 of 38 2-process gloo runs on a 2-core box; pytorch#190489). A
    gloo barrier holds (weakly) the collectives still in flight when it was issued; kept alive here,
    it and they are freed by the main thread, which holds the GIL. Only the default group's
    collectives are covered: with NCCL the barrier is NCCL's and gloo's CPU-side work is not held."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    work = dist.barrier(async_op=True)
    work.wait()
    _FINAL_BARRIER.append(work)
    dist.destroy_process_group()


def on_main(fn):
    """fn() on rank 0 only; its exception, if any, raised on every rank (the same one: a bad input
    is reported once, by rank 0, and every rank stops). Its return value is rank 0's everywhere."""
    result = error = None
    if is_main():
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - handed to every rank below
            error = e
    if active():
        result, error = broadcast_object((result, error))
    if error is not None:
        raise error
    return result


def rank_local(error: BaseException) -> BaseException:
    """Mark `error` as this rank's own (raised by its part of the data, e.g. a reward function on
    its completions: the other ranks need not raise it), so the CLI says it on this rank too; the
    errors every rank raises alike (bad config, bad data) are said once, by rank 0. Returns it."""
    error.rank_local = True
    return error


def split_evenly(n: int, what: str) -> int:
    """n / world_size, refusing an n that does not divide: per-rank parts must be equal (a sharded
    forward is collective: every rank must run as many as the others)."""
    ws = world_size()
    if n % ws:
        from tether.errors import UserError
        raise UserError(f"{what} = {n} does not divide among {ws} processes: use a multiple of {ws}")
    return n // ws


def rank_share(items: list, per: int) -> list:
    """This rank's share of `items` cut into consecutive chunks of `per` (chunk i goes to rank
    i mod world_size), padded with None so every rank gets as many entries: a None is a turn this
    rank must still take (run a forward that counts for nothing), because sharded forwards are
    collective. For evaluation passes whose size need not divide among the ranks."""
    chunks = [items[i:i + per] for i in range(0, len(items), per)]
    mine = chunks[rank()::world_size()]
    turns = -(-len(chunks) // world_size())
    return mine + [None] * (turns - len(mine))


def rank_unshare(mine: list, chunks: int) -> list:
    """The inverse of `rank_share`: `mine` holds one result per chunk this rank was given (in its
    share's order; entries past them, for None turns, are ignored); returns all `chunks` results
    in the chunks' own order, on every rank, as one process would have them (collective; results
    are pickled: keep them small and on the CPU)."""
    if not active():
        return mine[:chunks]
    ws, got = world_size(), all_gather_object(mine)
    return [got[i % ws][i // ws] for i in range(chunks)]


def cat_ranks(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` (per-row numbers: [rows, ...]) concatenated along dim 0 in rank order,
    on every rank and on `t`'s device, detached; `t` itself in one process (collective). Ranks
    holding consecutive parts of a batch thus rebuild it in one process's order."""
    if not active():
        return t
    # Tensor collectives, not all_gather_object: that pickles every tensor through the host (a
    # blocking device-to-host copy, then host-to-device and back, several syncs a call), called a
    # few times per optimizer step by every sharded trainer (bench/scale.py's profiles,
    # benchmarks/RESULTS.md). Here: one small all-gather of the row counts (the one sync), one of the rows
    # padded to the longest rank's. Bool travels as uint8 (not every backend reduces bool).
    dev = _device()
    x = t.detach().to(dev)
    kind = x.dtype
    if kind == torch.bool:
        x = x.to(torch.uint8)
    if x.dim() == 0 or x.dim() > _MAX_DIMS:
        raise ValueError(f"cat_ranks: rows of 1 to {_MAX_DIMS} dims, got a {x.dim()}-dim tensor")
    ws = world_size()
    # the header: rows, then what must agree across ranks for the rows to gather (dtype, trailing
    # dims): a disagreement is one clear error on every rank, not a collective of mismatched sizes
    # (gloo aborts the process, NCCL may hang)
    head = [x.shape[0], _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1, x.dim(), *x.shape[1:]]
    head += [-1] * (2 + _MAX_DIMS - len(head))
    heads = [torch.zeros(len(head), dtype=torch.int64, device=dev) for _ in range(ws)]
    dist.all_gather(heads, torch.tensor(head, dtype=torch.int64, device=dev))
    heads = torch.stack(heads).tolist()  # the one sync
    if any(h[1:] != heads[0][1:] for h in heads) or heads[0][1] < 0:
        raise ValueError(f"cat_ranks: the ranks' rows differ in dtype or trailing shape (rank: [rows, "
                         f"dtype #, dims, *shape[1:]]): {heads}")
    rows = [h[0] for h in heads]
    padded = torch.cat([x, x.new_zeros((max(rows) - x.shape[0], *x.shape[1:]))]) if x.shape[0] < max(rows) else x
    padded = padded.contiguous()
    parts = [torch.empty(padded.shape, dtype=padded.dtype, device=dev) for _ in range(ws)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, rows)]).to(kind).to(t.device)


_MAX_DIMS = 4  # rows of per-row numbers: [rows], [rows, T], a little more
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8]


# --- sharding ------------------------------------------------------------------------------------

def is_sharded(model) -> bool:
    """`model` or a submodule is wrapped by FSDP2 (only possible inside a process group; without
    one this never imports FSDP2, whose public API needs torch >= 2.6)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule
    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard(model: torch.nn.Module, layers: list[torch.nn.Module], *, bf16: bool = False,
          reduce_bf16: bool = False, offload: bool = False, reshard_after_forward: bool = True,
          defer_grad_sync: bool = False, unit_layers: int = 1) -> torch.nn.Module:
    """FSDP2 in place: `fully_shard` each of `layers` (the decoder layers: one all-gather per layer
    per forward), an untied LM head as a unit of its own, then `model` itself (embeddings, final
    norm, a tied head). bf16: compute in bf16, reduce gradients in fp32 (in bf16 with
    reduce_bf16), keep the fp32 sharded master weights. offload: parameters, gradients and
    optimizer state live on the CPU between uses. Gradients are *summed* over ranks (divide factor
    1): the trainers divide by global counts themselves (module doc). defer_grad_sync: with several
    micro-batches a step, reduce only the last one's gradients (:func:`accumulation`).
    unit_layers: consecutive layers per FSDP2 unit (one all-gather and one reduce-scatter for the
    group: fewer, larger collectives; torch still hooks every layer of a unit, so the per-layer
    Python cost stays: docs/distributed.md). Returns `model`."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              reduce_dtype=torch.bfloat16 if reduce_bf16 else torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else None,
              reshard_after_forward=reshard_after_forward)
    kw = {k: v for k, v in kw.items() if v is not None}
    layers = list(layers)
    for i in range(0, len(layers), unit_layers):
        group = layers[i:i + unit_layers]
        fully_shard(group[0] if len(group) == 1 else group, **kw)  # a list: one unit of several
    head = _untied_head(model)
    if head is not None and os.environ.get("TETHER_FSDP_HEAD_UNIT", "1") != "0":  # 0: in the root (A/B)
        # Why: in the root unit, the head's gradient (vocab x width: 545M parameters at 7B) is made
        # first in backward but reduce-scattered with the embedding's at the very end, so it is held
        # unsharded, with its fp32 reduce input, through the whole backward. Its own unit reduces it
        # as soon as the head's backward ends. Not resharded after a forward whose output autograd
        # will differentiate: the backward needs it next (as FSDP2 keeps its root); after any other
        # (evaluation, frozen models, a frozen head) nothing else would reshard it, so the hook does:
        # a head left gathered would hide its sharded parameters from the optimizer and the clip.
        fully_shard(head, **{**kw, "reshard_after_forward": False})
        if kw["reshard_after_forward"]:
            head.register_forward_hook(_reshard_unless_differentiated)
    scalar = _scalar_head(model)
    if scalar is not None:
        # A reward model's or critic's scalar head (models.heads.ScalarHeadModel) computes in fp32 on
        # purpose (bf16 scores flip close pairs): a unit of its own without the bf16 policy keeps
        # its gathered weight fp32, as in one process (in the root it would be gathered in bf16).
        fully_shard(scalar, **{**kw, "mp_policy": MixedPrecisionPolicy(), "reshard_after_forward": False})
        if kw["reshard_after_forward"]:
            scalar.register_forward_hook(_reshard_unless_differentiated)
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied one)
    model.tether_defer_grad_sync = defer_grad_sync
    return model


def _reshard_unless_differentiated(module, args, out) -> None:
    """Forward hook of an untied head unit (shard): reshard now unless a backward through it follows."""
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    if not (torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in tensors)):
        module.reshard()


def _scalar_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A ScalarHeadModel's fp32 head (reward model, critic: models.heads.Fp32Linear); else None."""
    head = getattr(model, "head", None)
    return head if getattr(head, "fp32_unit", False) else None


def fp32_unit_params(model: torch.nn.Module) -> set[int]:
    """ids of the parameters `shard` puts in an fp32 unit of their own (a scalar head's)."""
    scalar = _scalar_head(model)
    return {id(p) for p in scalar.parameters()} if scalar is not None else set()


def _untied_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The model's output head when it is a module with weights of its own (not the input
    embedding's); else None."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    head, emb = (get_out() if get_out else None), (get_in() if get_in else None)
    if head is None or getattr(head, "weight", None) is None:
        return None
    if emb is not None and getattr(emb, "weight", None) is head.weight:
        return None
    return head


def replicate(model: torch.nn.Module) -> torch.nn.Module:
    """The whole `model` on this rank's device, its parameters and buffers rank 0's (a broadcast:
    a freshly initialised head must not differ between ranks). Nothing is wrapped or hooked:
    forward and backward run as in one process, and `sum_gradients` (every optimizer step) sums the
    plain gradients. Returns `model`."""
    model.to(_device())
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    return model


GRAD_BUCKET_BYTES = 256 << 20  # per all-reduce: few enough calls, a bounded temporary per bucket


@torch.no_grad()
def sum_gradients(params: Iterable[torch.Tensor]) -> None:
    """Sum the plain (not sharded) parameters' gradients over the ranks, in place: a replicated
    model's data-parallel reduction (`replicate`), once per optimizer step after the last
    micro-batch. Sharded parameters (DTensors: FSDP2 reduced them in backward) are skipped; off
    torchrun nothing happens. A parameter that got no gradient on some rank (None) counts as zeros
    there, and one that got none on any rank keeps None, as in one process (a small all-reduce of
    which ones have one: the bucket layout must be every rank's)."""
    if not active():
        return
    params = [p for p in params if not hasattr(p, "to_local")]
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=_device())
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    params = [p for p, h in zip(params, has.tolist()) if h]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    by_kind: dict = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for group in by_kind.values():
        for bucket in _buckets(group):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            torch._foreach_copy_(bucket, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in bucket]), bucket)])
            del flat  # before the next bucket's cat: one flat temporary at a time (memory/replicated.py)


def _buckets(tensors: list) -> Iterable[list]:
    """`tensors` in order, cut into runs of at most GRAD_BUCKET_BYTES (a larger one alone)."""
    bucket, size = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > GRAD_BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += n
    if bucket:
        yield bucket


def accumulation(model, micro_batches: Iterable):
    """Yield `micro_batches` (a step's, each followed by a backward), telling a sharded model which
    backward is the step's last. FSDP2 reduce-scatters every backward's gradients; with
    shard(defer_grad_sync=True) the earlier micro-batches' gradients instead accumulate unsharded on
    each rank (in the fp32 reduce dtype) and the last backward reduces their sum: one reduce-scatter
    per layer a step instead of one per micro-batch (FSDP1's no_sync), for the memory of a whole
    fp32 gradient per rank. The gradient is the same sum either way, up to the order of the
    additions. Every rank must take the same number of micro-batches (the trainers' idle turns see
    to that); a plain model: `micro_batches` unchanged."""
    items = list(micro_batches)
    if not getattr(model, "tether_defer_grad_sync", False) or len(items) < 2:
        yield from items
        return
    try:
        for i, item in enumerate(items):
            model.set_requires_gradient_sync(i == len(items) - 1)
            yield item
    finally:  # a step left half-way (an error): the next backward outside a loop reduces again
        model.set_requires_gradient_sync(True)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective: all-gather), the tensor itself otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state_dict(model, trainable_only: bool = False) -> Optional[dict]:
    """The model's state dict gathered whole onto rank 0's CPU (collective; None on other ranks).
    trainable_only: only parameters that require grad (a LoRA adapter), not the frozen base."""
    out = {}
    params = dict(model.named_parameters())  # a tied weight (embeddings = LM head) under one name,
    named = set(params) | {n for n, _ in model.named_buffers()}  # as save_pretrained writes it
    for name, value in model.state_dict().items():
        if name not in named or (trainable_only and not params.get(name, value).requires_grad):
            continue
        value = full(value)
        if is_main():
            out[name] = value.detach().cpu()
    return out if is_main() else None


@torch.no_grad()
def copy_full_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Every parameter and buffer of sharded `src` gathered into the plain replica `dst` (same
    names; the replica's dtype). Collective: every rank ends with the whole model."""
    target = dict(dst.named_parameters())
    params = set(target)
    target.update(dict(dst.named_buffers()))
    written, dst_list, src_list = set(), [], []
    for name, value in src.state_dict().items():
        if name in target:
            if hasattr(value, "full_tensor"):  # sharded: gathered one at a time (a 7B model's
                target[name].copy_(value.full_tensor())  # whole fp32 weights would not fit at once)
            else:
                dst_list.append(target[name])
                src_list.append(value)
            written.add(name)
    if dst_list:  # one foreach copy (casting to the replica's dtype), not ~270 copy_ calls: the
        torch._foreach_copy_(dst_list, src_list)  # refresh runs before every rollout, the GPU idle
    if params - written:  # a weight the sampler would keep stale forever: refuse rather than drift
        raise RuntimeError(f"copy_full_weights: {len(params - written)} parameter(s) of the copy have no "
                           f"counterpart in the model's state_dict, e.g. {sorted(params - written)[:3]}")


# --- optimizer state through torch.distributed.checkpoint ---------------------------------------

def save_optimizer(directory: Path, model, optimizer) -> None:
    """The optimizer's state, keyed by parameter name, into `directory` (DCP: each rank writes its
    shards; collective). Also in one process, so every checkpoint has one format."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _one_process_is_fine():
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(directory))


def load_optimizer(directory: Path, model, optimizer) -> None:
    """`save_optimizer`'s state into `optimizer`, resharded to this run's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=str(directory))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])



@contextlib.contextmanager
def _one_process_is_fine():
    """DCP warns on every save and load without a process group ("assuming the intent is to save
    in a single process"): that is our intent (module doc), not news for every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        yield
