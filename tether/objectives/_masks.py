"""Mask and aggregation helpers shared by every objective.

Masks may be bool or float; any nonzero entry means "this position counts". Selection is done with
``torch.where`` rather than multiplication so that garbage in padded positions (even NaN/inf from a
model's logits over pad tokens) can never leak into a result: ``nan * 0`` is ``nan``.
"""
from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def as_bool(mask: Tensor) -> Tensor:
    """Mask as bool (nonzero = included)."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Σ x over positions where mask is set; padded entries are never read, so NaN there is harmless."""
    x = torch.where(as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Mean of x over the masked positions; 0 (not NaN) when nothing is masked in."""
    m = as_bool(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance (divide by n, not n−1) over all masked positions."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6, shift_mean: bool = True) -> Tensor:
    """(x − μ) / (σ + eps) with μ, σ the masked mean and *population* std; padding set to 0.

    A constant input (σ = 0) whitens to exactly 0 when ``shift_mean`` (x − μ is 0 up to rounding).
    """
    m = as_bool(mask)
    mean = masked_mean(x, m)
    std = masked_var(x, m).sqrt()
    out = ((x - mean) if shift_mean else x) / (std + eps)
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def aggregate_loss(loss_mat: Tensor, mask: Tensor, agg: str = "token-mean",
                   norm_length: int | float | None = None) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    - ``"token-mean"``: Σ_{i,t} m·L / Σ_{i,t} m — every token in the batch weighs the same
      (DAPO's token-level loss; long sequences dominate).
    - ``"seq-mean-token-mean"``: (1/B') Σ_i (Σ_t m·L / Σ_t m) — each sequence weighs the same
      (original GRPO); B' counts only rows with at least one token, so an all-padding row is ignored.
    - ``"seq-mean-token-sum-norm"``: Σ_{i,t} m·L / (B · C) with C = ``norm_length`` (default: the
      mask's length dimension T) — Dr.GRPO's constant normalizer, free of length bias. Because C
      defaults to T, extra right-padding changes this mode's value unless ``norm_length`` is given.

    With every row holding exactly L tokens the three agree up to a constant:
    token-mean = seq-mean-token-mean = (C / L) · seq-mean-token-sum-norm.
    """
    m = as_bool(mask)
    if loss_mat.dim() == 1:
        loss_mat, m = loss_mat.unsqueeze(0), m.reshape(1, -1)
    if agg == "token-mean":
        return masked_mean(loss_mat, m)
    if agg == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, m, dim=-1)
        has_tokens = m.any(dim=-1)
        return masked_mean(per_seq, has_tokens)
    if agg == "seq-mean-token-sum-norm":
        c = m.shape[-1] if norm_length is None else norm_length
        return masked_sum(loss_mat, m) / (m.shape[0] * c)
    raise ValueError(f"unknown agg {agg!r}; expected one of {AGG_MODES}")
