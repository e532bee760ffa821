"""PPO and best-of-n over an environment's episodes (env=...): the KL, GAE and the value loss run
over the model's tokens alone (the environment's are neither actions nor states the critic learns);
PPO raises the two-turn Recall task's reward (tests/test_env_grpo.py) on a from-scratch model; best-of-n
keeps the episode the environment rewards most."""

import json

import pytest
import torch

from test_env_grpo import model_dir, one_thread  # noqa: F401  (the Recall task's model; one thread)
from tether.config import ConfigError
from tether.objectives import policy_loss, value_loss
from tether.rollout.types import SEQ_MULTIPLE
from tether.trainers.best_of_n import BoNConfig, run_bon
from tether.trainers.ppo import PPOConfig, loop as ppo_mod, train_ppo
from tether.trainers.ppo.loop import ppo_advantages

ENV = "tests.test_env_grpo:Recall"  # the two-turn task GRPO learns in tests/test_env_grpo.py

# One episode: 2 prompt tokens, the model's turn (2 tokens), the environment's reply (3 tokens),
# the model's turn (2 tokens), 1 padding column.
MODEL_AT = [2, 3, 7, 8]
WIDTH = 10


def _spread(values, fill):
    """[1, WIDTH]: `values` at the model's positions, `fill` (one per column) elsewhere."""
    out = torch.as_tensor(fill, dtype=torch.float32).clone().reshape(1, WIDTH)
    out[0, MODEL_AT] = torch.tensor(values)
    return out


def test_gae_runs_over_the_models_tokens_with_the_observations_skipped():
    old, ref, values = [-1.0, -2.0, -0.5, -1.5], [-1.5, -1.0, -0.5, -2.0], [0.5, 0.25, 1.0, 0.5]
    beta, R, gamma, lam = 0.1, 2.0, 0.9, 0.5
    mask = torch.zeros(1, WIDTH, dtype=torch.bool)
    mask[0, MODEL_AT] = True
    noise = torch.Generator().manual_seed(0)

    def full(compact):  # the values at the model's positions; noise at the reply's, the prompt's, the padding's
        return _spread(compact, 5 * torch.randn(WIDTH, generator=noise))
    rewards, adv, ret = ppo_advantages(torch.tensor([R]), full(old), full(ref), full(values), mask, beta, "k1",
                                       gamma=gamma, lam=lam, whiten=False)
    # k1 = old − ref = (0.5, −1.0, 0.0, 0.5) on the model's tokens; R on the model's last token
    r = [-0.05, 0.1, 0.0, -0.05 + R]
    torch.testing.assert_close(rewards, _spread(r, torch.zeros(WIDTH)))
    # GAE by hand over the four model tokens, as if the reply were not there (γ applies per model
    # token: the reply's three positions neither discount nor bootstrap), V after the last = 0
    d4 = r[3] + 0 - 0.5                    # 1.45
    d3 = r[2] + gamma * 0.5 - 1.0          # −0.55
    d2 = r[1] + gamma * 1.0 - 0.25         # 0.75   (V_{t+1} is the value of the turn after the reply)
    d1 = r[0] + gamma * 0.25 - 0.5         # −0.325
    a4 = d4
    a3 = d3 + gamma * lam * a4             # 0.1025
    a2 = d2 + gamma * lam * a3             # 0.796125
    a1 = d1 + gamma * lam * a2             # 0.03325625
    assert [round(a, 8) for a in (a1, a2, a3, a4)] == [0.03325625, 0.796125, 0.1025, 1.45]
    torch.testing.assert_close(adv, _spread([a1, a2, a3, a4], torch.zeros(WIDTH)))
    torch.testing.assert_close(ret, _spread([a1 + 0.5, a2 + 0.25, a3 + 1.0, a4 + 0.5], torch.zeros(WIDTH)))

    # the same as PPO's advantages of the sequence with the observations cut out, whitened or not
    compact_mask = torch.ones(1, 4, dtype=torch.bool)
    for whiten in (False, True):
        cut = ppo_advantages(torch.tensor([R]), torch.tensor([old]), torch.tensor([ref]), torch.tensor([values]),
                             compact_mask, beta, "k1", gamma=gamma, lam=lam, whiten=whiten)
        out = ppo_advantages(torch.tensor([R]), full(old), full(ref), full(values), mask, beta, "k1",
                             gamma=gamma, lam=lam, whiten=whiten)
        for a, b in zip(cut, out):
            torch.testing.assert_close(b[:, MODEL_AT], a)
            assert not b[~mask].any()

    # other value predictions (and log-probs) at the reply's positions change nothing, bit for bit
    base = [ppo_advantages(torch.tensor([R]), full(old), full(ref), full(values), mask, beta, "k1",
                           gamma=gamma, lam=lam, whiten=True)]
    for _ in range(3):
        again = ppo_advantages(torch.tensor([R]), full(old), full(ref), full(values), mask, beta, "k1",
                               gamma=gamma, lam=lam, whiten=True)
        for a, b in zip(base[0], again):
            assert torch.equal(a, b)

    # the value loss and the policy loss read the model's tokens only: the critic's predictions and
    # the policy's log-probs at the observation positions move neither
    _, adv, ret = base[0]
    old_values = full(values)
    losses = []
    for _ in range(3):
        critic, logps = full([0.7, 0.1, 1.3, 0.2]), full([-0.9, -2.1, -0.4, -1.6])
        losses.append((value_loss(critic, old_values, ret, mask, clip=0.2)[0],
                       policy_loss(logps, full(old), adv, mask, clip_low=0.2)[0]))
    assert all(torch.equal(v, losses[0][0]) and torch.equal(p, losses[0][1]) for v, p in losses)


