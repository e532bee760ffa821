"""Advantage estimators: the critic-free group family (GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++) and GAE.

Groups are given by ``group_ids`` [N]: any integer labels, in any order, groups of any size — e.g.
the prompt index of each sampled completion (GRPO's group of outputs per question, Shao et al. 2024,
§4.1). Statistics are computed with ``torch.unique(return_inverse=True)`` + ``index_add_`` (no Python
loop over rows), so shuffling rows together with their group ids permutes the output and changes
nothing else.

Standard deviations are *population* std (divide by n, not n − 1): the GRPO paper writes std(r)
without saying which, and the population form gives a two-member group exactly ±1 (tested).
A group whose rewards are all equal — including every singleton group — carries no learning
signal: its advantages are exactly 0 (never NaN), whatever ``eps`` is.

Headroom: rewards so large that float32 statistics of them could overflow (a reward of 1e38 made
a group's sum, and so its std, inf: every advantage silently 0) are computed in float64 and the
result handed back in the rewards' dtype (:func:`_with_headroom`). The bound is far above any
sensible reward, so ordinary rewards are computed exactly as before, bit for bit.

Registry: :data:`ADVANTAGE_ESTIMATORS` maps a name to an :class:`Estimator`: the function, with the
uniform signature ``fn(rewards [N], group_ids [N], mask [N, T], **kwargs) -> [N] or [N, T]``
(per-sequence advantages broadcast over tokens in :func:`tether.objectives.policy_loss`), and what a
trainer must hand it (group ids, a greedy baseline, per-token rewards, a scale). A trainer asks the
entry, never the name. A new estimator is one function, one registry entry and one row in the
hand-value table of tests/test_objectives_advantages.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ._masks import as_bool, masked_whiten


def _with_headroom(values: Tensor, count: int | None = None) -> Tensor:
    """``values`` as float64 when sums of squares of ``count`` (default: all) deviations of them
    could overflow their dtype, else unchanged. |x − mean| ≤ 2·max|x|, so the sum stays finite
    while 4·count·max|x|² ≤ the dtype's max; float32 holds that to |x| ≈ 1e18 for 64 values."""
    if values.dtype == torch.float64 or not values.is_floating_point() or values.numel() == 0:
        return values
    count = max(count or values.numel(), 1)
    limit = (torch.finfo(values.dtype).max / (4 * count)) ** 0.5
    largest = float(torch.nan_to_num(values.detach(), nan=0.0, posinf=0.0, neginf=0.0).abs().max())
    return values.double() if largest > limit else values


def _groups(rewards: Tensor, group_ids) -> tuple[Tensor, int]:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N] (one scalar per sequence), got {tuple(rewards.shape)}")
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniq.numel()


def group_stats(values: Tensor, group_ids) -> dict[str, Tensor]:
    """Per-row group statistics of ``values`` [N]: ``count``, ``sum``, ``mean``, population ``std``,
    and ``constant`` (bool: every member of the row's group has the same value). All [N].
    Half-precision values are accumulated in float32 (the statistics come back in float32);
    values beyond float32's headroom in float64 (the statistics come back in float64)."""
    inv, g = _groups(values, group_ids)
    if values.dtype in (torch.float16, torch.bfloat16):
        values = values.float()
    values = _with_headroom(values)
    zeros = values.new_zeros(g)
    count = zeros.index_add(0, inv, torch.ones_like(values))
    total = zeros.index_add(0, inv, values)
    mean = total / count
    # Two-pass variance: E[x²] − E[x]² cancels catastrophically for large rewards.
    var = zeros.index_add(0, inv, (values - mean[inv]) ** 2) / count
    gmax = zeros.scatter_reduce(0, inv, values, "amax", include_self=False)
    gmin = zeros.scatter_reduce(0, inv, values, "amin", include_self=False)
    return {"count": count[inv], "sum": total[inv], "mean": mean[inv], "std": var.sqrt()[inv],
            "constant": (gmax == gmin)[inv]}


