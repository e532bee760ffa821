"""The gold-reward studies reach their targets (slow: the full default studies, ~1.5 min + ~3 min)."""
import pytest

from tether.studies.frontier import FrontierConfig, frontier_gold_at, run_frontier, upper_envelope
from tether.studies.overoptimization import OveroptimizationConfig, run_overoptimization


def test_frontier_interpolation_and_envelope():
    env = upper_envelope([(0.0, 1.0), (2.0, 3.0), (1.0, 0.5), (4.0, 2.0)])
    assert env == [(0.0, 1.0), (2.0, 3.0)]
    assert frontier_gold_at(env, 1.0) == pytest.approx(2.0)
    assert frontier_gold_at(env, 5.0) == 3.0


@pytest.mark.slow
def test_overoptimization_and_frontier_targets(tmp_path):
    s = run_overoptimization(OveroptimizationConfig(runs_dir=str(tmp_path)))
    low, high = s["ppo"]["0.001"], s["ppo"]["0.1"]
    # very low β: the proxy keeps rising while gold peaks and then falls below where it started
    assert low["proxy_final_gain"] >= low["proxy_max_gain"] - 0.2
    assert low["gold_final_gain"] < low["gold_peak_gain"] - 2.0 and low["gold_final_gain"] < 0
    # a real KL leash holds gold near its peak at a far smaller KL
    assert high["gold_final_gain"] > 1.0 and high["final_kl"] < low["final_kl"] / 5
    assert s["bon"]["fit_gold"]["r2"] >= 0.9 and s["bon"]["fit_proxy"]["r2"] >= 0.9
    f = run_frontier(FrontierConfig(runs_dir=str(tmp_path)))
    for m, r in f["methods"].items():
        if m != "PPO":
            assert r["raises_gold_every_beta"], m
