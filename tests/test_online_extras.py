"""The online trainer's DAPO / KL / LoRA options and presets: hand-computable wiring checks (the
numbers the loop hands on are the ones the equations give) and short runs that must move the reward
the right way. A flipped sign or swapped argument fails at least one of them."""

import json
from types import SimpleNamespace

import pytest
import torch

from extras import needs
from tether.models import load_model, make_tiny_model
from tether.objectives import token_logps
from tether.rewards.scoring import overlong_penalty
from tether.rollout import Sampler
from tether.trainers.grpo import loop as online, update as online_update
from tether.trainers.core import setup
from tether.trainers.grpo import GRPOConfig, ReMaxConfig, RLOOConfig, train_grpo
from tether.trajectories.sampling import has_signal

DIGITS = set("0123456789")
EOS = 2  # the tiny char tokenizer's <eos>


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("online_extras")
    make_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Say {i}:", "tag": i % 2}) + "\n")
    return root


def digit_frac(prompts, completions, completion_ids, **_):
    return [sum(c in DIGITS for c in t) / max(len(t), 1) for t in completions]


def _cfg(root, name, cls=GRPOConfig, **kw):
    base = dict(model=str(root / "model"), data=str(root / "prompts.jsonl"), runs_dir=str(root / "runs"),
                name=name, batch_size=4, num_generations=8, max_new_tokens=8, max_steps=15,
                lr=1e-2, device="cpu", progress=False, log_entropy=False, seed=0)
    base.update(kw)
    return cls(**base)


