"""tether.objectives.preference: Bradley–Terry, DPO family, KTO, SimPO, ORPO."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.objectives import (
    PREFERENCE_LOSSES,
    PairLogps,
    bradley_terry_loss,
    kto_kl_reference_point,
    kto_loss,
    log1mexp,
    log_odds,
    orpo_loss,
    preference_loss,
    sequence_logps,
    simpo_loss,
)

LN2 = math.log(2)


def t(*x):
    return torch.tensor(x, dtype=torch.float64)


def assert_detached(metrics):
    for k, v in metrics.items():
        assert not (torch.is_tensor(v) and v.requires_grad), k


def test_bradley_terry_values_accuracy_margin():
    rc, rr = t(2.0, 0.0), t(0.0, 1.0)
    loss, m = bradley_terry_loss(rc, rr)
    expect = (-math.log(1 / (1 + math.exp(-2))) - math.log(1 / (1 + math.exp(1)))) / 2
    assert loss.item() == pytest.approx(expect)
    assert m["accuracy"].item() == 0.5 and m["margin"].item() == pytest.approx(0.5)
    loss_m, m2 = bradley_terry_loss(rc, rr, margin=1.0)
    expect_m = (-F.logsigmoid(t(1.0)) - F.logsigmoid(t(-2.0))).item() / 2
    assert loss_m.item() == pytest.approx(expect_m)
    assert m2["margin"].item() == pytest.approx(0.5)  # the metric is the raw reward gap
    loss_m2, _ = bradley_terry_loss(rc, rr, margin=t(1.0, 0.0))
    assert loss_m2.item() == pytest.approx((-F.logsigmoid(t(1.0)) - F.logsigmoid(t(-1.0))).item() / 2)


def dpo_worked_example(beta=1.0, **kw):
    # π/π_ref = 2 on the chosen, 0.5 on the rejected completion.
    ref_c, ref_r = t(-3.0), t(-4.0)
    return preference_loss(ref_c + LN2, ref_r - LN2, ref_c, ref_r, beta, **kw)


def test_dpo_seed_worked_example_probability_is_0_8():
    loss, m = dpo_worked_example()
    # P(y_w ≻ y_l) = σ(β·2 ln 2) = 4/5
    assert math.exp(-loss.item()) == pytest.approx(0.8)
    assert m["rewards/chosen"].item() == pytest.approx(LN2)
    assert m["rewards/rejected"].item() == pytest.approx(-LN2)
    assert m["rewards/margins"].item() == pytest.approx(2 * LN2)
    assert m["rewards/accuracies"].item() == 1.0
    assert m["logps/chosen"].item() == pytest.approx(-3 + LN2)
    loss_half, m_half = dpo_worked_example(beta=0.5)
    assert math.exp(-loss_half.item()) == pytest.approx(2 / 3)  # σ(ln 2)
    assert m_half["rewards/chosen"].item() == pytest.approx(0.5 * LN2)


def test_dpo_variants_hand_values():
    eps = 0.1
    cdpo, _ = dpo_worked_example(label_smoothing=eps)
    assert cdpo.item() == pytest.approx(-(1 - eps) * math.log(0.8) - eps * math.log(0.2))
    robust, _ = dpo_worked_example(loss_type="robust", label_smoothing=eps)
    assert robust.item() == pytest.approx((-(1 - eps) * math.log(0.8) + eps * math.log(0.2)) / (1 - 2 * eps))
    robust0, _ = dpo_worked_example(loss_type="robust")
    assert robust0.item() == pytest.approx(-math.log(0.8))
    hinge, _ = dpo_worked_example(loss_type="hinge")
    assert hinge.item() == 0.0  # βh = 2 ln 2 > 1
    hinge_small, _ = dpo_worked_example(beta=0.25, loss_type="hinge")
    assert hinge_small.item() == pytest.approx(1 - 0.25 * 2 * LN2)
    ipo, _ = dpo_worked_example(beta=0.5, loss_type="ipo")
    assert ipo.item() == pytest.approx((2 * LN2 - 1.0) ** 2)
    with pytest.raises(ValueError):
        dpo_worked_example(loss_type="nope")
    with pytest.raises(ValueError):
        dpo_worked_example(loss_type="robust", label_smoothing=0.5)


def test_dpop_hand_values():
    # β = 0.5, λ = 2. Pair 1: log π(y_w) = −3 below log π_ref(y_w) = −2.5, so the penalty is
    # max(0, −2.5 − (−3)) = 0.5; h = (−3 + 2.5) − (−5 + 4) = 0.5; loss = −log σ(0.5·(0.5 − 2·0.5))
    # = log(1 + e^0.25) = 0.825939. Pair 2: log π(y_w) = −2 above log π_ref(y_w) = −3: penalty
    # max(0, −1) = 0; h = (−2 + 3) − (−4 + 3.5) = 1.5; loss = log(1 + e^−0.75) = 0.386871.
    # Wrong sign of the penalty: pair 1 gives 0.386871; no max(0, ·): pair 2 gives log(1 + e^−1.75)
    # = 0.160224; λ outside β (βh − λ·pen): pair 1 gives log(1 + e^0.75) = 1.136871.
    pair = PairLogps(t(-3.0, -2.0), t(-5.0, -4.0), t(-2.5, -3.0), t(-4.0, -3.5))
    per_pair = PREFERENCE_LOSSES["dpop"](pair, SimpleNamespace(beta=0.5, dpop_lambda=2.0))
    assert per_pair.tolist() == pytest.approx([0.825939, 0.386871], abs=1e-6)
    loss, _ = preference_loss(t(-3.0, -2.0), t(-5.0, -4.0), t(-2.5, -3.0), t(-4.0, -3.5), 0.5,
                              loss_type="dpop", dpop_lambda=2.0)
    assert loss.item() == pytest.approx((0.825939 + 0.386871) / 2, abs=1e-6)


def test_registry_lists_every_loss_type():
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "robust", "hinge", "ipo", "dpop"}


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.5), ("robust", 0.5), ("hinge", 0.1), ("ipo", 0.5)])
def test_gradient_step_raises_chosen_and_lowers_rejected_logps(loss_type, beta):
    g = torch.Generator().manual_seed(0)
    V, T = 6, 5
    logits = torch.nn.Parameter(torch.randn(1, T, V, generator=g, dtype=torch.float64))
    chosen = torch.tensor([[0, 1, 2, 3, 4]])
    rejected = torch.tensor([[0, 1, 5, 5, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    ref_c = sequence_logps(logits, chosen, mask).detach()
    ref_r = sequence_logps(logits, rejected, mask).detach()
    eps = 0.1 if loss_type == "robust" else 0.0
    opt = torch.optim.SGD([logits], lr=0.1)
    loss, _ = preference_loss(sequence_logps(logits, chosen, mask), sequence_logps(logits, rejected, mask),
                              ref_c, ref_r, beta, loss_type=loss_type, label_smoothing=eps)
    loss.backward()
    opt.step()
    with torch.no_grad():
        assert sequence_logps(logits, chosen, mask).item() > ref_c.item()
        assert sequence_logps(logits, rejected, mask).item() < ref_r.item()


def test_dpo_gradient_signs_and_symmetry():
    pc, pr = t(-2.0, -1.0).requires_grad_(), t(-2.5, -0.5).requires_grad_()
    loss, m = preference_loss(pc, pr, t(-2.2, -1.1), t(-2.4, -0.7), 0.3)
    loss.backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()
    assert_detached(m)
    # swapping chosen and rejected maps σ(βh) to σ(−βh)
    swapped, _ = preference_loss(pr.detach(), pc.detach(), t(-2.4, -0.7), t(-2.2, -1.1), 0.3)
    h = (t(-2.0, -1.0) - t(-2.2, -1.1)) - (t(-2.5, -0.5) - t(-2.4, -0.7))
    assert swapped.item() == pytest.approx(-F.logsigmoid(-0.3 * h).mean().item())


def test_kto_hand_values():
    beta, z = 0.5, 0.2
    policy, ref = t(-1.0, -2.0, -1.5), t(-1.5, -1.0, -1.5)
    labels = torch.tensor([True, False, True])
    loss, m = kto_loss(policy, ref, labels, z, beta, desirable_weight=1.0, undesirable_weight=2.0)
    r = (policy - ref).tolist()  # 0.5, -1.0, 0.0
    sig = lambda x: 1 / (1 + math.exp(-x))
    expect = ((1 - sig(beta * (r[0] - z))) + 2.0 * (1 - sig(beta * (z - r[1]))) + (1 - sig(beta * (r[2] - z)))) / 3
    assert loss.item() == pytest.approx(expect)
    assert m["rewards/chosen"].item() == pytest.approx(beta * 0.25)
    assert m["rewards/rejected"].item() == pytest.approx(beta * -1.0)
    assert m["count/chosen"].item() == 2 and m["count/rejected"].item() == 1
    assert m["kl"].item() == pytest.approx(z)
    assert_detached(m)


def test_kto_reference_point_is_clamped_and_detached():
    policy, ref = t(-1.0, -2.0).requires_grad_(), t(-1.2, -1.5)
    labels = torch.tensor([1, 0])
    neg = t(-0.7).requires_grad_()
    loss_neg, m = kto_loss(policy, ref, labels, neg, 1.0)
    loss_zero, _ = kto_loss(policy, ref, labels, 0.0, 1.0)
    assert loss_neg.item() == pytest.approx(loss_zero.item()) and m["kl"].item() == 0.0
    loss_neg.backward()
    assert neg.grad is None
    # desirable examples are pushed up, undesirable down
    assert policy.grad[0] < 0 and policy.grad[1] > 0
    z0 = kto_kl_reference_point(t(-1.0, -3.0), t(-2.0, -1.0))  # mean(1, −2) < 0 → 0
    assert z0.item() == 0.0 and not z0.requires_grad
    assert kto_kl_reference_point(t(-1.0, -1.0), t(-2.0, -1.5)).item() == pytest.approx(0.75)


def test_kto_without_undesirable_examples_has_finite_metrics():
    _, m = kto_loss(t(-1.0), t(-1.0), torch.tensor([True]), 0.0, 0.1)
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in m.values())


def test_simpo_hand_value_and_gradient():
    c, r = t(-0.5, -1.0).requires_grad_(), t(-0.8, -0.6).requires_grad_()
    loss, m = simpo_loss(c, r, beta=2.0, gamma=0.5)
    expect = -F.logsigmoid(2.0 * (t(-0.5, -1.0) - t(-0.8, -0.6)) - 0.5).mean()
    assert loss.item() == pytest.approx(expect.item())
    assert m["rewards/margins"].item() == pytest.approx(2.0 * (0.3 - 0.4) / 2)
    loss.backward()
    assert (c.grad < 0).all() and (r.grad > 0).all()
    ls, _ = simpo_loss(c.detach(), r.detach(), 2.0, 0.5, label_smoothing=0.2)
    z = 2.0 * (t(-0.5, -1.0) - t(-0.8, -0.6)) - 0.5
    assert ls.item() == pytest.approx((-0.8 * F.logsigmoid(z) - 0.2 * F.logsigmoid(-z)).mean().item())


def test_log_odds_matches_naive_and_is_stable_at_the_ends():
    a = torch.linspace(-8, -1e-3, 101, dtype=torch.float64)
    p = a.exp()
    torch.testing.assert_close(log_odds(a), torch.log(p / (1 - p)))
    torch.testing.assert_close(log1mexp(a), torch.log1p(-p))
    extreme = torch.tensor([0.0, -1e-12, -1e-30, -700.0], dtype=torch.float64, requires_grad=True)
    lo = log_odds(extreme)
    assert torch.isfinite(lo).all()
    assert lo[1].item() == pytest.approx(-math.log(1e-12), rel=1e-6)  # log(1/1e-12)
    assert lo[3].item() == pytest.approx(-700.0)  # p → 0: log odds → log p
    lo.sum().backward()
    assert torch.isfinite(extreme.grad).all()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.isfinite(log_odds(torch.tensor([0.0, -1e-8, -50.0], dtype=dtype))).all()


def test_log_odds_gradcheck():
    a = torch.tensor([-5.0, -1.0, -0.7, -0.69, -0.1, -1e-3], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(log_odds, (a,))


def test_orpo_hand_value_metrics_and_gradcheck():
    cw, cl = t(-0.3, -1.2), t(-0.9, -0.4)
    nll = t(0.7, 0.5)
    loss, m = orpo_loss(cw, cl, nll, lam=0.1)
    lo = lambda a: a - math.log(1 - math.exp(a))
    terms = [-math.log(1 / (1 + math.exp(-(lo(w) - lo(l))))) for w, l in [(-0.3, -0.9), (-1.2, -0.4)]]
    assert loss.item() == pytest.approx(0.6 + 0.1 * sum(terms) / 2)
    assert m["or_loss"].item() == pytest.approx(sum(terms) / 2)
    assert m["nll_loss"].item() == pytest.approx(0.6)
    assert m["rewards/accuracies"].item() == 0.5
    assert_detached(m)
    scalar_nll, _ = orpo_loss(cw, cl, 0.6, lam=0.1)
    assert scalar_nll.item() == pytest.approx(loss.item())
    x = torch.stack([cw, cl]).requires_grad_()
    assert torch.autograd.gradcheck(lambda z: orpo_loss(z[0], z[1], nll, 0.1)[0], (x,))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-6, 6), st.floats(-6, 6), st.floats(-6, 6), st.floats(-6, 6)), min_size=1, max_size=6),
       st.floats(0.05, 2.0))
def test_dpo_depends_only_on_h_and_matches_closed_form(rows, beta):
    x = torch.tensor(rows, dtype=torch.float64)
    loss, _ = preference_loss(x[:, 0], x[:, 1], x[:, 2], x[:, 3], beta)
    h = (x[:, 0] - x[:, 2]) - (x[:, 1] - x[:, 3])
    torch.testing.assert_close(loss, torch.log1p(torch.exp(-beta * h)).mean())
    shifted, _ = preference_loss(x[:, 0] + 1.0, x[:, 1] + 1.0, x[:, 2], x[:, 3], beta)
    torch.testing.assert_close(shifted, loss)
