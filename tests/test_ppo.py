"""PPO-RLHF: the advantage wiring on a hand-built trajectory, and short runs that must move a
reward the right way (a flipped advantage sign fails them)."""
import json

import pytest
import torch

from extras import needs
from tether.models import make_tiny_model
from tether.models.heads import ScalarHeadModel
from tether.run import read_jsonl
from tether.trainers.ppo import loop as ppo_mod
from tether.trainers.ppo.loop import PPOConfig, ppo_advantages, train_ppo


def test_ppo_advantages_hand_built_trajectory():
    # One sequence: 2 prompt tokens (masked out), 3 completion tokens, 1 pad.
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[0, 0, -1.0, -2.0, -0.5, 0]])
    ref = torch.tensor([[0, 0, -1.5, -1.0, -0.5, 0]])
    values = torch.tensor([[0, 0, 0.5, 0.25, 1.0, 0]])
    beta, R = 0.1, 2.0
    rewards, adv, ret = ppo_advantages(torch.tensor([R]), old, ref, values, mask, beta, "k1",
                                       gamma=1.0, lam=0.5, whiten=False)
    # k1 per token = old - ref = (0.5, -1.0, 0.0); the score sits on the last completion token only.
    torch.testing.assert_close(rewards, torch.tensor([[0, 0, -0.05, 0.1, 2.0, 0]]))
    # GAE by hand, γ=1, λ=0.5, V after the last token = 0:
    d4 = 2.0 + 0 - 1.0                # 1.0
    d3 = 0.1 + 1.0 - 0.25             # 0.85
    d2 = -0.05 + 0.25 - 0.5           # -0.3
    a4, a3 = d4, d3 + 0.5 * d4
    a2 = d2 + 0.5 * a3
    torch.testing.assert_close(adv, torch.tensor([[0, 0, a2, a3, a4, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0, 0, a2 + 0.5, a3 + 0.25, a4 + 1.0, 0]]))
    _, white, _ = ppo_advantages(torch.tensor([R]), old, ref, values, mask, beta, whiten=True)
    assert abs(float(white[mask].mean())) < 1e-6 and abs(float(white[mask].std(unbiased=False)) - 1) < 1e-3
    assert (white[~mask] == 0).all()


def test_ppo_advantages_ignore_right_padding_columns():
    """PPO's training batch is padded on the right to a multiple of 16 (training_batch(SEQ_MULTIPLE)):
    whatever the padding columns hold (the critic's values, log-probs there), the rewards, the GAE
    advantages (whitened too) and the returns at the real columns are those of the unpadded batch,
    and 0 on the padding."""
    torch.manual_seed(0)
    B, W, extra = 3, 7, 5
    mask = torch.zeros(B, W, dtype=torch.bool)
    mask[0, 2:7], mask[1, 2:5], mask[2, 3:6] = True, True, True
    old, ref, values = torch.randn(B, W), torch.randn(B, W), torch.randn(B, W)
    scores, dense = torch.tensor([1.0, -0.5, 2.0]), torch.randn(B, W)

    def pad(x, fill):
        return torch.cat([x, fill(B, extra)], 1)
    plain = ppo_advantages(scores, old, ref, values, mask, 0.1, "k3", gamma=0.9, lam=0.8, whiten=True, dense=dense)
    padded = ppo_advantages(scores, pad(old, torch.randn), pad(ref, torch.randn), pad(values, torch.randn),
                            pad(mask, lambda *s: torch.zeros(*s, dtype=torch.bool)), 0.1, "k3", gamma=0.9, lam=0.8,
                            whiten=True, dense=pad(dense, torch.randn))
    for a, b in zip(plain, padded):
        torch.testing.assert_close(b[:, :W], a)
        assert not b[:, W:].any()


def test_ppo_trains_the_same_on_a_width_padded_batch(tmp_path, monkeypatch):
    """Two PPO steps with the training batch padded to a multiple of 16 and unpadded: the same
    metrics and the same weights (to float rounding: the forwards' shapes differ)."""
    data = _setup(tmp_path)
    runs = {}
    for multiple in (1, 16):
        monkeypatch.setattr(ppo_mod, "SEQ_MULTIPLE", multiple)
        train_ppo(_cfg(tmp_path, data, f"m{multiple}", max_steps=2), reward_funcs=[count_x])
        runs[multiple] = tmp_path / "runs" / f"m{multiple}"
    rows = {m: read_jsonl(r / "metrics.jsonl") for m, r in runs.items()}
    for a, b in zip(rows[1], rows[16]):
        for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "val/ratio", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
    from safetensors.torch import load_file
    w1, w16 = (load_file(next(runs[m].glob("checkpoints/*/model.safetensors"))) for m in (1, 16))
    for name in w1:
        torch.testing.assert_close(w16[name], w1[name], atol=1e-5, rtol=1e-4)


