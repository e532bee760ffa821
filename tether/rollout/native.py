"""Forward passes for the sampler over a preallocated KV cache.

Two backends with one interface (``alloc``, ``prefill``, ``decode``, ``select``):

* :class:`NativeBackend` — our own forward for the Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 families over the
  Hugging Face model's own parameters (never a copy; a linear that is not a plain ``nn.Linear``,
  e.g. a LoRA/PEFT wrapper, is called as a module so its adapters apply). The math is HF's (RMSNorm
  in float32; RoPE products in the model dtype from tables made by HF's own rotary module), with
  fewer ops: a static cache, one additive mask per step, q and k rotated together, (``FUSE``) the
  norm weight and residual adds fused into neighbouring kernels, (``FUSE_PROJECTIONS``) one GEMM
  for q|k|v and one for gate|up where the weights lie in one buffer (fuse.py), and (``FUSE_KERNELS``,
  CUDA) the decode step's RoPE inside its attention kernel and silu(gate) * up as one kernel
  (kernels.py); a shape-static decode step is what lets the step be captured in a CUDA graph.
  On the CPU, for float32 models with plain layers, the whole decode step and the whole prefill
  are one call each into C (:mod:`cpu`, cpu_decode.c: the same math, BLAS sgemm from torch, a
  KV cache tiled for streaming); this module's torch code is then not run.
* :class:`HFBackend` — any causal LM: the model's forward with a ``DynamicCache``. Slower, eager only.

What NativeBackend relies on (stable across transformers 5.x; checked by :func:`native_support`):
``model.model.{embed_tokens, layers, norm, rotary_emb}``, ``model.lm_head``; per layer
``input_layernorm``, ``post_attention_layernorm``, ``mlp`` (``gate_proj/up_proj/down_proj/act_fn``
inlined when present, else called), ``self_attn.{q,k,v,o}_proj``, ``self_attn.{head_dim, scaling}``
and optionally ``self_attn.{q_norm, k_norm}`` (Qwen3, Gemma 3); RMSNorm modules' ``weight`` and
``variance_epsilon`` (Gemma's: ``eps``, times 1 + weight; else the module is called); the rotary
module's ``forward(x, position_ids[, layer_type]) -> (cos, sin)`` and ``rope_type``.

Gemma 3 (``gemma3_text``) differs from Llama in four places, each taken from the model itself: the
embedding module scales by sqrt(hidden) (it is called); every layer has four norms, ``input_layernorm``
before attention, ``post_attention_layernorm`` on the attention's output before the residual add,
``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP (gelu-tanh, called
through the model's ``act_fn``); RoPE tables per ``config.layer_types`` entry (local layers base 10k,
global 1M); and the local layers attend over a sliding window.

Sliding windows (Gemma 3's local layers, Mistral's ``sliding_window``): a query at position p sees
keys at positions > p - window, HF's rule. Keys are masked by their RoPE *position*, kept per cache
slot (``kpos``), not by slot distance: a multi-turn row's waiting slots and left padding sit between
its tokens, and the transcript the trainer reads has neither.

Layout: every row of a batch shares cache slot indices (prompts are left-padded to a common width P;
token t of the completion sits in slot P + t). Each row's RoPE position is its own (pad excluded);
``bias[b, s]`` (0 or -inf, in the model dtype) is the additive mask over the slots a row may attend to.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tether.rollout.cpu as cpu  # by module path: `from . import` goes through the package __init__
import tether.rollout.kernels as kernels
from .fuse import GATE_UP, QKV, fused_view, group
from .layers import gemma_rmsnorm_eps, is_gelu_tanh, is_silu, rmsnorm_eps, sliding_window
from tether.distributed import is_sharded

NATIVE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def unwrap(model):
    """The transformers model under a PEFT wrapper (its LoRA layers stay in place and are called)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def native_support(model, max_len: int) -> str | None:
    """None if :class:`NativeBackend` can run ``model`` for sequences of ``max_len`` tokens, else why not."""
    m = unwrap(model)
    cfg = m.config
    if is_sharded(m):  # FSDP2: the weights are shards between forwards; only the module call gathers
        return "the model is sharded (FSDP2): sampled through its own forward"
    if getattr(cfg, "model_type", None) not in NATIVE_FAMILIES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {NATIVE_FAMILIES}"
    base = getattr(m, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(m, "lm_head"):
        return "unexpected module layout"
    rope = getattr(base.rotary_emb, "rope_type", "default")
    for r in (rope.values() if isinstance(rope, dict) else [rope]):  # Gemma 3: one per layer type
        if "dynamic" in str(r) or r == "longrope":
            return f"rope_type {r!r} changes frequencies with the sequence length"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if isinstance(rope, dict) and not _per_type_rope(base.rotary_emb, cfg):
        return "per-layer-type RoPE without config.layer_types"
    for layer in base.layers:
        a = layer.self_attn
        if not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return "unexpected attention module"
    return None


def _per_type_rope(rotary, cfg) -> bool:
    """Whether the rotary module makes tables per ``config.layer_types`` entry (Gemma 3)."""
    return getattr(cfg, "layer_types", None) is not None and \
        "layer_type" in inspect.signature(rotary.forward).parameters


def _linear(m):
    """A plain nn.Linear runs as F.linear (no module-call overhead); anything else (a LoRA/PEFT
    wrapper, a quantized linear) is called as a module so its extra computation is kept."""
    if type(m) is nn.Linear:
        w, b = m.weight, m.bias
        return lambda x: F.linear(x, w, b)
    return m


# Fuse the RMSNorm weight into the norm kernel and the residual add into the o_proj / down_proj
# matmul (addmm, beta = 1): 96 fewer kernels per step on a 24-layer model (~0.2 ms of a ~2.4 ms
# step on an H200 at batch 64). In float32 the results equal HF's up to float32 rounding; in
# bf16 each fused op rounds once where HF rounds twice (<= 1 bf16 ulp), which is part of the
# bf16 training-inference mismatch that the benchmark reports. False: HF's op order exactly.
FUSE = True

# One GEMM for q|k|v and one for gate|up in each layer, where fuse.fuse_projections laid the group's
# weights out as consecutive rows of one buffer (the trainers' sampling copy, the benchmarks' model;
# checked per group when a backend is built, and the pointers again at each call: fuse.py). A decode
# step on an H200 (Qwen2.5-0.5B shape, batch 64, bench/decode_profile.py) runs 540 kernels, 193 of them
# GEMMs taking 0.92 of its 1.64 ms of GPU work, 4.4x their weight-read floor: at 64 rows a GEMM of a
# few hundred output columns runs far from bandwidth. Fusing removes 72 GEMM launches a step (3 per
# layer) and the 24 cats of q and k before RoPE (the fused output holds q and k side by side; RoPE
# reads them as one strided view), and gives each GEMM a wider N. The same math; a wider GEMM may
# accumulate in another order (bf16 rounding; fp32 on the CPU runs the C step, cpu.py). False: one GEMM
# per projection, as HF. Read when a backend is built.
FUSE_PROJECTIONS = True

# Triton kernels for the elementwise work around the decode attention and the MLP (kernels.py), on
# CUDA with Triton importable. Where q|k|v is one GEMM and the layer has no q/k norm, RoPE, the cache
# write and the attention are one kernel (decode_attention_rope: it reads q, k and v from the GEMM's
# output and each row's position from device memory); where gate|up is one GEMM and the activation
# is silu, silu(gate) * up is one kernel (silu_mul; the prefill's MLP too). A decode step on an H200
# (Qwen2.5-0.5B shape, batch 64: one CUDA graph of 444 kernels, 1.69 ms) spends 141 us in RoPE's 48
# strided multiplies, 56 us in its 24 half-swap copies, ~30 us in its 24 adds, 66 us in 24 silus over
# a strided view and ~30 us in the 24 multiplies after them, plus ~1 us of gap per kernel in the
# graph; the kernels remove 5 kernels per layer (120 of the 444) and the step's 2 table gathers.
# The same math and rounding as the torch ops (RoPE bit for bit; silu with torch's expf and IEEE
# division). The prefill's RoPE stays in torch. Gemma's RMSNorm (float32 throughout, times 1 + w) is
# one kernel too (gemma_rmsnorm: seven torch kernels a norm, six norms a layer with q and k's; the
# post-attention and post-MLP ones with their residual add), and so is Gemma's gelu(gate) * up where
# gate|up is one GEMM (gelu_tanh_mul). False: the torch ops. Read when a backend is built.
FUSE_KERNELS = True


# Decode attention: "auto" = our Triton kernel (kernels.py) on CUDA when Triton is importable; on
# CPU the C step (cpu.py) when it can run the model and builds, else baddbmm + softmax + bmm ("bmm");
# torch's SDPA elsewhere. "c" / "sdpa" / "triton" / "bmm" force one (the torch path of a CPU model:
# "bmm"). On CPU, SDPA's flash kernel costs 2x bmm at the quickstart's shapes (batch 32, 2 threads: 138
# vs 68 us per layer call; the sampler's step 2.07 -> 1.69 ms) and is no faster on one thread (bench
# batch 64: 4.05 vs 3.71 ms/step). On an H100 bmm is slower than SDPA (and rounds bf16 scores).
# (SDPA picks cuDNN's kernel on an H100 here: 22 us per layer at batch 64 and 74 us at batch 256 over
# 400 slots, 3-5x its KV-read time.) Read when a backend is built.
DECODE_ATTN = "auto"
PREFILL_CAUSAL = True  # pad-free prefill chunks use mask-free causal attention (False: always masked)


def _rmsnorm(m):
    """HF's Llama/Qwen RMSNorm: normalize in float32, cast back, times the weight in the model dtype.
    F.rms_norm without a weight is that first part in one op (its float32 upcast is internal).
    Gemma's: normalize and multiply by (1 + weight) both in float32, then cast back."""
    geps = gemma_rmsnorm_eps(m)
    if geps is not None:
        w, fuse = m.weight, FUSE_KERNELS

        def gemma(x):
            if fuse and kernels.elementwise_available(x):  # one kernel (FUSE_KERNELS; kernels.py)
                return kernels.gemma_rmsnorm(x, w, geps)
            return F.rms_norm(x.float(), (x.shape[-1],), eps=geps).mul_(w.float() + 1.0).to(x.dtype)
        return gemma
    if rmsnorm_eps(m) is not None:
        w, eps = m.weight, m.variance_epsilon
        if FUSE:
            return lambda x: F.rms_norm(x, (x.shape[-1],), w, eps)
        return lambda x: F.rms_norm(x, (x.shape[-1],), eps=eps) * w
    return m


def _rmsnorm_add(m):
    """(x, residual) -> residual + norm(x): Gemma's post-attention and post-MLP norms; with its norm as
    a kernel (FUSE_KERNELS, CUDA), the add in the same kernel (kernels.gemma_rmsnorm), rounded as here."""
    norm, geps, fuse = _rmsnorm(m), gemma_rmsnorm_eps(m), FUSE_KERNELS
    if geps is None or not fuse:
        return lambda x, res: res + norm(x)
    w = m.weight

    def add(x, res):
        if kernels.elementwise_available(x) and res.is_contiguous():
            return kernels.gemma_rmsnorm(x, w, geps, res)
        return res + norm(x)
    return add


def _linear_add(m):
    """(x, residual) -> residual + m(x), as one addmm for a plain bias-free nn.Linear, accumulated into
    the residual in place: the forwards here never read a residual again once it is added to, and an
    out-of-place addmm first copies it into its output (one more kernel a call, 48 a decode step of a
    24-layer model). The residual is contiguous (an embedding's output or an earlier addmm's)."""
    if FUSE and type(m) is nn.Linear and m.bias is None:
        wt = m.weight.t()
        return lambda x, res: res.view(-1, res.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), wt).view(res.shape)
    f = _linear(m)
    return lambda x, res: res + f(x)