def _metrics(root, name):
    return [json.loads(x) for x in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _start_end(rows, key, k=4):
    vals = [r[key] for r in rows]
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


# ---- overlong shaping ------------------------------------------------------------------------------

def test_overlong_penalty_values():
    # L = 10, buffer 4: 0 up to length 6, then −coef·(len − 6)/4 down to −coef at 10
    got = overlong_penalty(torch.tensor([1, 6, 7, 8, 10]), max_new_tokens=10, buffer=4, coef=0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert (overlong_penalty(torch.tensor([10]), 10, 0) == 0).all()
    with pytest.raises(ValueError):
        GRPOConfig(max_new_tokens=8, overlong_buffer=8)


def test_overlong_shaping_shortens_completions(root):
    # The only reward is the shaping; buffer 7 of 8: every length ≥ 1 is on the ramp, so the step's
    # reward is exactly −(mean_length − 1)/7 · coef, and the policy learns to stop early.
    def zero(completions, **_):
        return [0.0] * len(completions)

    train_grpo(_cfg(root, "overlong", overlong_buffer=7, overlong_penalty=0.5), reward_funcs=[zero])
    rows = _metrics(root, "overlong")
    for r in rows:
        assert r["reward"] == pytest.approx(-0.5 * (r["completions/mean_length"] - 1) / 7, abs=1e-6)
        assert r["rewards/overlong_penalty/mean"] == pytest.approx(r["reward"], abs=1e-6)
    start, end = _start_end(rows, "completions/mean_length")
    assert end < start - 1.5, (start, end)


# ---- truncated completions are masked --------------------------------------------------------------

def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_mask_truncated_completions_gets_no_gradient(root):
    # Only truncated completions are scored (others return None = skipped): with the mask on,
    # nothing is left in the loss and the weights must not move; with it off they do.
    def truncated_only(completions, completion_ids, **_):
        return [float(sum(c in DIGITS for c in t)) if len(ids) == 8 and ids[-1] != EOS else None
                for t, ids in zip(completions, completion_ids)]

    init = _state(load_model(str(root / "model"), device="cpu"))
    moved = {}
    for flag in (True, False):
        out = train_grpo(_cfg(root, f"masktrunc-{flag}", max_steps=2, mask_truncated_completions=flag),
                         reward_funcs=[truncated_only])
        final = _state(load_model(out["checkpoint"], device="cpu"))
        moved[flag] = max(float((final[k] - init[k]).abs().max()) for k in init)
        assert _metrics(root, f"masktrunc-{flag}")[0]["completions/clipped_ratio"] > 0.5
    assert moved[True] == 0.0 and moved[False] > 1e-4, moved


@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def test_skipping_zero_advantage_rows_gives_the_same_gradient(root, monkeypatch, agg):
    """Groups whose rewards all agree have advantage 0: they are left out of the forward/backward
    (skip_zero_advantage) and the accumulated gradient is the full batch's — not rescaled to the
    rows trained (which a first Adam step would hide: the gradients are compared, not weights)."""
    def half_constant(prompts, completions, completion_ids, tag, **_):  # tag 0: one reward for the group
        return [1.0 if g == 0 else sum(c in DIGITS for c in t) / max(len(t), 1)
                for t, g in zip(completions, tag)]

    grads, rows_seen = {}, {}
    real_step, real_logps = setup.guarded_step, online_update.completion_token_logps

    for skip in (True, False):
        def spy_step(model, *a, **k):
            grads[skip] = torch.cat([p.grad.flatten().clone() for p in model.parameters()])
            return real_step(model, *a, **k)

        def spy_logps(model, mb, *a, **k):
            rows_seen[skip] = rows_seen.get(skip, 0) + mb["input_ids"].shape[0]
            return real_logps(model, mb, *a, **k)
        monkeypatch.setattr(setup, "guarded_step", spy_step)
        monkeypatch.setattr(online_update, "completion_token_logps", spy_logps)
        train_grpo(_cfg(root, f"skip0-{agg}-{skip}", max_steps=1, skip_zero_advantage=skip, loss_agg=agg,
                        micro_batch_size=5), reward_funcs=[half_constant])
        m = _metrics(root, f"skip0-{agg}-{skip}")[0]
        assert m["frac_zero_advantage_skipped"] == (0.5 if skip else 0.0)
    assert rows_seen == {True: 16, False: 32}  # 2 of the 4 groups (tag 0) trained on
    assert grads[False].abs().max() > 1e-3
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-7)


def test_trained_rows_whole_micro_batches():
    adv = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, -2.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.ones(6, 2, dtype=torch.bool)
    mask[3, 1] = False  # its only non-zero advantage sits on padding: no gradient either
    assert online_update._trained_rows(adv, mask, True).tolist() == [1]
    assert online_update._trained_rows(adv, mask, False).tolist() == [0, 1, 2, 3, 4, 5]
    # compiled layers: rounded up to whole micro-batches of 4 with skipped rows (static shapes)
    assert online_update._trained_rows(adv, mask, True, quantum=4).tolist() == [0, 1, 2, 3]
    assert online_update._trained_rows(adv, mask, True, quantum=6).tolist() == [0, 1, 2, 3, 4, 5]
    assert online_update._trained_rows(torch.zeros(6, 2), mask, True, quantum=4).tolist() == []


def test_skip_zero_advantage_keeps_the_kl_term(root, monkeypatch):
    """With β > 0 in the loss every row has a KL gradient: nothing is skipped."""
    def constant(prompts, completions, completion_ids, **_):
        return [1.0] * len(completions)
    train_grpo(_cfg(root, "skip0-kl", max_steps=1, beta=0.1), reward_funcs=[constant])
    assert _metrics(root, "skip0-kl")[0]["frac_zero_advantage_skipped"] == 0.0
    train_grpo(_cfg(root, "skip0-all", max_steps=1), reward_funcs=[constant])
    assert _metrics(root, "skip0-all")[0]["frac_zero_advantage_skipped"] == 1.0


# ---- dynamic sampling ------------------------------------------------------------------------------

def test_has_signal():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 2.0, float("nan"), float("nan")])
    assert has_signal(r, 2).tolist() == [False, True, False, False]