def grpo_advantages(rewards: Tensor, group_ids, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, §4.1.2, outcome supervision).

    A_i = (r_i − mean_g(r)) / (σ + eps) with g the group of i and
    - ``scale="group"``: σ = population std of r within g (GRPO),
    - ``scale="batch"``: σ = population std of r over the whole batch (group mean, batch std:
      "Lite PPO", Liu et al. 2025; TRL ``scale_rewards="batch"``),
    - ``scale="none"``: no division (Dr.GRPO, Liu et al. 2025: the std term biases toward
      too-easy/too-hard prompts).
    Constant groups (incl. singletons) get exactly 0. Shapes: rewards, group_ids [N] → [N].
    Example: one group with rewards (1, 0, 0, 1) → mean 0.5, σ 0.5 → (1, −1, −1, 1) (up to eps).
    """
    dtype, rewards = rewards.dtype, _with_headroom(rewards)
    s = group_stats(rewards, group_ids)
    centered = rewards - s["mean"]
    if scale == "group":
        adv = centered / (s["std"] + eps)
    elif scale == "batch":
        adv = centered / (rewards.std(correction=0) + eps)
    elif scale == "none":
        adv = centered
    else:
        raise ValueError(f"unknown scale {scale!r}; expected 'group', 'batch' or 'none'")
    return torch.where(s["constant"], 0.0, adv).to(dtype)


def rloo_advantages(rewards: Tensor, group_ids) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = r_i − (1/(n_g − 1)) Σ_{j∈g, j≠i} r_j  =  n_g/(n_g − 1) · (r_i − mean_g(r)).
    Singleton groups have no leave-one-out baseline: their advantage is 0 (as for constant groups).
    Shapes: rewards, group_ids [N] → [N].
    """
    dtype, rewards = rewards.dtype, _with_headroom(rewards)
    s = group_stats(rewards, group_ids)
    n = s["count"]
    baseline = (s["sum"] - rewards) / (n - 1).clamp(min=1)
    return torch.where(s["constant"] | (n < 2), 0.0, rewards - baseline).to(dtype)