class _Fused:
    """x -> [m_1(x), ..., m_n(x)] along the last dim, for plain linears whose weights (and biases) are
    consecutive rows of one buffer (fuse.py): one F.linear over the whole [N_1 + ... + N_n, in] view,
    which is the parameters' own memory (in-place updates are seen; a CUDA graph reads the same
    addresses). The parameters' addresses are compared with the view's at each call (under 1 us):
    a group re-homed since (``p.data = ...``) is resolved again — one view over the new buffer when it
    is laid out anew, else one GEMM per projection, concatenated — never a stale view."""

    def __init__(self, mods, view):
        self.mods = mods
        self._set(view)

    def _set(self, view):
        mods = self.mods
        self.params = [m.weight for m in mods] + [m.bias for m in mods if m.bias is not None]
        self.ptrs = tuple(p.data_ptr() for p in self.params)
        self.w, self.b = view if view is not None else (None, None)

    def __call__(self, x: Tensor) -> Tensor:
        if tuple(p.data_ptr() for p in self.params) != self.ptrs:
            self._set(fused_view(self.mods))
        if self.w is None:
            return torch.cat([F.linear(x, m.weight, m.bias) for m in self.mods], -1)
        return F.linear(x, self.w, self.b)

    @property
    def fused(self) -> bool:
        """Whether the last call (or the build) found the group in one buffer."""
        return self.w is not None


