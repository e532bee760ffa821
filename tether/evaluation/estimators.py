"""The numbers `tether eval` reports, as pure functions of counts and scores (no model, no torch).

    pass_at_k(n=5, c=2, k=2)              -> 0.7       (Chen et al. 2021, eq. 1)
    mean_pass_at_k([(5, 2), (5, 0)], 2)   -> 0.35      (the mean over problems)
    preference_stats(chosen, rejected)    -> accuracy (ties fail), tie rate, margin statistics
    perplexity(nll_sum, tokens)           -> (token-mean NLL, exp of it)
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from `n` samples of which `c` pass (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1):

        pass@k = E_problems[ 1 − C(n − c, k) / C(n, k) ]

    i.e. the probability that k of the n samples drawn without replacement include a passing one.
    The binomial ratio is evaluated as the product (the paper's numerically stable form, Fig. 3)

        C(n − c, k) / C(n, k) = Π_{i = n − c + 1}^{n} (1 − k / i)

    which never forms the huge binomials. When n − c < k every draw of k holds a pass: 1.0.
    Not c/n for k > 1 (that is pass@1 at every k), nor 1 − (1 − c/n)^k (drawing with replacement,
    biased low: Chen et al. §2.1)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n; got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n (k samples drawn from n); got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """The mean of :func:`pass_at_k` over problems, each given as (n, c) (Chen et al. 2021, eq. 1's
    expectation over problems); NaN for no problems."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    return sum(values) / len(values) if values else float("nan")


def preference_stats(chosen: Sequence[float], rejected: Sequence[float]) -> dict:
    """Pairwise accuracy and margins of per-pair scores (a reward model's rewards, or DPO's implicit
    rewards r = β·(log π(y|x) − log π_ref(y|x)), Rafailov et al. 2023, eq. 5).

    accuracy = (1/N) Σ [r_chosen > r_rejected]: a tie counts as a failure (a model that cannot tell
    the two apart has not ranked them; the same rule as the trainers' `rewards/accuracies`, so
    policy == reference gives 0, not 0.5). `tie_rate` says how many pairs were ties;
    `margin` = mean(r_chosen − r_rejected)."""
    if len(chosen) != len(rejected):
        raise ValueError(f"{len(chosen)} chosen scores for {len(rejected)} rejected")
    n = len(chosen)
    if n == 0:
        return {"pairs": 0}
    margins = [c - r for c, r in zip(chosen, rejected)]
    mean_margin = sum(margins) / n
    both = list(chosen) + list(rejected)
    mean_all = sum(both) / len(both)
    return {"pairs": n,
            "accuracy": sum(m > 0 for m in margins) / n,
            "tie_rate": sum(m == 0 for m in margins) / n,
            "margin": mean_margin,
            "margin_std": math.sqrt(sum((m - mean_margin) ** 2 for m in margins) / n),
            "chosen_mean": sum(chosen) / n,
            "rejected_mean": sum(rejected) / n,
            "reward_std": math.sqrt(sum((x - mean_all) ** 2 for x in both) / len(both))}


def perplexity(nll_sum: float, tokens: int) -> tuple[float, float]:
    """(token-mean NLL, perplexity) over `tokens` target tokens (Jelinek et al. 1977, "Perplexity —
    a measure of the difficulty of speech recognition tasks": PPL = 2^H, H the per-token entropy
    estimate; here in nats):

        NLL = −(1/T) Σ_t log p(x_t | x_<t),      PPL = exp(NLL)

    the sums over the T target tokens of every sequence together (a token mean, not a mean of
    per-sequence perplexities), the SFT loss's aggregation."""
    if tokens <= 0:
        return float("nan"), float("nan")
    nll = nll_sum / tokens
    return nll, math.exp(nll)
