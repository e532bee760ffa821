"""tether.objectives.advantages: group estimators (GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++) and GAE."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.objectives import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
)

SETTINGS = settings(max_examples=40, deadline=None)


def t(*x):
    return torch.tensor(x, dtype=torch.float64)


groups_strategy = st.lists(st.tuples(st.integers(-3, 5), st.floats(-10, 10)), min_size=1, max_size=12)


def test_grpo_seed_example_1001():
    adv = grpo_advantages(t(1, 0, 0, 1), torch.tensor([7, 7, 7, 7]))
    torch.testing.assert_close(adv, t(1, -1, -1, 1), atol=1e-5, rtol=0)
    exact = grpo_advantages(t(1, 0, 0, 1), torch.tensor([7, 7, 7, 7]), eps=0.0)
    torch.testing.assert_close(exact, t(1, -1, -1, 1))


def test_grpo_seed_group_ordering_and_population_std():
    r = t(0.8, 0.2, 0.9, 0.1)
    adv = grpo_advantages(r, torch.zeros(4, dtype=torch.long), eps=0.0)
    assert torch.equal(torch.argsort(adv), torch.argsort(r))  # ordering preserved: 0.1 < 0.2 < 0.8 < 0.9
    pop_std = math.sqrt((0.09 + 0.09 + 0.16 + 0.16) / 4)  # not the n−1 sample std
    torch.testing.assert_close(adv, (r - 0.5) / pop_std)
    assert adv.sum().abs().item() < 1e-12


def reference_grpo(rewards, ids, eps, scale):
    out = torch.zeros_like(rewards)
    for gid in set(ids.tolist()):
        sel = ids == gid
        grp = rewards[sel]
        c = grp - grp.mean()
        if scale == "group":
            c = c / (grp.std(correction=0) + eps)
        elif scale == "batch":
            c = c / (rewards.std(correction=0) + eps)
        out[sel] = 0.0 if (grp == grp[0]).all() else c
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_unsorted_unequal_groups_match_loop_reference(scale):
    r = t(3.0, 1.0, 0.5, 2.0, 4.0, 4.0, -1.0, 7.0)
    ids = torch.tensor([10, -2, 10, 5, -2, 10, 5, 99])  # sizes 3, 2, 2, 1; not sorted
    torch.testing.assert_close(grpo_advantages(r, ids, scale=scale), reference_grpo(r, ids, 1e-6, scale))


def test_singletons_and_constant_groups_give_exact_zero_without_nan():
    r = t(0.3, 0.3, 0.3, 5.0, 1.0, 2.0)
    ids = torch.tensor([0, 0, 0, 1, 2, 2])
    for eps in (1e-6, 0.0):
        adv = grpo_advantages(r, ids, eps=eps)
        assert torch.isfinite(adv).all()
        assert torch.all(adv[:4] == 0)
    assert torch.all(rloo_advantages(r, ids)[:4] == 0)
    assert torch.all(grpo_advantages(t(2.0), torch.tensor([0])) == 0)
    with pytest.raises(ValueError):
        grpo_advantages(r, ids, scale="whatever")


def test_dr_grpo_is_centering_only_and_batch_scale_uses_batch_std():
    r = t(1.0, 3.0, 10.0, 20.0)
    ids = torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(grpo_advantages(r, ids, scale="none"), t(-1, 1, -5, 5))
    torch.testing.assert_close(compute_advantages("dr_grpo", r, ids), t(-1, 1, -5, 5))
    batch_std = r.std(correction=0).item()
    torch.testing.assert_close(grpo_advantages(r, ids, scale="batch", eps=0.0), t(-1, 1, -5, 5) / batch_std)


def test_rloo_hand_values():
    r = t(1, 0, 0, 1, 2.0, 4.0)
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    # A_1 = 1 − (0 + 0 + 1)/3 = 2/3; pair (2, 4) → −2, +2
    torch.testing.assert_close(rloo_advantages(r, ids), t(2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0))


def test_remax():
    torch.testing.assert_close(remax_advantages(t(1.0, 0.5), t(0.25, 0.5)), t(0.75, 0.0))
    torch.testing.assert_close(compute_advantages("remax", t(1.0, 0.5), None, greedy_rewards=t(0.25, 0.5)), t(0.75, 0.0))


@SETTINGS
@given(groups_strategy)
def test_group_advantages_have_zero_mean_per_group(rows):
    ids = torch.tensor([g for g, _ in rows])
    r = torch.tensor([x for _, x in rows], dtype=torch.float64)
    for adv in (grpo_advantages(r, ids), grpo_advantages(r, ids, scale="none"),
                grpo_advantages(r, ids, scale="batch"), rloo_advantages(r, ids)):
        assert torch.isfinite(adv).all()
        for gid in ids.unique():
            assert abs(adv[ids == gid].mean().item()) < 1e-9


@SETTINGS
@given(groups_strategy, st.randoms(use_true_random=False))
def test_shuffling_rows_with_group_ids_changes_nothing(rows, rnd):
    ids = torch.tensor([g for g, _ in rows])
    r = torch.tensor([x for _, x in rows], dtype=torch.float64)
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    mask = torch.ones(len(rows), 3)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        base = compute_advantages(name, r, ids, mask)
        shuffled = compute_advantages(name, r[perm], ids[perm], mask)
        torch.testing.assert_close(shuffled, base[perm], atol=1e-9, rtol=1e-9)
        relabeled = compute_advantages(name, r, ids * 7 + 100, mask)  # labels are just labels
        torch.testing.assert_close(relabeled, base, atol=1e-9, rtol=1e-9)


def test_reinforce_pp_whitens_over_tokens_token_weighted():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    adv = reinforce_pp_advantages(t(1.0, 0.0), mask, eps=0.0)
    # tokens [1, 1, 1, 0]: mean 0.75, population std sqrt(0.1875)
    s = math.sqrt(0.1875)
    torch.testing.assert_close(adv, torch.tensor([[0.25 / s] * 3 + [0.0], [-0.75 / s, 0, 0, 0]], dtype=torch.float64))
    assert adv[mask.bool()].mean().abs().item() < 1e-12
    assert adv[mask.bool()].std(correction=0).item() == pytest.approx(1.0)


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    r = t(1.0, 3.0, 10.0, 14.0)
    ids = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2)
    adv = reinforce_pp_advantages(r, mask, group_ids=ids, eps=0.0)
    centered = t(-1.0, 1.0, -2.0, 2.0)
    expect = (centered - centered.mean()) / centered.std(correction=0)
    torch.testing.assert_close(adv, expect.unsqueeze(1).expand(4, 2))
    # without the baseline the big-reward group dominates: both its rows are positive
    plain = reinforce_pp_advantages(r, mask)
    assert (plain[2:] > 0).all() and (plain[:2] < 0).all()


def test_reinforce_pp_token_rewards_use_reward_to_go():
    rewards = t(0.0, -0.1, 1.0, 0.0, 0.5, 9.0).reshape(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    G = discounted_returns(rewards, mask)
    torch.testing.assert_close(G, torch.tensor([[0.9, 0.9, 1.0], [0.5, 0.5, 0.0]], dtype=torch.float64))
    adv = reinforce_pp_advantages(rewards, mask, eps=0.0)
    vals = torch.tensor([0.9, 0.9, 1.0, 0.5, 0.5], dtype=torch.float64)
    torch.testing.assert_close(adv[mask.bool()], (vals - vals.mean()) / vals.std(correction=0))
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=0.5)[0],
                               t(0.0 - 0.05 + 0.25, -0.1 + 0.5, 1.0))


def textbook_gae(r, v, gamma, lam):
    T = len(r)
    adv, last = [0.0] * T, 0.0
    for t_ in reversed(range(T)):
        nv = v[t_ + 1] if t_ + 1 < T else 0.0
        last = r[t_] + gamma * nv - v[t_] + gamma * lam * last
        adv[t_] = last
    return adv


def test_gae_gamma1_lambda1_is_reward_to_go_minus_value():
    r = t(0.0, 0.5, 0.0, 2.0).unsqueeze(0)
    v = t(0.3, -0.2, 1.0, 0.7).unsqueeze(0)
    adv, ret = gae(r, v, torch.ones(1, 4), gamma=1.0, lam=1.0)
    rtg = t(2.5, 2.5, 2.0, 2.0).unsqueeze(0)
    torch.testing.assert_close(adv, rtg - v)
    torch.testing.assert_close(ret, rtg)


def test_gae_matches_textbook_and_terminal_has_no_bootstrap():
    r, v = [0.1, -0.3, 0.0, 1.0], [0.5, 0.2, -0.4, 0.9]
    adv, ret = gae(t(*r).unsqueeze(0), t(*v).unsqueeze(0), torch.ones(1, 4), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[0], t(*textbook_gae(r, v, 0.9, 0.8)))
    torch.testing.assert_close(ret[0], adv[0] + t(*v))
    assert adv[0, -1].item() == pytest.approx(1.0 - 0.9)  # r_T − V_T, nothing after the end
    lam0, _ = gae(t(*r).unsqueeze(0), t(*v).unsqueeze(0), torch.ones(1, 4), gamma=0.9, lam=0.0)
    torch.testing.assert_close(lam0[0, :3], t(*r[:3]) + 0.9 * t(*v[1:]) - t(*v[:3]))


def test_gae_with_right_padding_of_different_lengths():
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 99.0, 99.0]], dtype=torch.float64)
    v = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 99.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    adv, ret = gae(r, v, mask, gamma=0.95, lam=0.9)
    torch.testing.assert_close(adv[1, :2], t(*textbook_gae([0.0, 2.0], [0.5, 0.6], 0.95, 0.9)))
    assert torch.all(adv[1, 2:] == 0) and torch.all(ret[1, 2:] == 0)
    torch.testing.assert_close(adv[0], t(*textbook_gae([0, 0, 1, 0], [0.1, 0.2, 0.3, 0.4], 0.95, 0.9)))


@SETTINGS
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(1, 4), st.integers(0, 2**16),
       st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_padding_never_changes_gae_or_reinforce_pp(lengths, pad, seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)
    adv, ret = gae(r, v, mask, gamma, lam)
    rpp = reinforce_pp_advantages(r, mask, gamma=gamma)
    junk = lambda: torch.randn(B, pad, generator=g, dtype=torch.float64) * 100
    mask_p = torch.cat([mask, torch.zeros(B, pad, dtype=torch.bool)], 1)
    adv_p, ret_p = gae(torch.cat([r, junk()], 1), torch.cat([v, junk()], 1), mask_p, gamma, lam)
    torch.testing.assert_close(adv_p[:, :T], adv)
    torch.testing.assert_close(ret_p[:, :T], ret)
    assert torch.all(adv_p[:, T:] == 0)
    rpp_p = reinforce_pp_advantages(torch.cat([r, junk()], 1), mask_p, gamma=gamma)
    torch.testing.assert_close(rpp_p[:, :T], rpp)
    for i, n in enumerate(lengths):  # each row individually equals the unpadded textbook GAE
        torch.testing.assert_close(adv[i, :n], t(*textbook_gae(r[i, :n].tolist(), v[i, :n].tolist(), gamma, lam)))


# Hand-computed values of every registered estimator on one batch: rewards (1, 0, 2, 4) in groups
# (0, 0, 1, 1), two tokens per row. A registry entry without a row here fails the test below.
HAND_R, HAND_IDS, HAND_MASK = t(1.0, 0.0, 2.0, 4.0), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)
HAND_VALUES = {
    # group 0: mean 0.5, σ 0.5 → ±1; group 1: mean 3, σ 1 → ∓1 (σ + 1e-6: atol below)
    "grpo": ({}, t(1.0, -1.0, -1.0, 1.0)),
    # centering only: (1 − 0.5, 0 − 0.5, 2 − 3, 4 − 3)
    "dr_grpo": ({}, t(0.5, -0.5, -1.0, 1.0)),
    # leave-one-out: 1 − 0, 0 − 1, 2 − 4, 4 − 2
    "rloo": ({}, t(1.0, -1.0, -2.0, 2.0)),
    # minus the greedy completion's reward of the same prompt: 1 − 0.5, 0 − 0.5, 2 − 3, 4 − 3
    "remax": ({"greedy_rewards": t(0.5, 0.5, 3.0, 3.0)}, t(0.5, -0.5, -1.0, 1.0)),
    # every token carries its row's reward; token mean 1.75, population variance
    # (0.75² + 1.75² + 0.25² + 2.25²)/4 = 8.75/4 = 2.1875 → (r − 1.75)/√2.1875 on both tokens
    "reinforce_pp": ({}, ((t(1.0, 0.0, 2.0, 4.0) - 1.75) / math.sqrt(2.1875)).unsqueeze(1).expand(4, 2)),
    # group means (0.5, 3) subtracted first → (0.5, −0.5, −1, 1): mean 0, variance 2.5/4 = 0.625
    "reinforce_pp_baseline": ({}, (t(0.5, -0.5, -1.0, 1.0) / math.sqrt(0.625)).unsqueeze(1).expand(4, 2)),
}


def test_every_estimator_has_hand_values():
    assert set(HAND_VALUES) == set(ADVANTAGE_ESTIMATORS)


@pytest.mark.parametrize("name", sorted(HAND_VALUES))
def test_estimator_hand_values(name):
    extra, want = HAND_VALUES[name]
    got = compute_advantages(name, HAND_R, HAND_IDS, HAND_MASK, **extra)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_registry_uniform_signature_and_declared_needs():
    r, ids, mask = t(1.0, 0.0, 0.5, 0.5), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)
    for name, est in ADVANTAGE_ESTIMATORS.items():
        extra = {"greedy_rewards": t(0.5, 0.5, 0.5, 0.5)} if est.needs_greedy else {}
        if est.scaled:
            extra["scale"] = "batch"
        out = est(r, ids if est.grouped else None, mask, **extra)  # an ungrouped one needs no ids
        assert out.shape in {(4,), (4, 2)} and torch.isfinite(out).all()
        if est.needs_greedy:
            with pytest.raises(TypeError):
                est(r, ids, mask)
        if est.token_rewards:  # per-token rewards [N, T] are accepted
            assert est(r.unsqueeze(1).expand(4, 2), ids, mask).shape == (4, 2)
    torch.testing.assert_close(compute_advantages("grpo", r, ids, mask), grpo_advantages(r, ids))
    with pytest.raises(ValueError):
        compute_advantages("nope", r, ids, mask)


def test_interleaved_non_contiguous_group_labels():
    # group 7 = rows 0, 2 (rewards 1, 3); group 3 = rows 1, 3 (rewards 2, 6)
    r, ids = t(1.0, 2.0, 3.0, 6.0), torch.tensor([7, 3, 7, 3])
    torch.testing.assert_close(grpo_advantages(r, ids, eps=0.0), t(-1.0, -1.0, 1.0, 1.0))
    torch.testing.assert_close(grpo_advantages(r, [7, 3, 7, 3], scale="none"), t(-1.0, -2.0, 1.0, 2.0))
    torch.testing.assert_close(rloo_advantages(r, ids), t(-2.0, -4.0, 2.0, 4.0))
    adv = reinforce_pp_advantages(r, torch.ones(4, 2), group_ids=ids, eps=0.0)
    c = t(-1.0, -2.0, 1.0, 2.0)
    torch.testing.assert_close(adv, ((c - c.mean()) / c.std(correction=0)).unsqueeze(1).expand(4, 2))


def test_half_precision_rewards_keep_their_dtype():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.25, 0.75]).bfloat16()
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    for adv in (grpo_advantages(r, ids), rloo_advantages(r, ids)):
        assert adv.dtype == torch.bfloat16 and torch.isfinite(adv).all()
    torch.testing.assert_close(grpo_advantages(r, ids).float(), grpo_advantages(r.float(), ids), atol=1e-2, rtol=1e-2)
