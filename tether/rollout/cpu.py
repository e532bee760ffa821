"""The CPU decode step and prefill in C (cpu_decode.c + cpu_attention.h): built with the system's C
compiler on first use, called through ctypes, one call per decode step and one per prefill chunk,
its arguments one :class:`Args` structure.

Why: on the CPU a decode step of a small model is ~100 small torch ops; at batch 64 the work other
than the matmuls (norms, RoPE, cache writes, attention as hundreds of tiny batched matmuls, SiLU,
and the dispatch of each op) cost more than the matmuls (`python bench/rollout.py` on a 2-core CPU; benchmarks/RESULTS.md).
The C step does the matmuls with the same BLAS ``sgemm`` torch.mm uses (the symbol libtorch_cpu
exports) and everything else in one pass per row, over the model's own parameters (pointers to
them; nothing is copied, so optimizer steps between calls are seen).

Used by :class:`~tether.rollout.native.NativeBackend` for float32 models on the CPU whose layers are
plain (``nn.Linear`` without output bias on o/gate/up/down/lm_head, HF RMSNorm, SiLU MLP,
``nn.Embedding``); anything else, no compiler, or ``TETHER_CPU_DECODE=0`` in the environment (a
deliberate choice: no warning) keeps the torch path. The compiled library is
cached under ``$TETHER_CACHE`` (default ``~/.cache/tether``), keyed by the source, the compiler
flags and this CPU's flags, so a shared home directory never runs code built for another CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from .layers import is_silu, rmsnorm_eps, sliding_window

SRC = Path(__file__).with_name("cpu_decode.c")
HEADER = SRC.with_name("cpu_attention.h")  # included by SRC: part of what is built
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
_lib = None  # the loaded library, False after a failed build (tried once per process)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _sgemm():
    """The Fortran-interface sgemm that torch.mm runs on the CPU (MKL on x86 wheels), or None."""
    name = {"win32": "torch_cpu.dll", "darwin": "libtorch_cpu.dylib"}.get(sys.platform, "libtorch_cpu.so")
    lib = Path(torch.__file__).parent / "lib" / name
    try:
        return ctypes.cast(ctypes.CDLL(str(lib)).sgemm_, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None


def library():
    """The compiled step (building it once if needed), or None with a warning saying why not."""
    global _lib
    if _lib is None:
        _lib = _build() or False
    return _lib or None


def _build(extra_flags: tuple[str, ...] = ()):
    """Compile (or find in the cache) and load the library; None, with a warning, where it can't."""
    def fail(why: str):
        warnings.warn(f"tether: {why}; the CPU sampler uses its torch path (slower)", stacklevel=4)

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    gemm = _sgemm()
    if cc is None or gemm is None:
        return fail("no C compiler" if cc is None else "torch exports no BLAS sgemm")
    src = SRC.read_bytes() + HEADER.read_bytes()
    flags = FLAGS + list(extra_flags)
    key = hashlib.sha256(src + " ".join([cc] + flags).encode() + _cpu_flags().encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    so = None
    for cache in (Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether")) / "kernels",
                  Path(tempfile.gettempdir()) / f"tether-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        so = cache / f"cpu_decode_{key}.so"
        if so.exists():
            break
        try:  # build beside the target, then rename: a concurrent process sees no file or the whole one
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        except OSError:
            continue  # not writable (a read-only home): the temp directory
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, str(SRC), "-o", tmp, "-lm"], capture_output=True, text=True)
            err = None if r.returncode == 0 else " ".join(r.stderr.strip().splitlines()[-1:])[:200]
        except OSError as e:  # CC names no runnable program
            err = str(e)
        if err is not None:
            os.unlink(tmp)
            return fail(f"building the CPU decode step failed ({cc}: {err})")
        os.replace(tmp, so)
        break
    else:
        return fail("no writable directory for the compiled CPU decode step")
    lib = ctypes.CDLL(str(so))
    lib.tether_decode_step.restype = lib.tether_prefill.restype = lib.tether_gemm_check.restype = None
    lib.tether_decode_step.argtypes = lib.tether_prefill.argtypes = [ctypes.POINTER(Args)]
    lib.tether_args_size.restype = ctypes.c_size_t
    if lib.tether_args_size() != ctypes.sizeof(Args):  # a field added on one side only
        return fail("cpu.py's Args does not match cpu_decode.c's")
    # The sgemm found must be the 32-bit-integer Fortran BLAS interface this code calls (a wrong one
    # would compute garbage, not fail): check it on one small product against torch.mm.
    g = torch.Generator().manual_seed(0)
    a, w, c = torch.randn(3, 5, generator=g), torch.randn(7, 5, generator=g), torch.zeros(3, 7)
    lib.tether_gemm_check(gemm, ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(w.data_ptr()),
                          ctypes.c_void_p(c.data_ptr()), 3, 7, 5)
    if not torch.allclose(c, a @ w.t(), atol=1e-5):
        return fail("torch's sgemm does not behave as the Fortran BLAS interface")
    lib.gemm = gemm
    return lib