def test_dynamic_sampling_drops_zero_variance_groups_and_refills(root, monkeypatch):
    # Even-tag prompts always score 100 (zero variance): they must never reach the advantages, and
    # each step must still train on batch_size groups, found over several sampling rounds.
    def reward(completions, tag, **_):
        return [100.0 if t == 0 else float(sum(c in DIGITS for c in s)) for s, t in zip(completions, tag)]

    seen = []
    real = online.compute_advantages

    def spy(name, rewards, group_ids, mask=None, **kw):
        seen.append((rewards.clone(), group_ids.clone()))
        return real(name, rewards, group_ids, mask, **kw)

    monkeypatch.setattr(online, "compute_advantages", spy)
    train_grpo(_cfg(root, "dyn", max_steps=4, dynamic_sampling=True, max_sampling_rounds=6),
               reward_funcs=[reward])
    assert len(seen) == 4
    for rewards, groups in seen:
        assert (rewards != 100.0).all()
        assert groups.unique().numel() == 4
        for g in groups.unique():
            assert rewards[groups == g].unique().numel() > 1
    rows = _metrics(root, "dyn")
    assert all(r["num_sampling_rounds"] >= 2 for r in rows)
    assert sum(r["frac_reward_zero_std"] for r in rows) / 4 == pytest.approx(0.5, abs=0.15)
    for r in rows:
        assert r["dynamic_sampling/sampled_groups"] == 4 * r["num_sampling_rounds"]
        assert r["dynamic_sampling/kept_groups"] == 4
        assert r["dynamic_sampling/dropped_groups"] >= r["dynamic_sampling/sampled_groups"] // 2 - 2


def test_dynamic_sampling_moves_a_sparse_reward(root):
    # "starts with a digit" (~10% at init): most groups are all-zero and get dropped.
    def first_digit(completions, **_):
        return [float(t[:1] in DIGITS) for t in completions]

    train_grpo(_cfg(root, "dyn-up", dynamic_sampling=True), reward_funcs=[first_digit])
    rows = _metrics(root, "dyn-up")
    start, end = _start_end(rows, "reward")
    assert end > start + 0.1, (start, end)
    assert rows[0]["dynamic_sampling/dropped_groups"] > 0


# ---- KL in the reward ------------------------------------------------------------------------------

def test_kl_in_reward_token_rewards_are_k1_plus_score(root, monkeypatch):
    # REINFORCE++ takes per-token rewards: at every completion token −β(log π_old − log π_ref), plus
    # the score at the last token. Step 2 (after one update) so that π_old ≠ π_ref. log π_old is the
    # trainer's, not the sampler's: the sampler's log-probs are shifted here by a made-up
    # training–inference mismatch (on CUDA a real one), which must not reach the KL.
    beta, mismatch = 0.5, 0.25
    scores, rollouts, token_rewards = [], [], []

    def reward(completions, **_):
        out = [float(sum(c in DIGITS for c in s)) for s in completions]
        scores.append(torch.tensor(out))
        return out

    real_sample, real_adv = Sampler.sample, online.compute_advantages

    def sample_spy(self, *a, **k):
        ro = real_sample(self, *a, **k)
        ro.logprobs = torch.where(ro.completion_mask, ro.logprobs + mismatch, ro.logprobs)
        rollouts.append(ro)
        return ro

    def adv_spy(name, rewards, group_ids, mask=None, **kw):
        token_rewards.append(rewards.clone())
        return real_adv(name, rewards, group_ids, mask, **kw)

    monkeypatch.setattr(Sampler, "sample", sample_spy)
    monkeypatch.setattr(online, "compute_advantages", adv_spy)
    train_grpo(_cfg(root, "klreward", max_steps=2, beta=beta, kl_in="reward", advantage="reinforce_pp"),
               reward_funcs=[reward])
    ro, got = rollouts[1], token_rewards[1]
    tb = ro.training_batch()
    ref_model = load_model(str(root / "model"), device="cpu")
    with torch.no_grad():
        logits = ref_model(input_ids=tb["input_ids"], attention_mask=tb["attention_mask"],
                           position_ids=tb["position_ids"]).logits
    ref = token_logps(logits, tb["input_ids"], ro.logprob_temperature)
    m = tb["completion_mask"]
    trained = tb["logprobs"] - mismatch  # on the CPU the sampler's own equal the trainer's (fp32)
    want = torch.where(m, -beta * (trained - ref), 0.0)
    last = m.shape[1] - 1 - m.flip(1).long().argmax(1)
    want[torch.arange(len(ro)), last] += scores[1]
    assert got.shape == want.shape
    assert torch.allclose(got[m], want[m], atol=1e-5)
    assert (trained - ref)[m].abs().max() > 1e-3  # the KL part is really exercised
    rows = _metrics(root, "klreward")
    k1_sum = torch.where(m, trained - ref, 0.0).sum(1)
    assert rows[1]["rewards/kl_penalty/mean"] == pytest.approx(float((-beta * k1_sum).mean()), abs=1e-5)


