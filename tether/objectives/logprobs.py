"""Log-probabilities, SFT loss and entropy from a causal LM's logits.

Alignment (every trainer depends on this): a causal LM's ``logits[:, t]`` is the distribution of
the *next* token, ``input_ids[:, t + 1]``. Masks passed here are aligned with ``input_ids``:
``mask[:, t] = 1`` means token t is a completion (trained) token, and its log-prob is read from
``logits[:, t - 1]``. Token 0 has no prediction, so its log-prob is defined as 0 and a mask bit
at position 0 is ignored.

Memory: a full ``log_softmax`` would allocate (and autograd would keep) another [B, T, V] tensor,
the largest tensor in a training step. We instead compute z_y − logsumexp(z) one tile of at most
:data:`BLOCK_ELEMENTS` logits at a time (whole batch rows when they fit — small shapes run as one
vectorized block — else slices of one row along time), so the transient peak is one tile whatever
T and V are, autograd keeps only the logits it already holds, and backward writes straight into
the one [B, T, V] gradient it must return. (Within a tile a fused ``log_softmax`` + gather is used:
same values as a separate ``logsumexp``, and several times faster than it on CPU and GPU.)
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._masks import as_bool, masked_mean, masked_sum

_LOW_PRECISION = (torch.float16, torch.bfloat16)
IGNORE_INDEX = -100


def _row(z: Tensor, temperature: float) -> Tensor:
    # bf16/fp16 logsumexp loses several bits over a 50k-way vocabulary; one tile upcast is cheap.
    if z.dtype in _LOW_PRECISION:
        z = z.float()
    return z / temperature if temperature != 1.0 else z


def _softmax(z: Tensor, temperature: float, log: bool) -> Tensor:
    """(log-)softmax of one tile in float32 or wider; at temperature 1 the upcast of half-precision
    logits is fused into the kernel (``dtype=``) instead of materializing a float32 copy first."""
    fn = torch.log_softmax if log else torch.softmax
    if temperature == 1.0:
        return fn(z, dim=-1, dtype=torch.float32 if z.dtype in _LOW_PRECISION else None)
    return fn(_row(z, temperature), dim=-1)


# Largest number of logits processed at once by the custom autograd functions below; ``None``
# picks per device: 2^22 on CPU (cache-sized tiles run fastest there) and 2^24 on accelerators
# (64 MiB of float32 transient per temporary: few enough tiles that kernel launches don't dominate;
# on an H200, 1.0–1.3× the time of a plain log_softmax + gather with 1/3 to 1/6 of its extra
# memory). Small shapes are one block (no Python loop); a 128k-vocabulary × 8k-token row never
# materializes a float32 copy of itself.
BLOCK_ELEMENTS: int | None = None


def _budget(device: torch.device) -> int:
    if BLOCK_ELEMENTS is not None:
        return BLOCK_ELEMENTS
    return 1 << 22 if device.type == "cpu" else 1 << 24


def _tiles(B: int, T: int, V: int, budget: int):
    """(b0, b1, t0, t1) tiles covering [B, T], each holding at most ~``budget`` logits."""
    if T * V <= budget:
        rows = max(1, budget // max(T * V, 1))
        for b0 in range(0, B, rows):
            yield b0, min(B, b0 + rows), 0, T
    else:
        steps = max(1, budget // max(V, 1))
        for b in range(B):
            for t0 in range(0, T, steps):
                yield b, b + 1, t0, min(T, t0 + steps)


class _TokenLogps(torch.autograd.Function):
    """Target log-prob of every position but the last: out[:, t] = log softmax(z[:, t])[targets[:, t]]
    for t < T − 1 (``targets`` [B, T − 1]). Takes the full logits (no slice, so no extra
    [B, T, V] zero-padded gradient from a slice's backward) and saves only them and the targets
    (the plain autograd graph of ``logsumexp`` would keep a float32 copy of bf16 logits).
    d/dz_v [z_y − logsumexp z] = (1[v = y] − p_v) / temperature."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        B, T1 = targets.shape
        out_dtype = torch.float32 if logits.dtype in _LOW_PRECISION else logits.dtype
        out = torch.empty((B, T1), dtype=out_dtype, device=logits.device)
        for b0, b1, t0, t1 in _tiles(B, T1, logits.shape[-1], _budget(logits.device)):
            logp = _softmax(logits[b0:b1, t0:t1], temperature, log=True)
            out[b0:b1, t0:t1] = logp.gather(-1, targets[b0:b1, t0:t1].unsqueeze(-1)).squeeze(-1)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, targets = ctx.saved_tensors
        B, T1 = targets.shape
        grad = torch.empty_like(logits)
        grad[:, T1:].zero_()  # the last position predicts nothing inside the sequence
        for b0, b1, t0, t1 in _tiles(B, T1, logits.shape[-1], _budget(logits.device)):
            dz = _softmax(logits[b0:b1, t0:t1], ctx.temperature, log=False)
            g = grad_out[b0:b1, t0:t1].to(dz.dtype).unsqueeze(-1)
            dz.mul_(-g)
            dz.scatter_add_(-1, targets[b0:b1, t0:t1].unsqueeze(-1), g)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            grad[b0:b1, t0:t1] = dz
        return grad, None, None


def token_logps(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Per-token log π(x_t | x_<t), aligned with ``input_ids``.

    out[:, t] = z[:, t−1, x_t] − logsumexp_v z[:, t−1, v]   for t ≥ 1, out[:, 0] = 0,
    with z = logits / temperature (pass the sampler's temperature so ratios against the sampler's
    log-probs are consistent).

    Shapes: logits [B, T, V], input_ids [B, T] → [B, T] (float32 for half-precision logits, else
    the logits' dtype). Negative ids (the ``-100`` ignore index) read as id 0; mask them out.
    Memory-lean custom autograd (:class:`_TokenLogps`): nothing [B, T, V]-sized is kept for backward
    beyond the logits themselves.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [B, T, V] with input_ids [B, T], "
                         f"got input_ids {tuple(input_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    targets = input_ids[:, 1:].clamp(min=0).long()
    lp = _TokenLogps.apply(logits, targets, float(temperature))
    return torch.nn.functional.pad(lp, (1, 0))


def _completion_mask(mask: Tensor) -> Tensor:
    m = as_bool(mask).clone()
    m[:, 0] = False  # token 0 has no logits predicting it
    return m


def sequence_logps(logits: Tensor, input_ids: Tensor, completion_mask: Tensor,
                   average: bool = False, temperature: float = 1.0) -> Tensor:
    """Per-sequence log-probability of the completion: the log π(y | x) of DPO's loss (Rafailov et al.
    2023, eq. 7) and of the other preference objectives.

    log π(y | x) = Σ_t m_t · log π(x_t | x_<t)   (``average=True``: divided by Σ_t m_t, the
    length-normalized log-prob used by IPO, SimPO and ORPO; 0 for an empty completion).

    ``completion_mask`` [B, T] is aligned with ``input_ids`` (see module docstring): the log-prob of
    token t comes from ``logits[:, t − 1]``. Shapes: logits [B, T, V], input_ids [B, T] → [B].
    """
    m = _completion_mask(completion_mask)
    total = masked_sum(token_logps(logits, input_ids, temperature), m, dim=-1)
    if average:
        total = total / m.sum(-1).clamp(min=1).to(total.dtype)
    return total


def sft_loss(logits: Tensor, labels: Tensor, mask: Tensor | None = None):
    """Token-mean negative log-likelihood (supervised fine-tuning).

    L = − Σ_{i,t} m_{i,t} log π(x_{i,t} | x_{i,<t}) / Σ_{i,t} m_{i,t}

    ``labels`` [B, T] follow the Hugging Face convention: aligned with ``input_ids`` (usually equal
    to them), the shift is done here exactly as in :func:`token_logps`; positions whose label is
    ``-100`` are excluded as well as those where ``mask`` [B, T] is 0 (``mask=None``: all).

    Returns ``(loss, metrics)`` with metrics ``nll`` (detached loss) and ``num_tokens``.
    """
    valid = labels != IGNORE_INDEX
    if mask is not None:
        valid = valid & as_bool(mask)
    m = _completion_mask(valid)
    loss = masked_mean(-token_logps(logits, labels), m)  # (not −mean: an empty mask gives 0, not −0)
    return loss, {"nll": loss.detach(), "num_tokens": m.sum().detach()}


class _TokenEntropy(torch.autograd.Function):
    """H(z) per position, saving only the logits for backward (autograd would keep p and log p,
    two extra [B, T, V] tensors); tiled like :class:`_TokenLogps`.
    dH/dz_v = −p_v (log p_v − Σ_u p_u log p_u) / temperature."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float) -> Tensor:
        ctx.save_for_backward(logits)
        ctx.temperature = temperature
        B, T, V = logits.shape
        out_dtype = torch.float32 if logits.dtype in _LOW_PRECISION else logits.dtype
        out = torch.empty((B, T), dtype=out_dtype, device=logits.device)
        for b0, b1, t0, t1 in _tiles(B, T, V, _budget(logits.device)):
            logp, p = _logp_p(logits[b0:b1, t0:t1], temperature)
            out[b0:b1, t0:t1] = -_plogp(p, logp).sum(-1)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_h: Tensor):
        (logits,) = ctx.saved_tensors
        B, T, V = logits.shape
        grad = torch.empty_like(logits)
        for b0, b1, t0, t1 in _tiles(B, T, V, _budget(logits.device)):
            logp, p = _logp_p(logits[b0:b1, t0:t1], ctx.temperature)
            neg_h = _plogp(p, logp).sum(-1, keepdim=True)
            centered = torch.where(p > 0, logp - neg_h, 0.0)
            scale = grad_h[b0:b1, t0:t1].unsqueeze(-1).to(p.dtype) / -ctx.temperature
            grad[b0:b1, t0:t1] = centered.mul_(p).mul_(scale)
        return grad, None


def _logp_p(z: Tensor, temperature: float):
    logp = _softmax(z, temperature, log=True)
    return logp, logp.exp()


def _plogp(p: Tensor, logp: Tensor) -> Tensor:
    # −inf logits (vocab masks) give p = 0 and log p = −inf; 0·(−inf) must count as 0, not NaN.
    return torch.where(p > 0, p * logp, 0.0)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of each position's next-token distribution, H_t = −Σ_v p_{t,v} log p_{t,v}.

    Shapes: logits [B, T, V] → [B, T] (no shift: H_t belongs to ``logits[:, t]``, i.e. to the
    distribution token t+1 was drawn from). Memory-lean custom autograd, see :class:`_TokenEntropy`.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    return _TokenEntropy.apply(logits, float(temperature))


def entropy_from_logits(logits: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Masked token-mean entropy: Σ_{i,t} m_{i,t} H_{i,t} / Σ m, H as in :func:`token_entropy`.

    ``mask`` [B, T] is aligned with ``logits`` [B, T, V] (no shift). To measure the policy's
    entropy at completion tokens with a mask aligned to ``input_ids`` (the convention of
    :func:`sequence_logps`), call ``entropy_from_logits(logits[:, :-1], completion_mask[:, 1:])``.
    Returns a differentiable scalar (usable as an entropy bonus; detach it for logging).
    """
    return masked_mean(token_entropy(logits, temperature), mask)
