"""Decode attention for grouped-query heads: one Triton kernel per layer and step.

Why: at a decode step each KV head serves G query heads (Qwen2.5-0.5B: 14 / 2 = 7) and one new token
per row. torch's fused attention kernels tile queries by 64–128 rows, so 7 real queries fill a tenth
of each tile; on an H100 cuDNN's kernel took 74 µs per layer at batch 256 over 400 cache slots —
3–5× the time to read that layer's keys and values, and half of the whole decode step.

Here one program handles one (row, KV head): its G queries (padded to 16, the smallest tensor-core
tile) against the cache in blocks of BLOCK slots, with the online softmax of flash attention in
float32: scores s = q·k × scale + bias (the additive 0 / −inf mask), running max m and sum l,
acc = Σ exp(s − m) v, out = acc / l. P is rounded to the value dtype before the P·V product, as
flash attention does. Used by the native backend on CUDA when Triton is importable and the head
size is a power of two; otherwise torch's scaled_dot_product_attention.
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the native backend uses torch's SDPA
    triton = None

BLOCK = 64  # cache slots per inner step (64 × 64 bf16 keys = 8 KB per load)


def available(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether :func:`decode_attention` can run: CUDA, Triton importable, a power-of-two head size,
    at most 64 query heads per KV head."""
    D = head_dim
    return (triton is not None and torch.device(device).type == "cuda" and 16 <= D <= 256 and D & (D - 1) == 0
            and group <= 64 and dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:
    @triton.jit
    def _decode_attn(Q, K, V, Bias, O, scale, kv_len,
                     sqb, sqh, sqg, skb, skh, sks, svb, svh, svs, sbb, sob, soh, sog,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                     PREC: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g[:, None] < G
        q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + d[None, :], mask=gmask, other=0.0)
        m = tl.full([GP], -1.0e30, tl.float32)  # finite: a block masked entirely keeps exp() at 0, not NaN
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for s0 in range(0, kv_len, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            smask = s < kv_len
            k = tl.load(K + b * skb + h * skh + s[:, None] * sks + d[None, :], mask=smask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            bias = tl.load(Bias + b * sbb + s, mask=smask, other=float("-inf")).to(tl.float32)
            qk = qk + bias[None, :]
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + h * svh + s[:, None] * svs + d[None, :], mask=smask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        out = acc / l[:, None]
        tl.store(O + b * sob + h * soh + g[:, None] * sog + d[None, :], out.to(O.dtype.element_ty), mask=gmask)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """softmax(q kᵀ · scale + bias) v for one new token per row.

    q [B, Hkv, G, D] (the G query heads of each KV head), k / v [B, Hkv, S, D] (cache views; the last
    dim contiguous), bias [B, S] additive (0 or −inf). Returns [B, Hkv, G, D] in q's dtype.
    """
    B, Hkv, G, D = q.shape
    S = k.shape[2]
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1 and bias.stride(1) == 1
    o = torch.empty((B, Hkv, G, D), dtype=q.dtype, device=q.device)
    GP = max(16, triton.next_power_of_2(G))
    _decode_attn[(B, Hkv)](q, k, v, bias, o, float(scale), S,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), bias.stride(0),
                           o.stride(0), o.stride(1), o.stride(2),
                           G=G, GP=GP, D=D, BLOCK_S=BLOCK,
                           PREC="ieee" if q.dtype == torch.float32 else "tf32")  # fp32: no TF32 rounding
    return o
