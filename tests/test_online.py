"""GRPO-family trainer: each estimator / loss option moves the reward the right way (and a
flipped reward moves the behaviour the other way), None rewards are skipped, the run directory
contract holds, and a resumed run matches an uninterrupted one."""

import json

import pytest
import torch

from tether.errors import UserError
from tether.models import make_tiny_model
from tether.rewards.scoring import score
from tether.trainers.grpo import GRPOConfig, train_grpo

DIGITS = set("0123456789")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # 2 shared cores: tiny ops in 2-thread regions stall when the other core is busy.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    make_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Say {i}:", "tag": i % 2}) + "\n")
    return root


def digit_frac(prompts, completions, completion_ids, **_):
    """Fraction of the completion's characters that are digits (~10% for a random-init model)."""
    return [sum(c in DIGITS for c in t) / max(len(t), 1) for t in completions]


def no_digits(prompts, completions, completion_ids, **_):
    return [-r for r in digit_frac(prompts, completions, completion_ids)]


def _cfg(root, name, **kw):
    base = dict(model=str(root / "model"), data=str(root / "prompts.jsonl"), runs_dir=str(root / "runs"),
                name=name, batch_size=4, num_generations=8, max_new_tokens=8, max_steps=15,
                lr=1e-2, device="cpu", progress=False, log_entropy=True, seed=0)
    base.update(kw)
    return GRPOConfig(**base)


def _metrics(root, name):
    return [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _digits_start_end(root, name):
    """Mean digit fraction over the first and last 4 steps of a run (rewards/digit_frac/mean)."""
    rows = _metrics(root, name)
    key = next(k for k in rows[0] if k.startswith("rewards/") and k.endswith("/mean"))
    sign = -1.0 if "no_digits" in key else 1.0
    vals = [sign * r[key] for r in rows]
    return sum(vals[:4]) / 4, sum(vals[-4:]) / 4


@pytest.mark.parametrize("advantage,beta,extra", [
    ("grpo", 0.0, {}),
    ("dr_grpo", 0.0, {"loss_agg": "seq-mean-token-sum-norm"}),
    ("rloo", 0.0, {}),
    ("reinforce_pp_baseline", 0.0, {}),
    ("grpo", 0.05, {"num_iterations": 2, "micro_batch_size": 12}),
    ("grpo", 0.0, {"importance_level": "sequence", "loss_agg": "seq-mean-token-mean",
                   "clip_low": 3e-3, "clip_high": 4e-3}),
])
def test_reward_moves_the_right_way(setup, advantage, beta, extra):
    root = setup
    name = f"{advantage}-{beta}-{len(extra)}"
    up = train_grpo(_cfg(root, name + "-up", advantage=advantage, beta=beta, **extra),
                    reward_funcs=[digit_frac])
    down = train_grpo(_cfg(root, name + "-down", advantage=advantage, beta=beta, **extra),
                      reward_funcs=[no_digits])
    s_up, e_up = _digits_start_end(root, name + "-up")
    s_dn, e_dn = _digits_start_end(root, name + "-down")
    assert e_up > s_up + 0.1, (s_up, e_up)        # rewarded digits: more digits
    assert e_dn < s_dn - 0.03, (s_dn, e_dn)       # penalized digits (a flipped sign): fewer
    rows = _metrics(root, name + "-up")
    for key in ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "completions/mean_length", "completions/clipped_ratio",
                "step_time", "tokens_per_second", "sampling/sampling_logp_difference/mean"):
        assert key in rows[-1], key
    # the sampler and the trainer agree on log-probs (fp32, CPU)
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-3
    if beta > 0:
        assert rows[-1]["kl"] > 0
    assert up["steps"] == 15 and down["steps"] == 15


def test_none_rewards_are_skipped(setup):
    root = setup
    seen = []

    def odd_only(prompts, completions, completion_ids, tag, **_):
        seen.extend(tag)
        return [None if t == 0 else float(sum(c in DIGITS for c in s)) for s, t in zip(completions, tag)]

    summary = train_grpo(_cfg(root, "none", max_steps=3, batch_size=8), reward_funcs=[odd_only])
    assert set(seen) == {0, 1}  # the extra column reached the function
    rows = _metrics(root, "none")
    assert all(0.2 < r["frac_skipped"] < 0.8 for r in rows)
    assert all(r["reward"] is not None for r in rows)
    assert summary["steps"] == 3

    # scoring: a row no function scores is NaN (skipped); others sum the weighted scored ones
    per_fn, total = score([lambda **k: [None, 1.0], lambda **k: [None, None]], [1.0, 2.0],
                          [{"prompt": "a"}, {"prompt": "b"}], ["x", "y"], [[1], [2]])
    assert torch.isnan(total[0]) and total[1] == 1.0