def test_kl_in_reward_keeps_the_policy_near_the_reference(root):
    runs = {}
    for beta in (0.01, 1.0):
        train_grpo(_cfg(root, f"klr-{beta}", beta=beta, kl_in="reward"), reward_funcs=[digit_frac])
        runs[beta] = _metrics(root, f"klr-{beta}")
    start, end = _start_end(runs[0.01], "reward")
    assert end > start + 0.1, (start, end)             # small β: the task reward still rises
    kl_small = _start_end(runs[0.01], "kl")[1]
    kl_big = _start_end(runs[1.0], "kl")[1]
    assert kl_big < 0.5 * kl_small, (kl_small, kl_big)  # large β (right sign): stays near the reference


# ---- LoRA: the reference is the base with adapters disabled -----------------------------------------

@needs("peft")
def test_lora_reference_is_the_base_without_a_copy(root, monkeypatch):
    loads, refs, rollouts = [], [], []
    real_load, real_loss, real_sample = setup.load_model, online_update.policy_loss, Sampler.sample

    def load_spy(*a, **k):
        loads.append(a)
        return real_load(*a, **k)

    def loss_spy(*a, ref_logps=None, **k):
        refs.append(ref_logps)
        return real_loss(*a, ref_logps=ref_logps, **k)

    def sample_spy(self, *a, **k):
        ro = real_sample(self, *a, **k)
        rollouts.append(ro)
        return ro

    def no_copy(*a, **k):
        raise AssertionError("the LoRA reference must not copy the model")

    monkeypatch.setattr(setup, "load_model", load_spy)
    monkeypatch.setattr(online_update, "policy_loss", loss_spy)
    monkeypatch.setattr(Sampler, "sample", sample_spy)
    monkeypatch.setattr(setup, "copy", SimpleNamespace(deepcopy=no_copy))
    # (adapters on the inner layers alone barely move this 32-wide random model; on lm_head they do)
    train_grpo(_cfg(root, "lora", lora_r=8, lora_alpha=16, lora_targets="lm_head,down_proj", lr=3e-2,
                    beta=0.05), reward_funcs=[digit_frac])
    assert len(loads) == 1  # one model in memory: the policy
    # the reference log-probs of the last step equal the base model's, exactly
    ro = rollouts[-1]
    tb = ro.training_batch()
    base = real_load(str(root / "model"), device="cpu")
    with torch.no_grad():
        logits = base(input_ids=tb["input_ids"], attention_mask=tb["attention_mask"],
                      position_ids=tb["position_ids"]).logits
    want = token_logps(logits, tb["input_ids"], ro.logprob_temperature)
    m = tb["completion_mask"]
    assert torch.allclose(refs[-1][m], want[m], atol=1e-6)
    assert (tb["logprobs"] - want)[m].abs().max() > 1e-3  # while the policy has moved off the base
    rows = _metrics(root, "lora")
    start, end = _start_end(rows, "reward")
    assert end > start + 0.1, (start, end)
    assert rows[-1]["kl"] > 0


# ---- presets ---------------------------------------------------------------------------------------

def test_presets_and_cli():
    from tether import cli

    r, x = RLOOConfig(), ReMaxConfig()
    assert (r.grpo.advantage, r.grpo.kl_in, r.grpo.beta) == ("rloo", "reward", 0.05)
    assert (x.grpo.advantage, x.rollout.num_generations, x.grpo.kl_in) == ("remax", 1, "reward")
    assert cli.load_command("rloo") == (RLOOConfig, train_grpo) and cli.load_command("remax") == (ReMaxConfig, train_grpo)


def test_remax_preset_moves_the_reward(root):
    # one sample per prompt, greedy baseline, KL in the reward (β = 0.05)
    train_grpo(_cfg(root, "remax", cls=ReMaxConfig, batch_size=16, num_generations=1, max_steps=20),
               reward_funcs=[digit_frac])
    rows = _metrics(root, "remax")
    start, end = _start_end(rows, "reward")
    assert end > start + 0.1, (start, end)
    assert "rewards/kl_penalty/mean" in rows[-1]
