"""Pieces every trainer loop shares: data order, optimizer + schedule, the guarded step, progress.

Kept as plain functions (no base class) so each trainer file still reads top to bottom as its
algorithm and can be changed without reading a hierarchy.
"""

from __future__ import annotations

import copy
import math
import sys
import time

import torch

from tether import distributed
from tether.errors import NonFiniteLossError, UserError
from tether.models import logprobs
from tether.run import TRAINER_STATE, load_trainer_state, set_rng_state


class EpochSampler:
    """Deterministic, resumable batch order: epoch e is a permutation seeded by (seed, e).

    The position is just the number of batches drawn, so a checkpoint stores one integer and a
    resumed run sees exactly the batches the uninterrupted run would have seen. Under
    torch.distributed each rank takes its own slice of every global batch.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, contiguous: bool = False):
        if n < 1:
            raise ValueError("cannot sample batches from an empty dataset")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.contiguous = contiguous  # a rank's part: a block of consecutive rows (see part)
        self.position = 0
        self._cached: tuple[int, list[int]] | None = None

    def _perm(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        if self._cached is None or self._cached[0] != epoch:  # one permutation per epoch, not per batch
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._cached = (epoch, torch.randperm(self.n, generator=g).tolist())
        return self._cached[1]

    def global_batch_at(self, position: int) -> list[int]:
        """Indices of global batch number `position` (wrapping across epochs), every rank's rows."""
        start = position * self.batch_size
        idx = []
        while len(idx) < self.batch_size:
            epoch, offset = divmod(start + len(idx), self.n)
            perm = self._perm(epoch)
            take = min(self.batch_size - len(idx), self.n - offset)
            idx.extend(perm[offset:offset + take])
        return idx

    def part(self, idx: list[int], rank: int) -> list[int]:
        """`rank`'s rows of a global batch: every world_size-th row, or with `contiguous` the
        rank-th of world_size consecutive blocks. Contiguous blocks that are whole micro-batches
        make the ranks run exactly one process's micro-batches (same rows, same padding: the
        offline trainer's cached reference log-probs then match its forwards bit for bit)."""
        if self.contiguous:
            size = len(idx) // self.world_size
            return idx[rank * size:(rank + 1) * size]
        return idx[rank::self.world_size]

    def batch_at(self, position: int) -> list[int]:
        """Indices of global batch number `position` (wrapping across epochs), this rank's part."""
        return self.part(self.global_batch_at(position), self.rank)

    def next(self) -> list[int]:
        idx = self.batch_at(self.position)
        self.position += 1
        return idx

    @property
    def epoch(self) -> float:
        return self.position * self.batch_size / self.n


