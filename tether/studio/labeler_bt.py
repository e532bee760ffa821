"""The labeler's tiny Bradley–Terry reward model: linear in hashed bag-of-words features, fitted
in milliseconds on CPU, so it can retrain every few labels while the person keeps labelling.

    r(x, y) = w · φ(y)         φ(y) = [count of each word of y hashed into D buckets, log(1 + |y|)]
    L(w)    = mean_i −log σ(r(x_i, y_c,i) − r(x_i, y_r,i)) + λ‖w‖²

The loss is tether.objectives.bradley_terry_loss (Ouyang et al. 2022 eq. 1), the one `tether rm`
trains with, on features instead of a transformer's last hidden state; full-batch L-BFGS.
φ sees only the response: the gold-reward world's labels favour responses with more of the
prompt's topic words, and a bag of words learns "more content words are better", the same
shortcut a transformer RM learns there (tether/tasks/preference_world.py), from a few dozen pairs.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from tether.objectives import bradley_terry_loss

DIM = 256
"hash buckets of the bag of words (+1 length feature)"
L2 = 1e-2
"λ: keeps w finite on separable data (a handful of labels always is)"


def _text(v) -> str:
    """A response as text: a string, or a conversation's messages' contents."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return " ".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in v)
    return str(v)


def features(response, dim: int = DIM) -> np.ndarray:
    """φ(y): word counts hashed (crc32, stable across processes) into `dim` buckets, then log(1 + |y|)."""
    words = _text(response).lower().split()
    phi = np.zeros(dim + 1)
    for w in words:
        phi[zlib.crc32(w.encode("utf-8")) % dim] += 1.0
    phi[dim] = math.log1p(len(words))
    return phi


@dataclass
class BTModel:
    w: np.ndarray
    "weights over features() (dim + 1)"
    train_loss: float
    "final training loss (BT + L2)"
    n_train: int
    "pairs it was fitted on"

    def score(self, response) -> float:
        return float(features(response, len(self.w) - 1) @ self.w)


def fit_bt(chosen: list, rejected: list, l2: float = L2, dim: int = DIM, max_iter: int = 200) -> BTModel:
    """Fit w on pairs (chosen[i] ≻ rejected[i]) by full-batch L-BFGS on bradley_terry_loss + λ‖w‖².
    Deterministic: w starts at 0 and L-BFGS draws nothing at random. No pairs: w = 0."""
    if len(chosen) != len(rejected):
        raise ValueError(f"fit_bt: {len(chosen)} chosen for {len(rejected)} rejected")
    if not chosen:
        return BTModel(np.zeros(dim + 1), float("nan"), 0)
    fc = torch.tensor(np.stack([features(c, dim) for c in chosen]), dtype=torch.float64)
    fr = torch.tensor(np.stack([features(r, dim) for r in rejected]), dtype=torch.float64)
    w = torch.zeros(dim + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=max_iter, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = bradley_terry_loss(fc @ w, fr @ w)[0] + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        loss = float(bradley_terry_loss(fc @ w, fr @ w)[0] + l2 * (w * w).sum())
    return BTModel(w.detach().numpy().copy(), loss, len(chosen))


def pair_accuracy(model: BTModel, chosen: list, rejected: list) -> float | None:
    """Fraction of pairs where the model scores the chosen response above the rejected one (a tie
    counts as wrong, as bradley_terry_loss's accuracy does); None without pairs."""
    if not chosen:
        return None
    return sum(model.score(c) > model.score(r) for c, r in zip(chosen, rejected)) / len(chosen)


def expected_bt_accuracy(model: BTModel, a: list, b: list, gold_a: list, gold_b: list, tau: float) -> float:
    """The model's expected accuracy on Bradley–Terry labels drawn from the gold reward:
    mean_i [σ(Δg_i/τ) if r(a_i) > r(b_i) else σ(−Δg_i/τ)], Δg = g_a − g_b (a tie of r picks b).
    Comparable with tether.tasks.preference_world.bayes_optimal_accuracy on the same pairs,
    its ceiling: the Bayes rule picks the gold-better response and scores mean max(p, 1 − p)."""
    total = 0.0
    for x, y, gx, gy in zip(a, b, gold_a, gold_b):
        p_a = 1.0 / (1.0 + math.exp(-(gx - gy) / tau))
        total += p_a if model.score(x) > model.score(y) else 1.0 - p_a
    return total / len(a)