def test_reward_function_error_names_it(setup):
    def broken(prompts, completions, completion_ids, **_):
        raise KeyError("answer")

    with pytest.raises(UserError, match="broken"):
        train_grpo(_cfg(setup, "broken", max_steps=1), reward_funcs=[broken])


@pytest.mark.parametrize("batch_size", [4, 1])  # 1: the KV cache fits in the gradient buffer
def test_resume_matches_uninterrupted(setup, batch_size):
    root = setup
    ref, cut = f"ref{batch_size}", f"cut{batch_size}"
    train_grpo(_cfg(setup, ref, max_steps=6, save_every=3, batch_size=batch_size), reward_funcs=[digit_frac])
    train_grpo(_cfg(setup, cut, max_steps=3, batch_size=batch_size), reward_funcs=[digit_frac])
    # the 3-step run's final checkpoint is step 3 with an untouched schedule (constant lr)
    res = train_grpo(_cfg(setup, cut, max_steps=6, resume=True, batch_size=batch_size), reward_funcs=[digit_frac])
    assert res["steps"] == 6
    volatile = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds"}
    a = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(root, ref)]
    b = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(root, cut)]
    assert a == b


def test_sampler_copy_is_refreshed_after_every_update(setup):
    """rollout.sampler_copy: the sampler runs on a copy of the policy (bf16 on CUDA; here on CPU
    the same dtype), brought up to date after each update — so the run is the one without a copy,
    step for step (a copy left stale would sample step 2's completions from step 0's weights)."""
    volatile = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds",
                "gather_time"}
    train_grpo(_cfg(setup, "nocopy", max_steps=3), reward_funcs=[digit_frac])
    train_grpo(_cfg(setup, "copy", max_steps=3, sampler_copy=True), reward_funcs=[digit_frac])
    a = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(setup, "nocopy")]
    b = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(setup, "copy")]
    assert a == b and len(a) == 3
    assert all("gather_time" in r for r in _metrics(setup, "copy"))  # the copy was used and refreshed
    assert a[0]["loss"] != a[-1]["loss"]  # the weights did move between the samplings


def test_a_bf16_sampling_copy_borrows_the_fp32_gradient_buffer(setup, monkeypatch):
    """rollout.sampler_copy with a bf16 copy (forced here on CPU; on CUDA the default under mixed
    precision): the bf16 KV cache lives in the fp32 gradient buffer's bytes (viewed as bf16), and the
    run equals the one whose cache has memory of its own."""
    from tether.rollout import Sampler
    from tether.trainers.core import common, sharding
    monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device: True)
    seen = []
    real_sample = Sampler.sample

    def spy(self, *a, **k):
        out = real_sample(self, *a, **k)
        s, b = self.kv_storage, self.backend.k
        seen.append(s is not None and s.dtype == b.dtype == torch.bfloat16
                    and s.data_ptr() <= b.data_ptr() < s.data_ptr() + s.numel() * s.element_size())
        return out
    monkeypatch.setattr(Sampler, "sample", spy)
    kw = dict(max_steps=3, batch_size=1, micro_batch_size=4, sampler_copy=True)
    train_grpo(_cfg(setup, "bf16_shared", **kw), reward_funcs=[digit_frac])
    assert seen and all(seen)
    monkeypatch.setattr(common, "flat_grad_buffer", lambda model, at_least=0: None)
    train_grpo(_cfg(setup, "bf16_own", **kw), reward_funcs=[digit_frac])
    volatile = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds",
                "gather_time"}
    a = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(setup, "bf16_shared")]
    b = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(setup, "bf16_own")]
    assert a == b and len(a) == 3


def test_the_default_samples_from_a_copy_exactly_when_the_trainer_computes_in_bf16(setup, monkeypatch):
    """rollout.sampler_copy=auto (the default): a bf16 trainer over fp32 weights (CUDA under mixed
    precision; forced here) samples from a copy in the compute dtype — the policy its gradient is
    taken for — and an fp32 trainer from its weights; true / false force either way."""
    from tether.trainers.core import sharding
    used = {}
    for bf16, copy, want in ((True, "auto", True), (False, "auto", False), (True, False, False),
                             (False, True, True)):
        monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device, b=bf16: b)
        name = f"auto-{bf16}-{copy}"
        train_grpo(_cfg(setup, name, max_steps=1, batch_size=1, sampler_copy=copy), reward_funcs=[digit_frac])
        used[name] = "gather_time" in _metrics(setup, name)[0]  # the copy's refresh is timed
        assert used[name] == want, used


