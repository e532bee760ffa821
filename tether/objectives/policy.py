"""Policy-gradient objectives: KL estimators, the clipped surrogate (PPO/GRPO/DAPO/GSPO/GMPO), the
value loss, KL-shaped rewards and KL-coefficient controllers.

All per-token inputs are [B, T] tensors aligned the same way (e.g. from
:func:`tether.objectives.token_logps`) with a mask [B, T] (bool or float, nonzero = counts);
padded positions are never read (``torch.where``, not multiplication, so NaN there is harmless).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ._masks import AGG_MODES, aggregate_loss, as_bool, masked_mean
from .importance import importance_weights, is_metrics


# ---- KL estimators (Schulman 2020, "Approximating KL divergence", the k1/k2/k3 of that note) -----
# Per token, samples from π, estimating KL(π ‖ π_ref); Δ = log π_ref − log π.
# Half-precision inputs are computed in float32 and returned in their own dtype: in bf16,
# expm1(Δ) − Δ ≈ Δ²/2 cancels to a few percent error for |Δ| ~ 0.01–0.1.

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _f32(x: Tensor | None) -> Tensor | None:
    """Upcast half-precision tensors to float32 (a differentiable cast); others unchanged."""
    return x.float() if x is not None and x.dtype in _LOW_PRECISION else x


def kl_k1(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k1 = log π − log π_ref = −Δ. Unbiased, high variance, can be negative per token."""
    return logps - ref_logps


def kl_k2(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k2 = ½ (log π − log π_ref)² = ½ Δ². Biased (exact to 2nd order), ≥ 0, low variance."""
    return 0.5 * (logps - ref_logps) ** 2


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 = exp(Δ) − Δ − 1 with Δ = log π_ref − log π. Unbiased, ≥ 0 (e^x ≥ 1 + x), 0 iff equal."""
    out_dtype = torch.promote_types(logps.dtype, ref_logps.dtype)
    delta = _f32(ref_logps) - _f32(logps)
    # expm1: no cancellation in e^Δ − 1 for small Δ
    return (torch.expm1(delta) - delta).to(out_dtype)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def _kl(name: str, logps: Tensor, ref_logps: Tensor) -> Tensor:
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; expected one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name](logps, ref_logps)


def _clean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, 0.0)


def _per_token(advantages: Tensor, shape) -> Tensor:
    # Per-sequence advantages [B] (or [B, 1]) apply to every token of their sequence.
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    return advantages.expand(shape)


# ---- importance ratio + clip: one function per `importance_level` -----------------------------------
# fn(log_ratio, logps, advantages, mask, eps_low, eps_high) -> Surrogate, all [B, T]: log_ratio =
# log π − log π_old and logps are 0 at padding, advantages per token (0 at padding), mask bool.

class Surrogate(NamedTuple):
    loss: Tensor
    "[B, T] per-token surrogate loss (to be aggregated with the loss's `agg`)"
    ratio: Tensor
    "[B, T] the importance ratio's value at each token, detached (logged as ratio/mean)"
    clipped_low: Tensor
    "[B, T] bool: the clip binds at the low edge (ratio below it, A < 0): no gradient"
    clipped_high: Tensor
    "[B, T] bool: the clip binds at the high edge (ratio above it, A > 0)"


def _ppo_clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Surrogate:
    surrogate = ratio * adv
    surrogate_clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    r, a = ratio.detach(), adv.detach()
    return Surrogate(-torch.minimum(surrogate, surrogate_clipped), r,
                     (r < 1 - eps_low) & (a < 0), (r > 1 + eps_high) & (a > 0))


def token_ratio_surrogate(log_ratio, logps, adv, mask, eps_low, eps_high) -> Surrogate:
    """PPO's clipped surrogate with one ratio per token (Schulman et al. 2017, eq. 7; as used by
    GRPO, Shao et al. 2024, eq. 3; ε_high > ε_low is DAPO's clip-higher, Yu et al. 2025, §3.1):

        r_t = exp(log π_t − log π_old,t),   L_t = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)
    """
    return _ppo_clip(torch.exp(log_ratio), adv, eps_low, eps_high)


