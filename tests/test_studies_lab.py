"""Instruments of the gold-reward studies: the exact best-of-n average and the Gao et al. fits."""
import itertools
import math

import numpy as np
import pytest

from tether.studies.lab import best_of_n_curve, fit_bon, fit_rl


def test_best_of_n_curve_equals_brute_force_over_subsets():
    rng = np.random.default_rng(0)
    proxy = rng.normal(size=(3, 7))
    gold = rng.normal(size=(3, 7))
    for n in (1, 2, 3, 7):
        want_g, want_p = [], []
        for p in range(3):
            subsets = list(itertools.combinations(range(7), n))
            best = [max(s, key=lambda j: proxy[p, j]) for s in subsets]
            want_g.append(np.mean([gold[p, j] for j in best]))
            want_p.append(np.mean([proxy[p, j] for j in best]))
        got = best_of_n_curve(proxy, gold, [n])[n]
        assert got["gold"] == pytest.approx(np.mean(want_g), abs=1e-12)
        assert got["proxy"] == pytest.approx(np.mean(want_p), abs=1e-12)
        assert got["kl"] == pytest.approx(math.log(n) - (n - 1) / n)
    # n = 1 is the plain mean; n = K the per-prompt max of the proxy
    c = best_of_n_curve(proxy, gold, [1, 7])
    assert c[1]["gold"] == pytest.approx(gold.mean())
    assert c[7]["proxy"] == pytest.approx(proxy.max(1).mean())


def test_fits_recover_known_coefficients():
    d = np.linspace(0.1, 3, 30)
    f = fit_bon(d, d * (2.0 - 0.5 * d))
    assert (f["alpha"], f["beta"], f["r2"]) == pytest.approx((2.0, 0.5, 1.0))
    g = fit_rl(d, d * (1.5 - 0.7 * np.log(d)))
    assert (g["alpha"], g["beta"], g["r2"]) == pytest.approx((1.5, 0.7, 1.0))
    noisy = fit_bon(d, d * (2.0 - 0.5 * d) + np.random.default_rng(0).normal(0, 0.5, d.size))
    assert noisy["r2"] < 0.99  # R² is a real goodness of fit, not a constant
