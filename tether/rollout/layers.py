"""Which Hugging Face layers the sampler's own forwards recognize, by type: their math is known, so
the native torch path (native.py) can inline them and the C step (cpu.py) can run them.

Kept apart so that both import it and neither imports the other (native.py builds the C step).
"""
from __future__ import annotations

from torch import nn


def rmsnorm_eps(m) -> float | None:
    """The epsilon of an HF Llama/Qwen-style RMSNorm module (its math is known), else None."""
    ok = type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and hasattr(m, "weight")
    return float(m.variance_epsilon) if ok else None


def is_silu(act) -> bool:
    return type(act) is nn.SiLU or type(act).__name__ == "SiLUActivation"
