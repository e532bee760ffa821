"""Triton kernels of the decode step: grouped-query decode attention (with RoPE inside), SwiGLU's and
Gemma's gated activations, Gemma's RMSNorm, the two-kernel full-vocabulary draw (per-block softmax
statistics, then the draw) that needs no float32 copy of the [B, V] probabilities, and the step's
bookkeeping after the draw (:func:`record_step`).

Decode attention, one kernel per layer and step.

Why: at a decode step each KV head serves G query heads (Qwen2.5-0.5B: 14 / 2 = 7) and one new token
per row. torch's fused attention kernels tile queries by 64–128 rows, so 7 real queries fill a tenth
of each tile; on an H100 cuDNN's kernel took 74 µs per layer at batch 256 over 400 cache slots —
3–5× the time to read that layer's keys and values, and half of the whole decode step.

Here one program handles one (row, KV head): its G queries (padded to 16, the smallest tensor-core
tile) against the cache in blocks of BLOCK slots, with the online softmax of flash attention in
float32: scores s = q·k × scale + bias (the additive 0 / −inf mask), running max m and sum l,
acc = Σ exp(s − m) v, out = acc / l. For P·V, P is rounded to the cache's 16-bit type, as flash attention
(and the training forward's SDPA) rounds it; a float32 P through TF32 costs 0.7–1.5 µs more a call at
batch 64 (bench/decode_attention.py). The kernel also writes
the step's key and value into the cache slot first. Used by the native backend on CUDA when Triton is
importable and the head size is a power of two; otherwise torch ops (native.py).

Decode attention with RoPE (:func:`decode_attention_rope`): the same attention, reading q, k and v
straight from the output y of the layer's fused q|k|v GEMM ([B, (H + 2 Hkv) D]: q heads, then k
heads, then v heads), rotating q and k at each row's position ``pos[b]`` and writing the rotated k
and the raw v into the cache slot. The position and the slot are loaded from device memory, so a
captured CUDA graph replays both; the kernel gathers the table rows from [slots, D] views of the
backend's tables. It replaces per layer torch's RoPE (native.py ``_rope``: two multiplies, a
half-swap copy and an add). The rotation is torch's, bit for bit: rotate-half RoPE as
x·cos + swap(x)·sin± (sin± = [−sin_1, sin_2], the backend's table; swap(x)[d] = x[(d + D/2) mod D]),
where torch computes each op in float32 and rounds to the model dtype after it: a = rnd(x·c),
b = rnd(swap(x)·s), out = rnd(a + b). In half precision the float32 product of two 16-bit values is
exact; in float32 the products are PTX's mul.rn (inline assembly), which the compiler never
contracts with the add into an FMA (torch runs them as separate kernels). Both kernels share the
online-softmax loop (:func:`_attend`), so the attention's code, and its rounding, is the same.

SwiGLU (:func:`silu_mul`): silu(gate) · up from the fused gate|up GEMM's output in one kernel, in
torch's rounding order: silu in float32 (x / (1 + exp(−x)), IEEE division, CUDA's expf through
libdevice) rounded to the model dtype, then the product in float32, rounded. It replaces an in-place
silu over a strided view and a multiply (two kernels, two reads of the gate half); its output is a
new contiguous [.., n] tensor.

Under Triton's interpreter (TRITON_INTERPRET=1, CPU) plain float32 ops stand in for mul.rn and
libdevice's expf (numpy contracts nothing either); the interpreter rounds float32 to bfloat16 by truncation
and multiplies bfloat16 matrices wrongly, so bfloat16 is checked on CUDA alone
(tests/test_rollout_kernels.py).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the native backend uses torch ops
    triton = None

BLOCK = 64  # cache slots per inner step (64 × 64 bf16 keys = 8 KB per load)
# Twice that where the grid has no more programs than the card has SMs (batch 64 × 2 KV heads on an
# H200's 132) and a block stays 8k elements: one program an SM walks the cache block by block, ~1.8 µs
# a block, and fewer, longer blocks take 2–12 % off a call from 128 slots on (at 64 slots, half of one
# wide block is masked: 13 % slower); with several programs an SM (batch 256) the 64-slot block is
# 2–45 % faster. Splitting a row's slots over several programs merged at the end
# (flash decoding) was no faster at either batch (0.212 vs 0.210 ms a step at batch 64): it is not kept.
WIDE_BLOCK_ELEMENTS = 8192
# decode attention's launch: 2 warps or 2 stages are slower at batch 64 (bench/decode_attention.py)
NUM_WARPS, NUM_STAGES = 4, 3
_SMS: dict = {}


def _block(rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Cache slots per inner step of the decode attention for a grid of rows × kv_heads programs."""
    dev = torch.device(device)
    if dev.type != "cuda" or dtype == torch.float32 or 2 * BLOCK * head_dim > WIDE_BLOCK_ELEMENTS:
        return BLOCK
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return 2 * BLOCK if rows * kv_heads <= _SMS[i] else BLOCK


