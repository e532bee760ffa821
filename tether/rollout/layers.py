"""Which Hugging Face layers the sampler's own forwards recognize, by type: their math is known, so
the native torch path (native.py) can inline them and the C step (cpu.py) can run them.

Kept apart so that both import it and neither imports the other (native.py builds the C step).
"""
from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn


def rmsnorm_eps(m) -> float | None:
    """The epsilon of an HF Llama/Qwen-style RMSNorm module (its math is known), else None."""
    ok = type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and hasattr(m, "weight")
    return float(m.variance_epsilon) if ok else None


def gemma_rmsnorm_eps(m) -> float | None:
    """The epsilon of an HF Gemma-style RMSNorm module (normalize in float32, times (1 + weight) in
    float32, cast back), else None."""
    ok = type(m).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm") and hasattr(m, "eps") \
        and hasattr(m, "weight")
    return float(m.eps) if ok else None


def is_silu(act) -> bool:
    return type(act) is nn.SiLU or type(act).__name__ == "SiLUActivation"


def is_gelu_tanh(act) -> bool:
    """torch's tanh-approximate GELU: nn.GELU(approximate="tanh"), or transformers' GELUTanh
    (Gemma's ``gelu_pytorch_tanh``) when it calls F.gelu (not its Python formula)."""
    if type(act) is nn.GELU:
        return act.approximate == "tanh"
    f = getattr(act, "act", None)
    return type(act).__name__ == "GELUTanh" and isinstance(f, functools.partial) \
        and f.func is F.gelu and f.keywords == {"approximate": "tanh"}


def sliding_window(attn, cfg) -> int | None:
    """A layer's sliding window in tokens (a query at position p sees keys at positions > p - w), or
    None: the attention module's own (Qwen2/3, Gemma 3: None on full-attention layers), else the
    config's (Mistral)."""
    w = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
    return None if w is None else int(w)
