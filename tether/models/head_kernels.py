"""Triton kernels of the chunked LM head (`tether.models.logprobs._HeadLogps`): a chunk's softmax statistics in one
read of its logits, and the logits' gradient written over them in place.

Why: with the head applied chunk by chunk, the work per chunk of logits z [n, V] was a dozen torch
elementwise passes in float32 (upcast, ÷T, logsumexp, exp, products, scatter, cast back), each a
read and a write of 4 bytes per logit. On an H100 at the GRPO benchmark's shapes (Qwen2.5-0.5B, 64 ×
384 tokens, micro-batch 16) those passes were 0.23 s of the 0.47 s of GPU time in a step's forward
and backward — more than every matmul of the model together (0.15 s) — plus 14k kernel launches.
Here each chunk costs one read of z in its own dtype (bf16 under autocast) for the statistics, and
one read and one write for the gradient; the float32 math happens in registers.

    _stats:  per row, lse = logsumexp(z / T), lp = z_y / T − lse, H = lse − Σ softmax(z / T)·z / T
             (one program per row, an online softmax over blocks of the vocabulary, per lane then
             combined);
    _grad:   dz = [g_lp (onehot(y) − p) − g_H p (log p + H)] / T with p = exp(z / T − lse), written
             over z (a 2-D grid over rows and vocabulary blocks; `v0` shifts the target index when
             the chunk is a slice of the vocabulary).

Used on CUDA when Triton is importable; elsewhere (CPU, and as the reference in tests) the torch
code in `tether.models.logprobs._HeadLogps` does the same math.
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path in logprobs._HeadLogps
    triton = None

STATS_BLOCK = 2048  # vocabulary entries per inner step of _stats (bf16: 4 KB per load)
GRAD_BLOCK = 2048   # vocabulary entries per program of _grad


def available(z: Tensor) -> bool:
    return triton is not None and z.is_cuda and z.dim() == 2 and z.stride(1) == 1


if triton is not None:
    @triton.jit
    def _stats(Z, Y, LSE, LP, ENT, n_cols, stride_z, temperature,
               WANT_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = Z + row.to(tl.int64) * stride_z
        cols = tl.arange(0, BLOCK)
        # per lane: running max m, Σ exp(x − m) s and Σ exp(x − m)·x t, with x = z / T; finite
        # initial m so lanes that never see a valid column combine to 0, not NaN
        m = tl.full([BLOCK], -1.0e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            ok = c0 + cols < n_cols
            x = tl.load(base + c0 + cols, mask=ok, other=-1.0e30).to(tl.float32) / temperature
            m_new = tl.maximum(m, x)
            alpha = tl.exp(m - m_new)
            e = tl.where(ok, tl.exp(x - m_new), 0.0)
            s = s * alpha + e
            if WANT_ENT:
                t = t * alpha + e * x
            m = m_new
        mx = tl.max(m, 0)
        w = tl.exp(m - mx)
        total = tl.sum(s * w, 0)
        lse = mx + tl.log(total)
        y = tl.load(Y + row)
        tl.store(LSE + row, lse)
        tl.store(LP + row, tl.load(base + y).to(tl.float32) / temperature - lse)
        if WANT_ENT:
            tl.store(ENT + row, lse - tl.sum(t * w, 0) / total)

    @triton.jit
    def _grad(Z, Y, LSE, ENT, GLP, GENT, n_cols, stride_z, v0, temperature,
              HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        ptr = Z + row.to(tl.int64) * stride_z + cols
        logp = tl.load(ptr, mask=ok, other=0.0).to(tl.float32) / temperature - tl.load(LSE + row)
        p = tl.exp(logp)
        coef = tl.zeros([BLOCK], tl.float32)
        if HAS_LP:
            g_lp = tl.load(GLP + row)
            coef += g_lp
        if HAS_ENT:
            coef += tl.load(GENT + row) * (logp + tl.load(ENT + row))
        d = -p * coef
        if HAS_LP:
            d = tl.where(cols == tl.load(Y + row) - v0, d + g_lp, d)
        tl.store(ptr, (d / temperature).to(Z.dtype.element_ty), mask=ok)


def softmax_stats(z: Tensor, targets: Tensor, temperature: float, want_ent: bool):
    """(lse, lp, ent) float32 [n] of logits z [n, V] and targets [n] (ent undefined unless asked)."""
    n = z.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    lp, ent = torch.empty_like(lse), torch.empty_like(lse)
    if n:
        _stats[(n,)](z, targets, lse, lp, ent, z.shape[1], z.stride(0), float(temperature),
                     WANT_ENT=bool(want_ent), BLOCK=STATS_BLOCK, num_warps=8)
    return lse, lp, ent


def grad_in_place(z: Tensor, targets: Tensor, lse: Tensor, ent: Tensor, g_lp, g_ent,
                  temperature: float, v0: int) -> Tensor:
    """Overwrite logits z [n, v1 − v0] (vocabulary columns v0..v1) with d loss / d z; returns z."""
    n, cols = z.shape
    if n and cols:
        grid = (n, triton.cdiv(cols, GRAD_BLOCK))
        _grad[grid](z, targets, lse, ent, g_lp if g_lp is not None else lse,
                    g_ent if g_ent is not None else lse, cols, z.stride(0), int(v0), float(temperature),
                    HAS_LP=g_lp is not None, HAS_ENT=g_ent is not None, BLOCK=GRAD_BLOCK, num_warps=4)
    return z