def remax_advantages(rewards: Tensor, greedy_rewards: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): the baseline is the reward of the greedy completion of the same prompt.

    A_i = r_i − r(greedy(x_i)). Shapes: rewards [N], greedy_rewards [N] (or broadcastable) → [N].
    """
    return rewards - greedy_rewards


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = Σ_{s ≥ t, m_s} γ^{(# masked-in steps from t to s)} r_s over masked-in tokens.

    Masked-out positions are transparent (skipped, not terminal) and return 0; with right-padding
    the last real token is terminal. Shapes: [B, T] → [B, T].
    """
    m = as_bool(mask)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    out = []
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(m[:, t], token_rewards[:, t] + gamma * running, running)
        out.append(torch.where(m[:, t], running, 0.0))
    return torch.stack(out[::-1], dim=1) if out else token_rewards.clone()


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, group_ids=None, gamma: float = 1.0,
                            eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (Hu 2025): returns whitened over every valid token of the global batch.

    G_{i,t} = r_i for sequence rewards [N] (broadcast to the sequence's tokens), or the discounted
    return :func:`discounted_returns` for per-token rewards [N, T] (e.g. from
    :func:`~tether.objectives.kl_penalized_rewards`). With ``group_ids`` (REINFORCE++-baseline)
    the group mean of the sequence reward (Σ_t r_{i,t} for token rewards) is subtracted first:
    G ← G − mean_g. Then A = (G − μ) / (σ + eps), μ and σ the token-weighted mean and
    *population* std over all masked-in tokens (so longer sequences weigh more, as in the paper).
    Padding returns 0. Shapes: mask [N, T] → [N, T].
    """
    m = as_bool(mask)
    # returns sum up to T token rewards, and are whitened over up to N·T tokens
    dtype = rewards.dtype
    rewards = _with_headroom(rewards, rewards.shape[0] * m.shape[1] * (m.shape[1] if rewards.dim() == 2 else 1))
    if rewards.dim() == 1:
        seq = rewards
        returns = rewards.unsqueeze(1).expand(m.shape)
    elif rewards.shape == m.shape:
        returns = discounted_returns(rewards, m, gamma)
        seq = torch.where(m, rewards, 0.0).sum(1)
    else:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [N] or match mask {tuple(m.shape)}")
    if group_ids is not None:
        returns = returns - group_stats(seq, group_ids)["mean"].unsqueeze(1)
    return masked_whiten(returns, m, eps=eps).to(dtype)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16).

    δ_t = r_t + γ V_{t+1} − V_t,   A_t = δ_t + γλ A_{t+1},   returns R_t = A_t + V_t,
    with V and A after the last real token taken as 0 (the episode ends there: no bootstrap).
    Masked-out positions are transparent — the recursion skips them — so right-padding of any
    length (and holes, e.g. tool output inside a completion) never changes a result; they output 0.
    γ = λ = 1 gives A_t = Σ_{s≥t} r_s − V_t (reward-to-go minus value).

    Pass detached ``values`` (old critic); the loop runs over T, vectorized over the batch.
    Shapes: token_rewards, values, mask [B, T] → (advantages [B, T], returns [B, T]).
    """
    m = as_bool(mask)
    B, T = token_rewards.shape
    next_value = token_rewards.new_zeros(B)
    next_adv = token_rewards.new_zeros(B)
    advs = []
    for t in reversed(range(T)):
        mt = m[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(mt, adv_t, next_adv)
        next_value = torch.where(mt, values[:, t], next_value)
        advs.append(torch.where(mt, adv_t, 0.0))
    advantages = torch.stack(advs[::-1], dim=1) if advs else token_rewards.clone()
    returns = torch.where(m, advantages + values, 0.0)
    return advantages, returns


# ---- registry: uniform signature fn(rewards, group_ids, mask, **kwargs) -------------------------

@dataclass(frozen=True)
class Estimator:
    """A registry entry: the estimator and what the trainer must hand it."""
    fn: Callable[..., Tensor]
    "fn(rewards, group_ids, mask, **kwargs) -> [N] or [N, T]"
    grouped: bool = True
    "uses group_ids (statistics within each prompt's completions); else the trainer passes None"
    needs_greedy: bool = False
    "takes greedy_rewards= [N]: the reward of the greedy completion of each row's prompt"
    token_rewards: bool = False
    "takes per-token rewards [N, T] (returns-to-go), so a KL penalty in the reward stays per token"
    scaled: bool = False
    "takes scale= ('group' | 'batch' | 'none'): what the centered rewards are divided by"
    whitened: bool = False
    "normalized by statistics of the whole batch (REINFORCE++): a batch held in parts (torchrun ranks) is gathered first"

    def __call__(self, rewards: Tensor, group_ids, mask: Tensor | None = None, **kwargs) -> Tensor:
        return self.fn(rewards, group_ids, mask, **kwargs)


def _grpo(rewards, group_ids, mask=None, **kw):
    return grpo_advantages(rewards, group_ids, **kw)


def _dr_grpo(rewards, group_ids, mask=None, **kw):
    return grpo_advantages(rewards, group_ids, scale="none", **kw)


def _rloo(rewards, group_ids, mask=None):
    return rloo_advantages(rewards, group_ids)


def _remax(rewards, group_ids, mask=None, *, greedy_rewards):
    return remax_advantages(rewards, greedy_rewards)


def _reinforce_pp(rewards, group_ids, mask, **kw):
    return reinforce_pp_advantages(rewards, mask, **kw)


def _reinforce_pp_baseline(rewards, group_ids, mask, **kw):
    return reinforce_pp_advantages(rewards, mask, group_ids=group_ids, **kw)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_grpo, scaled=True),
    "dr_grpo": Estimator(_dr_grpo),
    "rloo": Estimator(_rloo),
    "remax": Estimator(_remax, grouped=False, needs_greedy=True),
    "reinforce_pp": Estimator(_reinforce_pp, grouped=False, token_rewards=True, whitened=True),
    "reinforce_pp_baseline": Estimator(_reinforce_pp_baseline, token_rewards=True, whitened=True),
}


def compute_advantages(name: str, rewards: Tensor, group_ids, mask: Tensor | None = None, **kwargs) -> Tensor:
    """Look up :data:`ADVANTAGE_ESTIMATORS` by ``name`` and call it (extra kwargs, e.g.
    ``greedy_rewards`` for ReMax or ``scale`` for GRPO, are passed through)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](rewards, group_ids, mask, **kwargs)
