"""tether.objectives.policy: KL estimators, clipped surrogate (PPO/DAPO/GSPO), value loss,
KL-shaped rewards, KL controllers, best-of-n KL."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.objectives import (
    KL_ESTIMATORS,
    SURROGATES,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    best_of_n_kl,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
    policy_loss,
    value_loss,
)

SETTINGS = settings(max_examples=40, deadline=None)
LN4 = math.log(4.0)


def t(*x):
    return torch.tensor(x, dtype=torch.float64)


# ---- KL estimators ----------------------------------------------------------------------------

def test_kl_estimators_hand_values():
    lp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    torch.testing.assert_close(kl_k1(lp, ref), t(0.5, -1.0))
    torch.testing.assert_close(kl_k2(lp, ref), t(0.125, 0.5))
    # Δ = ref − logp = (−0.5, 1.0)
    torch.testing.assert_close(kl_k3(lp, ref), t(math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1))
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


@SETTINGS
@given(st.lists(st.tuples(st.floats(-20, 0), st.floats(-20, 0)), min_size=1, max_size=10))
def test_k3_nonnegative_and_zero_when_equal(pairs):
    x = torch.tensor(pairs, dtype=torch.float64)
    assert (kl_k3(x[:, 0], x[:, 1]) >= 0).all()
    assert (kl_k2(x[:, 0], x[:, 1]) >= 0).all()
    assert torch.all(kl_k3(x[:, 0], x[:, 0]) == 0)


def test_k1_and_k3_are_unbiased_for_kl_pi_ref_under_samples_from_pi():
    # Exact expectation over a categorical π: Σ_x π(x) k(x) must equal KL(π ‖ π_ref).
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    kl = (logp.exp() * (logp - ref)).sum()
    for k in (kl_k1, kl_k3):
        torch.testing.assert_close((logp.exp() * k(logp, ref)).sum(), kl)
    # a flipped Δ (estimating KL(π_ref ‖ π)) would not match
    assert not torch.allclose((logp.exp() * kl_k3(ref, logp)).sum(), kl)


# ---- clipped surrogate ------------------------------------------------------------------------

def one_token(ratio, adv, **kw):
    lp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(1, 1, dtype=torch.float64), t(adv), torch.ones(1, 1), **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad.item(), m


def test_ppo_seed_example_ratio_4_is_clipped_to_1_2_for_positive_advantage():
    loss, grad, m = one_token(4.0, 2.0, clip_low=0.2)
    assert loss == pytest.approx(-1.2 * 2.0)  # objective contribution 1.2·A
    assert grad == 0.0  # flat beyond 1 + ε
    assert m["clip_ratio/high_mean"].item() == 1.0 and m["clip_ratio/low_mean"].item() == 0.0
    # A < 0 at ratio 4: the pessimistic min keeps the unclipped 4·A, and the gradient is live
    loss, grad, m = one_token(4.0, -2.0, clip_low=0.2)
    assert loss == pytest.approx(4.0 * 2.0) and grad == pytest.approx(4.0 * 2.0)
    assert m["clip_ratio/region_mean"].item() == 0.0


def test_flat_beyond_the_low_edge_for_negative_advantage():
    loss, grad, m = one_token(0.25, -1.0, clip_low=0.2)
    assert loss == pytest.approx(0.8) and grad == 0.0
    assert m["clip_ratio/low_mean"].item() == 1.0 and m["clip_ratio/region_mean"].item() == 1.0
    loss, grad, _ = one_token(0.25, 1.0, clip_low=0.2)
    assert loss == pytest.approx(-0.25) and grad == pytest.approx(-0.25)
    # inside the trust region: loss −r·A, gradient −r·A
    loss, grad, _ = one_token(1.1, 3.0)
    assert loss == pytest.approx(-3.3) and grad == pytest.approx(-3.3)


def test_dapo_asymmetric_clip_high():
    loss, grad, _ = one_token(4.0, 1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    loss, _, _ = one_token(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.25)  # inside [0.8, 1.28]: not clipped
    loss, _, _ = one_token(0.5, -1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(0.8)  # the low edge still uses clip_low


def test_clip_metrics_and_approx_kl():
    lp = torch.log(t(4.0, 4.0, 0.5, 0.5, 1.0, 9.0)).reshape(2, 3)
    adv = t(1.0, -1.0, -1.0, 1.0, 1.0, 1.0).reshape(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, m = policy_loss(lp, torch.zeros(2, 3, dtype=torch.float64), adv, mask)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert m["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert m["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    expect = 0.5 * (2 * LN4 ** 2 + 2 * math.log(0.5) ** 2) / 5
    assert m["approx_kl"].item() == pytest.approx(expect)
    # the spec lists `kl` among policy_loss's metrics: always present, 0 without a reference
    assert m["kl"].item() == 0.0
    assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "kl", "approx_kl"} <= set(m)
    for v in m.values():
        assert not v.requires_grad


def test_agg_modes_hand_values():
    # with ratio 1 (logps == old) the per-token loss is −A
    adv = t(1.0, 0.0, 0.0, 2.0, 4.0, 6.0).reshape(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    z = torch.zeros(2, 3, dtype=torch.float64)
    loss = lambda agg, **kw: policy_loss(z, z, adv, mask, agg=agg, **kw)[0].item()
    assert loss("token-mean") == pytest.approx(-(1 + 2 + 4 + 6) / 4)
    assert loss("seq-mean-token-mean") == pytest.approx(-(1 + 4) / 2)
    assert loss("seq-mean-token-sum-norm") == pytest.approx(-13 / (2 * 3))
    assert loss("seq-mean-token-sum-norm", norm_length=10) == pytest.approx(-13 / (2 * 10))
    with pytest.raises(ValueError):
        loss("mean")


def test_per_sequence_advantages_broadcast_like_per_token():
    g = torch.Generator().manual_seed(1)
    lp, old = torch.randn(3, 4, generator=g) * 0.3, torch.randn(3, 4, generator=g) * 0.3
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    a = torch.tensor([0.5, -1.0, 2.0])
    for level in ("token", "sequence"):
        l1, _ = policy_loss(lp, old, a, mask, importance_level=level)
        l2, _ = policy_loss(lp, old, a.unsqueeze(1).expand(3, 4), mask, importance_level=level)
        torch.testing.assert_close(l1, l2)


def test_kl_penalty_in_loss_adds_beta_times_estimator():
    g = torch.Generator().manual_seed(2)
    lp, old, ref = (torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.2 - 1 for _ in range(3))
    adv = t(1.0, -0.5)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    base, m0 = policy_loss(lp, old, adv, mask, ref_logps=ref, beta=0.0)
    for est in ("k1", "k2", "k3"):
        with_kl, m = policy_loss(lp, old, adv, mask, ref_logps=ref, beta=0.1, kl_estimator=est)
        kl = (KL_ESTIMATORS[est](lp, ref) * mask).sum() / mask.sum()
        torch.testing.assert_close(with_kl, base + 0.1 * kl)
        torch.testing.assert_close(m["kl"], kl)
        torch.testing.assert_close(m["pg_loss"], base)
    assert "kl" in m0  # reported even with β = 0


def test_gspo_sequence_ratio_value_and_gradient():
    g = torch.Generator().manual_seed(3)
    lp = (torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.05 - 1).requires_grad_()
    old = lp.detach() + torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.05
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv = t(1.5, -0.7)
    loss, m = policy_loss(lp, old, adv, mask, clip_low=10.0, agg="seq-mean-token-mean", importance_level="sequence")
    # sequence-level GSPO: s_i = exp(mean_t (log π − log π_old)), J = mean_i s_i A_i
    s = torch.exp(((lp - old) * mask).sum(1) / mask.sum(1))
    ref_loss = -(s * adv).mean()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(m["ratio/mean"], ((s.unsqueeze(1) * mask).sum() / mask.sum()).detach())
    (g1,) = torch.autograd.grad(loss, lp)
    (g2,) = torch.autograd.grad(ref_loss, lp)
    torch.testing.assert_close(g1, g2)


def test_gspo_clips_whole_sequences():
    # One sequence with s = e^{0.1} ≈ 1.105 > 1 + 3e-4 and A > 0: every token clipped, zero gradient.
    lp = torch.tensor([[0.0, 0.2, 0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.1]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1]])
    loss, m = policy_loss(lp, old, t(1.0), mask, clip_low=3e-4, clip_high=4e-4, importance_level="sequence")
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert m["clip_ratio/high_mean"].item() == 1.0
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.all(grad == 0)


# Hand-computed loss and gradient of every `importance_level` in SURROGATES on one batch; a registry
# entry without a row here fails the test below. Batch: old log-probs 0, so log π = Δ = log-ratio;
# row 1 Δ = (0.3, −0.1, 0.0), A = +1, 3 tokens; row 2 Δ = (−0.5, 0.1), A = −2, 2 tokens (+1 padding);
# ε_low = ε_high = 0.2; agg seq-mean-token-mean: loss = (row 1 mean + row 2 mean) / 2 and each row's
# token gradients carry 1/2 · 1/|y_i|.
SURROGATE_LP = [[0.3, -0.1, 0.0], [-0.5, 0.1, 0.0]]
SURROGATE_ADV, SURROGATE_MASK = (1.0, -2.0), [[1, 1, 1], [1, 1, 0]]
e = math.exp
SURROGATE_HAND = {
    # PPO per token, r = e^Δ. Row 1 (A = 1): r = (e^.3 = 1.3499 → clipped to 1.2, e^−.1, 1): row mean
    # −(1.2 + e^−.1 + 1)/3. Row 2 (A = −2): r = (e^−.5 = 0.6065 → the min keeps the clipped 0.8·A,
    # e^.1): row mean (2·0.8 + 2e^.1)/2. Gradient −A·r/(2|y|) where unclipped, 0 where clipped.
    "token": ((-(1.2 + e(-0.1) + 1.0) / 3 + (1.6 + 2 * e(0.1)) / 2) / 2,
              [[0.0, -e(-0.1) / 6, -1.0 / 6], [0.0, 2 * e(0.1) / 4, 0.0]]),
    # GSPO-token: s_1 = e^{(0.3 − 0.1 + 0)/3} = e^{0.2/3} = 1.0689, s_2 = e^{(−0.5 + 0.1)/2} = e^−.2 =
    # 0.8187, both inside [0.8, 1.2]: row means −s_1 and 2 s_2; gradient −A s_i/(2|y_i|) on every token.
    "sequence": ((-e(0.2 / 3) + 2 * e(-0.2)) / 2,
                 [[-e(0.2 / 3) / 6] * 3, [2 * e(-0.2) / 4] * 2 + [0.0]]),
    # GMPO: clip each Δ in log space first, on the side A's sign makes binding, then the geometric
    # mean. Row 1 (A > 0): min(Δ, clip(Δ, −.2, .2)) = (0.2, −0.1, 0.0) → s_1 = e^{0.1/3} = 1.033895
    # (not the arithmetic mean of clipped ratios (1.2 + e^−.1 + 1)/3 = 1.034946, not GSPO's
    # unclipped e^{0.2/3} = 1.068939). Row 2 (A < 0): max(Δ, clip) = (−0.2, 0.1) → s_2 = e^{−0.1/2} =
    # 0.951229 (clipping at 1 − ε = 0.8 in ratio space would give e^{(ln 0.8 + 0.1)/2} = 0.940285).
    # Row losses −A s: −s_1, 2 s_2. Gradient −A s_i/(2|y_i|) on unclipped tokens: −s_1/6 on row 1's
    # tokens 2-3, 2 s_2/4 on row 2's token 2; 0 on the clipped tokens 1 of each row.
    "gmpo": ((-e(0.1 / 3) + 2 * e(-0.05)) / 2,
             [[0.0, -e(0.1 / 3) / 6, -e(0.1 / 3) / 6], [0.0, 2 * e(-0.05) / 4, 0.0]]),
}


def test_every_surrogate_has_hand_values():
    assert set(SURROGATE_HAND) == set(SURROGATES)


@pytest.mark.parametrize("level", sorted(SURROGATE_HAND))
def test_surrogate_hand_values(level):
    lp = torch.tensor(SURROGATE_LP, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(2, 3, dtype=torch.float64), t(*SURROGATE_ADV),
                          torch.tensor(SURROGATE_MASK), clip_low=0.2, agg="seq-mean-token-mean",
                          importance_level=level)
    want_loss, want_grad = SURROGATE_HAND[level]
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_gradcheck(level, agg):
    g = torch.Generator().manual_seed(4)
    lp = (torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.1 - 1).requires_grad_()
    old = lp.detach() + t(0.05, -0.3, 0.5, 0.0, 0.02, -0.6).reshape(2, 3)  # mix of clipped/unclipped
    ref = lp.detach() + 0.2
    adv = t(0.7, -1.3, 0.4, -0.2, 1.0, 0.3).reshape(2, 3)
    if level == "sequence":
        # GSPO-token's gradient is the derivative of the loss's value only when A is constant
        # within a sequence (documented); per-token A is checked in the test below instead.
        adv = t(0.7, -1.3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    fn = lambda x: policy_loss(x, old, adv, mask, agg=agg, ref_logps=ref, beta=0.05, importance_level=level)[0]
    assert torch.autograd.gradcheck(fn, (lp,))


def test_gspo_token_form_gradient_with_per_token_advantages():
    # s_{i,t} = sg[s_i] · π_t / sg[π_t]: d loss / d log π_t = −sg[s_i] · A_{i,t} / N (token-mean,
    # unclipped), i.e. every token is weighted by its sequence's ratio and its own advantage.
    lp = torch.tensor([[-1.0, -0.8, -1.2]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.05, -0.8, -1.1]], dtype=torch.float64)
    adv = t(0.5, -2.0, 1.0).unsqueeze(0)
    loss, _ = policy_loss(lp, old, adv, torch.ones(1, 3), clip_low=10.0, importance_level="sequence")
    s = math.exp((0.05 + 0.0 - 0.1) / 3)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, -s * adv / 3)
    assert loss.item() == pytest.approx(-s * (0.5 - 2.0 + 1.0) / 3)


@SETTINGS
@given(B=st.integers(1, 4), L=st.integers(1, 5), extra=st.integers(0, 3), seed=st.integers(0, 2**16),
       level=st.sampled_from(["token", "sequence"]))
def test_aggregation_modes_agree_when_all_lengths_equal(B, L, extra, seed, level):
    g = torch.Generator().manual_seed(seed)
    T = L + extra
    lp, old = (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 for _ in range(2))
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T)
    mask[:, :L] = 1
    f = lambda agg: policy_loss(lp, old, adv, mask, agg=agg, importance_level=level)[0]
    torch.testing.assert_close(f("token-mean"), f("seq-mean-token-mean"))
    # documented constant: token-mean = (C / L) · seq-mean-token-sum-norm, C = T by default
    torch.testing.assert_close(f("token-mean"), f("seq-mean-token-sum-norm") * T / L)


@SETTINGS
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(lambda x: max(x) > 0),
       pad=st.integers(1, 3), seed=st.integers(0, 2**16),
       agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
       level=st.sampled_from(["token", "sequence"]), per_token_adv=st.booleans())
def test_padding_never_changes_policy_or_value_loss(lengths, pad, seed, agg, level, per_token_adv):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    rnd = lambda n: torch.randn(B, n, generator=g, dtype=torch.float64)
    lp, old, ref = (rnd(T) * 0.3 - 1).requires_grad_(), rnd(T) * 0.3 - 1, rnd(T) * 0.3 - 1
    adv = rnd(T) if per_token_adv else torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)
    kw = dict(agg=agg, importance_level=level, ref_logps=ref, beta=0.1, norm_length=7)

    def padded(x, fill):
        junk = torch.randn(B, pad, generator=g, dtype=torch.float64) * 30
        junk[:, 0] = fill
        return torch.cat([x, junk], 1)

    nan = float("nan")
    loss, m = policy_loss(lp, old, adv, mask, **kw)
    lp_p = padded(lp.detach(), nan).requires_grad_()
    mask_p = torch.cat([mask, torch.zeros(B, pad, dtype=torch.bool)], 1)
    adv_p = padded(adv, nan) if per_token_adv else adv
    loss_p, m_p = policy_loss(lp_p, padded(old, 1e4), adv_p, mask_p, **{**kw, "ref_logps": padded(ref, nan)})
    torch.testing.assert_close(loss_p, loss)
    for k in m:
        torch.testing.assert_close(m_p[k], m[k])
    (g0,) = torch.autograd.grad(loss, lp)
    (gp,) = torch.autograd.grad(loss_p, lp_p)
    torch.testing.assert_close(gp[:, :T], g0)
    assert torch.all(gp[:, T:] == 0)
    v, ov, R = rnd(T), rnd(T), rnd(T)
    vl, vm = value_loss(v, ov, R, mask, clip=0.3)
    vl_p, vm_p = value_loss(padded(v, nan), padded(ov, 5.0), padded(R, nan), mask_p, clip=0.3)
    torch.testing.assert_close(vl_p, vl)
    torch.testing.assert_close(vm_p["clipfrac"], vm["clipfrac"])


# ---- value loss, shaped rewards, controllers ------------------------------------------------------

def test_value_loss_hand_values():
    v, old, R = t(1.5, 1.0).unsqueeze(0), t(1.0, 1.0).unsqueeze(0), t(2.0, 0.0).unsqueeze(0)
    mask = torch.ones(1, 2)
    loss, m = value_loss(v, old, R, mask, clip=0.2)
    # token 0: unclipped (−0.5)² = 0.25, clipped V = 1.2 → 0.64 (max); token 1: (1.0)² both
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    noclip, m2 = value_loss(v, old, R, mask, clip=None)
    assert noclip.item() == pytest.approx(0.5 * (0.25 + 1.0) / 2) and m2["clipfrac"].item() == 0.0
    vv = v.clone().requires_grad_()
    (grad,) = torch.autograd.grad(value_loss(vv, old, R, mask, clip=0.2)[0], vv)
    assert grad[0, 0].item() == 0.0  # the clipped branch wins: no gradient past the clip
    assert torch.autograd.gradcheck(lambda x: value_loss(x, old, R + 0.05, mask, clip=0.2)[0],
                                    (t(1.3, 1.05).unsqueeze(0).requires_grad_(),))


def test_value_clipfrac_counts_only_where_the_clip_acts():
    """Inside the clip range V_old + (V − V_old) is V only up to rounding (V_old much smaller than
    V: 5 % of these float32 tokens round off), so the 'clipped' term can come out one ulp larger
    where nothing is clipped; those tokens are no clip (before: 0.33 % counted here, and 1 vs 2
    processes logged 0.070 vs 0.039 for the same loss). Past the range every token is counted
    where the clipped term is the larger."""
    g = torch.Generator().manual_seed(0)
    n = 100_000
    old, v = (torch.rand(n, generator=g) - 0.5) * 0.01, (torch.rand(n, generator=g) - 0.5) * 0.3
    R = (torch.rand(n, generator=g) - 0.5) * 2
    assert (old + (v - old) != v).any()  # the premise: rounding happens
    _, m = value_loss(v[None], old[None], R[None], torch.ones(1, n), clip=0.2)
    assert m["clipfrac"].item() == 0.0  # |V − V_old| < 0.15 < 0.2 everywhere
    _, m = value_loss(v[None] + 1.0, old[None], R[None], torch.ones(1, n), clip=0.2)
    assert m["clipfrac"].item() == pytest.approx(((old + 0.2 - R) ** 2 > (v + 1 - R) ** 2).float().mean().item())


def test_kl_penalized_rewards_score_on_last_token_with_right_padding():
    lp = t(-1.0, -2.0, -1.0, -0.5, -0.5, 7.0).reshape(2, 3)
    ref = t(-1.5, -1.0, -1.0, -0.5, -1.0, float("nan")).reshape(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = kl_penalized_rewards(t(2.0, -1.0), lp, ref, mask, beta=0.1)
    expect = torch.tensor([[-0.05, 0.1, 2.0], [0.0, -0.05 - 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out, expect)
    k3 = kl_penalized_rewards(t(2.0, -1.0), lp, ref, mask, beta=0.1, estimator="k3")
    torch.testing.assert_close(k3[0, :2], -0.1 * kl_k3(lp[0, :2], ref[0, :2]))
    empty = kl_penalized_rewards(t(3.0), t(0.0, 0.0).unsqueeze(0), t(0.0, 0.0).unsqueeze(0), torch.zeros(1, 2), 0.1)
    assert torch.all(empty == 0)


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    assert fixed.update(123.0, 10) == 0.05 and fixed.value == 0.05
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(6.0, 256)
    assert ctl.value == pytest.approx(0.1)
    ctl.update(torch.tensor(12.0), 100)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    before = ctl.value
    ctl.update(0.0, 1000)  # error −1 clipped to −0.2
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 1000 / 10000))
    before = ctl.value
    ctl.update(6.6, 500)  # unclipped error +0.1
    assert ctl.value == pytest.approx(before * (1 + 0.1 * 500 / 10000))


def test_best_of_n_kl():
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(16) == pytest.approx(math.log(16) - 15 / 16)
    vals = [best_of_n_kl(n) for n in range(1, 50)]
    assert all(b > a for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError):
        best_of_n_kl(0)


def test_aggregate_loss_skips_empty_rows_in_seq_mean():
    x = t(1.0, 3.0, 100.0, 100.0).reshape(2, 2)
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate_loss(x, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate_loss(x, torch.zeros(2, 2), "token-mean").item() == 0.0


def test_half_precision_inputs_are_computed_in_float32():
    # bf16 resolves exp(log π − log π_old) to only ~0.4–0.8 % near 1 and k3 ≈ Δ²/2 cancels; the
    # loss is computed on the float32 upcast of the given values and comes back in float32.
    g = torch.Generator().manual_seed(5)
    lp = (torch.randn(3, 4, generator=g) * 0.05 - 2).bfloat16().requires_grad_()
    old = (lp.detach().float() + torch.randn(3, 4, generator=g) * 0.03).bfloat16()
    ref = (lp.detach().float() - 0.02).bfloat16()
    adv = torch.tensor([1.0, -0.5, 2.0]).bfloat16()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss, m = policy_loss(lp, old, adv, mask, ref_logps=ref, beta=0.1)
    expect, m32 = policy_loss(lp.detach().float(), old.float(), adv.float(), mask, ref_logps=ref.float(), beta=0.1)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), expect)
    for k in ("kl", "approx_kl", "ratio/mean"):
        torch.testing.assert_close(m[k], m32[k])
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad).all()
    # k3 on bf16 values: relative error of the bf16 result, not of a bf16 computation
    a = torch.full((4,), -2.0).bfloat16()
    b = (a.float() - torch.tensor([0.0078125, 0.03125, 0.0625, 0.5])).bfloat16()
    exact = kl_k3(a.double(), b.double())
    got = kl_k3(a, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=8e-3, atol=0)
    vl, _ = value_loss(lp.detach(), old, ref, mask)
    assert vl.dtype == torch.float32
    torch.testing.assert_close(vl, value_loss(lp.detach().float(), old.float(), ref.float(), mask)[0])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_rows_with_no_completion_tokens_are_finite_and_add_nothing(agg):
    lp = torch.tensor([[-1.0, -0.5, -2.0], [float("nan"), 3.0, -7.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -2.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    for level in ("token", "sequence"):
        loss, m = policy_loss(lp, old, t(1.0, -3.0), mask, agg=agg, importance_level=level)
        alone, _ = policy_loss(lp[:1], old[:1], t(1.0), mask[:1], agg=agg, importance_level=level)
        scale = 0.5 if agg == "seq-mean-token-sum-norm" else 1.0  # Σ/(B·C): B counts the empty row
        torch.testing.assert_close(loss, alone * scale)
        assert all(torch.isfinite(v).all() for v in m.values())
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.all(grad[1] == 0)