def test_values_read_one_position_early():
    # V_t must describe the state that chose token t, i.e. the head output at t − 1.
    class Const(torch.nn.Module):
        def forward(self, ids, attn, pos):
            return ids.float() * 10
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3),
             "position_ids": torch.arange(3)[None]}
    out = ppo_mod._values(Const(), batch, torch.autocast("cpu", enabled=False))
    assert out.tolist() == [[0.0, 10.0, 20.0]]


def _setup(tmp_path):
    model, tok = make_tiny_model(tmp_path / "base", hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64, seed=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["ab", "cd", "ef", "gh"] * 8))
    return data


def count_x(prompts, completions, **_):
    """Reward: share of the completion's characters that are digits (a random tiny model: ~10 %)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _cfg(tmp_path, data, name, **kw):
    base = dict(model=str(tmp_path / "base"), data=str(data), name=name, runs_dir=str(tmp_path / "runs"),
                batch_size=16, num_generations=1, max_new_tokens=8, max_steps=12, lr=3e-3,
                kl_coef=0.0, ppo_epochs=2, num_minibatches=2, vf_coef=0.1, device="cpu", progress=False,
                seed=0, value_model="policy")
    base.update(kw)
    return PPOConfig(**base)


def _reward_curve(run):
    rows = read_jsonl(run / "metrics.jsonl")
    return [r["objective/scores"] for r in rows]


def test_ppo_raises_a_simple_reward_and_a_flipped_sign_does_not(tmp_path, monkeypatch):
    data = _setup(tmp_path)
    train_ppo(_cfg(tmp_path, data, "up"), reward_funcs=[count_x])
    up = _reward_curve(tmp_path / "runs" / "up")
    assert sum(up[-3:]) / 3 > sum(up[:3]) / 3 + 0.15, up

    real = ppo_mod.ppo_advantages

    def flipped(*a, **k):
        r, adv, ret = real(*a, **k)
        return r, -adv, ret
    monkeypatch.setattr(ppo_mod, "ppo_advantages", flipped)
    train_ppo(_cfg(tmp_path, data, "down"), reward_funcs=[count_x])
    down = _reward_curve(tmp_path / "runs" / "down")
    assert sum(down[-3:]) / 3 < sum(up[-3:]) / 3 - 0.15, (up, down)


def test_kl_penalty_holds_the_policy_near_the_reference(tmp_path):
    data = _setup(tmp_path)
    train_ppo(_cfg(tmp_path, data, "free", max_steps=8), reward_funcs=[count_x])
    train_ppo(_cfg(tmp_path, data, "leash", max_steps=8, kl_coef=1.0), reward_funcs=[count_x])
    kl = {n: read_jsonl(tmp_path / "runs" / n / "metrics.jsonl")[-1]["objective/kl"] for n in ("free", "leash")}
    assert kl["leash"] < kl["free"] * 0.5, kl


def test_kl_budget_stops_early_and_checkpoint_has_the_critic(tmp_path):
    data = _setup(tmp_path)
    out = train_ppo(_cfg(tmp_path, data, "budget", max_steps=30, kl_budget=0.5), reward_funcs=[count_x])
    assert out["stopped_early_at"] is not None and out["stopped_early_at"] < 30
    assert out["final_kl"] > 0.5
    ck = tmp_path / "runs" / "budget" / "checkpoints" / f"step-{out['steps']}"
    critic = ScalarHeadModel.from_pretrained(ck / "value", device="cpu")
    assert critic.kind == "value"
    assert json.loads((ck / "ppo_state.json").read_text())["kl_coef"] == 0.0


def test_resume_continues_exactly(tmp_path):
    data = _setup(tmp_path)
    train_ppo(_cfg(tmp_path, data, "full", max_steps=6, kl_coef=0.1, adaptive_kl=True, kl_target=0.1,
                   kl_horizon=100.0), reward_funcs=[count_x])
    train_ppo(_cfg(tmp_path, data, "cut", max_steps=3, save_every=3, kl_coef=0.1, adaptive_kl=True,
                   kl_target=0.1, kl_horizon=100.0), reward_funcs=[count_x])
    train_ppo(_cfg(tmp_path, data, "cut", max_steps=6, resume=True, kl_coef=0.1, adaptive_kl=True,
                   kl_target=0.1, kl_horizon=100.0), reward_funcs=[count_x])
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "step_time", "rollout/seconds",
                                                                   "tokens_per_second")} for r in rows]
    a = strip(read_jsonl(tmp_path / "runs" / "full" / "metrics.jsonl"))
    b = strip(read_jsonl(tmp_path / "runs" / "cut" / "metrics.jsonl"))
    assert len(a) == len(b) == 6
    for ra, rb in zip(a, b):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), k


def test_critic_starts_from_the_reward_model_of_an_rm_spec(tmp_path):
    """value_model='' takes the first `rm:` reward model (a run directory resolves to its newest
    checkpoint): the critic's head starts equal to the RM's head, without the RM's centering offset."""
    from tether.trainers.ppo.critic import load_value_model

    data = _setup(tmp_path)
    model, tok = make_tiny_model(None, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64, seed=1)
    rm = ScalarHeadModel(model, offset=0.7)
    with torch.no_grad():
        rm.head.weight.normal_()
    ck = tmp_path / "rmrun" / "checkpoints" / "step-3"
    rm.save_pretrained(ck, tok)
    torch.save({"step": 3}, ck / "trainer_state.pt")  # what makes it a complete checkpoint
    cfg = _cfg(tmp_path, data, "x", value_model="", reward_funcs=[f"rm:{tmp_path / 'rmrun'}?aggregate=min"])
    critic = load_value_model(cfg, None)
    torch.testing.assert_close(critic.head.weight, rm.head.weight)
    assert critic.offset == 0.0 and critic.kind == "value"
    policy_critic = load_value_model(_cfg(tmp_path, data, "y", value_model="policy",
                                          reward_funcs=[f"rm:{tmp_path / 'rmrun'}"]), None)
    assert not torch.allclose(policy_critic.head.weight, rm.head.weight)


