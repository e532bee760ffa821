"""The decode step's fused Triton kernels (rollout/kernels.py) against the torch ops they replace:
decode_attention_rope against torch's RoPE (native._rope over the backend's tables) followed by
decode_attention — the output and the cache, bit for bit, for one and seven query heads per KV
head, rows at different positions, the slot inside the cache, masked slots and a masked block;
silu_mul against F.silu(gate) * up; NativeBackend's decode of a tiny Qwen2 model with fused
projections, FUSE_KERNELS on against off; the two-kernel draw against the dense softmax draw; and
Gemma's kernels (its RMSNorm, with and without the residual add, and gelu(gate) * up) against HF's
module and torch's ops, alone and in a tiny Gemma 3 model's decode; and the step's bookkeeping
kernel (record_step) against engine.record_step's torch ops, alone and in multi-turn episodes.

Runs on CUDA; on a machine without one, under Triton's interpreter (TRITON_INTERPRET=1) on CPU, in
float32 and float16 only: the interpreter rounds float32 to bfloat16 by truncation and multiplies
bfloat16 matrices (tl.dot) wrongly, so bfloat16 runs on CUDA alone. The interpreter has no CUDA
graphs: the replay test runs on CUDA; on CPU the kernels are called again after the position and
slot tensors are rewritten in place."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen3Config

from tether.rollout import kernels, native
from tether.rollout.fuse import fuse_projections
from tether.rollout.native import NativeBackend
from test_rollout_cpu import _model as _tiny_hf_model

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(kernels.triton is None or not (DEV == "cuda" or INTERPRET),
                                 reason="needs Triton on CUDA (or TRITON_INTERPRET=1)")]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
DTYPE_IDS = ["fp32", "fp16", "bf16"][:len(DTYPES)]


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The backend's torch code (no C step) with our attention kernel, also on the CPU."""
    monkeypatch.setattr(native, "DECODE_ATTN", "triton")


def _qwen2(heads, kv_heads, head_dim, dtype, family=Qwen2Config):
    return _tiny_hf_model(family, hidden_size=heads * head_dim, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=96).to(DEV, dtype)


def _tables(heads, kv_heads, head_dim, dtype, slots):
    """The backend's RoPE tables cos, sin± [slots, H + Hkv, D] (HF's rotary module, Qwen2)."""
    be = NativeBackend(_qwen2(heads, kv_heads, head_dim, dtype))
    be.alloc(1, slots)
    return be.cos, be.sin


