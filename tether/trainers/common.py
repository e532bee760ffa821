"""Pieces every trainer loop shares: data order, optimizer + schedule, the guarded step, progress.

Kept as plain functions (no base class) so each trainer file still reads top to bottom as its
algorithm and can be changed without reading a hierarchy.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from tether.errors import NonFiniteLossError
from tether.run import load_trainer_state, set_rng_state
from tether.trainers import head_kernels


class EpochSampler:
    """Deterministic, resumable batch order: epoch e is a permutation seeded by (seed, e).

    The position is just the number of batches drawn, so a checkpoint stores one integer and a
    resumed run sees exactly the batches the uninterrupted run would have seen. Under
    torch.distributed each rank takes its own slice of every global batch.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        if n < 1:
            raise ValueError("cannot sample batches from an empty dataset")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.position = 0
        self._cached: tuple[int, list[int]] | None = None

    def _perm(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        if self._cached is None or self._cached[0] != epoch:  # one permutation per epoch, not per batch
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._cached = (epoch, torch.randperm(self.n, generator=g).tolist())
        return self._cached[1]

    def batch_at(self, position: int) -> list[int]:
        """Indices of global batch number `position` (wrapping across epochs), this rank's part."""
        start = position * self.batch_size
        idx = []
        while len(idx) < self.batch_size:
            epoch, offset = divmod(start + len(idx), self.n)
            perm = self._perm(epoch)
            take = min(self.batch_size - len(idx), self.n - offset)
            idx.extend(perm[offset:offset + take])
        return idx[self.rank::self.world_size]

    def next(self) -> list[int]:
        idx = self.batch_at(self.position)
        self.position += 1
        return idx

    @property
    def epoch(self) -> float:
        return self.position * self.batch_size / self.n


def make_optimizer(model, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8):
    """AdamW with no decay on biases and norms (decaying a norm's gain toward 0 hurts)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # Fused on CUDA only. On CPU it would be faster too (the quickstart's 38 tensors: 2.1 -> 0.4 ms
    # a step, ~3 s of its 1840 steps) but it rounds differently, and the quickstart's stages are a
    # knife edge of rounding: with it, the same recipe's SFT stage gave 0.945 instead of 0.480 and
    # left RL nothing to do (docs/grpo.md, "Quickstart: how fragile"). Kept as measured.
    params = decay + no_decay
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
    """Clip and step only if the loss and gradient norm are finite.

    A NaN that reaches AdamW's moments poisons every later step, so we refuse it here: the
    gradients are dropped and NonFiniteLossError is raised for the caller to count or abort.
    `keep_grads`: zero the gradients instead of freeing them (they are views of a flat buffer,
    :func:`flat_grad_buffer`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    norm = float(norm)
    if not (math.isfinite(loss_value) and math.isfinite(norm)):
        optimizer.zero_grad(set_to_none=not keep_grads)
        raise NonFiniteLossError(f"non-finite loss ({loss_value}) or grad norm ({norm}); step skipped")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=not keep_grads)
    return norm


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
    if not params or len({(p.dtype, p.device) for p in params}) != 1:
        return None
    align = 64  # elements: each view starts on a 128-byte boundary (vectorized optimizer kernels)
    sizes = [-(-p.numel() // align) * align for p in params]
    if sum(sizes) < at_least:
        return None
    buf = torch.zeros(sum(sizes), dtype=params[0].dtype, device=params[0].device)
    off = 0
    for p, n in zip(params, sizes):
        p.grad = buf[off:off + p.numel()].view_as(p)
        off += n
    return buf


def lend_gradients(sampler, model, sequences: int, max_len: int) -> torch.Tensor | None:
    """Put `sampler`'s KV cache (for `sequences` sequences of up to `max_len` tokens) inside the
    trainable parameters' gradients when it fits (:func:`flat_grad_buffer`); returns the buffer,
    which the trainer zeroes after sampling and steps with `keep_grads=True`, or None (gradients
    freed after each step as usual, the cache in memory of its own)."""
    need = sampler.kv_cache_elements(sequences, max_len)
    buf = flat_grad_buffer(model, need) if need is not None else None
    sampler.kv_storage = buf
    return buf


def compile_layers(model) -> int:
    """torch.compile every decoder layer of a HF causal LM in place; returns how many.

    Why layers and not the model: the training forward is launch-bound at these sizes (H100,
    Qwen2.5-0.5B, 16 × 384 tokens: 0.22 s of kernels in 0.53 s of forward+backward), and most
    launches are a layer's small elementwise ops (RMSNorm, RoPE, SiLU·up, residual adds), which
    Inductor fuses. The layers share one compiled graph (same code, parameters as inputs), so the
    compile cost does not grow with depth; the LM head stays ours (`_HeadLogps`), the sampler keeps
    its own forward over the same parameters."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for mod in base.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and type(mod[0]).__name__.endswith("DecoderLayer"):
            for layer in mod:
                layer.compile()
            return len(mod)
    return 0


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


class Timer:
    def __init__(self):
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def restore_training(ckpt, run, optimizer, scheduler, data_order) -> tuple[int, float, int]:
    """Put optimizer, scheduler, data position and RNG back as checkpoint `ckpt` left them and
    drop the run's log rows after it. Returns (step, elapsed seconds, skipped steps)."""
    state = load_trainer_state(ckpt)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    data_order.position = state["data_position"]
    set_rng_state(state["rng"])
    run.truncate_after(state["step"])
    return state["step"], state.get("time", 0.0), state.get("skipped_steps", 0)


def save_training(run, step: int, model, tokenizer, optimizer, scheduler, data_order,
                  skipped: int, time_offset: float, keep_last: int, extra=None):
    """Checkpoint everything `restore_training` needs for an exact resume."""
    return run.save_checkpoint(step, model, tokenizer, {
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "data_position": data_order.position, "step": step, "skipped_steps": skipped,
        "time": time_offset + (time.time() - run.t0)}, keep_last=keep_last, extra=extra)


# ---- the policy forward every RL and preference trainer shares -----------------------------------

_KEEP_SUPPORT: dict[type, bool] = {}


def supports_logits_to_keep(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (every HF causal LM of transformers 5 does)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    t = type(base)
    if t not in _KEEP_SUPPORT:
        _KEEP_SUPPORT[t] = "logits_to_keep" in inspect.signature(base.forward).parameters
    return _KEEP_SUPPORT[t]


# Families whose logits are exactly lm_head(body(x)) (no soft-capping or logit scale), so the head
# can be applied by us, chunk by chunk, to the completion positions only.
_HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "gpt_neox", "phi3")
# Logits held at once by the chunked head: 2^25 (~220 tokens at V = 152k, 128 MB per float32
# temporary) on an accelerator, 2^22 on CPU (cache-sized). None: per device.
HEAD_CHUNK_ELEMENTS: int | None = None


def _split_head(model):
    """(body, lm_head) when the logits are plain lm_head(body(...).last_hidden_state), else None.
    Under PEFT the LoRA layers inside the body stay in place (and `disable_adapter` still works)."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(m.config, "model_type", None) not in _HEAD_FAMILIES:
        return None
    if getattr(m.config, "final_logit_softcapping", None) or getattr(m.config, "logit_scale", None):
        return None
    body, head = getattr(m, getattr(m, "base_model_prefix", ""), None), m.get_output_embeddings()
    if body is None or type(head) is not torch.nn.Linear:
        return None
    return body, head


class _HeadLogps(torch.autograd.Function):
    """lp_i = log softmax(z_i / T)[y_i] and H_i = entropy(softmax(z_i / T)) with z_i = W h_i + b,
    one chunk of tokens at a time. Saves only h and two numbers per token (logsumexp, entropy);
    backward recomputes each chunk's logits once and writes
        dz'/T with dz' = g_lp (onehot(y) − p) − g_H p (log p + H),
        dh = dz W (by token chunks),   dW = dz^T h (by vocabulary chunks),
    so no [N, V] tensor is ever held (Liger's fused linear cross-entropy, for per-token outputs)."""

    @staticmethod
    def forward(ctx, h, w, b, targets, temperature: float, step: int, cd, want_ent: bool):
        ctx.set_materialize_grads(False)
        wc, bc = w.to(cd), (b.to(cd) if b is not None else None)
        N = h.shape[0]
        lp = torch.empty(N, dtype=torch.float32, device=h.device)
        lse, ent = torch.empty_like(lp), torch.empty_like(lp)
        for i in range(0, N, step):
            z = torch.nn.functional.linear(h[i:i + step].to(cd), wc, bc)
            if head_kernels.available(z):  # one read of the chunk, float32 math in registers
                lse[i:i + step], lp[i:i + step], ent[i:i + step] = head_kernels.softmax_stats(
                    z, targets[i:i + step], temperature, want_ent)
                continue
            z = z.float().div_(temperature)
            lse[i:i + step] = torch.logsumexp(z, -1)
            lp[i:i + step] = z.gather(-1, targets[i:i + step, None]).squeeze(-1) - lse[i:i + step]
            if want_ent:  # H = lse − Σ p z
                ent[i:i + step] = lse[i:i + step] - torch.softmax(z, -1).mul_(z).sum(-1)
        ctx.save_for_backward(h, w, b, targets, lse, ent)
        ctx.temperature, ctx.step, ctx.cd = temperature, step, cd
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        h, w, b, targets, lse, ent = ctx.saved_tensors
        T, step, cd = ctx.temperature, ctx.step, ctx.cd
        wc, bc = w.to(cd), (b.to(cd) if b is not None else None)
        N, V = h.shape[0], w.shape[0]

        g_lp = g_lp.float().contiguous() if g_lp is not None else None  # may be an expanded view
        g_ent = g_ent.float().contiguous() if g_ent is not None else None

        def dz(hc, rows, v0, v1):
            """dz for tokens `rows` over vocabulary columns v0..v1 ([n, v1 - v0], compute dtype)."""
            logp = torch.nn.functional.linear(hc, wc[v0:v1], bc[v0:v1] if bc is not None else None)
            if head_kernels.available(logp):  # written over the logits, no float32 temporaries
                return head_kernels.grad_in_place(logp, targets[rows], lse[rows], ent[rows],
                                                  None if g_lp is None else g_lp[rows],
                                                  None if g_ent is None else g_ent[rows], T, v0)
            logp = logp.float().div_(T).sub_(lse[rows, None])
            p = logp.exp()
            coef = g_lp[rows, None] if g_lp is not None else 0.0
            if g_ent is not None:
                coef = logp.add_(ent[rows, None]).mul_(g_ent[rows, None]).add_(coef)
            d = p.mul_(coef).neg_()
            if g_lp is not None:  # + g_lp at the target column (where it falls inside v0..v1)
                y = targets[rows] - v0
                inside = (y >= 0) & (y < v1 - v0)
                d.scatter_add_(-1, y.clamp(0, v1 - v0 - 1)[:, None], (g_lp[rows] * inside)[:, None])
            return d.div_(T).to(cd)

        dh = torch.empty_like(h)
        for i in range(0, N, step):  # dh = dz W, by token chunks
            rows = slice(i, i + step)
            dh[rows] = (dz(h[rows].to(cd), rows, 0, V) @ wc).to(h.dtype)
        dw = db = None
        if ctx.needs_input_grad[1] or (b is not None and ctx.needs_input_grad[2]):
            # dW = dz^T h by vocabulary chunks over all tokens: each row of dW is one GEMM with float32
            # accumulation (as in the full-logits path), no [V, H] accumulator summed chunk by chunk
            hc, vstep = h.to(cd), max(1, (step * V) // max(N, 1))
            dw = torch.empty_like(w)
            db = torch.empty_like(b) if b is not None else None
            for v0 in range(0, V, vstep):
                v1 = min(V, v0 + vstep)
                d = dz(hc, slice(None), v0, v1)
                dw[v0:v1] = (d.t() @ hc).to(w.dtype)
                if db is not None:
                    db[v0:v1] = d.sum(0, dtype=torch.float32).to(b.dtype)
        return dh, dw, db, None, None, None, None, None


def _head_budget(device) -> int:
    return HEAD_CHUNK_ELEMENTS or (1 << 22 if device.type == "cpu" else 1 << 25)


def _chunked_head(h, head, targets, temperature: float, entropy: str):
    """Per-token log-probs (and entropies) of `targets` [N] from hidden states `h` [N, H] through
    the linear `head`, never holding more than one chunk of logits (:class:`_HeadLogps`).
    `entropy`: "" (none), "detached" or "grad"."""
    step = max(1, _head_budget(h.device) // head.out_features)
    dev = h.device.type
    cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else head.weight.dtype
    lp, ent = _HeadLogps.apply(h, head.weight, head.bias, targets, float(temperature), step, cd, bool(entropy))
    return lp, (None if not entropy else ent.detach() if entropy == "detached" else ent)


def completion_token_logps(model, batch: dict, temperature: float, amp, want_entropy: bool = False,
                           entropy_grad: bool = False):
    """Per-token log-probs [B, T] aligned with `input_ids` (0 outside the completions: at prompt and
    padding positions), and the masked mean entropy of the completion tokens' distributions when
    asked (differentiable only with `entropy_grad`, for an entropy bonus; otherwise a detached number
    for logging).

    The LM head — the step's largest activation, [B, T, V] logits and as large a gradient — runs only
    on the completion tokens and in chunks (:func:`_chunked_head`) when the model's logits are a plain
    linear head over its body (Llama / Mistral / Qwen / GPT-2 families) and the logits would not fit
    in one chunk: at 16 × 256 completion tokens and a 152k vocabulary that is ~2.5 GB of bf16 logits
    and gradient not held. Otherwise: the HF forward with `logits_to_keep` from the first completion
    token.
    """
    from tether.objectives import entropy_from_logits, token_logps

    ids, cmask = batch["input_ids"], batch["completion_mask"]
    B, T = ids.shape
    split = _split_head(model)
    if split is not None and B * T * split[1].out_features <= _head_budget(ids.device):
        split = None  # the logits fit in one chunk: the plain forward is as lean and a little faster
    if split is not None:
        body, head = split
        # flat positions t whose hidden state predicts a completion token t + 1 (one host sync)
        idx = torch.nn.functional.pad(cmask[:, 1:].bool(), (0, 1)).flatten().nonzero().squeeze(1)
        with amp:
            h = body(input_ids=ids, attention_mask=batch["attention_mask"],
                     position_ids=batch.get("position_ids"), use_cache=False).last_hidden_state
            mode = ("grad" if entropy_grad and torch.is_grad_enabled() else "detached") if want_entropy else ""
            lp, ent = _chunked_head(h.reshape(B * T, -1).index_select(0, idx), head,
                                    ids.flatten().index_select(0, idx + 1), temperature, mode)
        logps = torch.zeros(B * T, dtype=torch.float32, device=ids.device)
        logps = logps.index_copy(0, idx + 1, lp.float()).view(B, T)
        return logps, (ent.mean() if ent is not None and ent.numel() else
                       (lp.new_zeros(()) if want_entropy else None))

    first = int(cmask.float().argmax(-1).min()) if bool(cmask.any()) else T
    start = max(first - 1, 0)  # logits at `start` predict the first completion token
    kw = {"logits_to_keep": T - start} if start > 0 and supports_logits_to_keep(model) else {}
    if not kw:
        start = 0
    with amp:
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"],
                       position_ids=batch.get("position_ids"), use_cache=False, **kw).logits
    part = token_logps(logits, ids[:, start:], temperature)
    logps = torch.cat([part.new_zeros(ids.shape[0], start), part], 1) if start else part
    logps = logps * torch.nn.functional.pad(cmask[:, 1:].to(logps.dtype), (1, 0))
    ent = None
    if want_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            z = logits[:, :-1] if entropy_grad else logits[:, :-1].detach()
            ent = entropy_from_logits(z, cmask[:, start + 1:], temperature)
    return logps, ent