def make_optimizer(model, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8,
                   fused: bool | None = None):
    """AdamW with no decay on biases and norms (decaying a norm's gain toward 0 hurts).
    `fused`: None = the fused kernel on CUDA only; True / False force it on / off."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # Auto = fused on CUDA only. On CPU it is faster too (the quickstart's 38 tensors: 2.1 -> 0.4 ms
    # a step) but rounds differently from the per-tensor loop; results must not hang on that
    # (the quickstart is checked with it on and off), so it stays an explicit choice there.
    params = decay + no_decay
    if fused is None:
        fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def make_scheduler(optimizer, schedule: str, warmup_steps: int, total_steps: int,
                   min_lr_ratio: float = 0.0):
    """Linear warmup, then cosine / linear decay to `min_lr_ratio`·lr, or constant."""
    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "cosine":
            shape = 0.5 * (1 + math.cos(math.pi * progress))
        elif schedule == "linear":
            shape = 1 - progress
        else:
            raise ValueError(f"schedule must be cosine, linear or constant; got {schedule!r}")
        return min_lr_ratio + (1 - min_lr_ratio) * shape
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def guarded_step(model, optimizer, scheduler, max_grad_norm: float, loss_value: float,
                 keep_grads: bool = False) -> float:
    """Clip and step only if the loss and gradient norm are finite, and only keep a step that
    leaves every weight finite.

    A NaN that reaches AdamW's moments poisons every later step, so we refuse it here: the
    gradients are dropped and NonFiniteLossError is raised for the caller to count or abort.
    Finite gradients can still make non-finite weights (lr=inf, or an update past the dtype's
    range); :func:`update_is_bounded` proves most steps safe from numbers already at hand, and a
    step it cannot vouch for is taken on a snapshot: weights non-finite afterwards -> weights and
    optimizer state put back exactly, NonFiniteLossError. Normal steps run exactly as before.
    `keep_grads`: zero the gradients instead of freeing them (they are views of a flat buffer,
    :func:`flat_grad_buffer`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    distributed.sum_gradients(params)  # a replicated model's data-parallel sum (sharded: done in backward)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    norm = float(distributed.full(norm))  # sharded gradients: the global norm (a DTensor)
    if distributed.active():  # every rank takes the same decision, or the next collective hangs
        loss_value = distributed.max_float(loss_value if math.isfinite(loss_value) else math.nan)
    if not (math.isfinite(loss_value) and math.isfinite(norm)):
        optimizer.zero_grad(set_to_none=not keep_grads)
        raise NonFiniteLossError(f"non-finite loss ({loss_value}) or grad norm ({norm}); step skipped")
    if update_is_bounded(optimizer):
        optimizer.step()
    else:
        saved = _snapshot(optimizer)
        try:
            optimizer.step()
            broken = not all_finite(p for g in optimizer.param_groups for p in g["params"])
        except RuntimeError as e:  # torch refuses a step size past float32 ("... without overflow")
            if "overflow" not in str(e):
                raise
            broken = True
        if broken:
            _restore(optimizer, saved)
            optimizer.zero_grad(set_to_none=not keep_grads)
            lr = optimizer.param_groups[0]["lr"]
            raise NonFiniteLossError(f"the update made weights non-finite (lr {lr:g}); step rolled back")
    scheduler.step()
    optimizer.zero_grad(set_to_none=not keep_grads)
    return norm


@torch.no_grad()  # no autograd: no per-tensor detach (a CPU op per parameter, every step)
def _max_abs(tensors) -> float:
    """max |x| over every element of every tensor (NaN if any is NaN): one sync per device. Sharded
    tensors (DTensor): over every rank's shard (one all-reduce), so all ranks get the same value."""
    by_device: dict = {}
    sharded = False
    for t in tensors:
        local = distributed.local(t)
        sharded |= local is not t
        by_device.setdefault(local.device, []).append(local)
    out = 0.0
    for device, ts in by_device.items():
        # Empty tensors out: a rank's shard of a small parameter can be empty under FSDP2 (a norm
        # weight of 64 over 128 ranks), and CUDA's inf-norm refuses an empty tensor.
        ts = [t for t in ts if t.numel()]
        if not ts:
            continue
        if device.type == "cpu":  # torch's CPU inf-norm is ~5x slower than abs().amax() (quickstart
            m = float(torch.stack([t.abs().amax() for t in ts]).max())  # model: 1.9 vs 0.37 ms); amax keeps NaN
        else:  # one fused kernel, no temporary the size of a weight
            m = float(torch.stack(torch._foreach_norm(ts, math.inf)).max())
        out = m if math.isnan(m) else max(out, m)
        if math.isnan(out):
            break
    return distributed.max_float(out) if sharded else out


def all_finite(tensors) -> bool:
    """Every element of every tensor finite."""
    return math.isfinite(_max_abs(tensors))


def update_is_bounded(optimizer) -> bool:
    """True when this Adam/AdamW step provably leaves every parameter finite.

    Adam's per-element step is lr·m̂/(√v̂+ε) with m, v running averages of g and g² from zero, so
    by Cauchy–Schwarz |m̂|/√v̂ ≤ √(Σ_{k<t} q^k)/√(1−β2) with q = β1²/β2 whatever the gradients were
    (the bias corrections only shrink it, since 1−β1^t ≥ 1−β1). So |p_new| ≤ max|p|·|1−lr·wd| +
    lr·that bound; below half the dtype's range, no element can overflow. It fails only for a
    non-finite lr or weights/lr within a few orders of the dtype's limit (lr=inf; lr=1e37): those
    steps take the snapshot path. Costs one fused max-abs of the parameters; any other optimizer
    always takes the snapshot path."""
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    if not (decoupled or type(optimizer) is torch.optim.Adam):
        return False
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        lr, wd, (b1, b2) = abs(group["lr"]), group["weight_decay"], group["betas"]
        q = b1 * b1 / b2
        try:
            limit = min(torch.finfo(p.dtype).max for p in params) / 2
            largest = _max_abs(params)
            decay = abs(1 - lr * wd) if decoupled else 1.0

            def bounded(ratio: float) -> bool:
                return math.isfinite(lr) and largest * decay + lr * ratio <= limit
            # q < 1 (any usual β: 0.81 / 0.999): Σ_{k<t} q^k < 1/(1−q) for every t, so the bound
            # holds without reading the step counts (a stack of one tensor per parameter and a sync)
            if q < 1 and bounded(math.sqrt(1 / ((1 - q) * (1 - b2)))):
                continue
            steps = [optimizer.state[p]["step"] for p in params if "step" in optimizer.state[p]]
            t = 1 + (_max_abs(steps) if steps else 0.0)  # the step about to be taken (the longest-stepped)
            if not bounded(math.sqrt((t if q == 1 else (1 - q ** t) / (1 - q)) / (1 - b2))):
                return False
        except (OverflowError, ZeroDivisionError, ValueError):  # q**t too large, β2 = 1: no bound
            return False
    return True


def _snapshot(optimizer) -> tuple[list[torch.Tensor], dict]:
    """What undoing one step needs: the parameters and the optimizer state, copied."""
    params = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    return params, copy.deepcopy(optimizer.state_dict())


def _restore(optimizer, saved) -> None:
    params, state = saved
    with torch.no_grad():
        for p, old in zip((p for g in optimizer.param_groups for p in g["params"]), params):
            p.copy_(old)
    optimizer.load_state_dict(state)


def flat_grad_buffer(model, at_least: int = 0) -> torch.Tensor | None:
    """Make every trainable parameter's `.grad` a view of one zeroed flat buffer, and return it
    (None, and nothing changed, when the parameters differ in dtype or device or the buffer would
    hold fewer than `at_least` elements).

    Why: an online RL step has two phases that never overlap — sampling, which needs a KV cache,
    and the update, which needs gradients. Lending this buffer to the sampler as the home of its
    KV cache (`Sampler.kv_storage`) keeps one of the two out of memory (Qwen2.5-0.5B at 64 × 384
    tokens: the 0.30 GB cache inside the 0.99 GB of gradients). Backward accumulates into the views
    in place; the caller zeroes the buffer after sampling and steps with `keep_grads=True`.
    Parameters get a (zero) gradient even when backward does not reach them, so AdamW's momentum
    keeps moving them; with weight decay on they also decay (an unused parameter is rare in a
    causal LM)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params or len({(p.dtype, p.device) for p in params}) != 1 or distributed.active():
        return None  # (sharded gradients are DTensors that FSDP2 allocates itself)
    align = 64  # elements: each view starts on a 128-byte boundary (vectorized optimizer kernels)
    sizes = [-(-p.numel() // align) * align for p in params]
    if sum(sizes) < at_least:
        return None
    buf = torch.zeros(sum(sizes), dtype=params[0].dtype, device=params[0].device)
    off = 0
    for p, n in zip(params, sizes):
        p.grad = buf[off:off + p.numel()].view_as(p)
        setattr(p, logprobs.GRAD_IN_PLACE, True)  # the chunked head adds its dW here (logprobs.grad_in_place)
        off += n
    return buf


def lend_gradients(sampler, model, sequences: int, max_len: int) -> torch.Tensor | None:
    """Put `sampler`'s KV cache (for `sequences` sequences of up to `max_len` tokens) inside the
    trainable parameters' gradients when it fits (:func:`flat_grad_buffer`); returns the buffer,
    which the trainer zeroes after sampling and steps with `keep_grads=True`, or None (gradients
    freed after each step as usual, the cache in memory of its own)."""
    need = sampler.kv_cache_elements(sequences, max_len)
    trained = next((p for p in model.parameters() if p.requires_grad), None)
    if need is None or trained is None:
        sampler.kv_storage = None
        return None
    # A sampling copy in another dtype (rollout.sampler_copy: bf16 cache, fp32 gradients) borrows
    # the same bytes: the buffer viewed as the cache's dtype (the backend takes storage of its own dtype)
    kv = next(sampler.model.parameters()).dtype
    per = trained.element_size() // kv.itemsize if trained.element_size() % kv.itemsize == 0 else 0
    buf = flat_grad_buffer(model, -(-need // per)) if per else None
    sampler.kv_storage = buf if buf is None or buf.dtype == kv else buf.view(kv)
    return buf


def autocast_context(device: torch.device, mixed_precision: str):
    """bf16 autocast on CUDA (fp32 master weights, bf16 matmuls); a no-op elsewhere."""
    enabled = device.type == "cuda" and mixed_precision in ("auto", "bf16") and \
        torch.cuda.is_bf16_supported()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


class Progress:
    """A tqdm bar with ETA and the live key metrics; silent off rank 0 or when disabled."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                            file=sys.stderr, leave=True)

    def update(self, metrics: dict | None = None) -> None:
        if self.bar is None:
            return
        if metrics:
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v)
                                  for k, v in metrics.items()}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StepClock:
    """Wall-clock throughput over the steps since the last logged row: `tick` once a step (with
    the tokens it processed, where the loop counts them), `lap` at a log point gives step_time
    (and tokens_per_second) and starts the next window. Wall-clock, so never resume-exact."""

    def __init__(self):
        self.t, self.steps, self.tokens = time.perf_counter(), 0, None

    def tick(self, tokens: int | None = None) -> None:
        self.steps += 1
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens

    def lap(self) -> dict:
        now = time.perf_counter()
        dt = now - self.t
        out = {"step_time": dt / max(self.steps, 1)}
        if self.tokens is not None:
            out["tokens_per_second"] = self.tokens / dt
        self.t, self.steps, self.tokens = now, 0, None
        return out


