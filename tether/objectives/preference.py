"""Preference objectives: Bradley–Terry reward models and the offline DPO family.

All take per-example log-probabilities (see :func:`tether.objectives.sequence_logps`), reduce with
a batch mean and return ``(loss, metrics)``; metrics are detached 0-d tensors (no host sync).
A new DPO-style variant is one function of a :class:`PairLogps` (the policy's and the reference's
log-probs) and the config's numbers, one entry in :data:`PREFERENCE_LOSSES`, and one test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._masks import as_bool, masked_mean


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | float | None = None):
    """Bradley–Terry reward-model loss (Ouyang et al. 2022 eq. 1; Llama-2's optional margin m).

    L = mean_i −log σ(r_c,i − r_r,i − m_i)

    Shapes: rewards [N] (or any equal shape), margin scalar or broadcastable. Metrics:
    ``accuracy`` = fraction with r_c > r_r (ties count as wrong), ``margin`` = mean(r_c − r_r).
    """
    diff = chosen_rewards - rejected_rewards
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits).mean()
    d = diff.detach()
    return loss, {"accuracy": (d > 0).float().mean(), "margin": d.mean()}


# ---- DPO family: a per-pair loss of the policy's and the reference's log-probs ------------------

@dataclass(frozen=True)
class PairLogps:
    """Per-pair inputs of a preference loss, each [N]: the policy's log π(y|x) of the chosen (y_w)
    and rejected (y_l) completion, the reference's log π_ref(y|x) (None when reference-free), and the
    completion lengths in tokens (None: the log-probs are used as given)."""
    chosen: Tensor
    rejected: Tensor
    ref_chosen: Optional[Tensor] = None
    ref_rejected: Optional[Tensor] = None
    chosen_len: Optional[Tensor] = None
    rejected_len: Optional[Tensor] = None

    @property
    def chosen_logratio(self) -> Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratio(self) -> Tensor:
        return self.rejected - self.ref_rejected

    @property
    def h(self) -> Tensor:
        """The log-ratio difference h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))."""
        return self.chosen_logratio - self.rejected_logratio

    def length_averaged(self) -> PairLogps:
        """ā = log π(y|x) / |y| (|y| ≥ 1), for the policy and the reference alike."""
        n_chosen, n_rejected = self.chosen_len.clamp(min=1), self.rejected_len.clamp(min=1)
        ref = {} if self.ref_chosen is None else {"ref_chosen": self.ref_chosen / n_chosen,
                                                  "ref_rejected": self.ref_rejected / n_rejected}
        return PairLogps(self.chosen / n_chosen, self.rejected / n_rejected, **ref,
                         chosen_len=self.chosen_len, rejected_len=self.rejected_len)


# Each entry: (pair, params) -> per-pair loss [N]. `params` is any object with the numbers the entry
# reads (`beta`, `label_smoothing`, ...): the offline trainer passes its config section, so a loss
# with a new number needs that one config field and nothing else.

def _sigmoid(x: PairLogps, p) -> Tensor:
    """DPO (Rafailov et al. 2023, eq. 7): −log σ(βh). ε = label_smoothing > 0 is conservative DPO
    (cDPO, Mitchell 2023): the label is flipped with probability ε, i.e. cross-entropy against the
    soft target 1 − ε: −(1−ε) log σ(βh) − ε log σ(−βh)."""
    h, beta, eps = x.h, p.beta, p.label_smoothing
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def _robust(x: PairLogps, p) -> Tensor:
    """Robust DPO (Chowdhury et al. 2024, eq. 6), unbiased under a label-flip rate ε < 1/2:
    (−(1−ε) log σ(βh) + ε log σ(−βh)) / (1 − 2ε)."""
    h, beta, eps = x.h, p.beta, p.label_smoothing
    if not 0 <= eps < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {eps}")
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


def _hinge(x: PairLogps, p) -> Tensor:
    """SLiC-HF's calibration hinge (Zhao et al. 2023) on the scaled log-ratio difference:
    max(0, 1 − βh)."""
    return torch.relu(1 - p.beta * x.h)


def _ipo(x: PairLogps, p) -> Tensor:
    """IPO (Azar et al. 2023, eq. 17): (h − 1/(2β))², regressing h onto 1/(2β) instead of pushing
    it to ∞; h on length-averaged log-probs when lengths are given (as the authors' code and TRL)."""
    return (x.h - 1 / (2 * p.beta)) ** 2


def _dpop(x: PairLogps, p) -> Tensor:
    """DPO-Positive (Pal et al. 2024, eq. 3): −log σ(β(h − λ·max(0, log π_ref(y_w) − log π(y_w)))),
    λ = ``dpop_lambda``. DPO can widen the gap while lowering the chosen completion's likelihood;
    the penalty starts once log π(y_w) falls below the reference's."""
    return -F.logsigmoid(p.beta * (x.h - p.dpop_lambda * torch.relu(x.ref_chosen - x.chosen)))


PREFERENCE_LOSSES = {"sigmoid": _sigmoid, "robust": _robust, "hinge": _hinge, "ipo": _ipo, "dpop": _dpop}
LENGTH_AVERAGED = {"ipo"}  # their log-probs are length-averaged before the loss and its metrics


def chosen_nll(x: PairLogps) -> Tensor:
    """Per pair, the chosen completion's negative log-likelihood per token, −log π(y_w|x) / |y_w|:
    RPO's NLL term (Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1 divides
    by the length of the chosen completion). TRL's `rpo_alpha` takes the token mean over all of a
    batch's chosen tokens instead; the two agree when the chosen completions are equally long. Per
    pair, so it is a batch mean like every loss here and gradient accumulation equals a big batch."""
    if x.chosen_len is None:
        raise ValueError("rpo_alpha needs the chosen completions' lengths (PairLogps.chosen_len)")
    return -x.chosen / x.chosen_len.clamp(min=1)


def pairwise_preference_loss(x: PairLogps, loss_type: str, params):
    """Batch mean of ``PREFERENCE_LOSSES[loss_type](x, params)``, plus α · mean NLL of the chosen
    completions when ``params.rpo_alpha`` = α > 0 (RPO, Pang et al. 2024; :func:`chosen_nll`: an
    additive term on any loss here, which holds the chosen completions' likelihood up while the
    loss widens the margin). Metrics (TRL names) with the implicit reward r = β(log π − log π_ref):
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins`` (means), ``rewards/accuracies``
    (fraction r_w > r_l), ``logps/chosen``, ``logps/rejected`` — all on the log-probs the loss saw
    (length-averaged for LENGTH_AVERAGED) — and ``nll_loss`` (the unweighted NLL term) when α > 0."""
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {sorted(PREFERENCE_LOSSES)}")
    alpha = getattr(params, "rpo_alpha", 0.0)
    nll = chosen_nll(x).mean() if alpha else None  # on the summed log-probs, before any averaging
    if loss_type in LENGTH_AVERAGED and x.chosen_len is not None:
        x = x.length_averaged()
    loss = PREFERENCE_LOSSES[loss_type](x, params).mean()
    if nll is not None:  # α = 0 adds nothing at all: the loss stays bit-identical
        loss = loss + alpha * nll
    rc, rr = params.beta * x.chosen_logratio.detach(), params.beta * x.rejected_logratio.detach()
    metrics = {
        "rewards/chosen": rc.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/margins": (rc - rr).mean(),
        "rewards/accuracies": (rc > rr).float().mean(),
        "logps/chosen": x.chosen.detach().mean(),
        "logps/rejected": x.rejected.detach().mean(),
    }
    if nll is not None:
        metrics["nll_loss"] = nll.detach()
    return loss, metrics


def preference_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor,
                    ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, beta: float,
                    loss_type: str = "sigmoid", label_smoothing: float = 0.0, **numbers):
    """Offline pairwise preference loss on log-probs *as given* (the caller decides summed or
    length-averaged). With h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)) and
    ε = ``label_smoothing``, per pair:

    - ``"sigmoid"`` (DPO, Rafailov et al. 2023, eq. 7; cDPO if ε > 0):
      −(1−ε) log σ(βh) − ε log σ(−βh)
    - ``"robust"`` (rDPO, Chowdhury et al. 2024, eq. 6):
      (−(1−ε) log σ(βh) + ε log σ(−βh)) / (1 − 2ε)
    - ``"hinge"`` (SLiC-HF, Zhao et al. 2023):  max(0, 1 − βh)
    - ``"ipo"`` (Azar et al. 2023, eq. 17):  (h − 1/(2β))²

    Loss = batch mean. Shapes: four [N] tensors → scalar. ``numbers``: further numbers a loss reads
    (e.g. ``dpop_lambda``; ``rpo_alpha`` needs the lengths: call :func:`pairwise_preference_loss`
    with a :class:`PairLogps` that has them). Metrics: see :func:`pairwise_preference_loss`.
    """
    params = SimpleNamespace(beta=beta, label_smoothing=label_smoothing, **numbers)
    pair = PairLogps(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return pairwise_preference_loss(pair, loss_type, params)


def kto_kl_reference_point(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point z₀ = max(0, mean_j (log π(y_j|x_j') − log π_ref(y_j|x_j'))), detached.

    Estimated on mismatched (prompt, completion) pairs of the batch (Ethayarajh et al. 2024 §4.1);
    in data-parallel training all-reduce the mean across ranks before passing it to :func:`kto_loss`.
    """
    return (policy_kl_logps - ref_kl_logps).detach().mean().clamp(min=0)


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, labels: Tensor, kl_reference_point: Tensor | float,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    """KTO: Kahneman–Tversky optimization on unpaired labels (Ethayarajh et al. 2024, eq. 8).

    r = log π(y|x) − log π_ref(y|x), z₀ = max(0, ``kl_reference_point``) detached (the KL estimate
    *without* β), v = σ(β(r − z₀)) if y is desirable else σ(β(z₀ − r));
    L = mean_i w(y_i)·(1 − v_i),  w = λ_D (``desirable_weight``) or λ_U (``undesirable_weight``).

    Shapes: policy_logps, ref_logps, labels (bool or 0/1) [N] → scalar. Metrics: ``rewards/chosen``
    / ``rewards/rejected`` = mean β·r over desirable / undesirable examples (0 when there are none),
    ``count/chosen``, ``count/rejected``, ``kl`` = z₀.
    """
    desirable = as_bool(labels)
    z0 = torch.as_tensor(kl_reference_point, dtype=policy_logps.dtype, device=policy_logps.device)
    z0 = z0.detach().clamp(min=0)
    r = policy_logps - ref_logps
    v = torch.where(desirable, torch.sigmoid(beta * (r - z0)), torch.sigmoid(beta * (z0 - r)))
    w = torch.where(desirable, desirable_weight, undesirable_weight).to(v.dtype)
    loss = (w * (1 - v)).mean()
    rd = beta * r.detach()
    return loss, {
        "rewards/chosen": masked_mean(rd, desirable),
        "rewards/rejected": masked_mean(rd, ~desirable),
        "count/chosen": desirable.sum(),
        "count/rejected": (~desirable).sum(),
        "kl": z0,
    }


def simpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0):
    """SimPO: reference-free, length-normalized, with target margin γ (Meng et al. 2024 eq. 6).

    L = mean −(1−ε) log σ(β(ā_w − ā_l) − γ) − ε log σ(−(β(ā_w − ā_l) − γ)),
    ā = (1/|y|) log π(y|x) (``sequence_logps(..., average=True)``). γ is the paper's margin itself
    (TRL's ``gamma_beta_ratio`` = γ/β). Shapes [N] → scalar. Metrics: ``rewards/*`` with the
    implicit reward β·ā.
    """
    logits = beta * (chosen_avg_logps - rejected_avg_logps) - gamma
    loss = (-(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)).mean()
    rc, rr = beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach()
    return loss, {
        "rewards/chosen": rc.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/margins": (rc - rr).mean(),
        "rewards/accuracies": (rc > rr).float().mean(),
    }


_LN2 = math.log(2.0)


def log1mexp(a: Tensor) -> Tensor:
    """log(1 − e^a) for a ≤ 0, accurate everywhere (Mächler 2012: expm1 near 0, log1p far from it).

    Inputs are clamped to ≤ −tiny so a probability of exactly 1 gives a large finite value rather
    than −inf. Both ``where`` branches see a safe dummy input so no NaN gradient leaks through.
    """
    a = a.clamp(max=-torch.finfo(a.dtype).tiny)
    near = a > -_LN2
    a_near = torch.where(near, a, -1.0)
    a_far = torch.where(near, -1.0, a)
    return torch.where(near, torch.log(-torch.expm1(a_near)), torch.log1p(-torch.exp(a_far)))


def log_odds(avg_logps: Tensor) -> Tensor:
    """log(p / (1 − p)) with log p = ``avg_logps`` ≤ 0, computed without forming p."""
    return avg_logps - log1mexp(avg_logps)


def orpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, chosen_nll: Tensor | float, lam: float):
    """ORPO: SFT plus an odds-ratio preference term (Hong et al. 2024 eqs. 6–7).

    odds(y) = p/(1 − p) with p = exp(ā), ā the length-averaged log-prob;
    L = mean(NLL_w) + λ · mean_i −log σ(log odds(y_w) − log odds(y_l)).

    ``chosen_nll`` is the SFT negative log-likelihood of the chosen completion (per example [N] or
    already a scalar; it is averaged). Log-odds use :func:`log_odds` (stable at p → 0 and p → 1).
    Metrics: ``nll_loss``, ``or_loss`` (the unweighted odds-ratio term), ``log_odds_ratio`` (mean
    log odds(y_w) − log odds(y_l)), ``rewards/chosen``/``rejected`` = λ·ā, ``rewards/accuracies``.
    """
    ratio = log_odds(chosen_avg_logps) - log_odds(rejected_avg_logps)
    or_loss = -F.logsigmoid(ratio).mean()
    nll = torch.as_tensor(chosen_nll, dtype=ratio.dtype, device=ratio.device).mean()
    loss = nll + lam * or_loss
    rc, rr = lam * chosen_avg_logps.detach(), lam * rejected_avg_logps.detach()
    return loss, {
        "nll_loss": nll.detach(),
        "or_loss": or_loss.detach(),
        "log_odds_ratio": ratio.detach().mean(),
        "rewards/chosen": rc.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (ratio.detach() > 0).float().mean(),
    }