def _fused(module, names) -> _Fused | None:
    """A :class:`_Fused` over ``module``'s projections ``names`` when FUSE_PROJECTIONS is on and they are
    plain linears laid out in one buffer now; else None (one callable per projection)."""
    if not FUSE_PROJECTIONS:
        return None
    mods = group(module, names)
    view = fused_view(mods) if mods is not None else None
    return None if view is None else _Fused(mods, view)


def _mlp_add(m, gu: _Fused | None = None):
    """(x, residual) -> residual + down(act(gate(x)) * up(x)), the SwiGLU MLP of these families;
    ``gu``: gate and up as one :class:`_Fused` GEMM."""
    if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        down, act = _linear_add(m.down_proj), m.act_fn
        if gu is not None:  # gate|up in one GEMM: [.., 2I], gate and up views of its halves
            n = m.gate_proj.weight.shape[0]
            if is_silu(act):
                fuse = FUSE_KERNELS

                def silu_mlp(x, res):
                    y = gu(x)
                    if fuse and kernels.elementwise_available(y):
                        # one kernel (FUSE_KERNELS); its output is a new [.., I] tensor beside y: three
                        # [T, I] tensors at a time in the prefill instead of two
                        return down(kernels.silu_mul(y, n), res)
                    return down(F.silu(y[..., :n], inplace=True).mul_(y[..., n:]), res)
                return silu_mlp

            def act_mlp(x, res):
                y = gu(x)
                return down(act(y[..., :n]) * y[..., n:], res)
            return act_mlp
        gate, up = _linear(m.gate_proj), _linear(m.up_proj)
        if is_silu(act):  # in place (the sampler runs under inference_mode): two [T, I] tensors
            # at a time instead of four — the prefill's largest transient (40 MB each per 4k tokens)
            return lambda x, res: down(F.silu(gate(x), inplace=True).mul_(up(x)), res)
        return lambda x, res: down(act(gate(x)) * up(x), res)
    return lambda x, res: res + m(x)