def _reference(y, cos, sin, pos, kc, vc, bias, scale, slot, H, Hkv, D):
    """torch's RoPE as the backend's decode applies it (native._qkv), then decode_attention."""
    B = y.shape[0]
    qk = native._rope(y[..., :(H + Hkv) * D].view(B, 1, H + Hkv, D), cos[pos][:, None], sin[pos][:, None])
    q, k = qk[:, :, :H], qk[:, :, H:]
    v = y[..., (H + Hkv) * D:].view(B, 1, Hkv, D)
    return kernels.decode_attention(q.reshape(B, Hkv, H // Hkv, D), kc, vc, bias, scale, k[:, 0], v[:, 0], slot)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("H,Hkv,D", [(2, 2, 64), (14, 2, 64)], ids=["G1", "G7"])
def test_decode_attention_rope_equals_torch_rope_then_decode_attention(dtype, H, Hkv, D):
    B, slots, S, scale = 4, 160, 130, D ** -0.5
    cos, sin = _tables(H, Hkv, D, dtype, slots)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(B, 1, (H + 2 * Hkv) * D, generator=g).mul(2).to(DEV, dtype)
    cache = [torch.randn(B, Hkv, slots, D, generator=g).to(DEV, dtype) for _ in range(2)]
    pos = torch.tensor([3, 77, 129, 40], device=DEV)  # each row its own position
    slot = torch.tensor([100], device=DEV)  # inside the cache view, in its second block of 64
    bias = torch.zeros(B, slots, dtype=dtype, device=DEV)
    bias[0, :40] = float("-inf")  # left padding
    bias[1, 110:] = float("-inf")  # slots past the row's end
    bias[2, :64] = float("-inf")  # a whole block of the kernel
    bias[3, 101:120] = float("-inf")
    b = bias[:, :S]
    want_k, want_v = (c.clone() for c in cache)
    want = _reference(y, cos, sin, pos, want_k[:, :, :S], want_v[:, :, :S], b, scale, slot, H, Hkv, D)
    got_k, got_v = (c.clone() for c in cache)
    got = kernels.decode_attention_rope(y, cos[:, 0], sin[:, 0], pos, got_k[:, :, :S], got_v[:, :, :S], b, scale,
                                        slot, H, Hkv, D)
    assert got.shape == (B, Hkv, H // Hkv, D) and got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # the rotated k and the raw v, in slot 100
    assert torch.equal(got, want)
    # the test is not vacuous: the rotation moves k, and every row's position changes its values
    kv = y[:, 0, H * D:].view(B, 2, Hkv, D)
    assert not torch.equal(want_k[:, :, 100], kv[:, 0]) and torch.equal(want_v[:, :, 100], kv[:, 1])
    assert (cos[pos, 0] != cos[pos.roll(1), 0]).any(-1).all()
    # a graph replays the kernel with new values in the same tensors: read from device memory at each call
    pos.copy_(torch.tensor([150, 0, 12, 99]))
    slot.fill_(7)
    want = _reference(y, cos, sin, pos, want_k[:, :, :S], want_v[:, :, :S], b, scale, slot, H, Hkv, D)
    got = kernels.decode_attention_rope(y[:, 0], cos[:, 0], sin[:, 0], pos, got_k[:, :, :S], got_v[:, :, :S], b,
                                        scale, slot, H, Hkv, D)  # y as [B, (H + 2 Hkv) D] too
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and torch.equal(got, want)
    assert not torch.equal(got_k[:, :, 7], cache[0][:, :, 7])


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs")
def test_decode_attention_rope_replays_in_a_cuda_graph():
    """Captured once, replayed after pos and slot change in place: the replay uses the new values."""
    H, Hkv, D, B, slots, dtype = 14, 2, 64, 8, 96, torch.bfloat16
    cos, sin = _tables(H, Hkv, D, dtype, slots)
    g = torch.Generator(device=DEV).manual_seed(0)
    y = torch.randn(B, 1, (H + 2 * Hkv) * D, device=DEV, generator=g).to(dtype)
    kc, vc = (torch.randn(B, Hkv, slots, D, device=DEV, generator=g).to(dtype) for _ in range(2))
    bias = torch.zeros(B, slots, dtype=dtype, device=DEV)
    pos = torch.arange(B, device=DEV) * 5
    slot = torch.tensor([10], device=DEV)

    def step():
        return kernels.decode_attention_rope(y, cos[:, 0], sin[:, 0], pos, kc, vc, bias, D ** -0.5, slot, H, Hkv, D)
    step()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    pos.copy_(torch.arange(B, device=DEV) * 7 + 3)
    slot.fill_(50)
    wk, wv = kc.clone(), vc.clone()
    want = _reference(y, cos, sin, pos, wk, wv, bias, D ** -0.5, slot, H, Hkv, D)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc, wk) and torch.equal(vc, wv) and torch.equal(out, want)


def _ulps(got, want):
    """How many representable values of the dtype lie between got and want (elementwise)."""
    ints, mag = (torch.int32, 0x7FFFFFFF) if want.dtype == torch.float32 else (torch.int16, 0x7FFF)

    def ordered(x):  # the float's bits as an integer that counts in the floats' order
        i = x.contiguous().view(ints).long()
        return torch.where(i < 0, -(i & mag), i)
    return (ordered(got) - ordered(want)).abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [300, 1100])  # a partial block; two programs per row
def test_silu_mul_equals_torch(dtype, n):
    """silu in float32 rounded to the dtype, then the product rounded: torch's order. The exp may
    differ from torch's in the last float32 ulps (on CUDA the kernel calls CUDA's expf, torch's own;
    under the interpreter numpy's exp and torch's vectorized CPU exp differ by up to 2 ulps, silu by
    up to 3): float32 within 4 ulps; a half-precision result moves by one ulp only where the float32
    value lies next to a rounding boundary: within 1 ulp, on at most 1 % of the elements."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(2, 3, 2 * n + 8, generator=g).mul(4).to(DEV, dtype)
    y = big[..., 8:]  # rows with a stride of their own
    got = kernels.silu_mul(y, n)
    want = F.silu(y[..., :n]) * y[..., n:]
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    ulps = _ulps(got, want)
    if dtype == torch.float32:
        assert ulps.max() <= 4, ulps.max()
    else:
        assert ulps.max() <= 1 and (ulps > 0).float().mean() <= 0.01, (ulps.max(), (ulps > 0).float().mean())
    swapped = torch.cat([y[..., n:], y[..., :n]], -1)  # gate and up are not interchangeable
    assert _ulps(kernels.silu_mul(swapped, n), want).max() > 1000


def _decode_logits(model, steps=4):
    """Prefill then `steps` greedy decode steps of NativeBackend over ragged prompts: the logits."""
    be = NativeBackend(model)
    g = torch.Generator().manual_seed(0)
    lens = [1, 7, 12, 4, 9]
    B, P = len(lens), max(lens)
    ids = torch.randint(3, 64, (B, P), generator=g).to(DEV)
    mask = (torch.arange(P)[None] >= P - torch.tensor(lens)[:, None]).to(DEV)
    be.alloc(B, P + steps + 1)
    with torch.inference_mode():
        out = [be.prefill(ids, mask, 0)]
        bias = torch.full((B, P + steps + 1), float("-inf"), dtype=be.dtype, device=DEV)
        bias[:, :P].masked_fill_(mask, 0.0)
        pos = mask.sum(-1)
        for t in range(steps):
            slot = torch.tensor([P + t], device=DEV)
            out.append(be.decode(out[-1].argmax(-1), pos + t, slot, bias, P + t + 1))
    return be, torch.stack(out)


def _count(monkeypatch, name):
    calls = []
    fn = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backend_decode_with_and_without_fused_kernels(dtype, monkeypatch):
    """A tiny Qwen2 (q/k/v biases; 14 heads over 2 KV heads, as Qwen2.5-0.5B; head_dim 32), its
    projections fused: with silu_mul left out, FUSE_KERNELS on and off give the same logits bit for
    bit (the RoPE is torch's, the attention the same code); with silu_mul (on CUDA by default, forced
    on the CPU) within the silu's last-ulp differences."""
    model = fuse_projections(_qwen2(14, 2, 32, dtype))
    rope_calls, attn_calls, silu_calls = (_count(monkeypatch, n) for n in
                                          ("decode_attention_rope", "decode_attention", "silu_mul"))
    monkeypatch.setattr(native, "FUSE_KERNELS", False)
    be, off = _decode_logits(model)
    assert be.rope_in_kernel == [False, False] and len(rope_calls) == 0 and len(attn_calls) == 8
    assert not silu_calls
    monkeypatch.setattr(native, "FUSE_KERNELS", True)
    monkeypatch.setattr(kernels, "elementwise_available", lambda x: False)
    be, on = _decode_logits(model)
    assert be.rope_in_kernel == [True, True] and len(rope_calls) == 8 and len(attn_calls) == 8
    assert torch.equal(on, off)
    monkeypatch.setattr(kernels, "elementwise_available", lambda x: True)
    _, on_silu = _decode_logits(model)
    assert len(silu_calls) == 2 * 5  # the prefill and 4 decode steps, 2 layers
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (on_silu.float() - off.float()).abs().max() <= tol


def test_rope_stays_in_torch_where_the_kernel_does_not_apply(monkeypatch):
    """Unfused q|k|v, Qwen3's q/k norms, the switch off, or another attention: torch's RoPE."""
    plain = _qwen2(4, 2, 16, torch.float32)
    assert NativeBackend(fuse_projections(copy.deepcopy(plain))).rope_in_kernel == [True, True]
    assert NativeBackend(plain).rope_in_kernel == [False, False]
    assert NativeBackend(fuse_projections(_qwen2(4, 2, 16, torch.float32, Qwen3Config))).rope_in_kernel \
        == [False, False]
    monkeypatch.setattr(native, "DECODE_ATTN", "sdpa")
    assert NativeBackend(fuse_projections(plain)).rope_in_kernel == [False, False]


@pytest.mark.parametrize("T,V", [(1.0, 5000), (0.7, 5000), (1.0, 1500)])  # 1500: one block, not a power of 2
def test_blockwise_draw_equals_the_softmax_draw(T, V):
    """block_stats + draw (two kernels, no float32 [B, V] copy) pick the token that the softmax +
    inverse-CDF draw picks for the same uniform (but for float32 rounding at a token boundary), with
    log_softmax(z / T) at it; a block of -inf logits is never drawn from. Shifting the uniforms
    moves the draws: the test reads u."""
    from tether.rollout import sampling
    g = torch.Generator().manual_seed(1)
    dtype = torch.float16 if DEV != "cuda" else torch.bfloat16
    logits = (torch.randn(256, V, generator=g) * 3).to(DEV, dtype)
    logits[0, 1200:] = float("-inf")  # whole blocks of -inf logits (V = 5000)
    u = torch.rand(256, generator=g).to(DEV)
    p = torch.softmax(logits.float() / T, -1)
    want = sampling._inverse_cdf(p, u).squeeze(1)
    y, lp = sampling._sample_blockwise(logits, u, T)
    assert y.dtype == torch.int64 and lp.dtype == torch.float32
    assert (y == want).float().mean() >= 0.99 and (y[0] < 1200 or V == 1500)
    ref = torch.log_softmax(logits.float() / T, -1).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    y2, _ = sampling._sample_blockwise(logits, (u + 0.5) % 1, T)
    assert (y2 != y).float().mean() > 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemma_rmsnorm_equals_hf_module(dtype):
    """One kernel against HF's Gemma3RMSNorm (float32 throughout, times 1 + w, one rounding) on a
    contiguous [B, T, n] input and on a head view of a fused q|k|v output (rows on two strides): float32
    within a few ulps (the reciprocal square root's approximation), half precision within one ulp on at
    most 1 % of the elements. Reading w for 1 + w fails it."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    g = torch.Generator().manual_seed(3)
    for shape, view in (((3, 2, 640), None), ((4, 1, (4 + 2) * 256), (4, 256))):
        n = shape[-1] if view is None else view[1]
        norm = Gemma3RMSNorm(n, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=g) * 0.5)
        norm = norm.to(DEV, dtype)
        y = (torch.randn(*shape, generator=g) * 3).to(DEV, dtype)
        x = y if view is None else y[..., :view[0] * view[1]].view(*shape[:2], *view)
        got = kernels.gemma_rmsnorm(x, norm.weight, 1e-6)
        want = norm(x)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        ulps = _ulps(got, want)
        if dtype == torch.float32:
            assert ulps.max() <= 8, ulps.max()
        else:
            assert ulps.max() <= 1 and (ulps > 0).float().mean() <= 0.01, (ulps.max(), (ulps > 0).float().mean())
        wrong = (norm.weight.float() * x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
        assert (got.float() - wrong).abs().max() > 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemma_backend_decode_with_and_without_the_norm_kernel(dtype, monkeypatch):
    """A tiny Gemma 3 layout (four norms a layer and q/k norms, sliding windows, gate|up fused):
    NativeBackend's prefill and decode with every Gemma RMSNorm as one kernel (the post-attention and
    post-MLP ones with their residual add) and gelu(gate) · up as one kernel (FUSE_KERNELS), against
    the torch ops: the same logits to float rounding; the norm kernel runs for all 6 norms of a layer
    plus the final one, the GELU kernel once a layer."""
    from tether.models import make_tiny_model
    model, _ = make_tiny_model(None, family="gemma3", sliding_window=8)
    model = fuse_projections(model.to(DEV, dtype).eval())
    calls, gelu_calls = _count(monkeypatch, "gemma_rmsnorm"), _count(monkeypatch, "gelu_tanh_mul")
    monkeypatch.setattr(kernels, "elementwise_available", lambda x: True)
    monkeypatch.setattr(native, "FUSE_KERNELS", False)
    _, off = _decode_logits(model)
    assert not calls and not gelu_calls
    monkeypatch.setattr(native, "FUSE_KERNELS", True)
    _, on = _decode_logits(model)
    layers = model.config.num_hidden_layers
    assert len(calls) == 5 * (6 * layers + 1)  # the prefill and 4 decode steps
    assert len(gelu_calls) == 5 * layers
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (on.float() - off.float()).abs().max() <= tol, (on.float() - off.float()).abs().max()
    assert off.float().std() > 0.1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemma_rmsnorm_adds_the_residual_as_torch_does(dtype):
    """residual + norm(x) in the kernel equals torch's add of the kernel's own norm, bit for bit."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 1, 640, generator=g) * 3).to(DEV, dtype)
    res = (torch.randn(5, 1, 640, generator=g) * 20).to(DEV, dtype)
    w = (torch.randn(640, generator=g) * 0.5).to(DEV, dtype)
    got = kernels.gemma_rmsnorm(x, w, 1e-6, res)
    assert torch.equal(got, res + kernels.gemma_rmsnorm(x, w, 1e-6))
    assert not torch.equal(got, kernels.gemma_rmsnorm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [300, 1100])
