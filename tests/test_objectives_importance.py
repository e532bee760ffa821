"""Off-policy correction (tether.objectives.importance): TIS and MIS, token and sequence level, by
hand-computed values, and as the policy loss's option."""
import math

import pytest
import torch

from tether.objectives import IS_CORRECTIONS, importance_weights, is_metrics, policy_loss

E = math.exp
# π_old (trainer) and μ (sampler) log-probs of two completions; row 1 has 2 tokens (+ padding)
OLD = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
MU = torch.tensor([[0.0, -1.5, -1.0], [-1.5, -0.7, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])
# log ρ = [[0, 0.5, -1], [1.0, 0.2, (pad)]]


def test_truncated_is_token_level_by_hand():
    c = importance_weights("tis", OLD, MU, MASK, "token", cap=1.5)
    want = [[1.0, 1.5, E(-1)], [1.5, E(0.2), 0.0]]  # e^0.5 = 1.649 and e^1 = 2.718 cut to 1.5
    for got, exp in zip(c.weights.tolist(), want):
        assert got == pytest.approx(exp, rel=1e-6)
    assert c.capped.tolist() == [[False, True, False], [True, False, False]]


def test_masked_is_token_level_by_hand():
    c = importance_weights("mis", OLD, MU, MASK, "token", cap=1.5)
    want = [[1.0, 0.0, E(-1)], [0.0, E(0.2), 0.0]]  # ratios above the cap rejected, the rest kept whole
    for got, exp in zip(c.weights.tolist(), want):
        assert got == pytest.approx(exp, rel=1e-6)
    assert c.capped.tolist() == [[False, True, False], [True, False, False]]


def test_sequence_level_by_hand():
    # row 0: Σ log ρ = -0.5 -> ρ = e^-0.5 (under any cap > 0.61); row 1: Σ = 1.2 -> e^1.2 = 3.32
    tis = importance_weights("tis", OLD, MU, MASK, "sequence", cap=2.0)
    mis = importance_weights("mis", OLD, MU, MASK, "sequence", cap=2.0)
    assert tis.weights[0].tolist() == pytest.approx([E(-0.5)] * 3, rel=1e-6)
    assert tis.weights[1].tolist() == pytest.approx([2.0, 2.0, 0.0])
    assert mis.weights[0].tolist() == pytest.approx([E(-0.5)] * 3, rel=1e-6)
    assert mis.weights[1].tolist() == [0.0, 0.0, 0.0]  # the whole sequence rejected
    assert tis.capped.tolist() == mis.capped.tolist() == [[False] * 3, [True, True, False]]


def test_far_off_sequence_does_not_overflow():
    # Σ log ρ = 200 overflows float32's exp: TIS gives the cap, MIS a clean 0 (never NaN)
    old, mu, mask = torch.zeros(1, 4), torch.full((1, 4), -50.0), torch.ones(1, 4, dtype=torch.bool)
    assert importance_weights("tis", old, mu, mask, "sequence", 3.0).weights.tolist() == [[3.0] * 4]
    assert importance_weights("mis", old, mu, mask, "sequence", 3.0).weights.tolist() == [[0.0] * 4]


def test_metrics_by_hand():
    c = importance_weights("tis", OLD, MU, MASK, "token", cap=1.5)
    m = is_metrics("tis", c, MASK)
    assert float(m["is_weight/mean"]) == pytest.approx((1 + 1.5 + E(-1) + 1.5 + E(0.2)) / 5, rel=1e-6)
    assert float(m["is_weight/max"]) == pytest.approx(1.5)
    assert float(m["is_weight/frac_truncated"]) == pytest.approx(2 / 5)
    m = is_metrics("mis", importance_weights("mis", OLD, MU, MASK, "token", cap=1.5), MASK)
    assert float(m["is_weight/max"]) == pytest.approx(E(0.2), rel=1e-6)
    assert float(m["is_weight/frac_masked"]) == pytest.approx(2 / 5)


def test_registry_and_bad_options():
    assert set(IS_CORRECTIONS) == {"tis", "mis"}
    with pytest.raises(ValueError, match="is_level"):
        importance_weights("tis", OLD, MU, MASK, "sentence")
    with pytest.raises(ValueError, match="is_correction"):
        importance_weights("tris", OLD, MU, MASK)
    with pytest.raises(ValueError, match="behavior_logps"):
        policy_loss(OLD, OLD, torch.ones(2), MASK, is_correction="tis")


@pytest.mark.parametrize("name", ["tis", "mis"])
def test_policy_loss_option_weights_the_advantage(name):
    # logps = π_old: ratio 1, no clip; token-mean loss = −Σ w_t A_t / 5 tokens, A = (+1, −2) per row
    logps = OLD.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, m = policy_loss(logps, OLD, adv, MASK, behavior_logps=MU, is_correction=name, is_cap=1.5)
    w = [[1.0, 1.5, E(-1)], [1.5, E(0.2)]] if name == "tis" else [[1.0, 0.0, E(-1)], [0.0, E(0.2)]]
    want = -(sum(w[0]) * 1.0 + sum(w[1]) * -2.0) / 5
    assert loss.item() == pytest.approx(want, rel=1e-6)
    # d loss / d log π_t = −w_t A_t / 5 (ratio 1): the weight reaches the gradient, detached itself
    loss.backward()
    assert logps.grad[0].tolist() == pytest.approx([-x / 5 for x in w[0]], rel=1e-6)
    assert logps.grad[1, :2].tolist() == pytest.approx([2 * x / 5 for x in w[1]], rel=1e-6)
    assert "is_weight/mean" in m and float(m["ratio/mean"]) == pytest.approx(1.0)


def test_policy_loss_without_correction_is_unchanged():
    logps = OLD + 0.1
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    a, ma = policy_loss(logps, OLD, adv, MASK)
    b, mb = policy_loss(logps, OLD, adv, MASK, behavior_logps=MU, is_correction="none")
    assert float(a) == float(b) and set(ma) == set(mb) and not any(k.startswith("is_") for k in ma)