def _mlp(m, gu: _Fused | None = None):
    """x -> down(act(gate(x)) * up(x)) (Gemma's MLP, whose output is normed before the residual add);
    ``gu``: gate and up as one :class:`_Fused` GEMM."""
    if not all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return m
    down, act = _linear(m.down_proj), m.act_fn
    if gu is not None:
        n = m.gate_proj.weight.shape[0]
        gelu = FUSE_KERNELS and is_gelu_tanh(act)

        def fused(x):
            y = gu(x)
            if gelu and kernels.elementwise_available(y):  # one kernel (FUSE_KERNELS; kernels.py)
                return down(kernels.gelu_tanh_mul(y, n))
            return down(act(y[..., :n]) * y[..., n:])
        return fused
    gate, up = _linear(m.gate_proj), _linear(m.up_proj)
    return lambda x: down(act(gate(x)) * up(x))


def _normed_add(f, norm_module):
    """(x, residual) -> residual + norm(f(x)): Gemma's post-attention and post-MLP norms."""
    add = _rmsnorm_add(norm_module)
    return lambda x, res: add(f(x), res)


def _rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF's rotate-half RoPE, x*cos + rotate_half(x)*sin, with rotate_half(x)*sin written as
    roll(x, D/2) * [-sin_1, sin_2]: the same products (negation is exact), two ops fewer.
    x, cos, sin_signed [B, T, heads, D], all the same shape (broadcasting makes GPU kernels slower).
    A strided x (q and k as a view of the fused q|k|v output) swaps its halves by a flip over
    [2, D/2], the same values as the roll: CUDA's roll makes a contiguous copy of a strided input
    first (one more kernel); flip reads any strides."""
    if x.is_contiguous():
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
    return x * cos + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin_signed


class _Layer:
    """One decoder layer's callables, resolved once (attribute lookups are per-token overhead)."""

    def __init__(self, layer, rope: str | None = None, window: int | None = None):
        a = layer.self_attn
        # Gemma: four norms a layer (module docstring); post_attention_layernorm then norms the
        # attention's output, pre_feedforward_layernorm the MLP's input
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        self.ln1 = _rmsnorm(layer.input_layernorm)
        self.ln2 = _rmsnorm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm)
        self.rope, self.window = rope, window  # its RoPE table's key; its sliding window or None
        # q|k|v in one GEMM when their weights share one buffer (FUSE_PROJECTIONS); else one each
        self.qkv = _fused(a, QKV)
        self.q = self.k = self.v = self.nq = self.nk = None
        if self.qkv is None:
            self.q, self.k, self.v = (_linear(getattr(a, n)) for n in QKV)
        else:  # output columns of q, of k
            self.nq, self.nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
        # (attention output, residual) -> residual + o_proj(...) (Gemma: + norm(o_proj(...)))
        self.o = _normed_add(_linear(a.o_proj), layer.post_attention_layernorm) if sandwich \
            else _linear_add(a.o_proj)
        # Qwen3: RMSNorm over head_dim of q and k before RoPE
        self.qn = _rmsnorm(a.q_norm) if hasattr(a, "q_norm") else None
        self.kn = _rmsnorm(a.k_norm) if hasattr(a, "k_norm") else None
        self.gate_up = _fused(layer.mlp, GATE_UP)  # gate|up in one GEMM (FUSE_PROJECTIONS), or None
        # (normed x, residual) -> residual + mlp(normed x) (Gemma: + norm(mlp(normed x)))
        self.mlp = _normed_add(_mlp(layer.mlp, self.gate_up), layer.post_feedforward_layernorm) \
            if sandwich else _mlp_add(layer.mlp, self.gate_up)