class Window:
    """Per-step metrics summed since the last logged row, for a trainer that logs their means.
    Part of the checkpoint (`state_dict`), so a resume from a checkpoint inside a log window logs
    the same means as an uninterrupted run, whatever log_every and save_every are."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, metrics: dict) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.steps += 1

    def means(self) -> dict:
        return {k: v / self.steps for k, v in self.sums.items()}

    def reset(self) -> None:
        self.sums, self.steps = {}, 0

    def state_dict(self) -> dict:
        return {"sums": dict(self.sums), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.sums, self.steps = dict(state["sums"]), state["steps"]


def restore_training(ckpt, run, model, optimizer, scheduler, data_order) -> tuple[int, float, int, dict]:
    """Put optimizer, scheduler, data position and RNG back as checkpoint `ckpt` left them and
    drop the run's log rows after it. Returns (step, elapsed seconds, skipped steps, the loop's
    carried state: see `save_training`)."""
    state = load_trainer_state(ckpt)
    if "optimizer" in state:  # written before the optimizer went through DCP: one process only
        if distributed.active():
            raise UserError(f"{ckpt} was written by an older tether (optimizer state inside "
                            f"{TRAINER_STATE}): resume it in one process")
        optimizer.load_state_dict(state["optimizer"])
    else:
        distributed.load_optimizer(ckpt / distributed.OPTIMIZER_DIR, model, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    data_order.position = state["data_position"]
    rngs = state.get("rng_ranks", [state["rng"]])
    # a rank the checkpointed run did not have continues rank 0's stream (rollouts are keyed by
    # seed and step, not by this RNG; it decides nothing a resume must reproduce across ranks)
    set_rng_state(rngs[distributed.rank()] if distributed.rank() < len(rngs) else rngs[0])
    run.truncate_after(state["step"])
    return state["step"], state.get("time", 0.0), state.get("skipped_steps", 0), state.get("carry", {})


def save_training(run, step: int, model, tokenizer, optimizer, scheduler, data_order,
                  skipped: int, time_offset: float, keep_last: int, extra=None, carry=None,
                  dtype=None, trainable=None, name=None):
    """Checkpoint everything `restore_training` needs for an exact resume. `carry`: plain Python
    state of the loop that logged numbers depend on (a metrics window, a history for the summary).
    `dtype`: the model's weights are written in it (RunDir.save_checkpoint; None = as trained).
    `trainable`: the module the optimizer's parameters belong to (default `model`). The optimizer
    state goes through torch.distributed.checkpoint (keyed by parameter name, resharded on load);
    a sharded model is gathered onto rank 0 for its Hugging Face folder (collective).
    `name`: a named checkpoint (keep_best's `best`): the model, tokenizer and `extra` only, no
    optimizer state (it is for evaluating and shipping, never resumed from), outside rotation."""
    trainable = model if trainable is None else trainable
    lora = hasattr(model, "peft_config")
    gathered = distributed.full_state_dict(model, trainable_only=lora) if distributed.is_sharded(model) else None
    return run.save_checkpoint(step, model, tokenizer, {
        "scheduler": scheduler.state_dict(),
        "data_position": data_order.position, "step": step, "skipped_steps": skipped,
        "time": time_offset + (time.time() - run.t0), "carry": carry or {}},
        keep_last=keep_last, extra=extra, dtype=dtype, state_dict=gathered, name=name,
        sharded=None if name else lambda d: distributed.save_optimizer(d / distributed.OPTIMIZER_DIR,
                                                                       trainable, optimizer))