# PTX's mul.rn for a float32 multiply that is never contracted into an FMA, libdevice for CUDA's expf.
# Triton's interpreter (CPU; read at import, as triton.jit reads it) has neither, and ROCm no PTX:
# plain float32 ops there
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PTX = not INTERPRET and torch.version.hip is None


def available(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether :func:`decode_attention` can run: CUDA, Triton importable, a power-of-two head size,
    at most 64 query heads per KV head."""
    D = head_dim
    # float32 at D = 256 (Gemma 3) needs 283 KB of shared memory, more than an H100/H200 has (227 KB)
    return (triton is not None and torch.device(device).type == "cuda" and 16 <= D <= 256 and D & (D - 1) == 0
            and group <= 64 and (dtype in (torch.bfloat16, torch.float16) or (dtype == torch.float32 and D <= 128)))


if triton is not None:
    @triton.jit
    def _attend(q, K, V, Bias, kv_len, scale, skb, skh, sks, svb, svh, svs, sbb, b, h,
                GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
                PREC_PV: tl.constexpr):
        """softmax(q kᵀ · scale + bias) v for q [GP, D] over the first kv_len slots of the cache of
        (row b, KV head h), online (flash attention) in float32. -> [GP, D] float32."""
        d = tl.arange(0, D)
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
            if PREC_PV == "16":  # P rounded to the cache's 16-bit type (flash attention's P · V)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:  # P in float32 (TF32 or IEEE), V widened to it
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC_PV)
            m = m_new
        return acc / l[:, None]

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
        out = _attend(q, K, V, Bias, kv_len, scale, skb, skh, sks, svb, svh, svs, sbb, b, h,
                      GP, D, BLOCK_S, PREC, PREC_PV)
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
                           G=G, GP=GP, D=D, BLOCK_S=_block(B, Hkv, D, q.dtype, q.device),
                           PREC="ieee" if fp32 else "tf32", PREC_PV="ieee" if fp32 else "16",
                           num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return o


if triton is not None:
    @triton.jit
    def _mul_rn(a, b, RN: tl.constexpr):
        """a · b in float32, correctly rounded: PTX's mul.rn, which is never contracted into an FMA
        with a later add and keeps subnormals (libdevice's mul_rn flushes them here)."""
        if RN:
            p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            p = a * b
        return p

    @triton.jit
    def _rope(x, xs, c, s, RN: tl.constexpr):
        """torch's x·cos + swap(x)·sin± with a rounding to x's dtype after each op (x, xs = swap(x)
        in the model dtype; c, s the table rows in it too). -> the model dtype."""
        dt = x.dtype
        a = _mul_rn(x.to(tl.float32), c.to(tl.float32), RN).to(dt)
        b = _mul_rn(xs.to(tl.float32), s.to(tl.float32), RN).to(dt)
        return (a.to(tl.float32) + b.to(tl.float32)).to(dt)

    @triton.jit
    def _decode_attn_rope(Y, Cos, Sin, Pos, K, V, Bias, O, Slot, scale, kv_len, H, HKV,
                          syb, scs, sss, spb, skb, skh, sks, svb, svh, svs, sbb, sob, soh, sog,
                          G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                          PREC: tl.constexpr, PREC_PV: tl.constexpr, RN: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        ds = (d + D // 2) % D  # rotate-half: each element's partner in the other half
        # this row's RoPE position and the step's cache slot, read from device memory (a graph replays them)
        pos = tl.load(Pos + b * spb)
        slot = tl.load(Slot)
        c = tl.load(Cos + pos * scs + d)
        s = tl.load(Sin + pos * sss + d)
        y = Y + b * syb
        # KV head h: its key rotated, its value as is, into the cache slot
        kh = y + (H + h) * D
        tl.store(K + b * skb + h * skh + slot * sks + d, _rope(tl.load(kh + d), tl.load(kh + ds), c, s, RN))
        tl.store(V + b * svb + h * svh + slot * svs + d, tl.load(y + (H + HKV + h) * D + d))
        tl.debug_barrier()  # the block's loads below see those stores
        # its G query heads h·G .. h·G + G − 1, rotated
        gmask = g[:, None] < G
        qh = y + (h * G + g[:, None]) * D
        q = tl.load(qh + d[None, :], mask=gmask, other=0.0)
        q_swap = tl.load(qh + ds[None, :], mask=gmask, other=0.0)
        q = _rope(q, q_swap, tl.broadcast_to(c[None, :], (GP, D)), tl.broadcast_to(s[None, :], (GP, D)), RN)
        out = _attend(q, K, V, Bias, kv_len, scale, skb, skh, sks, svb, svh, svs, sbb, b, h,
                      GP, D, BLOCK_S, PREC, PREC_PV)
        tl.store(O + b * sob + h * soh + g[:, None] * sog + d[None, :], out.to(O.dtype.element_ty), mask=gmask)


def decode_attention_rope(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k: Tensor, v: Tensor,
                          bias: Tensor, scale: float, slot: Tensor, n_heads: int, n_kv: int,
                          head_dim: int) -> Tensor:
    """:func:`decode_attention` with q, k, v taken from the fused q|k|v projection and RoPE applied
    inside: ``qkv`` [B, 1, (H + 2 Hkv) D] or [B, (H + 2 Hkv) D] (last dim contiguous; q heads, then
    k heads, then v heads), ``cos`` / ``sin`` [slots, D] (rows of the backend's tables, sin with its
    first half negated; any row stride), ``pos`` [B] int64 each row's position. Rotates q and k at
    ``pos`` as torch's RoPE does, bit for bit (module docstring), writes the rotated k and the raw v
    into cache slot ``slot`` (a [1] int64 tensor) of k / v [B, Hkv, S, D], then attends as
    :func:`decode_attention`. Returns [B, Hkv, G, D] in qkv's dtype."""
    B, D, S = qkv.shape[0], head_dim, k.shape[2]
    G = n_heads // n_kv
    y = qkv.reshape(B, -1)
    assert y.shape[1] == (n_heads + 2 * n_kv) * D and y.stride(1) == 1
    assert cos.stride(1) == sin.stride(1) == k.stride(3) == v.stride(3) == bias.stride(1) == 1
    assert pos.dim() == 1 and pos.shape[0] == B
    o = torch.empty((B, n_kv, G, D), dtype=qkv.dtype, device=qkv.device)
    GP = max(16, triton.next_power_of_2(G))
    fp32 = qkv.dtype == torch.float32
    _decode_attn_rope[(B, n_kv)](y, cos, sin, pos, k, v, bias, o, slot, float(scale), S, n_heads, n_kv,
                                 y.stride(0), cos.stride(0), sin.stride(0), pos.stride(0),
                                 k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                                 bias.stride(0), o.stride(0), o.stride(1), o.stride(2),
                                 G=G, GP=GP, D=D, BLOCK_S=_block(B, n_kv, D, qkv.dtype, qkv.device),
                                 PREC="ieee" if fp32 else "tf32", PREC_PV="ieee" if fp32 else "16",
                                 RN=PTX, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return o


if triton is not None:
    @triton.jit
    def _exp(x, RN: tl.constexpr):
        """exp(x) in float32 as CUDA's expf (torch's silu), not Triton's faster ex2.approx-based exp."""
        if RN:
            e = libdevice.exp(x)
        else:
            e = tl.exp(x)
        return e

    @triton.jit
    def _silu_mul(Y, O, n, syr, sor, BLOCK_N: tl.constexpr, RN: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)  # r · syr passes 2³¹ in a long prefill
        i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = i < n
        gate = tl.load(Y + r * syr + i, mask=mask, other=0.0)
        up = tl.load(Y + r * syr + n + i, mask=mask, other=0.0)
        x = gate.to(tl.float32)
        silu = tl.math.div_rn(x, 1.0 + _exp(-x, RN)).to(gate.dtype)
        tl.store(O + r * sor + i, (silu.to(tl.float32) * up.to(tl.float32)).to(O.dtype.element_ty), mask=mask)


    @triton.jit
    def _gelu_tanh_mul(Y, O, n, syr, sor, BLOCK_N: tl.constexpr, RN: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = i < n
        gate = tl.load(Y + r * syr + i, mask=mask, other=0.0)
        up = tl.load(Y + r * syr + n + i, mask=mask, other=0.0)
        x = gate.to(tl.float32)
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))  # sqrt(2 / pi) (x + 0.044715 x³)
        if RN:  # CUDA's tanhf, torch's
            t = libdevice.tanh(inner)
        else:
            t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        gelu = (0.5 * x * (1.0 + t)).to(gate.dtype)
        tl.store(O + r * sor + i, (gelu.to(tl.float32) * up.to(tl.float32)).to(O.dtype.element_ty), mask=mask)


def elementwise_available(x: Tensor) -> bool:
    """Whether :func:`silu_mul`, :func:`gelu_tanh_mul` and :func:`gemma_rmsnorm` run for ``x``: Triton
    importable and x on CUDA."""
    return triton is not None and x.is_cuda


SILU_BLOCK = 1024  # elements of a row per program


def silu_mul(y: Tensor, n: int) -> Tensor:
    """silu(y[..., :n]) · y[..., n:] for y [..., 2n] (last dim contiguous), as torch's
    ``F.silu(gate) * up`` rounds it (module docstring). Returns a new contiguous [..., n] tensor."""
    assert y.shape[-1] == 2 * n and y.stride(-1) == 1
    y2 = y.reshape(-1, 2 * n)
    o = torch.empty((y2.shape[0], n), dtype=y.dtype, device=y.device)
    if o.numel():
        _silu_mul[(y2.shape[0], triton.cdiv(n, SILU_BLOCK))](y2, o, n, y2.stride(0), o.stride(0),
                                                             BLOCK_N=SILU_BLOCK, RN=PTX)
    return o.view(*y.shape[:-1], n)


def gelu_tanh_mul(y: Tensor, n: int) -> Tensor:
    """gelu_tanh(y[..., :n]) · y[..., n:] for y [..., 2n] (last dim contiguous): Gemma's MLP, as torch's
    ``F.gelu(gate, approximate="tanh") * up`` rounds it — the GELU in float32 (0.5 x (1 + tanh(sqrt(2/π)
    (x + 0.044715 x³))), CUDA's tanhf) rounded to the model dtype, then the product in float32, rounded.
    Where the compilers contract the polynomial into FMAs differently, the float32 GELU may differ in its
    last ulps. One kernel where torch's ops are two (the GELU over a strided view, the product).
    Returns a new contiguous [..., n] tensor."""
    assert y.shape[-1] == 2 * n and y.stride(-1) == 1
    y2 = y.reshape(-1, 2 * n)
    o = torch.empty((y2.shape[0], n), dtype=y.dtype, device=y.device)
    if o.numel():
        _gelu_tanh_mul[(y2.shape[0], triton.cdiv(n, SILU_BLOCK))](y2, o, n, y2.stride(0), o.stride(0),
                                                                 BLOCK_N=SILU_BLOCK, RN=PTX)
    return o.view(*y.shape[:-1], n)


if triton is not None:
    @triton.jit
    def _gemma_rmsnorm(X, W, R, O, n, inner, sxo, sxi, eps, BLOCK_N: tl.constexpr, ADD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_N)
        mask = i < n
        x = tl.load(X + (r // inner) * sxo + (r % inner) * sxi + i, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.math.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(W + i, mask=mask, other=0.0).to(tl.float32)
        out = (y * (1.0 + w)).to(O.dtype.element_ty)
        if ADD:  # residual + the rounded norm, added in float32 and rounded: torch's order
            out = (tl.load(R + r * n + i, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32))
        tl.store(O + r * n + i, out.to(O.dtype.element_ty), mask=mask)


def gemma_rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """Gemma's RMSNorm in one kernel: x / sqrt(mean(x²) + eps) · (1 + w), all in float32, rounded once to
    x's dtype (HF's Gemma3RMSNorm; torch's ops of it are five kernels, the (1 + w) two more). x [..., n]
    with its last dim contiguous and its rows on at most two strides (a head view of the fused q|k|v
    output: [B, T, heads, n]). Returns a new contiguous tensor of x's shape. The reciprocal square root
    is the hardware's (rsqrt.approx), as torch's: the float32 result may differ from torch's in its last
    ulps, the rounded 16-bit one where it lies next to a rounding boundary. ``residual`` (contiguous, x's
    shape and dtype): residual + norm(x) instead, in the same kernel (Gemma's post-attention and
    post-MLP norms), rounded as torch's ``residual + norm(x)``."""
    n = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (n,) and weight.is_contiguous()
    if x.dim() == 1:
        x = x[None]
    try:
        x3 = x.view(-1, 1, n)
    except RuntimeError:  # rows on two strides (heads within a token, tokens); a copy if on more
        x3 = x.reshape(-1, x.shape[-2], n)
    o = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        _gemma_rmsnorm[(rows,)](x3, weight, o if residual is None else residual, o, n, x3.shape[1], x3.stride(0),
                                x3.stride(1), float(eps), BLOCK_N=triton.next_power_of_2(n),
                                ADD=residual is not None, enable_fp_fusion=False)  # (no FMA: torch's roundings)
    return o


def sampling_available(logits: Tensor) -> bool:
    return triton is not None and logits.is_cuda


if triton is not None:
    @triton.jit
    def _block_stats(Z, M, S, V, szb, smb, temperature, block, BLOCK_P2: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)  # r · (row stride) passes 2³¹ past 8k rows of a 262k vocabulary
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


if triton is not None:
    @triton.jit
    def _draw(Z, M, S, U, Y, LP, V, nb, szb, smb, temperature, block,
              NB_P2: tl.constexpr, BLOCK_P2: tl.constexpr, RN: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)  # r · (row stride) passes 2³¹ past 8k rows of a 262k vocabulary
        # the block holding the draw: the first whose cumulative weight S_j · exp(M_j − m) reaches u · total
        j = tl.arange(0, NB_P2)
        Mj = tl.load(M + r * smb + j, mask=j < nb, other=float("-inf"))
        m = tl.max(Mj, 0)
        w = tl.where(j < nb, tl.load(S + r * smb + j, mask=j < nb, other=0.0) * _exp(Mj - m, RN), 0.0)
        cs = tl.cumsum(w, 0)
        total = tl.max(cs, 0)  # the last cumulative weight (weights are >= 0)
        target = tl.maximum(tl.load(U + r) * total, 1.1754943508222875e-38)  # float32's smallest normal
        bi = tl.minimum(tl.sum((cs < target).to(tl.int32), 0), nb - 1)
        before = tl.sum(tl.where(j == bi - 1, cs, 0.0), 0)
        # inside it: the first token whose cumulative weight exp(z / T − m) reaches what is left
        i = tl.arange(0, BLOCK_P2)
        cols = bi * block + i
        z = tl.load(Z + r * szb + cols, mask=(i < block) & (cols < V), other=float("-inf")).to(tl.float32)
        wb = _exp(z / temperature - m, RN)
        cb = tl.cumsum(wb, 0)
        k = tl.sum((cb < target - before).to(tl.int32), 0)
        # rounding (block sums vs the scan inside the block) may put the target past the block's last
        # token of positive weight: never beyond it, so a zero-weight token is never drawn
        k = tl.minimum(k, tl.sum((cb < tl.max(cb, 0)).to(tl.int32), 0))
        y = bi * block + k
        zy = tl.load(Z + r * szb + y).to(tl.float32) / temperature
        tl.store(Y + r, y.to(tl.int64))
        tl.store(LP + r, zy - m - tl.log(total))


def draw(logits: Tensor, M: Tensor, S: Tensor, u: Tensor, temperature: float, block: int) -> tuple[Tensor, Tensor]:
    """One token per row of ``logits`` [B, V] by inverse-CDF sampling at ``temperature``, from the block
    statistics ``M``, ``S`` of :func:`block_stats` (blocks of ``block`` entries) and uniforms ``u`` [B]:
    the first block whose cumulative weight Σ S_j · exp(M_j − m) (m the row's max) reaches u times the
    total, then the first token inside it whose cumulative exp(z / T − m) reaches the rest.
    -> (tokens [B] int64, log_softmax(z / T) at them [B] float32 = z_y / T − m − log total).
    One program a row; the exps are CUDA's expf (torch's). The cumulative sums are Triton's scans,
    which may add in another order than torch's cumsum: a draw can differ from the dense softmax
    draw's only where the uniform lands within float32 rounding of a token boundary."""
    B, V = logits.shape
    nb = M.shape[1]
    assert logits.stride(1) == 1 and M.stride(1) == S.stride(1) == 1 and M.stride(0) == S.stride(0)
    y = torch.empty(B, dtype=torch.int64, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _draw[(B,)](logits, M, S, u.float().contiguous(), y, lp, V, nb, logits.stride(0), M.stride(0), float(temperature),
                block, NB_P2=triton.next_power_of_2(nb), BLOCK_P2=triton.next_power_of_2(block), RN=PTX)
    return y, lp


if triton is not None:
    @triton.jit
    def _record(Y, LP, FLAT, FIN, TOK, OUT_TOK, OUT_LP, OUT_KIND, FORCE_ON, FORCE_TOK, ENDS, n, n_ends, pad,
                BLOCK: tl.constexpr, EPISODES: tl.constexpr, CHECK_ENDS: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        flat = tl.load(FLAT + i, mask=m, other=0)
        y = tl.load(Y + i, mask=m, other=0)
        lp = tl.load(LP + i, mask=m, other=0.0)
        fin = tl.load(FIN + i, mask=m, other=0) != 0
        forced = fin & False
        if EPISODES:  # the environment's tokens: fed as they are, no log-prob, no end
            forced = tl.load(FORCE_ON + flat, mask=m, other=0) != 0
            y = tl.where(forced, tl.load(FORCE_TOK + flat, mask=m, other=0), y)
            lp = tl.where(forced, 0.0, lp)
            kind = tl.where(fin, 0, tl.where(forced, 2, 1))
            tl.store(OUT_KIND + flat, kind.to(tl.int8), mask=m)
        y = tl.where(fin, pad, y)
        tl.store(OUT_TOK + flat, y, mask=m)
        tl.store(OUT_LP + flat, tl.where(fin, 0.0, lp), mask=m)
        if CHECK_ENDS:  # one load a row, however many end tokens (a multi-turn benchmark has thousands)
            end = tl.load(ENDS + y, mask=m & (y >= 0) & (y < n_ends), other=0) != 0
            tl.store(FIN + i, (fin | (end & ~forced)).to(tl.int8), mask=m)
        tl.store(TOK + i, y, mask=m)


RECORD_BLOCK = 256  # rows a program


def record_available(x: Tensor) -> bool:
    """Whether :func:`record_step` runs for the step's tokens ``x``: Triton importable, x on CUDA."""
    return triton is not None and x.is_cuda


def record_step(y: Tensor, lp: Tensor, flat: Tensor, finished: Tensor, tokens: Tensor, out_tok: Tensor,
                out_logp: Tensor, ends: Tensor | None, pad: int, episodes: tuple[Tensor, Tensor, Tensor] | None) -> None:
    """A decode step's bookkeeping after the draw, in one kernel where torch's ops take 8 (19 with
    episodes): for each row with drawn token ``y`` and log-prob ``lp``, at its output position ``flat``
    (row · (steps + 1) + step into the flattened output buffers): with ``episodes`` = (force_on,
    force_tok, out_kind) a forced token replaces the draw with log-prob 0 and the step's kind is
    recorded (0 finished, 1 model token, 2 forced); a finished row records ``pad`` and log-prob 0; the
    token goes to ``out_tok``, the log-prob to ``out_logp``, and as the row's next input to ``tokens``;
    a row whose token is an end token (``ends``: bool over token ids, True at the end tokens; ids past
    it are none), and not forced, is finished. ``finished`` [n] bool and ``tokens`` [n] int64 are
    updated in place (contiguous views)."""
    n = y.shape[0]
    assert finished.is_contiguous() and tokens.is_contiguous() and out_tok.is_contiguous() and out_logp.is_contiguous()
    fin = finished.view(torch.int8)  # Triton reads a bool pointer as int1: bytes keep the stores plain
    force_on, force_tok, out_kind = episodes if episodes is not None else (fin, tokens, fin)
    n_ends = 0 if ends is None else ends.numel()
    _record[(triton.cdiv(n, RECORD_BLOCK),)](
        y, lp, flat, fin, tokens, out_tok, out_logp, out_kind,
        force_on.view(torch.int8) if force_on.dtype == torch.bool else force_on, force_tok,
        ends.view(torch.int8) if n_ends else fin, n, n_ends, pad, BLOCK=RECORD_BLOCK,
        EPISODES=episodes is not None, CHECK_ENDS=n_ends > 0)