class NativeBackend:
    name = "native"

    def __init__(self, model):
        m = unwrap(model)
        base = m.model
        self.rotary = base.rotary_emb
        emb = base.embed_tokens
        self.embed = (lambda ids: F.embedding(ids, emb.weight)) if type(emb) is nn.Embedding else emb
        self.norm, self.lm_head = _rmsnorm(base.norm), _linear(m.lm_head)
        cfg = m.config
        types = cfg.layer_types if _per_type_rope(self.rotary, cfg) else [None] * len(base.layers)
        self.layers = [_Layer(layer, t, sliding_window(layer.self_attn, cfg)) for layer, t in zip(base.layers, types)]
        self.windows = sorted({L.window for L in self.layers if L.window is not None})
        self.softcap = getattr(cfg, "final_logit_softcapping", None)  # where the config sets one (not Gemma 3)
        a = base.layers[0].self_attn
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.scaling = a.head_dim, a.scaling
        p = next(m.parameters())
        self.device, self.dtype = p.device, p.dtype
        own = kernels.available(p.device, p.dtype, self.head_dim, self.n_heads // self.n_kv)
        auto = "triton" if own else ("bmm" if p.device.type == "cpu" else "sdpa")
        self.attention = auto if DECODE_ATTN == "auto" else DECODE_ATTN
        # RoPE inside the decode attention kernel, for the layers whose q|k|v is one GEMM (FUSE_KERNELS)
        self.rope_in_kernel = [FUSE_KERNELS and self.attention == "triton" and L.qkv is not None
                               and L.qn is None for L in self.layers]
        self.cstep = None  # the whole CPU decode step in C (cpu.py), when it can run this model
        if DECODE_ATTN in ("auto", "c") and p.device.type == "cpu":
            why = cpu.support(m)
            lib = cpu.library() if why is None else None
            if lib is not None:
                self.cstep = cpu.CpuStep(lib, m, self.n_heads, self.n_kv, self.head_dim, self.scaling)
                self.attention = "c"
            elif DECODE_ATTN == "c":
                raise ValueError(f"DECODE_ATTN='c' can't run this model: {why or 'the C step did not build'}")
        self.k = self.v = self.cos = self.sin = self.kpos = None
        self.tables = {}  # RoPE table key (a layer type, or None) -> (cos, sin) [slots, q + kv heads, D]
        self.borrowed = False  # the cache is a view of a lent buffer, written by others between calls

    def alloc(self, rows: int, slots: int, storage: Tensor | None = None) -> None:
        """Static cache [layers, rows, kv_heads, slots, head_dim] for keys and for values (keys in
        tiles of 16 slots for the C step, :func:`cpu.cache_shapes`), and the RoPE tables for positions
        0..slots-1 (HF's rotary module, evaluated once). The cache lives in `storage` (a flat tensor
        lent by the caller) when it is large enough, of the model's dtype and on its device; else in
        memory of its own."""
        kshape = vshape = (len(self.layers), rows, self.n_kv, slots, self.head_dim)
        if self.cstep is not None:
            kshape, vshape = cpu.cache_shapes(*kshape)
        nk, n = torch.Size(kshape).numel(), torch.Size(vshape).numel()
        lend = storage is not None and storage.dtype == self.dtype and storage.device == self.device \
            and storage.dim() == 1 and storage.numel() >= n + nk
        if self.k is None or self.k.shape != kshape or self.cos.shape[0] != slots or lend != self.borrowed or \
                (lend and self.k.data_ptr() != storage.data_ptr()):
            self.k = self.v = None  # free the old cache before taking the new one
            if lend:
                self.k, self.v = storage[:nk].view(kshape), storage[nk:nk + n].view(vshape)
            else:
                self.k = torch.zeros(kshape, device=self.device, dtype=self.dtype)
                self.v = torch.zeros(vshape, device=self.device, dtype=self.dtype)
            self.borrowed = lend
            x = torch.zeros(1, device=self.device, dtype=self.dtype)
            h, heads = self.head_dim // 2, self.n_heads + self.n_kv
            self.tables = {}
            for key in dict.fromkeys(L.rope for L in self.layers):
                kw = {} if key is None else {"layer_type": key}
                cos, sin = self.rotary(x, torch.arange(slots, device=self.device)[None], **kw)
                sin = torch.cat([-sin[0, :, :h], sin[0, :, h:]], -1)
                # [slots, q + kv heads, D]: q and k are rotated together, one row gather per step
                self.tables[key] = (cos[0, :, None].expand(-1, heads, -1).contiguous(),
                                    sin[:, None].expand(-1, heads, -1).contiguous())
            self.cos, self.sin = self.tables[self.layers[0].rope]
            # each slot's RoPE position, for the sliding windows' masks
            self.kpos = torch.zeros(rows, slots, dtype=torch.long, device=self.device) if self.windows else None
            if self.cstep is not None:
                self.cstep.alloc(self.k, self.v, self.cos, self.sin)

    def release(self) -> None:
        self.k = self.v = self.cos = self.sin = self.kpos = None
        self.tables = {}
        if self.cstep is not None:
            self.cstep.release()
        self.borrowed = False

    def _qkv(self, L: _Layer, h: Tensor, cos: Tensor, sin: Tensor):
        """q [B, T, H, D], k and v [B, T, Hkv, D] (q and k views of one tensor), RoPE applied."""
        B, T, _ = h.shape
        D = self.head_dim
        if L.qkv is not None:  # one GEMM: [B, T, (H + 2 Hkv) D]; q and k side by side, rotated as one view
            y = L.qkv(h)
            nq, nqk = L.nq, L.nq + L.nk
            v = y[..., nqk:].view(B, T, -1, D)
            if L.qn is None:
                qk = y[..., :nqk].view(B, T, -1, D)
            else:  # Qwen3: q and k normed with weights of their own (new tensors: joined again)
                qk = torch.cat([L.qn(y[..., :nq].view(B, T, -1, D)), L.kn(y[..., nq:nqk].view(B, T, -1, D))], 2)
        else:
            q = L.q(h).view(B, T, -1, D)
            k = L.k(h).view(B, T, -1, D)
            v = L.v(h).view(B, T, -1, D)
            if L.qn is not None:
                q, k = L.qn(q), L.kn(k)
            qk = torch.cat([q, k], 2)
        qk = _rope(qk, cos, sin)
        return qk[:, :, :self.n_heads], qk[:, :, self.n_heads:], v

    @torch.no_grad()
    def prefill(self, ids: Tensor, attn_mask: Tensor, row0: int) -> Tensor:
        """Prompts ``ids`` [B, P] (left-padded, ``attn_mask`` bool [B, P]) into cache rows
        row0..row0+B, slots 0..P-1. Returns the last position's logits [B, V]."""
        if self.cstep is not None:  # the C prefill (same math, one call; cpu_decode.c)
            return self.cstep.prefill(ids, attn_mask, row0)
        B, P = ids.shape
        pos = (attn_mask.long().cumsum(-1) - 1).clamp(min=0)
        rope = {k: (c[pos], s[pos]) for k, (c, s) in self.tables.items()}
        if self.kpos is not None:
            self.kpos[row0:row0 + B, :P] = pos
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=ids.device)
        # Pad queries attend to themselves only: every softmax row stays finite (no NaN to leak).
        mask = ((causal & attn_mask[:, None, :]) | eye)[:, None]
        # a window shorter than the chunk: keys more than w - 1 positions back are masked too
        near = {w: ((causal & attn_mask[:, None, :] & (pos[:, :, None] - pos[:, None, :] < w)) | eye)[:, None]
                for w in self.windows if w < P}
        G = self.n_heads // self.n_kv
        # No padding in this chunk (equal-length prompts): plain causal attention, which SDPA runs as
        # flash attention with GQA and no mask tensor, instead of a masked kernel over repeated K/V.
        causal_only = PREFILL_CAUSAL and bool(attn_mask.all())
        x = self.embed(ids)
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, L.ln1(x), *rope[L.rope])
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            self.k[i, row0:row0 + B, :, :P] = k
            self.v[i, row0:row0 + B, :, :P] = v
            if causal_only and L.window not in near:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                                   scale=self.scaling, enable_gqa=G > 1)
            else:
                if G > 1:
                    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=near.get(L.window, mask),
                                                   scale=self.scaling)
            x = L.o(o.transpose(1, 2).reshape(B, P, -1), x)
            x = L.mlp(L.ln2(x), x)
        return self._logits(x[:, -1:])[:, 0]

    def _logits(self, x: Tensor) -> Tensor:
        """The final norm and the LM head (and the soft cap cap · tanh(logits / cap) where the config sets one)."""
        y = self.lm_head(self.norm(x))
        return y if self.softcap is None else torch.tanh(y / self.softcap) * self.softcap

    def _decode_attention(self, L: _Layer, h: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor,
                          bias: Tensor, slot: Tensor, kv_len: int) -> Tensor:
        """A decode step's attention of layer L for normed input h [B, 1, hidden] with torch's RoPE:
        this step's k, v into slot ``slot`` of the layer's cache kc / vc [B, Hkv, slots, D], then
        attention over slots < kv_len (bias shaped for self.attention). -> [B, Hkv, G, D] or
        [B * Hkv, G, D]."""
        B, G, D = h.shape[0], self.n_heads // self.n_kv, self.head_dim
        q, k, v = self._qkv(L, h, cos, sin)
        # GQA without repeating the cache: the G query heads of one KV head act as G queries.
        if self.attention == "triton":  # the kernel also writes k, v into the cache slot
            return kernels.decode_attention(q.reshape(B, self.n_kv, G, D), kc[:, :, :kv_len], vc[:, :, :kv_len],
                                            bias, self.scaling, k[:, 0], v[:, 0], slot)
        kc.index_copy_(2, slot, k.transpose(1, 2))  # [B, 1, Hkv, D] -> [B, Hkv, 1, D]
        vc.index_copy_(2, slot, v.transpose(1, 2))
        if self.attention == "bmm":
            kk = kc[:, :, :kv_len].reshape(B * self.n_kv, kv_len, D)  # views of the cache
            vv = vc[:, :, :kv_len].reshape(B * self.n_kv, kv_len, D)
            scores = torch.baddbmm(bias, q.reshape(B * self.n_kv, G, D), kk.transpose(1, 2), alpha=self.scaling)
            return torch.bmm(torch.softmax(scores, -1, dtype=torch.float32).to(vv.dtype), vv)
        return F.scaled_dot_product_attention(q.reshape(B, self.n_kv, G, D), kc[:, :, :kv_len],
                                              vc[:, :, :kv_len], attn_mask=bias, scale=self.scaling)

    @torch.no_grad()
    def decode(self, tokens: Tensor, pos: Tensor, slot: Tensor, bias: Tensor, kv_len: int) -> Tensor:
        """One token per row: ``tokens``/``pos`` [B] go into cache slot ``slot`` (a [1] tensor, so a
        captured graph reads it at replay); attention over slots < kv_len, masked by ``bias``
        (additive, kept as such so no layer converts a bool mask). -> logits [B, V]."""
        if self.cstep is not None:  # the whole step in C (it also unmasks the new slot)
            return self.cstep(tokens, pos, slot, bias, kv_len)
        B, D = tokens.shape[0], self.head_dim
        bias.index_fill_(1, slot, 0.0)
        bias = bias[:, :kv_len]
        biases = {None: bias}  # the mask of the full-attention layers, and one per sliding window
        if self.kpos is not None:
            kp = self.kpos[:B]
            kp.index_copy_(1, slot, pos[:, None])
            for w in self.windows:  # positions differ by less than slots do: none masked within w slots
                if kv_len > w:
                    biases[w] = bias.masked_fill(kp[:, :kv_len] <= (pos - w)[:, None], float("-inf"))
        for w, b in biases.items():
            if self.attention == "bmm":  # one [B*Hkv, 1, S] mask a step, broadcast over G query heads by baddbmm
                biases[w] = b[:, None].expand(B, self.n_kv, kv_len).reshape(B * self.n_kv, 1, kv_len)
            elif self.attention != "triton":
                biases[w] = b[:, None, None]
        rope = {}
        if not all(self.rope_in_kernel):  # the RoPE table rows of each row's position, for torch's RoPE
            rope = {k: (c[pos][:, None], s[pos][:, None]) for k, (c, s) in self.tables.items()}
        x = self.embed(tokens[:, None])
        for i, L in enumerate(self.layers):
            h = L.ln1(x)
            kc, vc = self.k[i, :B], self.v[i, :B]
            b = biases.get(L.window, biases[None])
            if self.rope_in_kernel[i]:  # one GEMM for q|k|v; RoPE, the cache write and attention: one kernel
                cos, sin = self.tables[L.rope]  # [slots, D] views: the kernel gathers its rows
                o = kernels.decode_attention_rope(L.qkv(h), cos[:, 0], sin[:, 0], pos, kc[:, :, :kv_len],
                                                  vc[:, :, :kv_len], b, self.scaling, slot,
                                                  self.n_heads, self.n_kv, D)
            else:
                o = self._decode_attention(L, h, *rope[L.rope], kc, vc, b, slot, kv_len)
            x = L.o(o.reshape(B, 1, -1), x)
            x = L.mlp(L.ln2(x), x)
        return self._logits(x)[:, 0]

    def select(self, idx: Tensor) -> None:
        """Keep cache rows ``idx`` (in that order, a row possibly more than once) as rows
        0..len(idx)-1: batch compaction, and a shared prefill's copies (engine.SHARE_PREFILL). Layer
        by layer, so the gathered copy is one layer's cache at a time."""
        n, dim = idx.numel(), 0 if self.cstep is None else 1  # (within a layer) the C step's caches are tile-major
        for c in (self.k, self.v):
            for layer in c:
                layer.narrow(dim, 0, n).copy_(layer.index_select(dim, idx))
        if self.kpos is not None:
            self.kpos.narrow(0, 0, n).copy_(self.kpos.index_select(0, idx))