def gspo_token_surrogate(log_ratio, logps, adv, mask, eps_low, eps_high) -> Surrogate:
    """GSPO (Zheng et al. 2025) in its GSPO-token form: every token's ratio has the value of the
    sequence ratio s_i, the geometric mean of the sequence's token ratios, and the gradient of its
    own log-probability; the clip acts on s_i, so a sequence is clipped as a whole:

        s_i = exp((1/|y_i|) Σ_t (log π_t − log π_old,t)),   s_{i,t} = sg[s_i] · π_t / sg[π_t]
        L_t = −min(s_{i,t} A_t, clip(s_{i,t}, 1 − ε_low, 1 + ε_high) A_t)

    Token t's gradient is s_i A_{i,t} ∇log π_t (as verl). With advantages constant within each
    sequence (GSPO's case) this is exactly the gradient of the loss's value under any ``agg``; with
    ``"seq-mean-token-mean"`` it is sequence-level GSPO, s_i A_i (1/|y_i|) Σ_t ∇log π_t. With
    per-token advantages it is GSPO-token's estimator, not the derivative of the value. Use GSPO's
    small clip ranges (3e-4 / 4e-4).
    """
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).detach().unsqueeze(-1)
    ratio = torch.where(mask, torch.exp(seq_log_ratio + logps - logps.detach()), 1.0)
    return _ppo_clip(ratio, adv, eps_low, eps_high)


