"""What `tether memory` knows of a model: its parameter count and its shape (a Llama-like decoder),
read from a Hugging Face config (a local path or the hub) or guessed from a parameter count alone.

Kept apart from memory/'s accounting (what each component costs): this part answers only which
model and what shape; transformers (and torch, for a count on the meta device) are imported only
when a config is read.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from tether.errors import UserError


@dataclass
class Shape:
    """A Llama-like decoder: embeddings, `layers` x (RMSNorm, attention with GQA, RMSNorm, SwiGLU MLP),
    final norm, LM head (tied or not). The bias/norm flags cover Qwen2 and Qwen3."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def linears(self) -> dict[str, tuple[int, int]]:
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        """One decoder layer: the unit FSDP2 gathers at a time (tether/distributed.py shards per layer)."""
        lin = self.linears()
        layer = sum(a * b for a, b in lin.values()) + 2 * self.hidden  # + two RMSNorm weights
        layer += self.qkv_bias * (lin["q_proj"][1] + 2 * lin["k_proj"][1]) + self.o_bias * self.hidden
        layer += self.mlp_bias * (2 * self.intermediate + self.hidden)
        return layer + self.qk_norm * 2 * self.head_dim

    def params(self) -> int:
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden + self.lm_head()

    def lm_head(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def lora_params(self, rank: int, targets: list[str]) -> int:
        return self.layers * sum(rank * (a + b) for name, (a, b) in self.linears().items() if name in targets)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes  # K and V, every layer


def parse_count(text: str) -> float | None:
    """'7e9', '7B', '0.5b', '125M', '7000000000.0' -> a number of parameters; None if not a count."""
    m = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)(e[+-]?\d+)?\s*([kmbt])?\s*", str(text), re.IGNORECASE)
    if not m:
        return None
    value = float(m.group(1) + (m.group(2) or "")) * {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12, "": 1}[
        (m.group(3) or "").lower()]
    return value if value > 0 else None


def llama_shape(layers: int, vocab: int = 32000) -> Shape:
    """Llama-2's aspect ratio: head_dim 128, hidden = 128*layers (so heads = layers), full MHA,
    SwiGLU width 8h/3 rounded up to a multiple of 256. Gives Llama-2-7B and -13B exactly."""
    h = 128 * layers
    return Shape(h, layers, layers, layers, 128, 256 * math.ceil(8 * h / 3 / 256), vocab)


def guess_shape(n_params: float) -> Shape:
    """The Llama-like shape (above) whose parameter count is closest to `n_params`."""
    best = llama_shape(1)
    for layers in range(2, 257):
        s = llama_shape(layers)
        if abs(s.params() - n_params) < abs(best.params() - n_params):
            best = s
        if s.params() > 2 * n_params:
            break
    return best


# model types whose parameters Shape.params() counts exactly (others are counted on the meta device)
_QKV_BIAS_ONLY = {"qwen2"}
_ANALYTIC = {"llama", "mistral", "qwen2", "qwen3"}


def shape_from_config(cfg) -> Shape:
    tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    h, heads = tc.hidden_size, tc.num_attention_heads
    mtype = getattr(tc, "model_type", "")
    attn_bias = bool(getattr(tc, "attention_bias", False))
    return Shape(hidden=h, layers=tc.num_hidden_layers, heads=heads,
                 kv_heads=getattr(tc, "num_key_value_heads", None) or heads,
                 head_dim=getattr(tc, "head_dim", None) or h // heads,
                 intermediate=getattr(tc, "intermediate_size", None) or 4 * h, vocab=tc.vocab_size,
                 tied=bool(getattr(tc, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False))),
                 qkv_bias=mtype in _QKV_BIAS_ONLY or attn_bias, o_bias=attn_bias and mtype not in _QKV_BIAS_ONLY,
                 mlp_bias=bool(getattr(tc, "mlp_bias", False)), qk_norm=mtype == "qwen3")


def _count_on_meta(cfg) -> int | None:
    """Exact count for any architecture: build it on the meta device (no memory) and sum unique params."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        return sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    except Exception:  # unknown class etc.: fall back to the Llama-like formula, flagged as approximate
        return None


def resolve_model(spec: str) -> dict:
    """-> {name, params, shape, source}. Local path first, then a parameter count, then the hub."""
    spec = str(spec).strip()
    if not os.path.exists(spec) and (n := parse_count(spec)) is not None:
        shape = guess_shape(n)
        return {"name": spec, "params": int(round(n)), "shape": shape,
                "source": f"Llama-like shape guessed from the count (that shape has {fmt_count(shape.params())} "
                          "params; weights use the count given)"}
    try:
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise UserError(f"reading model configs needs transformers ({e})") from None
    if os.path.exists(spec):
        try:
            cfg = AutoConfig.from_pretrained(spec)
        except Exception as e:
            raise UserError(f"'{spec}' is not a readable model config: {str(e).splitlines()[0]}") from None
    else:
        try:
            cfg = AutoConfig.from_pretrained(spec, local_files_only=True)  # the HF cache, without network
        except Exception:
            try:
                cfg = AutoConfig.from_pretrained(spec)
            except Exception:
                raise UserError(f"model '{spec}' is not a local path or a parameter count (like 7e9), and its "
                                "config could not be fetched from the Hugging Face hub (no network?)") from None
    shape = shape_from_config(cfg)
    mtype = getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "model_type", "")
    n = shape.params() if mtype in _ANALYTIC else _count_on_meta(cfg)
    source = f"config ({mtype})" + ("" if n is not None else "; params approximated by the Llama-like formula")
    return {"name": spec, "params": n if n is not None else shape.params(), "shape": shape, "source": source}


def fmt_count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))
