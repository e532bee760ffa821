"""The labeler's Bradley–Terry model (tether/studio/labeler_bt.py) on the gold-reward world: fitted
on the first n writer pairs labelled by the gold order (ties left out), its expected accuracy on 500
test-split pairs under BT labels (τ = 1) next to the Bayes-optimal accuracy on the same pairs.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studio_labeler.py
"""

from __future__ import annotations

import argparse
import time

from tether.studio.labeler_bt import expected_bt_accuracy, fit_bt
from tether.studio.labeler_store import WorldPairs
from tether.tasks.preference_world import bayes_optimal_accuracy


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    src = WorldPairs(seed=0)
    test = [src.pair(i, split="test") for i in range(500)]
    a, b = [p["a"] for p in test], [p["b"] for p in test]
    ga, gb = [p["gold_a"] for p in test], [p["gold_b"] for p in test]
    print(f"Bayes-optimal accuracy on the 500 test pairs: {bayes_optimal_accuracy(ga, gb, 1.0):.4f}")
    for n in (10, 20, 40, 100, 400):
        chosen, rejected = [], []
        for p in (src.pair(i) for i in range(n)):
            if p["gold_a"] != p["gold_b"]:
                win = p["gold_a"] > p["gold_b"]
                chosen.append(p["a"] if win else p["b"])
                rejected.append(p["b"] if win else p["a"])
        t = time.perf_counter()
        model = fit_bt(chosen, rejected)
        dt = time.perf_counter() - t
        print(f"{n:4d} pairs ({len(chosen)} not tied): expected accuracy "
              f"{expected_bt_accuracy(model, a, b, ga, gb, 1.0):.4f}, fit {dt:.3f} s")


if __name__ == "__main__":
    main()
