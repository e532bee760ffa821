"""The judges study's synthetic judges against exact values (fast), and the study end to end on a
shrunk world (slow)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tether.feedback.judge import choose, judge_pairs
from tether.studies.judges import (JudgesConfig, conditions, label_stats, run_judges, synthetic_p_first,
                                   world_judge)
from tether.tasks.preference_world import PreferenceWorld


@pytest.fixture(scope="module")
def pairs():
    world = PreferenceWorld()
    rng = random.Random(0)
    prompts = world.prompts(300, seed=2)
    a = [world.write(p, rng) or "the" for p in prompts]
    b = [world.write(p, rng) or "a" for p in prompts]
    return world, prompts, a, b


def test_synthetic_judges_by_hand():
    # gold: σ(Δ/τ); position p=0.75 (w=0.5): ½ + ½σ; verbosity q=0.5: ½·[longer] + ½σ
    s = 1 / (1 + np.exp(-1.0))
    assert synthetic_p_first("gold", 0, [2.0], [1.0], [3], [5]) == pytest.approx([s])
    assert synthetic_p_first("position", 0.75, [2.0], [1.0], [3], [5]) == pytest.approx([0.5 + 0.5 * s])
    assert synthetic_p_first("verbosity", 0.5, [2.0], [1.0], [3], [5]) == pytest.approx([0.5 * s])
    assert synthetic_p_first("verbosity", 0.5, [2.0], [1.0], [5], [5]) == pytest.approx([0.25 + 0.5 * s])
    assert synthetic_p_first("gold", 0, [1.0], [0.0], [1], [1], tau=2.0) == pytest.approx([1 / (1 + np.exp(-0.5))])


def test_position_judge_raw_bias_is_p_and_swap_leaves_the_gold_argmax(pairs):
    world, prompts, a, b = pairs
    gold = judge_pairs(world_judge(world, "gold", 0), prompts, a, b, [[]] * len(a))
    pos = judge_pairs(world_judge(world, "position", 0.7), prompts, a, b, [[]] * len(a))
    assert pos.stats()["position_bias"] == pytest.approx(0.7, abs=1e-12)  # exact: σ(Δ) + σ(−Δ) = 1
    assert gold.stats()["position_bias"] == pytest.approx(0.5, abs=1e-12)
    np.testing.assert_allclose(pos.p, 0.5 + 0.6 * (gold.p - 0.5), atol=1e-12)
    # argmax labels of the swap-debiased position judge are the gold argmax labels, ties included
    assert (choose(pos.p, "argmax", 1) == choose(gold.p, "argmax", 1)).all()
    # raw argmax: the first shown wins unless the second is better by more than log 5 (σ < 1/6)
    g = np.array(world.gold_reward(prompts, a)) - np.array(world.gold_reward(prompts, b))
    assert (choose(pos.p_ab, "argmax", 1) == (g > -np.log(5))).all()


def test_verbosity_judge_is_untouched_by_swapping_and_picks_the_longer(pairs):
    world, prompts, a, b = pairs
    j = judge_pairs(world_judge(world, "verbosity", 0.9), prompts, a, b, [[]] * len(a))
    np.testing.assert_allclose(j.p, j.p_ab, rtol=0, atol=1e-15)  # float rounding of ½(p + 1 − (1 − p))
    picks = choose(j.p, "sample", 1)
    gold = choose(judge_pairs(world_judge(world, "gold", 0), prompts, a, b, [[]] * len(a)).p, "sample", 1)
    s, sg = label_stats(world, prompts, a, b, picks, j), label_stats(world, prompts, a, b, gold, j)
    assert s["chosen_longer"] > sg["chosen_longer"] + 0.1 and s["gold_order_agreement"] < sg["gold_order_agreement"]


def test_label_stats_by_hand():
    world = PreferenceWorld()
    p = "write about animals and weather"
    a, b = ["cat dog", "the"], ["rain", "cat the a"]  # gold 2 vs 1, 0 vs 1; lengths 2 vs 1, 1 vs 3
    j = judge_pairs(world_judge(world, "gold", 0), [p, p], a, b, [[], []])
    s = label_stats(world, [p, p], a, b, np.array([True, True]), j)
    assert (s["gold_order_agreement"], s["chosen_first"], s["chosen_longer"]) == (0.5, 1.0, 0.5)


def test_conditions_cover_raw_and_swapped_position_and_every_q():
    labels = [c["label"] for c in conditions(JudgesConfig(verbosity_q=[0.2, 0.8]))]
    assert labels == ["gold BT", "gold argmax", "position p=0.7 raw", "position p=0.7 swap",
                      "position p=0.7 raw argmax", "position p=0.7 swap argmax", "verbosity q=0.2", "verbosity q=0.8"]


@pytest.mark.slow
def test_study_end_to_end_on_a_shrunk_world(tmp_path):
    s = run_judges(JudgesConfig(runs_dir=str(tmp_path), n_pairs=300, ppo_steps=2, ppo_batch_size=16,
                                verbosity_q=[0.9], publish_dir=str(tmp_path / "pub")))
    j = s["world"]["judges"]
    assert j["position p=0.7 raw"]["labels"]["position_bias"] == pytest.approx(0.7, abs=1e-12)
    assert j["verbosity q=0.9"]["labels"]["max_abs_swap_change"] < 1e-12
    data = tmp_path / "judges" / "data"
    same = [json.loads(x)["chosen"] for x in (data / "labels_position_p0.7_swap_argmax.jsonl").read_text().splitlines()]
    gold = [json.loads(x)["chosen"] for x in (data / "labels_gold_argmax.jsonl").read_text().splitlines()]
    assert same == gold
    assert j["verbosity q=0.9"]["labels"]["chosen_longer"] > j["gold BT"]["labels"]["chosen_longer"]
    for f in ("labels_rm.png", "ppo_position.png", "ppo_verbosity.png", "length.png", "README.md", "summary.json"):
        assert (tmp_path / "pub" / f).is_file()