class HFBackend:
    """Generic fallback: the model's own forward with a DynamicCache (any causal LM, eager only)."""
    name = "hf"

    def __init__(self, model):
        self.model = model
        params = inspect.signature(model.forward).parameters
        # transformers renamed past_key_values -> cache (5.2x keeps the old name as a deprecated alias)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache = None

    def alloc(self, rows: int, slots: int, storage: Tensor | None = None) -> None:
        pass

    def release(self) -> None:
        self.cache = None

    @torch.no_grad()
    def prefill(self, ids: Tensor, attn_mask: Tensor, row0: int) -> Tensor:
        from transformers import DynamicCache
        if row0 != 0:
            raise ValueError("HFBackend prefills the whole batch at once")
        self.cache = DynamicCache(config=self.model.config)
        pos = (attn_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn_mask.long(), position_ids=pos,
                         use_cache=True, **{self.cache_kw: self.cache}, **self.keep_kw)
        return out.logits[:, -1]

    @torch.no_grad()
    def decode(self, tokens: Tensor, pos: Tensor, slot: Tensor, bias: Tensor, kv_len: int) -> Tensor:
        bias.index_fill_(1, slot, 0.0)
        out = self.model(input_ids=tokens[:, None], attention_mask=(bias[:, :kv_len] == 0).long(),
                         position_ids=pos[:, None], use_cache=True, **{self.cache_kw: self.cache})
        return out.logits[:, -1]

    def select(self, idx: Tensor) -> None:
        self.cache.reorder_cache(idx)