def test_sampling_copy_casts_the_weights_not_the_rope_buffers():
    """The bf16 sampling copy (rollout.sampler_copy on CUDA; the torchrun replica): parameters in
    bf16, refreshed from the fp32 weights by copy_full_weights; RoPE's non-persistent inv_freq stays
    fp32 (no refresh restores a buffer, and a bf16 one put the cos/sin tables visibly off)."""
    from transformers import AutoModelForCausalLM
    from tether import distributed
    from tether.models.tiny import tiny_config
    from tether.trainers.core.setup import sampling_copy
    model = AutoModelForCausalLM.from_config(tiny_config(40, family="qwen2", hidden_size=32, num_layers=2,
                                                         num_heads=2, num_kv_heads=1, intermediate_size=64))
    copy_ = sampling_copy(model, torch.device("cpu"), bf16=True)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy_.parameters())
    inv = {n: b for n, b in copy_.named_buffers() if n.endswith("inv_freq")}
    assert inv and all(b.dtype == torch.float32 for b in inv.values())
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in inv.items())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    distributed.copy_full_weights(model, copy_)
    assert all(torch.equal(c, p.to(torch.bfloat16)) for c, p in zip(copy_.parameters(), model.parameters()))


def test_kv_cache_in_gradient_buffer_changes_nothing(setup, monkeypatch):
    """The sampler's KV cache lives in the trainer's gradient buffer (common.flat_grad_buffer):
    the run — rewards, losses, log-prob mismatch, weights — is the same as with a cache of its own,
    and the cache really is inside the buffer."""
    from tether.trainers.core import common
    from tether.rollout import Sampler

    seen = []
    real_sample = Sampler.sample

    def spy(self, *a, **k):
        out = real_sample(self, *a, **k)
        if self.kv_storage is not None:
            b, s = self.backend.k, self.kv_storage
            seen.append(s.data_ptr() <= b.data_ptr() < s.data_ptr() + s.numel() * s.element_size())
        return out
    monkeypatch.setattr(Sampler, "sample", spy)
    shared = train_grpo(_cfg(setup, "kv_shared", max_steps=4, batch_size=1, micro_batch_size=4), reward_funcs=[digit_frac])
    assert seen and all(seen)
    seen.clear()
    train_grpo(_cfg(setup, "kv_too_big", max_steps=1, batch_size=8), reward_funcs=[digit_frac])
    assert not seen  # 64 sequences' cache > the gradients: no shared buffer, gradients freed as usual
    monkeypatch.setattr(common, "flat_grad_buffer", lambda model, at_least=0: None)
    own = train_grpo(_cfg(setup, "kv_own", max_steps=4, batch_size=1, micro_batch_size=4), reward_funcs=[digit_frac])
    volatile = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds"}
    a = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(setup, "kv_shared")]
    b = [{k: v for k, v in r.items() if k not in volatile} for r in _metrics(setup, "kv_own")]
    assert a == b
    from safetensors.torch import load_file
    wa = load_file(f"{shared['checkpoint']}/model.safetensors")
    wb = load_file(f"{own['checkpoint']}/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("advantage", ["grpo", "remax"])
def test_release_replica_frees_the_copy_for_the_update_and_changes_nothing(setup, monkeypatch, advantage):
    """rollout.release_replica: the sampling copy's weights (and the sampler's cache) are freed
    once the batch is sampled — through the reference's forward and the update — and rebuilt for
    the next rollout, in new memory (ReMax's greedy baseline brings it back in between): the same
    run as keeping them, step for step and in the final weights."""
    from safetensors.torch import load_file
    from tether.trainers.grpo import loop as online
    seen = []
    for name in ("prepare_batch", "update_policy"):
        real = getattr(online, name)

        def spy(t, *a, _real=real, _name=name, **k):
            seen.append((_name, t.replica is not None and all(p.numel() == 0 for p in t.replica.parameters())))
            return _real(t, *a, **k)
        monkeypatch.setattr(online, name, spy)
    volatile = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds",
                "gather_time"}
    kw = dict(max_steps=3, sampler_copy=True, advantage=advantage, beta=0.05)
    kept = train_grpo(_cfg(setup, f"kept{advantage}", **kw), reward_funcs=[digit_frac])
    assert seen and not any(empty for _, empty in seen)
    seen.clear()
    freed = train_grpo(_cfg(setup, f"freed{advantage}", release_replica=True, **kw), reward_funcs=[digit_frac])
    assert seen == [("prepare_batch", True), ("update_policy", True)] * 3
    a, b = ([{k: v for k, v in r.items() if k not in volatile} for r in _metrics(setup, n)]
            for n in (f"kept{advantage}", f"freed{advantage}"))
    assert a == b and len(a) == 3
    wa, wb = (load_file(f"{s['checkpoint']}/model.safetensors") for s in (kept, freed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_release_replica_refusals(setup):
    from tether.config import ConfigError
    with pytest.raises(ConfigError, match="nothing to release"):
        _cfg(setup, "x", release_replica=True)  # one process without a copy
    with pytest.raises(ConfigError, match="synchronous loop"):
        _cfg(setup, "x", release_replica=True, sampler_copy=True, max_staleness=1)