def _metrics(root, name):
    rows = [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "objective/scores" in r]


def test_ppo_improves_the_model_on_a_two_turn_environment(model_dir, monkeypatch):  # noqa: F811
    # what the loop hands GAE (mask, advantages, returns) next to the episodes it sampled
    sampled, advantaged = [], []
    real_sample, real_advantages = ppo_mod.sample_episodes, ppo_mod.ppo_advantages

    def sample_spy(*a, **k):
        ro, kept = real_sample(*a, **k)
        sampled.append(ro)
        return ro, kept

    def advantages_spy(*a, **k):
        out = real_advantages(*a, **k)
        advantaged.append((a[4], *out[1:]))
        return out
    monkeypatch.setattr(ppo_mod, "sample_episodes", sample_spy)
    monkeypatch.setattr(ppo_mod, "ppo_advantages", advantages_spy)
    # 60 steps of 32 episodes, 2 epochs × 2 minibatches, no KL: 15-30 s on one CPU thread. Measured
    # (step 1 -> mean of the last 10): seed 0 0.056 -> 0.39, seed 1 0.056 -> 0.95 (reads the
    # letter), seed 2 0.081 -> 0.44
    train_ppo(PPOConfig(model=str(model_dir / "model"), data="env", env=ENV, train_rows=256,
                        runs_dir=str(model_dir / "runs"), name="ppo-recall", batch_size=32, num_generations=1,
                        max_new_tokens=24, max_steps=60, lr=3e-3, kl_coef=0.0, value_model="policy",
                        ppo_epochs=2, num_minibatches=2, device="cpu", progress=False, seed=0, num_samples=4))
    rows = _metrics(model_dir, "ppo-recall")
    first, last = rows[0]["objective/scores"], sum(r["objective/scores"] for r in rows[-10:]) / 10
    # the untrained model finishes a few % of its episodes (0.2 each); the trained one most of them
    assert first < 0.15 and last > 0.3, (first, last)
    assert all(r["env/turns"] <= 2 for r in rows) and rows[-1]["env/turns"] > 1.5
    assert rows[-1]["env/reset_errors"] == 0 and rows[-1]["env/episode_tokens"] > rows[-1]["completions/mean_length"]
    assert rows[-1]["rewards/env_reward/mean"] == pytest.approx(rows[-1]["objective/scores"])
    sample = json.loads((model_dir / "runs" / "ppo-recall" / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["messages"][0] == {"role": "user", "content": "go"} and sample["score"] == pytest.approx(sample["env_reward"])
    assert [k for k, _ in sample["segments"]][:3] == ["model", "env", "model"]

    # every step: GAE's mask is the model's tokens; the environment's get no advantage and no return
    assert len(sampled) == len(advantaged) == 60
    for ro, (mask, adv, ret) in zip(sampled, advantaged):
        batch = ro.training_batch(SEQ_MULTIPLE)
        P = ro.prompt_width
        observed = torch.zeros_like(mask)
        observed[:, P:P + ro.observation_mask.shape[1]] = ro.observation_mask
        assert torch.equal(mask, batch["completion_mask"]) and not (mask & observed).any()
        assert not adv[observed].any() and not ret[observed].any()
    assert sampled[-1].observation_mask.any()


def test_best_of_n_keeps_the_episode_the_environment_rewards_most(model_dir):  # noqa: F811
    from tether.envs import load_env
    from tether.envs.rollouts import EnvSection, env_data, sample_episodes
    from tether.models import load_model, load_tokenizer
    from tether.rollout import Sampler

    def short(prompts, completions, completion_ids, messages, **_):
        """A tie-break added to the environment's reward: fewer characters in the transcript."""
        return [-1e-3 * sum(len(m["content"]) for m in msgs) for msgs in messages]

    def gold(prompts, completions, completion_ids, env_reward, **_):
        return env_reward
    cfg = BoNConfig(model=str(model_dir / "model"), data="env", env=ENV, train_rows=6, n=16, max_new_tokens=24,
                    runs_dir=str(model_dir / "runs"), name="bon-recall", device="cpu", dtype="fp32", seed=3)
    summary = run_bon(cfg, reward_funcs=[short], gold_reward=gold)
    kept = [json.loads(line) for line in (model_dir / "runs" / "bon-recall" / "samples.jsonl").read_text().splitlines()]

    # the same episodes again (the sampling streams are keyed by seed and position): the kept one
    # of each prompt is the argmax of env_reward + short, and carries its transcript
    tokenizer = load_tokenizer(str(model_dir / "model"))
    model = load_model(str(model_dir / "model"), dtype="fp32", device="cpu")
    rows = env_data(EnvSection(env=ENV, train_rows=6), seed=3)
    ro, order = sample_episodes(Sampler(model, tokenizer, cfg.rollout.sampling()), tokenizer, load_env(ENV),
                                rows, 16, EnvSection(env=ENV), seed=3)
    assert order == list(range(6)) and len(kept) == 6
    env = [e["env_reward"] for e in ro.episodes]
    proxy = [r + s for r, s in zip(env, short(None, None, None, [e["messages"] for e in ro.episodes]))]
    for g, row in enumerate(kept):
        best = max(range(g * 16, (g + 1) * 16), key=lambda i: (proxy[i], -i))
        assert row["reward"] == pytest.approx(proxy[best]) and row["gold"] == env[best]
        assert row["env_reward"] == env[best] and row["messages"] == ro.episodes[best]["messages"]
        assert row["completion"] == ro.texts[best] and row["prompt"] == rows[g]["prompt"]
    assert summary["gold/best_mean"] == pytest.approx(sum(r["gold"] for r in kept) / 6)
    # the best of 16 beats the average episode (measured: 0.33 against 0.05)
    assert summary["gold/best_mean"] > summary["gold/mean"]
    assert summary["env/turns"] == pytest.approx(sum(e["turns"] for e in ro.episodes) / len(ro.episodes))


def test_env_refuses_what_it_does_not_combine_with():
    with pytest.raises(ConfigError, match="bon.rft"):
        BoNConfig(model="m", data="env", env=ENV, rft=True)
    with pytest.raises(ConfigError, match="ppo.process_reward"):
        PPOConfig(model="m", data="env", env=ENV, process_reward=True)
    with pytest.raises(ConfigError, match="data=env draws the rows from the environment"):
        PPOConfig(model="m", data="env")


# Recall whose reset raises on the letter d: a quarter of the rows leave their batch (env/reset_errors)
FLAKY = '''from tether.envs import load_env

Recall = load_env("tests.test_env_grpo:Recall")


class Flaky(Recall):
    def reset(self, row):
        if row["letter"] == "d":
            raise ValueError("no environment for d")
        return super().reset(row)
'''


@pytest.fixture(scope="module")
def flaky(model_dir):  # noqa: F811
    (model_dir / "flaky.py").write_text(FLAKY)
    return f"{model_dir / 'flaky.py'}:Flaky"


def test_a_row_whose_environment_cannot_start_leaves_the_ppo_batch(model_dir, flaky, monkeypatch):  # noqa: F811
    totals = []
    real = ppo_mod.ppo_epochs

    def spy(t, spec, critic, batch, *a, **k):
        totals.append((a[-2].total, len(batch["input_ids"])))  # (the global batch: shares, this process's rows)
        return real(t, spec, critic, batch, *a, **k)
    monkeypatch.setattr(ppo_mod, "ppo_epochs", spy)
    train_ppo(PPOConfig(model=str(model_dir / "model"), data="env", env=flaky, train_rows=64,
                        runs_dir=str(model_dir / "runs"), name="ppo-flaky", batch_size=8, num_generations=2,
                        max_new_tokens=12, max_steps=3, lr=1e-3, value_model="policy", ppo_epochs=1,
                        num_minibatches=2, device="cpu", progress=False, seed=0, num_samples=16))
    rows = _metrics(model_dir, "ppo-flaky")
    skipped = [int(r["env/reset_errors"]) for r in rows]
    assert sum(skipped) > 0 and totals == [(2 * (8 - k), 2 * (8 - k)) for k in skipped]
    samples = [json.loads(line) for line in (model_dir / "runs" / "ppo-flaky" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["messages"][2]["content"] != "d" for s in samples if len(s["messages"]) > 2)


@pytest.mark.slow
def test_ppo_and_best_of_n_over_episodes_in_two_processes_equal_one_process(model_dir, flaky):  # noqa: F811
    """Under torchrun each rank plays its share of the batch's episodes; the rows whose reset
    raised leave the global batch on every rank alike (update.Shares.keep), the env/* metrics are
    the global batch's (update.episode_metrics_over_ranks)."""
    from dist_support import assert_same_metrics, assert_same_weights, ok, run_tether

    def ppo(name, nproc):
        args = dict(model=model_dir / "model", data="env", env=flaky, train_rows=64, runs_dir=model_dir / "runs",
                    name=name, batch_size=8, num_generations=2, max_new_tokens=12, max_steps=3, save_every=3,
                    lr=1e-3, kl_coef=0.05, value_model="policy", ppo_epochs=2, num_minibatches=2, device="cpu",
                    progress="false", seed=0, num_samples=16)
        ok(run_tether("ppo", [f"{k}={v}" for k, v in args.items()], nproc=nproc))
        return model_dir / "runs" / name
    one, two = ppo("ppo-flaky-1", 1), ppo("ppo-flaky-2", 2)
    assert sum(r["env/reset_errors"] for r in _metrics(model_dir, "ppo-flaky-1")) > 0
    assert assert_same_metrics(one, two) >= 3 * 30
    assert (one / "samples.jsonl").read_bytes() == (two / "samples.jsonl").read_bytes()
    assert_same_weights(one / "checkpoints" / "step-3", two / "checkpoints" / "step-3")
    assert_same_weights(one / "checkpoints" / "step-3" / "value", two / "checkpoints" / "step-3" / "value")

    def bon(name, nproc):
        args = dict(model=model_dir / "model", data="env", env=flaky, train_rows=12, runs_dir=model_dir / "runs",
                    name=name, n=4, max_new_tokens=12, device="cpu", dtype="fp32", seed=3, progress="false")
        ok(run_tether("bon", [f"{k}={v}" for k, v in args.items()], nproc=nproc))
        return model_dir / "runs" / name
    a, b = bon("bon-flaky-1", 1), bon("bon-flaky-2", 2)
    assert (a / "samples.jsonl").read_bytes() == (b / "samples.jsonl").read_bytes()
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    sa.pop("sample_seconds"), sb.pop("sample_seconds")
    assert sa.pop("curve") == sb.pop("curve")  # from the same gathered rewards
    # (env/* are each rank's means weighted by its episodes: equal up to float rounding)
    assert sa == pytest.approx(sb, rel=1e-12) and sa["env/reset_errors"] > 0 and sa["prompts"] < 12