def test_gelu_tanh_mul_equals_torch(dtype, n):
    """Gemma's gelu_tanh(gate) · up in one kernel against F.gelu(approximate="tanh") * up: float32 within
    1e-5 of the largest value (FMA contraction of the polynomial may differ); on CUDA (CUDA's tanhf,
    torch's) half precision within one ulp on at most 1 % of the elements. Under the interpreter tanh
    comes from exp, and 1 + tanh cancels in the far negative tail where the two tanh differ by an
    ulp of 1: there, within 1e-3 of the largest value. Gate and up are not interchangeable."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(2, 3, 2 * n + 8, generator=g).mul(3).to(DEV, dtype)
    y = big[..., 8:]
    got = kernels.gelu_tanh_mul(y, n)
    want = F.gelu(y[..., :n], approximate="tanh") * y[..., n:]
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    ulps = _ulps(got, want)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    if dtype == torch.float32:
        assert err <= 1e-5, err
    elif INTERPRET:
        assert err <= 1e-3, err
    else:
        assert ulps.max() <= 1 and (ulps > 0).float().mean() <= 0.01, (ulps.max(), (ulps > 0).float().mean())
    swapped = torch.cat([y[..., n:], y[..., :n]], -1)
    assert (kernels.gelu_tanh_mul(swapped, n).float() - want.float()).abs().max() > 0.1 * want.float().abs().max()


@pytest.mark.parametrize("episodes,ends", [(False, False), (False, True), (True, True), (True, False)],
                         ids=["plain", "ends", "episodes", "episodes-no-ends"])
def test_record_step_equals_the_torch_ops(episodes, ends):
    """The step's bookkeeping in one kernel writes what engine.record_step's torch ops write: forced
    tokens replace draws (log-prob 0, kind 2, never an end), finished rows record the pad and 0, an
    end token (the pad among them) finishes a row, the next inputs are the recorded tokens. Rows
    span two programs; their output positions are scattered over the buffers. The end tokens are a
    table over ids (one load a row, for an end set of any size)."""
    from tether.rollout import engine
    g = torch.Generator().manual_seed(3)
    n, rows, steps, eos_ids, pad = kernels.RECORD_BLOCK + 7, 300, 12, [5, 9, 0], 0
    flat = (torch.randperm(rows, generator=g)[:n] * (steps + 1) + torch.randint(0, steps, (n,), generator=g))
    y = torch.randint(0, 12, (n,), generator=g)
    lp = -torch.rand(n, generator=g)
    fin = torch.rand(n, generator=g) < 0.3
    force_on = torch.rand(rows, steps + 1, generator=g) < 0.4
    force_tok = torch.randint(0, 12, (rows, steps + 1), generator=g)
    out = [torch.randint(0, 12, (rows, steps + 1), generator=g), torch.randn(rows, steps + 1, generator=g),
           torch.randint(0, 3, (rows, steps + 1), generator=g).to(torch.int8)]
    eos = None
    if ends:  # a table over every id drawn or forced
        eos = torch.zeros(12, dtype=torch.bool)
        eos[eos_ids] = True
    got, want = [[x.clone().to(DEV) for x in [fin, torch.zeros(n, dtype=torch.long)] + out] for _ in range(2)]
    args = [t.to(DEV) if t is not None else None for t in (y, lp, flat)]
    for record, (f, tok, ot, ol, ok) in ((kernels.record_step, got), (engine.record_step, want)):
        record(*args, f, tok, ot, ol, None if eos is None else eos.to(DEV), pad,
               (force_on.to(DEV), force_tok.to(DEV), ok) if episodes else None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    f0 = want[0].cpu()
    assert f0[fin].all() and (f0 != fin).any() == ends  # ends finish rows, and only with an end set
    if episodes:  # some forced tokens are end ids: they finish nothing
        forced = force_on.view(-1)[flat]
        hit = forced & ~fin & torch.isin(force_tok.view(-1)[flat], torch.tensor(eos_ids))
        assert hit.any() and not f0[hit].any()


def test_multi_turn_episodes_with_the_record_kernel_equal_the_torch_ops(monkeypatch):
    """A multi-turn call (replies forced into the cache, rows waiting for the check, the batch
    compacted) records the same episodes — tokens, log-probs, masks — with the step's bookkeeping in
    one kernel as in torch's ops."""
    from test_rollout_episodes import PROMPTS, Replies, eosy_model
    from tether.rollout import Sampler, engine
    model, tok = eosy_model()
    model = model.to(DEV)
    monkeypatch.setattr(kernels, "record_available", lambda x: True)  # also under the interpreter (CPU)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(engine, "FUSE_RECORD", fused)
        s = Sampler(model, tok, max_new_tokens=90, temperature=0.9, sync_every=3)
        replies = Replies(tok)
        runs.append((s.sample(PROMPTS, n=2, seed=3, episodes=replies), replies.seen))
    (a, seen_a), (b, seen_b) = runs
    assert seen_a == seen_b and sum(len(v) for v in seen_a.values()) >= 2 * len(a)  # several turns an episode
    for name in ("completion_ids", "logprobs", "completion_mask", "observation_mask", "token_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
