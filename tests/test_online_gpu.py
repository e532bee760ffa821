"""RL trainers on CUDA: `compile=true` computes the same first step as eager (GRPO, PPO), and PPO
runs the same with the sampler's KV cache in its gradient buffer as without."""

import json

import pytest
import torch

from tether.models import make_tiny_model
from tether.trainers.grpo import GRPOConfig, train_grpo

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def digit_frac(prompts, completions, completion_ids, **_):
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]


def test_compiled_grpo_step_equals_eager(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    make_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128)
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Say {i}:"}) + "\n")
    rows = {}
    for comp in (False, True):
        cfg = GRPOConfig(model=str(tmp_path / "model"), data=str(tmp_path / "p.jsonl"), runs_dir=str(tmp_path / "runs"),
                         name=f"c{int(comp)}", batch_size=1, num_generations=8, max_new_tokens=16, max_steps=2,
                         lr=1e-3, beta=0.05, device="cuda", mixed_precision="no", compile=comp, progress=False, seed=0)
        train_grpo(cfg, reward_funcs=[digit_frac])
        rows[comp] = [json.loads(x) for x in (tmp_path / "runs" / cfg.run.name / "metrics.jsonl").read_text().splitlines()]
    torch._dynamo.reset()
    a, b = rows[False][0], rows[True][0]
    assert a["reward"] == b["reward"]  # same weights, same seed: the same completions
    for k in ("loss", "kl", "grad_norm", "entropy"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k  # fp32 (no autocast), TF32 off


def test_ppo_with_the_kv_cache_in_gradients_equals_without(tmp_path, monkeypatch):
    """PPO on CUDA (graphs captured on the lent cache): the same run with and without the buffer."""
    import tether.trainers.ppo.loop as ppo
    from tether.run import read_jsonl
    make_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}:"}) + "\n" for i in range(16)))
    seen = []
    from tether.trainers.core import common
    real = common.flat_grad_buffer
    for name, fgb in (("lent", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]),
                      ("own", lambda *a, **k: None)):
        monkeypatch.setattr(common, "flat_grad_buffer", fgb)
        cfg = ppo.PPOConfig(model=str(tmp_path / "model"), data=str(tmp_path / "p.jsonl"), name=name,
                            runs_dir=str(tmp_path / "runs"), batch_size=8, num_generations=1, max_new_tokens=16,
                            max_steps=1, lr=1e-3, kl_coef=0.1, device="cuda", mixed_precision="no",
                            value_model="policy", progress=False, seed=0)
        ppo.train_ppo(cfg, reward_funcs=[digit_frac])
    assert seen and seen[0] is not None  # the cache did fit
    drop = {"time", "step_time", "rollout/seconds", "tokens_per_second"}
    a, b = (read_jsonl(tmp_path / "runs" / n / "metrics.jsonl")[0] for n in ("lent", "own"))
    assert a["objective/scores"] == b["objective/scores"]  # the same completions
    for k in a.keys() - drop:  # CUDA reductions are not bitwise deterministic: tolerances
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_compiled_ppo_step_equals_eager(tmp_path, monkeypatch):
    """PPO with compile=true (policy, reference and critic layers) computes the same first step."""
    import tether.trainers.ppo.loop as ppo
    from tether.run import read_jsonl
    make_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}:"}) + "\n" for i in range(16)))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    for comp in (False, True):
        cfg = ppo.PPOConfig(model=str(tmp_path / "model"), data=str(tmp_path / "p.jsonl"), name=f"c{int(comp)}",
                            runs_dir=str(tmp_path / "runs"), batch_size=8, num_generations=1, max_new_tokens=16,
                            max_steps=1, lr=1e-3, kl_coef=0.1, device="cuda", mixed_precision="no",
                            value_model="policy", compile=comp, progress=False, seed=0)
        ppo.train_ppo(cfg, reward_funcs=[digit_frac])
    torch._dynamo.reset()
    a, b = (read_jsonl(tmp_path / "runs" / n / "metrics.jsonl")[0] for n in ("c0", "c1"))
    assert a["objective/scores"] == b["objective/scores"]
    for k in ("objective/kl", "loss/policy_avg", "loss/value_avg", "grad_norm", "policy/entropy_avg"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k


def test_interleaved_eval_points_equal_a_fresh_evaluation(tmp_path, monkeypatch):
    """The interleaved placement on CUDA (sampler thread on a bf16 copy, graphs on both sides):
    every eval point scores what a fresh sampler scores on the same weights at that moment. An eval
    point that samples other numerics than the run's is visible here: SmolLM2 (H100/H200) scores
    0.14-0.16 from its fp32 weights where the same weights score 0.39-0.41 in bf16 in a fresh
    process; evaluation runs with the sampler thread paused
    (asynchronous.Interleaved.alone)."""
    from tether.trainers.core import held_out
    make_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}:"}) + "\n" for i in range(32)))
    pairs = []
    real = held_out.HeldOut.evaluate

    def both(self, model, tokenizer, sampler=None):
        logged = real(self, model, tokenizer, sampler)
        self.sampler = None  # HeldOut's own, new Sampler
        fresh = real(self, model, tokenizer, None)
        self.sampler = None
        pairs.append((logged, fresh))
        return logged
    monkeypatch.setattr(held_out.HeldOut, "evaluate", both)
    cfg = GRPOConfig(model=str(tmp_path / "model"), data=str(tmp_path / "p.jsonl"), runs_dir=str(tmp_path / "runs"),
                     name="inter", batch_size=4, num_generations=8, max_new_tokens=24, max_steps=8, lr=3e-3,
                     device="cuda", placement="interleaved", max_staleness=2, sampler_copy=True,
                     eval_data=str(tmp_path / "p.jsonl"), eval_every=2, progress=False, seed=0)
    train_grpo(cfg, reward_funcs=[digit_frac])
    assert len(pairs) >= 4
    for logged, fresh in pairs:
        for k in ("eval/greedy/reward", "eval/greedy/completions/mean_length"):
            assert logged[k] == pytest.approx(fresh[k], abs=1e-6), (k, pairs)
