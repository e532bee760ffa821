"""The gold-reward preference world: gold by hand, BT labels, Bayes accuracy, the spurious feature."""
import math

import numpy as np
import pytest

from tether.errors import UserError
from tether.studies.world import build_sft_policy, sample_completions
from tether.tasks.preference_world import PreferenceWorld, bayes_optimal_accuracy, gold_reward, label_pairs

P = "write about animals and weather"


def test_gold_reward_hand_checked():
    w = PreferenceWorld()
    cases = {
        "cat dog rain": 3.0,                       # 3 distinct topic words
        "the cat is very nice": 1.0 - 0.5,         # 'nice' is outside the vocabulary: off-topic
        "cat cat cat": 1.0 - 0.5 * 2,              # two repetitions
        "cat guitar": 1.0 - 0.5,                   # music is not asked for
        "": 0.0,
        " ".join(["the"] * 15): -1.0 * 3,          # 3 words past L* = 12
    }
    for text, g in cases.items():
        assert w.gold_reward([P], [text]) == [pytest.approx(g)], text
    assert gold_reward([P], ["cat dog rain"]) == [3.0]  # module-level spec of the default world
    with pytest.raises(UserError):
        w.gold_reward(["tell me a joke"], ["cat"])


def test_gold_falls_when_the_spurious_feature_is_pushed_past_the_data():
    w = PreferenceWorld()
    topic = ["cat", "dog", "horse", "bird", "fish", "cow", "rain", "snow", "wind", "cloud", "storm", "sun"]
    golds = [w.gold_reward([P], [" ".join((topic * 2)[:L])])[0] for L in range(4, 25)]
    lengths = list(range(4, 25))
    assert golds[lengths.index(12)] == max(golds) == 12.0
    tail = golds[lengths.index(12):]
    assert all(b < a for a, b in zip(tail, tail[1:]))  # strictly falling past L*
    assert golds[-1] < golds[0]  # 24 words are worse than 4 good ones


def test_writer_never_triggers_a_penalty_and_length_correlates_with_gold():
    w = PreferenceWorld()
    rows = w.sft_rows(3000, seed=1)
    parts = [w.gold_parts(r["prompt"], r["completion"]) for r in rows]
    assert all(p["rep"] == p["off"] == 0 and 1 <= p["length"] <= w.optimal_length for p in parts)
    s = w.spurious_feature([r["completion"] for r in rows])
    assert np.corrcoef(s, [p["gold"] for p in parts])[0, 1] > 0.5
    assert len(set(r["completion"] for r in rows)) > 2500  # plenty of entropy


def test_tokenizer_and_prompts():
    w = PreferenceWorld()
    tok = w.tokenizer()
    assert 50 <= len(tok) <= 200
    text = "cat the rain very storm"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == 5 and tok.unk_token_id not in ids and tok.decode(ids) == text
    train, test = w.prompts(None, "train"), w.prompts(None, "test")
    assert len(train) + len(test) == 56 and not set(train) & set(test)
    many = w.prompts(42 * 3, "train", seed=4)
    assert all(many.count(p) == 3 for p in train)  # whole passes: every prompt equally often
    assert w.prompts(10, "train", seed=4) == w.prompts(10, "train", seed=4)


def test_bayes_optimal_accuracy_hand_checked():
    sig = lambda z: 1 / (1 + math.exp(-z))
    assert bayes_optimal_accuracy([1.0, 0.0], [0.0, 0.0], 1.0) == pytest.approx((sig(1) + 0.5) / 2)
    assert bayes_optimal_accuracy([0.0], [3.0], 2.0) == pytest.approx(sig(1.5))  # order-free
    assert bayes_optimal_accuracy([5.0], [0.0], 1e-3) == pytest.approx(1.0)


def test_labels_are_bradley_terry_draws_at_the_documented_temperature():
    w = PreferenceWorld(temperature=2.0)
    n = 20000
    rows = label_pairs(w, [P] * n, ["cat dog rain"] * n, ["cat"] * n, seed=0)  # gold 3 vs 1
    frac = np.mean([r["chosen"] == "cat dog rain" for r in rows])
    p = 1 / (1 + math.exp(-(3 - 1) / 2.0))
    assert abs(frac - p) < 0.015
    assert rows[0].keys() >= {"prompt", "chosen", "rejected", "gold_chosen", "gold_rejected", "label_prob"}
    r = rows[0]
    assert r["label_prob"] == pytest.approx(p if r["chosen"] == "cat dog rain" else 1 - p)


@pytest.fixture(scope="module")
def quick_policy(tmp_path_factory):
    # A short build (the default is 600 steps); enough to check the plumbing and the correlation.
    return build_sft_policy(tmp_path_factory.mktemp("world"), steps=150, n_rows=6000)


def test_sft_policy_samples_keep_the_spurious_correlation(quick_policy):
    from tether.models import load_model, load_tokenizer
    w = PreferenceWorld()
    tok, model = load_tokenizer(str(quick_policy)), load_model(str(quick_policy), dtype="fp32", device="cpu")
    prompts = w.prompts(600, "test", seed=0)
    texts = sample_completions(w, model, tok, prompts, seed=0)
    gold, s = w.gold_reward(prompts, texts), w.spurious_feature(texts)
    assert np.corrcoef(s, gold)[0, 1] > 0.3
    assert np.mean(gold) > 1.0  # it writes about the asked topics (random words would score < 0)
    assert max(s) <= w.max_new_tokens
