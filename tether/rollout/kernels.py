"""Triton kernels of the decode step: grouped-query decode attention, and the per-block softmax
statistics that let a token be drawn without a float32 copy of the [B, V] probabilities.

Decode attention, one kernel per layer and step.

Why: at a decode step each KV head serves G query heads (Qwen2.5-0.5B: 14 / 2 = 7) and one new token
per row. torch's fused attention kernels tile queries by 64–128 rows, so 7 real queries fill a tenth
of each tile; on an H100 cuDNN's kernel took 74 µs per layer at batch 256 over 400 cache slots —
3–5× the time to read that layer's keys and values, and half of the whole decode step.

Here one program handles one (row, KV head): its G queries (padded to 16, the smallest tensor-core
tile) against the cache in blocks of BLOCK slots, with the online softmax of flash attention in
float32: scores s = q·k × scale + bias (the additive 0 / −inf mask), running max m and sum l,
acc = Σ exp(s − m) v, out = acc / l. P·V uses float32 P (TF32 tensor cores). The kernel also writes
the step's key and value into the cache slot first. Used by the native backend on CUDA when Triton is
importable and the head size is a power of two; otherwise torch ops (native.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the native backend uses torch ops
    triton = None

BLOCK = 64  # cache slots per inner step (64 × 64 bf16 keys = 8 KB per load)
# decode attention's launch: no point of a BLOCK / num_warps / num_stages sweep is more than 3 %
# faster than 64 / 4 / 3 (benchmarks/RESULTS.md)
NUM_WARPS, NUM_STAGES = 4, 3


def available(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether :func:`decode_attention` can run: CUDA, Triton importable, a power-of-two head size,
    at most 64 query heads per KV head."""
    D = head_dim
    return (triton is not None and torch.device(device).type == "cuda" and 16 <= D <= 256 and D & (D - 1) == 0
            and group <= 64 and dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:
    @triton.jit
    def _decode_attn(Q, K, V, Bias, O, KN, VN, Slot, scale, kv_len,
                     sqb, sqh, sqg, skb, skh, sks, svb, svh, svs, sbb, sob, soh, sog, sknb, sknh, svnb, svnh,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                     PREC: tl.constexpr, PREC_PV: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        # this step's key and value into the cache slot (read from device memory: a graph replays it)
        slot = tl.load(Slot)
        tl.store(K + b * skb + h * skh + slot * sks + d, tl.load(KN + b * sknb + h * sknh + d))
        tl.store(V + b * svb + h * svh + slot * svs + d, tl.load(VN + b * svnb + h * svnh + d))
        tl.debug_barrier()  # the block's loads below see those stores
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
            # P stays float32 (TF32 on tensor cores: 3 more mantissa bits than rounding it to bf16)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC_PV)
            m = m_new
        out = acc / l[:, None]
        tl.store(O + b * sob + h * soh + g[:, None] * sog + d[None, :], out.to(O.dtype.element_ty), mask=gmask)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float,
                     k_new: Tensor, v_new: Tensor, slot: Tensor) -> Tensor:
    """Write this step's ``k_new`` / ``v_new`` [B, Hkv, D] into cache slot ``slot`` (a [1] int64
    tensor), then softmax(q kᵀ · scale + bias) v over the first S slots, for one new token per row.

    q [B, Hkv, G, D] (the G query heads of each KV head), k / v [B, Hkv, S, D] (cache views; the last
    dim contiguous; ``slot`` < S), bias [B, S] additive (0 or −inf). Returns [B, Hkv, G, D] in q's dtype.
    """
    B, Hkv, G, D = q.shape
    S = k.shape[2]
    assert q.stride(3) == k.stride(3) == v.stride(3) == k_new.stride(2) == v_new.stride(2) == 1
    assert bias.stride(1) == 1
    o = torch.empty((B, Hkv, G, D), dtype=q.dtype, device=q.device)
    GP = max(16, triton.next_power_of_2(G))
    fp32 = q.dtype == torch.float32
    _decode_attn[(B, Hkv)](q, k, v, bias, o, k_new, v_new, slot, float(scale), S,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), bias.stride(0),
                           o.stride(0), o.stride(1), o.stride(2), k_new.stride(0), k_new.stride(1),
                           v_new.stride(0), v_new.stride(1),
                           G=G, GP=GP, D=D, BLOCK_S=BLOCK,
                           PREC="ieee" if fp32 else "tf32", PREC_PV="ieee" if fp32 else "tf32",
                           num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return o


def sampling_available(logits: Tensor) -> bool:
    return triton is not None and logits.is_cuda


if triton is not None:
    @triton.jit
    def _block_stats(Z, M, S, V, szb, smb, temperature, block, BLOCK_P2: tl.constexpr):
        r = tl.program_id(0)
        j = tl.program_id(1)
        i = tl.arange(0, BLOCK_P2)  # a power of two >= block (tl.arange needs one)
        cols = j * block + i
        z = tl.load(Z + r * szb + cols, mask=(i < block) & (cols < V), other=float("-inf"))
        z = z.to(tl.float32) / temperature
        mx = tl.maximum(tl.max(z, 0), -1.0e30)  # a block of −inf logits: weight 0, not NaN
        tl.store(M + r * smb + j, mx)
        tl.store(S + r * smb + j, tl.sum(tl.exp(z - mx), 0))


def block_stats(logits: Tensor, temperature: float, block: int) -> tuple[Tensor, Tensor]:
    """Per row and per block of ``block`` vocabulary entries of ``logits`` [B, V] (any float dtype,
    last dim contiguous): the block's max M of z = logits / temperature (float32) and
    S = Σ_block exp(z − M). One read of the logits; [B, V / block] out."""
    B, V = logits.shape
    assert logits.stride(1) == 1
    nb = -(-V // block)
    M = torch.empty((B, nb), dtype=torch.float32, device=logits.device)
    S = torch.empty_like(M)
    _block_stats[(B, nb)](logits, M, S, V, logits.stride(0), nb, float(temperature), block,
                          BLOCK_P2=triton.next_power_of_2(block))
    return M, S
