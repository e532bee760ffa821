"""Best-of-n: the BoN identities on enumerable policies, the n' < N estimator, and `tether bon`."""
import json

import numpy as np
import pytest

from tether.trainers.best_of_n import (BoNConfig, best_of_n_kl, bon_brute_force, bon_curve,
                                       bon_distribution, bon_kl, bon_kl_uniform, run_bon, select_best)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_bon_distribution_equals_brute_force_enumeration(n):
    rng = np.random.default_rng(n)
    p = rng.dirichlet(np.ones(6))
    r = np.array([0.3, -1.0, 2.0, 0.7, 5.0, 1.1])  # not sorted: sort outcomes by reward first
    order = np.argsort(r)
    closed = np.empty(6)
    closed[order] = bon_distribution(p[order], n)
    brute = bon_brute_force(p, r, n)
    assert np.abs(closed - brute).max() < 1e-12
    assert abs(brute.sum() - 1) < 1e-12
    if n > 1:  # a wrong formula (e.g. F^n without the F_{i-1}^n term) would not sum to 1
        assert brute[order[-1]] > p[order[-1]]


@pytest.mark.parametrize("M", [2, 3, 10, 100])
@pytest.mark.parametrize("n", [2, 4, 16, 256])
def test_bon_kl_is_bounded_by_the_formula_for_discrete_policies(M, n):
    kl = bon_kl(np.full(M, 1.0 / M), n)
    assert kl <= best_of_n_kl(n) + 1e-12
    assert abs(bon_kl_uniform(M, n) - kl) < 1e-10  # the chunked log-space version agrees
    rng = np.random.default_rng(M * n)
    assert bon_kl(rng.dirichlet(np.ones(M)), n) <= best_of_n_kl(n) + 1e-12
    if M <= 3 and n >= 16:  # a coarse discrete policy is far below the continuous value
        assert best_of_n_kl(n) - kl > 0.5


def test_bon_identity_holds_to_1e6_in_the_continuous_limit():
    gaps = {n: best_of_n_kl(n) - bon_kl_uniform(10_000_000, n) for n in (2, 16, 256)}
    assert all(0 <= g < 1e-6 for g in gaps.values()), gaps
    # and the gap really shrinks with M (not a formula that is always equal)
    assert best_of_n_kl(16) - bon_kl_uniform(100, 16) > 1e-4


def test_bon_curve_hand_checked():
    # 4 samples, proxy ranks 1 < 2 < 3 < 5; gold = 10 x proxy.
    c = bon_curve([3, 1, 2, 5], [30, 10, 20, 50], ns=[1, 2, 4])
    assert c[1] == pytest.approx((2.75, 27.5))
    assert c[2] == pytest.approx((23 / 6, 230 / 6))  # mean max over the 6 pairs: 2,3,5,3,5,5
    assert c[4] == pytest.approx((5.0, 50.0))
    # gold is read at the proxy's choice, not maximised itself
    assert bon_curve([1, 2], [5, 0], ns=[2])[2] == pytest.approx((2.0, 0.0))


def test_select_best_is_the_argmax_per_group():
    assert select_best([0, 3, 1, 9, 2, 2], 3) == [1, 0]
    assert select_best([1, 5, 5, 0], 4) == [1]  # first wins a tie


def _length_reward(prompts, completions, completion_ids=None, **kw):
    return [float(len(c)) for c in completions]


def test_run_bon_keeps_the_best_sample_and_reports_kl(tmp_path):
    from tether.models import make_tiny_model
    from tether.rollout import sample

    model, tok = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["ab", "xyz", "q"]))
    cfg = BoNConfig(model=str(tmp_path / "m"), data=str(data), n=8, max_new_tokens=12,
                    runs_dir=str(tmp_path), device="cpu", dtype="fp32", seed=3, rft=True, rft_lr=1e-4)
    s = run_bon(cfg, reward_funcs=[_length_reward], gold_reward=_length_reward)
    kept = [json.loads(l) for l in (tmp_path / "bon" / "samples.jsonl").read_text().splitlines()]
    # the same seed gives the same samples: the kept one is the longest of its group
    ro = sample(model, tok, [tok.bos_token + p for p in ["ab", "xyz", "q"]], n=8, seed=3, max_new_tokens=12)
    for g, row in enumerate(kept):
        group = ro.texts[g * 8:(g + 1) * 8]
        assert row["reward"] == max(len(t) for t in group)
        assert row["completion"] in group
    assert s["kl_bon"] == pytest.approx(np.log(8) - 7 / 8)
    assert s["proxy/best_mean"] >= s["proxy/mean"]
    assert [p["n"] for p in s["curve"]] == [1, 2, 4, 8]
    assert s["curve"][-1]["proxy"] == pytest.approx(s["proxy/best_mean"])
    assert s["curve"][0]["proxy"] == pytest.approx(s["proxy/mean"])
    rft = [json.loads(l) for l in (tmp_path / "bon" / "rft.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rft] == [r["completion"] for r in kept]
    assert (tmp_path / "bon" / "rft" / "checkpoints").exists() and s["rft"]["rows"] == 3
    # the RFT run is train_sft with bon's model section and run settings, rft_* on top of SFT's defaults
    import yaml
    rft_cfg = yaml.safe_load((tmp_path / "bon" / "rft" / "config.yaml").read_text())
    assert rft_cfg["model"] == yaml.safe_load((tmp_path / "bon" / "config.yaml").read_text())["model"]
    assert rft_cfg["optim"]["lr"] == 1e-4 and rft_cfg["optim"]["warmup_ratio"] == 0.03
    assert rft_cfg["data"]["batch_size"] == 8 and rft_cfg["data"]["max_length"] == 1024 + 12 + 2
    assert rft_cfg["run"]["seed"] == 3 and rft_cfg["run"]["name"] == "rft"