def gmpo_surrogate(log_ratio, logps, adv, mask, eps_low, eps_high) -> Surrogate:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", §3, the clipped objective):
    one ratio per sequence, the geometric mean of its token ratios, each token clipped in log space
    on the side the advantage's sign makes binding *before* the mean (GSPO clips the mean instead):

        A_i = mean_t A_{i,t},   Δ_t = log π_t − log π_old,t,   c_t = clip(Δ_t, −ε_low, ε_high)
        ℓ_t = min(Δ_t, c_t) if A_i ≥ 0, max(Δ_t, c_t) if A_i < 0   (= log of min(ρ_t A_i, clip(ρ_t) A_i)/A_i)
        s_i = exp((1/|y_i|) Σ_t ℓ_t),   L_i = −s_i A_i   (on each of the sequence's tokens)

    A clipped token gets no gradient; the others get −A_i s_i / |y_i| · ∇log π_t. Use
    ``loss_agg="seq-mean-token-mean"`` for the paper's mean over sequences, and its wider clip
    (ε = 0.4: ratios in (e^−0.4, e^0.4)); ε here is in log space. Per-token advantages are averaged
    over the sequence (GMPO is defined for one advantage per sequence).
    """
    seq_adv = masked_mean(adv, mask, dim=-1).unsqueeze(-1)
    clipped = torch.clamp(log_ratio, -eps_low, eps_high)
    kept = torch.where(seq_adv < 0, torch.maximum(log_ratio, clipped), torch.minimum(log_ratio, clipped))
    ratio = torch.exp(masked_mean(kept, mask, dim=-1)).unsqueeze(-1)
    delta = log_ratio.detach()
    return Surrogate((-ratio * seq_adv).expand_as(log_ratio), ratio.detach().expand_as(log_ratio),
                     (delta < -eps_low) & (seq_adv < 0), (delta > eps_high) & (seq_adv > 0))


SURROGATES: dict[str, Callable[..., Surrogate]] = {
    "token": token_ratio_surrogate,
    "sequence": gspo_token_surrogate,
    "gmpo": gmpo_surrogate,
}


def policy_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float | None = None, agg: str = "token-mean",
                ref_logps: Tensor | None = None, beta: float = 0.0, kl_estimator: str = "k3",
                importance_level: str = "token", norm_length: int | float | None = None,
                behavior_logps: Tensor | None = None, is_correction: str = "none", is_level: str = "token",
                is_cap: float = 2.0):
    """Clipped surrogate policy loss (PPO, Schulman et al. 2017, eq. 7) and its variants.

    Per token:  L_t = surrogate_t + β·KL_t, the surrogate from :data:`SURROGATES`
    [``importance_level``] — ``"token"``: PPO / GRPO, −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)
    with r_t = exp(log π_t − log π_old,t); ``"sequence"``: GSPO-token (one clipped ratio per
    sequence); see each function for its equation.
    - ε_high = ``clip_high`` defaults to ε_low = ``clip_low``; a larger ε_high is DAPO's clip-higher.
    - KL_t = ``kl_estimator`` (k1/k2/k3) of (log π, log π_ref), added only when ``ref_logps`` is
      given and β > 0 (GRPO's KL-in-loss, Shao et al. 2024, eq. 4 is k3); aggregated with the same
      ``agg``.

    ``advantages``: per sequence [B] (broadcast) or per token [B, T]. ``agg``
    (see :func:`aggregate_loss`): ``"token-mean"``, ``"seq-mean-token-mean"``,
    ``"seq-mean-token-sum-norm"`` (Σ m L / (B·C), C = ``norm_length`` or T). When every row has
    L tokens: token-mean = seq-mean-token-mean = (C/L) · seq-mean-token-sum-norm.

    Shapes: logps, old_logps, mask (and ref_logps) [B, T] → scalar loss. Metrics (token-means over
    the mask): ``clip_ratio/low_mean`` (the clip binds at the low edge, A < 0),
    ``clip_ratio/high_mean`` (at the high edge, A > 0), ``clip_ratio/region_mean`` (either),
    ``approx_kl`` = mean ½(log π − log π_old)² (k2 vs the sampling policy, as PPO
    implementations report it), ``kl`` = mean KL_t vs the reference (whenever ``ref_logps`` is
    given, even with β = 0; 0 without a reference), ``pg_loss`` (the surrogate part, aggregated),
    ``ratio/mean``.

    Off-policy correction (:mod:`tether.objectives.importance`): with ``is_correction`` = ``"tis"``
    or ``"mis"`` and the sampler's ``behavior_logps`` μ, every advantage is multiplied by the
    weight w = IS_CORRECTIONS[is_correction](log π_old − log μ) at ``is_level`` (token / sequence)
    with cap ``is_cap``: A_t ← w_t A_t (the surrogate's clip stays relative to π_old); metrics
    ``is_weight/mean``, ``is_weight/max``, ``is_weight/frac_truncated`` | ``frac_masked``.
    Half-precision inputs are computed (and the loss returned) in float32: a bf16
    ratio exp(log π − log π_old) is only resolved to ~0.4–0.8 % near 1.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; expected one of {AGG_MODES}")
    if importance_level not in SURROGATES:
        raise ValueError(f"unknown importance_level {importance_level!r}; expected one of {sorted(SURROGATES)}")
    m = as_bool(mask)
    eps_low = clip_low
    eps_high = clip_low if clip_high is None else clip_high
    logps, old_logps, advantages, ref_logps = _f32(logps), _f32(old_logps), _f32(advantages), _f32(ref_logps)
    # Sanitize padding up front: a NaN there would survive a later where() in the backward pass
    # (0 · NaN), and exp() of garbage could overflow.
    logps, old_logps = _clean(logps, m), _clean(old_logps, m)
    log_ratio = logps - old_logps
    adv = _clean(_per_token(advantages, logps.shape), m)
    is_stats = {}
    if is_correction != "none":
        if behavior_logps is None:
            raise ValueError(f"is_correction={is_correction!r} needs behavior_logps (the sampler's)")
        correction = importance_weights(is_correction, old_logps, _clean(_f32(behavior_logps), m), m,
                                        is_level, is_cap)
        adv, is_stats = adv * correction.weights, is_metrics(is_correction, correction, m)
    surrogate = SURROGATES[importance_level](log_ratio, logps, adv, m, eps_low, eps_high)

    pg_mat = surrogate.loss
    loss_mat = pg_mat
    metrics: dict[str, Tensor] = {"kl": torch.zeros((), dtype=pg_mat.dtype, device=pg_mat.device)}
    if ref_logps is not None:
        kl_mat = _kl(kl_estimator, logps, _clean(ref_logps, m))
        metrics["kl"] = masked_mean(kl_mat.detach(), m)
        if beta > 0:
            loss_mat = pg_mat + beta * kl_mat
    loss = aggregate_loss(loss_mat, m, agg, norm_length)

    r, low, high = surrogate.ratio, surrogate.clipped_low, surrogate.clipped_high
    metrics.update({
        "pg_loss": aggregate_loss(pg_mat.detach(), m, agg, norm_length),
        "clip_ratio/low_mean": masked_mean(low.to(r.dtype), m),
        "clip_ratio/high_mean": masked_mean(high.to(r.dtype), m),
        "clip_ratio/region_mean": masked_mean((low | high).to(r.dtype), m),
        "approx_kl": masked_mean(0.5 * log_ratio.detach() ** 2, m),
        "ratio/mean": masked_mean(r, m),
        **is_stats,
    })
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None = 0.2, agg: str = "token-mean"):
    """Clipped value loss: no paper equation; the form of OpenAI Baselines' ppo2 (Dhariwal et al. 2017),
    which TRL's PPO follows.

    V_clip = V_old + clip(V − V_old, −c, c);  L_t = ½ max((V − R)², (V_clip − R)²),
    aggregated with ``agg`` (token-mean by default). ``clip=None`` gives the plain ½(V − R)².
    Half-precision inputs are computed in float32.
    Shapes: all [B, T] → scalar. Metrics: ``clipfrac`` (fraction of tokens where the clipped
    term is the larger, i.e. the gradient is cut), ``values/mean``, ``returns/mean``.
    """
    m = as_bool(mask)
    values, old_values, returns = (_clean(_f32(x), m) for x in (values, old_values, returns))
    unclipped = (values - returns) ** 2
    if clip is None:
        loss_mat = unclipped
        clipped_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (v_clip - returns) ** 2
        loss_mat = torch.maximum(unclipped, clipped)
        # only where the clip acts: inside the range V_old + (V − V_old) is V up to rounding, and a
        # one-ulp larger "clipped" term there cuts no gradient (clamp passes it) — counting those
        # made the metric depend on float noise (1 vs 2 processes: 0.070 vs 0.039, same loss)
        active = (values - old_values).abs() > clip
        clipped_frac = masked_mean((active & (clipped > unclipped)).to(values.dtype).detach(), m)
    loss = 0.5 * aggregate_loss(loss_mat, m, agg)
    return loss, {"clipfrac": clipped_frac, "values/mean": masked_mean(values.detach(), m),
                  "returns/mean": masked_mean(returns.detach(), m)}


def last_token_index(mask: Tensor) -> Tensor:
    """Index of each row's last masked-in position [B] (−1 for a row with none)."""
    m = as_bool(mask)
    pos = torch.arange(m.shape[-1], device=m.device).expand(m.shape)
    return torch.where(m, pos, -1).max(dim=-1).values


def kl_penalized_rewards(scores: Tensor, logps: Tensor, ref_logps: Tensor, mask: Tensor, beta: float,
                         estimator: str = "k1") -> Tensor:
    """Per-token RLHF reward with the KL penalty inside (Ziegler et al. 2019, eq. 2, spread over tokens).

    r̃_t = 1[t = last completion token] · R − β · KL_t,  KL_t = ``estimator`` (k1 by default, the
    classic log π − log π_ref) of (log π_old, log π_ref). Padding gets 0; a row with no tokens drops
    its score. Pass detached log-probs (these are rewards, not a loss).
    Shapes: scores [B], logps, ref_logps, mask [B, T] → [B, T].
    """
    m = as_bool(mask)
    kl = _kl(estimator, _clean(logps, m), _clean(ref_logps, m))
    rewards = torch.where(m, -beta * kl, 0.0)
    last = last_token_index(m)
    at_last = torch.arange(m.shape[-1], device=m.device).unsqueeze(0) == last.unsqueeze(1)
    return rewards + torch.where(at_last, scores.to(rewards.dtype).unsqueeze(1), 0.0)


class FixedKLController:
    """Constant KL coefficient β; ``update`` is a no-op (same interface as the adaptive one)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """Proportional control of β toward a target KL (Ziegler et al. 2019, §2.2).

    e = clip(KL_current / KL_target − 1, −0.2, 0.2);  β ← β · (1 + e · n_steps / horizon).
    ``current_kl`` may be a float or a 0-d tensor; ``n_steps`` is the number of samples (or steps)
    since the last update, in the same unit as ``horizon``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController needs target > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps: int) -> float:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value


def best_of_n_kl(n: int) -> float:
    """Analytic KL(π_BoN ‖ π) of best-of-n sampling (Stiennon et al. 2020; Hilton & Gao):
    log n − (n − 1)/n. 0 at n = 1; grows like log n."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return math.log(n) - (n - 1) / n
