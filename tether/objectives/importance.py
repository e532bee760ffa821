"""Off-policy correction of the policy gradient: importance weights between the policy the trainer
holds (π_old, its own log-probs) and the behaviour policy μ that sampled the tokens (the sampler's
log-probs: another numeric implementation of the same weights — bf16 kernels, a KV cache — or an
older version of them when rollouts come from the trajectory queue with max_staleness > 0).

    ρ_t = π_old(y_t | x, y_<t) / μ(y_t | x, y_<t)     (token level)
    ρ_i = Π_t ρ_t = exp(Σ_t log ρ_t)                   (sequence level: one weight per completion)

Plain IS (E_μ[ρ·∇] = E_π[∇]) is unbiased with unbounded variance; each registry entry bounds it
with a cap C. The weight multiplies the advantage (equivalently the surrogate: the weight is ≥ 0
and detached, so −min(r·wA, clip(r)·wA) = −w·min(rA, clip(r)A)); the KL term is not weighted.

Every entry: fn(log_rho [B, T], mask [B, T] bool, level, cap) -> Correction, pure, no gradient.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ._masks import as_bool, masked_mean, masked_sum

IS_LEVELS = ("token", "sequence")


class Correction(NamedTuple):
    weights: Tensor
    "[B, T] the weight w_t multiplying each token's advantage (0 at padding), float32, detached"
    capped: Tensor
    "[B, T] bool: the cap acted on the token (truncated to C, or masked to 0)"


def _rho(log_rho: Tensor, mask: Tensor, level: str) -> Tensor:
    """ρ per token [B, T]: the token's own ratio, or its sequence's product of ratios."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown is_level {level!r}; expected one of {IS_LEVELS}")
    log_rho = torch.where(mask, log_rho.detach().float(), 0.0)
    if level == "sequence":
        log_rho = masked_sum(log_rho, mask, dim=-1).unsqueeze(-1).expand_as(mask)
    return torch.exp(log_rho)  # may be inf for a far-off sequence: the entries below handle it


def truncated_is(log_rho: Tensor, mask: Tensor, level: str = "token", cap: float = 2.0) -> Correction:
    """Truncated importance sampling, TIS (Yao, Liu et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", blog post: the policy gradient weighted by
    min(π_train / π_rollout, C) per token; truncated IS itself: Ionides 2008, eq. 2):

        w = min(ρ, C)          ρ per token (``level="token"``) or per sequence (``"sequence"``)

    Biased where ρ > C (the excess weight is dropped), variance ≤ C². ``capped``: ρ > C.
    """
    m = as_bool(mask)
    rho = _rho(log_rho, m, level)
    capped = (rho > cap) & m
    return Correction(torch.where(m, rho.clamp(max=cap), 0.0), capped)


def masked_is(log_rho: Tensor, mask: Tensor, level: str = "token", cap: float = 2.0) -> Correction:
    """Masked importance sampling, MIS (Liu, Li et al. 2025, "When Speed Kills Stability:
    Demystifying RL Collapse from the Training-Inference Mismatch", token- and sequence-level MIS):
    the tokens (or whole sequences) whose ratio exceeds the cap are rejected — weight 0 — instead of
    truncated; the others keep their full ratio:

        w = ρ · 1[ρ ≤ C]

    The rejected tokens stay in the loss's denominator (as TRL's ``token_mask`` /
    ``sequence_mask``; verl also drops them from it), so the micro-batch accumulation of the loss is
    unchanged. ``capped``: ρ > C (the rejected tokens).
    """
    m = as_bool(mask)
    rho = _rho(log_rho, m, level)
    capped = (rho > cap) & m
    return Correction(torch.where(m & ~capped, rho, 0.0), capped)


IS_CORRECTIONS: dict[str, Callable[..., Correction]] = {"tis": truncated_is, "mis": masked_is}
"is_correction -> its weight function (``none`` = no correction: the entry is absent)"

_CAPPED_NAME = {"tis": "is_weight/frac_truncated", "mis": "is_weight/frac_masked"}


def importance_weights(name: str, logps: Tensor, behavior_logps: Tensor, mask: Tensor,
                       level: str = "token", cap: float = 2.0) -> Correction:
    """:data:`IS_CORRECTIONS` [``name``] of log ρ = ``logps`` − ``behavior_logps`` (π_old vs μ)."""
    if name not in IS_CORRECTIONS:
        raise ValueError(f"unknown is_correction {name!r}; expected one of {sorted(IS_CORRECTIONS)}")
    if not cap > 0:
        raise ValueError(f"is_cap must be > 0, got {cap}")
    m = as_bool(mask)
    return IS_CORRECTIONS[name](logps.float() - behavior_logps.float(), m, level, cap)


def is_metrics(name: str, correction: Correction, mask: Tensor) -> dict[str, Tensor]:
    """The weights' statistics over the masked tokens (a sequence weight counts once per token):
    ``is_weight/mean``, ``is_weight/max``, and ``is_weight/frac_truncated`` (TIS) or
    ``is_weight/frac_masked`` (MIS), the fraction of tokens the cap acted on."""
    m = as_bool(mask)
    w = correction.weights
    top = torch.where(m, w, 0.0).max() if m.any() else torch.zeros((), device=w.device)
    return {"is_weight/mean": masked_mean(w, m), "is_weight/max": top,
            _CAPPED_NAME[name]: masked_mean(correction.capped.float(), m)}