def _round16(n: int) -> int:
    return -(-n // 16) * 16


RB = 16  # rows per attention block, as in cpu_attention.h


def cache_shapes(layers: int, rows: int, kv_heads: int, slots: int, head_dim: int) -> tuple[tuple, tuple]:
    """The C step's key and value caches: tiles of 16 slots holding every row's keys / values,
    k [layers, tiles, rows, kv_heads, head_dim, 16], v [layers, tiles, rows, kv_heads, 16, head_dim]
    (why: attention_rows in cpu_attention.h)."""
    t = _round16(slots) // 16
    return (layers, t, rows, kv_heads, head_dim, 16), (layers, t, rows, kv_heads, 16, head_dim)


# the scratch buffers of tether_decode_step / tether_prefill (Args fields)
SCRATCH = ("x", "h", "q", "k", "v", "att", "g", "u")
# per-layer weights in the order of cpu_decode.c's enum (W_LN1 ... W_D)
PER_LAYER = ("ln1", "wq", "bq", "wk", "bk", "wv", "bv", "qn", "kn", "wo", "ln2", "wg", "wu", "wd")

_int, _i64, _f32, _p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Args(ctypes.Structure):
    """The one argument of tether_decode_step / tether_prefill: cpu_decode.c's ``Args``, field for
    field (names, types, order; what each means is written there). Pointers are plain addresses."""
    _fields_ = [
        # the model
        *((n, _int) for n in ("L", "Hd", "H", "Hkv", "D", "I", "V")),
        ("eps", _f32), ("qk_eps", _f32), ("scale", _f32), ("w", _p), ("gemm", _p), ("nt", _int),
        # the KV cache and the RoPE tables
        ("kcache", _p), ("vcache", _p), ("cache_rows", _i64), ("slots", _i64),
        ("cos", _p), ("sin", _p), ("rope_stride", _i64),
        # scratch
        *((n, _p) for n in (*SCRATCH, "ml")),
        # the call
        ("B", _int), ("P", _int), ("row0", _i64), ("kv_len", _i64), ("bias_stride", _i64),
        ("tokens", _p), ("slot", _p), ("ids", _p), ("pos", _p), ("real", _p), ("bias", _p), ("logits", _p),
    ]

    def set(self, **fields) -> None:
        """Set fields; a tensor gives its data pointer (it must outlive the call that reads it)."""
        for name, x in fields.items():
            setattr(self, name, x.data_ptr() if isinstance(x, Tensor) else x)


def _plain(m, bias_ok: bool) -> bool:
    return type(m) is nn.Linear and (bias_ok or m.bias is None)


def support(model) -> str | None:
    """None if the C step can run ``model`` (an unwrapped HF model), else why not."""
    # The torch path by choice (to compare the two, or rule the C step out): read each time a
    # backend is built; the library is then never built, so nothing warns.
    if os.environ.get("TETHER_CPU_DECODE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by TETHER_CPU_DECODE=0"
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return "not a float32 model on the CPU"
    base = model.model
    if type(base.embed_tokens) is not nn.Embedding or not _plain(model.lm_head, False):
        return "embedding or lm_head is not plain"
    eps = rmsnorm_eps(base.norm)
    if eps is None:
        return "final norm is not an RMSNorm"
    a0 = base.layers[0].self_attn
    if a0.head_dim % 16:
        return f"head_dim {a0.head_dim} is not a multiple of 16"
    qk_eps = set()
    for layer in base.layers:
        a, mlp = layer.self_attn, layer.mlp
        if not all(_plain(getattr(a, n), n != "o_proj") for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention projections are not plain nn.Linear"
        if not all(hasattr(mlp, n) and _plain(getattr(mlp, n), False) for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP is not a plain SwiGLU"
        if not is_silu(getattr(mlp, "act_fn", None)):
            return "MLP activation is not SiLU"
        for n in ("input_layernorm", "post_attention_layernorm"):
            if rmsnorm_eps(getattr(layer, n)) != eps:
                return "layer norms are not RMSNorms with the model's epsilon"
        if sliding_window(a, model.config) is not None:
            return "sliding-window attention (the torch path masks it)"
        if hasattr(a, "q_norm") != hasattr(a, "k_norm"):
            return "q_norm without k_norm"
        if hasattr(a, "q_norm"):
            qk_eps |= {rmsnorm_eps(a.q_norm), rmsnorm_eps(a.k_norm)}
    if None in qk_eps or len(qk_eps) > 1:
        return "q/k norms are not RMSNorms with one epsilon"
    if any(not t.is_contiguous() for t in model.parameters()):
        return "a parameter is not contiguous"
    return None


class CpuStep:
    """The C decode step bound to one model's parameters and one backend's cache and RoPE tables."""

    def __init__(self, lib, model, n_heads: int, n_kv: int, head_dim: int, scaling: float):
        base = model.model
        self.lib = lib
        cfg = model.config
        self.hidden, self.heads, self.kv, self.D = cfg.hidden_size, n_heads, n_kv, head_dim
        self.inter = base.layers[0].mlp.gate_proj.out_features
        self.vocab = model.lm_head.out_features
        qk_eps = 0.0
        ptrs = []
        for layer in base.layers:  # in cpu_decode.c's order (its enum W_LN1 ... W_D), None = absent
            a, mlp = layer.self_attn, layer.mlp
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            if qn is not None:
                qk_eps = float(qn.variance_epsilon)
            w = dict(ln1=layer.input_layernorm.weight, wq=a.q_proj.weight, bq=a.q_proj.bias, wk=a.k_proj.weight,
                     bk=a.k_proj.bias, wv=a.v_proj.weight, bv=a.v_proj.bias,
                     qn=qn.weight if qn is not None else None, kn=kn.weight if kn is not None else None,
                     wo=a.o_proj.weight, ln2=layer.post_attention_layernorm.weight, wg=mlp.gate_proj.weight,
                     wu=mlp.up_proj.weight, wd=mlp.down_proj.weight)
            ptrs += [w[name] for name in PER_LAYER]
        ptrs += [base.embed_tokens.weight, base.norm.weight, model.lm_head.weight]
        self._w = (ctypes.c_void_p * len(ptrs))(*[t.data_ptr() if t is not None else None for t in ptrs])
        model_fields = dict(L=len(base.layers), Hd=self.hidden, H=n_heads, Hkv=n_kv, D=head_dim, I=self.inter,
                            V=self.vocab, eps=float(base.norm.variance_epsilon), qk_eps=qk_eps, scale=float(scaling),
                            w=ctypes.addressof(self._w), gemm=lib.gemm.value)
        # one Args per entry point: the model's fields now, the cache's and the scratch's when they
        # are allocated, and only what changes per call at each call
        self._step_args, self._pre_args = Args(**model_fields), Args(**model_fields)
        self.rows = 0
        self._pre = self._ml = None  # prefill scratch (grown to the largest chunk seen), softmax statistics

    def _buffers(self, n: int) -> dict:
        """Scratch for n tokens ([n, width] each), as tether_decode_step / tether_prefill take it."""
        H, Hkv, D = self.heads, self.kv, self.D
        widths = dict(x=self.hidden, h=self.hidden, q=H * D, k=Hkv * D, v=Hkv * D, att=H * D,
                      g=self.inter, u=self.inter)
        return {name: torch.empty(n, widths[name]) for name in SCRATCH}

    def _stats(self, nt: int) -> Tensor:
        """Running softmax statistics: 2 * RB * heads floats per thread (grown if threads were raised)."""
        need = max(1, nt) * 2 * RB * self.heads
        if self._ml is None or self._ml.numel() < need:
            self._ml = torch.empty(need)
        return self._ml

    def alloc(self, k, v, cos, sin) -> None:
        """Scratch for up to ``k.shape[2]`` rows; the caches ``k``, ``v`` (:func:`cache_shapes`) and
        the RoPE tables [slots, heads, D] are the backend's (row p of a table: stride heads * D)."""
        rows, slots = k.shape[2], cos.shape[0]
        assert k.is_contiguous() and v.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        self.rows, self.slots, self._keep = rows, slots, (k, v, cos, sin)
        self._step = self._buffers(rows)
        self.logits = torch.empty(rows, self.vocab)
        for a in (self._step_args, self._pre_args):
            a.set(kcache=k, vcache=v, cache_rows=rows, slots=slots, cos=cos, sin=sin, rope_stride=cos[0].numel())
        self._step_args.set(**self._step, logits=self.logits)

    def release(self) -> None:
        self._step = self._pre = self._keep = self._ml = None
        self.logits, self.rows = None, 0

    def prefill(self, ids: Tensor, attn_mask: Tensor, row0: int) -> Tensor:
        """Prompts ``ids`` [B, P] (left-padded; ``attn_mask`` bool [B, P]) into cache rows
        row0..row0+B-1, slots 0..P-1 (tether_prefill). -> the last position's logits [B, V]."""
        B, P = ids.shape
        if self._pre is None or self._pre["x"].shape[0] < B * P or self._pre["logits"].shape[0] < B:
            self._pre = {**self._buffers(B * P), "pos": torch.empty(B * P, dtype=torch.long),
                         "logits": torch.empty(B, self.vocab)}
            self._pre_args.set(**self._pre)
        nt = torch.get_num_threads()
        ids, real = ids.contiguous(), attn_mask.to(torch.uint8).contiguous()
        a = self._pre_args
        a.set(nt=nt, B=B, P=P, row0=row0, ids=ids, real=real, ml=self._stats(nt))
        self.lib.tether_prefill(ctypes.byref(a))
        return self._pre["logits"][:B]

    def __call__(self, tokens, pos, slot, bias, kv_len: int):
        B, nt = tokens.shape[0], torch.get_num_threads()
        assert B <= self.rows and tokens.is_contiguous() and pos.is_contiguous() and bias.stride(1) == 1
        a = self._step_args
        a.set(nt=nt, B=B, tokens=tokens, pos=pos, slot=slot, kv_len=kv_len, bias=bias, bias_stride=bias.stride(0),
              ml=self._stats(nt))
        self.lib.tether_decode_step(ctypes.byref(a))
        return self.logits[:B]