@pytest.mark.slow  # kept out of the default suite's 10 minutes (the GRPO loop's twin stays in it)
def test_kv_cache_in_gradient_buffer_changes_nothing(tmp_path, monkeypatch):
    """The sampler's cache inside the policy + value gradient buffer (it fits here): the same run
    as with gradients freed after each step and a cache of its own."""
    from tether.rollout import Sampler
    from tether.trainers.core import common
    data = _setup(tmp_path)
    seen = []
    real = Sampler.sample

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        seen.append(self.kv_storage is not None and self.backend.borrowed)
        return out
    monkeypatch.setattr(Sampler, "sample", spy)
    train_ppo(_cfg(tmp_path, data, "shared", max_steps=4, kl_coef=0.1), reward_funcs=[count_x])
    assert seen and all(seen)
    monkeypatch.setattr(common, "flat_grad_buffer", lambda model, at_least=0: None)
    train_ppo(_cfg(tmp_path, data, "own", max_steps=4, kl_coef=0.1), reward_funcs=[count_x])
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "step_time", "rollout/seconds",
                                                                   "tokens_per_second")} for r in rows]
    assert strip(read_jsonl(tmp_path / "runs" / "shared" / "metrics.jsonl")) == \
        strip(read_jsonl(tmp_path / "runs" / "own" / "metrics.jsonl"))


@needs("peft")
def test_lora_trains_only_the_adapters_and_raises_the_reward(tmp_path, monkeypatch):
    """lora_r > 0: the optimizer sees the policy's adapters (and the critic, trained in full), the
    checkpoint holds the adapter, the reference is the base under them (KL 0 before the first
    update, > 0 after), and the reward still goes up as in the full fine-tuning test."""
    from pathlib import Path
    from types import SimpleNamespace

    from tether.trainers.core import setup
    data = _setup(tmp_path)
    trained = []
    real = setup.make_optimizer

    def spy(model, *a, **k):
        trained.extend(n for n, p in model.named_parameters() if p.requires_grad)
        return real(model, *a, **k)
    monkeypatch.setattr(setup, "make_optimizer", spy)
    def no_copy(*a, **k):
        raise AssertionError("the LoRA reference must not copy the model")
    monkeypatch.setattr(setup, "copy", SimpleNamespace(deepcopy=no_copy))
    # (adapters on the inner layers alone barely move this 32-wide random model; on lm_head they do)
    out = train_ppo(_cfg(tmp_path, data, "lora", lora_r=8, lora_alpha=16, lora_targets="lm_head,down_proj",
                         lr=3e-2), reward_funcs=[count_x])
    policy = [n for n in trained if n.startswith("policy.")]
    assert policy and all("lora_" in n for n in policy), policy
    assert any(n.startswith("value.body.") for n in trained)
    ck = Path(out["checkpoint"])
    assert (ck / "adapter_model.safetensors").exists() and not (ck / "model.safetensors").exists()
    assert (ck / "value" / "scalar_head.safetensors").exists()
    rows = read_jsonl(tmp_path / "runs" / "lora" / "metrics.jsonl")
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["objective/kl"] > 0.01
    up = _reward_curve(tmp_path / "runs" / "lora")
    assert sum(up[-3:]) / 3 > sum(up[:3]) / 3 + 0.15, up


def test_release_replica_changes_nothing(tmp_path):
    """rollout.release_replica with PPO (a sampling copy freed for each update, rebuilt for the
    next rollout): the same run as keeping the copy."""
    data = _setup(tmp_path)
    for name, kw in (("kept", {}), ("freed", {"release_replica": True})):
        train_ppo(_cfg(tmp_path, data, name, max_steps=3, kl_coef=0.1, sampler_copy=True, **kw),
                  reward_funcs=[count_x])
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "step_time", "rollout/seconds",
                                                                   "tokens_per_second", "gather_time")} for r in rows]
    a, b = (strip(read_jsonl(tmp_path / "runs" / n / "metrics.jsonl")) for n in ("kept", "freed"))
    assert a == b and len(a) == 3
