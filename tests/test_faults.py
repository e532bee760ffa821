"""Faults: a run never loses or poisons data.

- a fresh start into a previous run is refused before anything is deleted (overwrite=true replaces
  it, and only after validation); resume=true with no checkpoint starts from step 0 and says so;
- two runs never share a directory (an exclusive lock, refused with one line; a dead holder's lock
  never blocks);
- non-finite weights are never kept or saved: a step that would make them is rolled back exactly,
  and max_skipped_steps refusals in a row stop the run;
- rewards past float32's range still give the right advantages;
- a resume must keep the run's config (except the RESUMABLE fields), and is exact for windowed
  metric means (DPO) and GRPO's reward_history whatever log_every and save_every are.
"""

import copy
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tether.errors import NonFiniteLossError, TrainingDiverged, UserError
from tether.models import make_tiny_model
from tether.objectives.advantages import (compute_advantages, grpo_advantages, group_stats,
                                          reinforce_pp_advantages, rloo_advantages)
from tether.run import LOCK, RunDir, read_jsonl
from tether.tasks import arithmetic
from tether.trainers.core import setup
from tether.trainers.core.common import guarded_step, make_optimizer, make_scheduler, update_is_bounded
from tether.trainers.preference.offline import DPOConfig, train_offline
from tether.trainers.grpo import GRPOConfig, train_grpo
from tether.trainers.sft import SFTConfig, train_sft

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
VOLATILE = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()  # 2 shared cores: small ops stall in 2-thread regions
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    make_tiny_model(root / "model", **TINY)
    train, _ = arithmetic.make_splits(200, 10, seed=1)
    (root / "sft.jsonl").write_text("".join(json.dumps(arithmetic.sft_example(p)) + "\n" for p in train))
    rng = random.Random(0)
    pairs = []
    for _ in range(64):
        w = "".join(rng.choice("abcdefghij") for _ in range(5))
        pairs.append({"prompt": f"{w}=", "chosen": w, "rejected": w[::-1] + "k"})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}:"}) + "\n" for i in range(32)))
    return root


def sft_cfg(root, name, **kw):
    base = dict(model=str(root / "model"), data=str(root / "sft.jsonl"), runs_dir=str(root / "runs"),
                name=name, batch_size=4, max_steps=4, lr=1e-3, log_every=1, device="cpu",
                progress=False, num_samples=1, sample_max_new_tokens=4)
    return SFTConfig(**{**base, **kw})


def snapshot(run: Path) -> dict:
    """Every file of a run directory (but its lock) with its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != LOCK}


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in read_jsonl(run / "metrics.jsonl")]


class Killed(Exception):
    """Stands in for kill -9 right after a checkpoint was written."""


def kill_after_checkpoint(monkeypatch, at_step: int):
    real = setup.Training.checkpoint

    def checkpoint(self):
        path = real(self)
        if self.step == at_step:
            raise Killed
        return path
    monkeypatch.setattr(setup.Training, "checkpoint", checkpoint)


# ---- a failed start never wipes the previous run ---------------------------------------------------

def test_fresh_start_into_a_previous_run_is_refused_and_deletes_nothing(root):
    train_sft(sft_cfg(root, "kept"))
    run = root / "runs" / "kept"
    before = snapshot(run)
    with pytest.raises(UserError, match=r"already holds a run .*resume=true.*name=.*overwrite=true"):
        train_sft(sft_cfg(root, "kept", lr=5e-4))
    # overwrite=true, but the start fails validation (no such data): still nothing deleted
    with pytest.raises(Exception, match="nope.jsonl"):
        train_sft(sft_cfg(root, "kept", data=str(root / "nope.jsonl"), overwrite=True))
    assert snapshot(run) == before


def test_the_cli_refuses_a_rerun_with_one_line(root, capsys):
    from tether.cli import main
    args = ["sft", f"model={root / 'model'}", f"data={root / 'sft.jsonl'}", f"runs_dir={root / 'runs'}",
            "name=cli-rerun", "max_steps=1", "batch_size=4", "device=cpu", "progress=false", "num_samples=0"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds a run" in err and "overwrite=true" in err


def test_overwrite_replaces_the_previous_run(root):
    train_sft(sft_cfg(root, "replaced", max_steps=4))
    summary = train_sft(sft_cfg(root, "replaced", max_steps=2, overwrite=True))
    run = root / "runs" / "replaced"
    assert summary["steps"] == 2
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]


def test_resume_without_a_checkpoint_starts_from_step_0_and_says_so(root, capsys):
    # decided: a start, not an error (a requeued job passes resume=true on its first start too);
    # rows of a run killed before its first checkpoint are produced again, as on any resume
    run = root / "runs" / "never-saved"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.0, "loss": 99.0}) + "\n")
    summary = train_sft(sft_cfg(root, "never-saved", resume=True))
    assert summary["steps"] == 4
    assert f"resume=true but {run} has no checkpoint: starting from step 0" in capsys.readouterr().err
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[0]["loss"] != 99.0


# ---- one run per directory ----------------------------------------------------------------------

HOLD = ("import sys, time; from tether.run import RunDir; RunDir(sys.argv[1], resume=True); "
        "print('ready', flush=True); time.sleep(600)")


def test_a_second_run_into_a_held_directory_is_refused_with_one_line(root):
    train_sft(sft_cfg(root, "held"))
    run = root / "runs" / "held"
    before = snapshot(run)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        for cfg in (sft_cfg(root, "held", resume=True, max_steps=6), sft_cfg(root, "held", overwrite=True)):
            with pytest.raises(UserError, match=rf"in use by another run \(pid {holder.pid} on ") as e:
                train_sft(cfg)
            assert "\n" not in str(e.value)
        assert snapshot(run) == before
    finally:
        holder.kill()  # kill -9: the kernel drops its lock
        holder.wait()
    assert train_sft(sft_cfg(root, "held", resume=True, max_steps=6))["steps"] == 6


def test_a_lock_file_left_by_a_dead_run_does_not_block(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK).write_text("999999999 some-other-host\n")  # no flock held on it
    run = RunDir(tmp_path / "run")
    assert (tmp_path / "run" / LOCK).read_text().split()[0] == str(__import__("os").getpid())
    run.close()


def test_close_releases_the_lock_for_other_processes(tmp_path):
    run = RunDir(tmp_path / "run")
    probe = [sys.executable, "-c", "import sys; from tether.run import RunDir; RunDir(sys.argv[1], resume=True)",
             str(tmp_path / "run")]
    held = subprocess.run(probe, capture_output=True, text=True)
    assert held.returncode != 0 and "in use by another run" in held.stderr
    run.close()
    assert subprocess.run(probe, capture_output=True, text=True).returncode == 0


# ---- non-finite weights are never kept or saved -------------------------------------------------------

def _model_and_optimizer(lr=1e-2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    opt = make_optimizer(model, lr, weight_decay=0.1)
    return model, opt, make_scheduler(opt, "constant", 0, 100)


def _backward(model, seed):
    torch.manual_seed(seed)
    loss = model(torch.randn(16, 8)).pow(2).mean()
    loss.backward()
    return float(loss)


def test_a_step_that_would_make_weights_non_finite_is_rolled_back_exactly():
    model, opt, sched = _model_and_optimizer()
    guarded_step(model, opt, sched, 1.0, _backward(model, 1))  # Adam state exists from here
    for lr in (float("inf"), float("nan"), 1e39):
        for g in opt.param_groups:
            g["lr"] = lr
        params = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict())
        loss = _backward(model, 2)
        assert not update_is_bounded(opt)
        with pytest.raises(NonFiniteLossError, match="rolled back"):
            guarded_step(model, opt, sched, 1.0, loss)
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        after = opt.state_dict()
        for key, old in state["state"].items():
            assert all(torch.equal(old[k], after["state"][key][k]) for k in old)
        assert all(p.grad is None for p in model.parameters())


def test_ordinary_steps_take_no_snapshot_and_match_a_plain_adamw_step():
    a, opt_a, sched_a = _model_and_optimizer()
    b, opt_b, _ = _model_and_optimizer()
    for seed in range(5):
        loss = _backward(a, seed)
        assert update_is_bounded(opt_a)  # the bound vouches for the step: no copy is made
        guarded_step(a, opt_a, sched_a, 1.0, loss)
        _backward(b, seed)
        torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_refused_updates_never_reach_the_checkpoint(root):
    # lr 1e39 overflows float32 on every update: each is rolled back, so the final weights are
    # the initial ones, bit for bit (and finite)
    s = train_sft(sft_cfg(root, "huge-lr", lr=1e39, schedule="constant", warmup_ratio=0.0,
                          max_steps=3, max_skipped_steps=0))
    assert s["skipped_steps"] == 3
    final = load_file(str(Path(s["checkpoint"]) / "model.safetensors"))
    initial = load_file(str(root / "model" / "model.safetensors"))
    assert all(torch.equal(final[k], initial[k]) for k in initial)


def test_consecutive_refused_updates_stop_the_run_with_one_line(root):
    with pytest.raises(TrainingDiverged, match=r"stopped at step 3: 3 updates in a row were refused") as e:
        train_sft(sft_cfg(root, "diverged", lr=1e39, schedule="constant", warmup_ratio=0.0,
                          max_steps=6, save_every=1, max_skipped_steps=3))
    assert "\n" not in str(e.value)
    ckpts = sorted((root / "runs" / "diverged" / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-1", "step-2"]  # the stop comes before step 3 is saved
    initial = load_file(str(root / "model" / "model.safetensors"))
    for c in ckpts:  # every update was refused: the saved weights are the initial ones
        saved = load_file(str(c / "model.safetensors"))
        assert all(torch.equal(saved[k], initial[k]) for k in initial)


# ---- rewards past float32's range -----------------------------------------------------------------

def test_huge_rewards_give_the_same_advantages_as_scaled_ones():
    for big in (1e38, 1e20):  # the leave-one-out advantages (up to 2·big) must fit in float32
        r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, -1.0]) * big
        ids = torch.tensor([0, 0, 0, 0, 1, 1])
        adv = grpo_advantages(r, ids)
        assert adv.dtype == torch.float32
        assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0]), atol=1e-5), big
        assert torch.isfinite(group_stats(r, ids)["std"]).all()
        batch = grpo_advantages(r, ids, scale="batch")
        assert torch.allclose(batch, grpo_advantages(r / big, ids, scale="batch"), atol=1e-5)
        loo = rloo_advantages(r, ids)
        assert torch.allclose(loo / big, rloo_advantages(r / big, ids), atol=1e-5)
        mask = torch.ones(6, 3, dtype=torch.bool)
        pp = reinforce_pp_advantages(r, mask, group_ids=ids)
        assert pp.dtype == torch.float32
        assert torch.allclose(pp, reinforce_pp_advantages(r / big, mask, group_ids=ids), atol=1e-5)
        assert torch.allclose(compute_advantages("grpo", r, ids), adv)
    r = torch.tensor([3e38, -3e38, 3e38, 3e38])  # sums and squares past float32; ±1 and 0 are not
    assert torch.equal(grpo_advantages(r, torch.tensor([0, 0, 1, 1]), eps=0.0), torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_ordinary_rewards_stay_in_float32():
    r = torch.tensor([0.25, 1.0, 0.0, 0.5])
    assert group_stats(r, torch.tensor([0, 0, 1, 1]))["std"].dtype == torch.float32


# ---- resume: the same run, or an error -------------------------------------------------------------

def test_resume_with_a_changed_config_is_refused_listing_the_differences(root):
    train_sft(sft_cfg(root, "guarded", save_every=2))
    run = root / "runs" / "guarded"
    before = snapshot(run)
    with pytest.raises(UserError, match=r"data\.batch_size 4 -> 8; .*optim\.lr 0\.001 -> 0\.01") as e:
        train_sft(sft_cfg(root, "guarded", resume=True, batch_size=8, lr=1e-2, max_steps=6))
    assert "\n" not in str(e.value)
    assert snapshot(run) == before  # config.yaml included
    # the run's length and its logging may change
    s = train_sft(sft_cfg(root, "guarded", resume=True, max_steps=6, log_every=2, keep_last=3))
    assert s["steps"] == 6


def test_resume_checks_an_old_flat_config_yaml(root):
    import yaml
    train_sft(sft_cfg(root, "flat"))
    path = root / "runs" / "flat" / "config.yaml"
    nested = yaml.safe_load(path.read_text())  # the old flat form: `model: <dir>`, `data: <file>`, lr...
    flat = {k: v for section in nested.values() for k, v in section.items() if k != "path"}
    path.write_text(yaml.safe_dump({**flat, "model": nested["model"]["path"], "data": nested["data"]["path"]}))
    with pytest.raises(UserError, match=r"optim\.lr 0\.001 -> 0\.002"):
        train_sft(sft_cfg(root, "flat", resume=True, max_steps=5, lr=2e-3))
    assert train_sft(sft_cfg(root, "flat", resume=True, max_steps=5))["steps"] == 5


# ---- resume is exact for windowed metrics and GRPO's history --------------------------------------

def test_dpo_resume_inside_a_log_window_logs_the_same_means(root, monkeypatch):
    def cfg(name, **kw):
        return DPOConfig(model=str(root / "model"), data=str(root / "pairs.jsonl"), runs_dir=str(root / "runs"),
                         name=name, device="cpu", progress=False, batch_size=4, lr=1e-3, schedule="constant",
                         max_steps=6, log_every=3, save_every=2, num_samples=0, **kw)
    train_offline(cfg("dpo-full"))
    kill_after_checkpoint(monkeypatch, 4)  # step 4: one step into the second log window
    with pytest.raises(Killed):
        train_offline(cfg("dpo-cut"))
    monkeypatch.undo()
    train_offline(cfg("dpo-cut", resume=True))
    full, cut = metrics(root / "runs" / "dpo-full"), metrics(root / "runs" / "dpo-cut")
    assert [r["step"] for r in full if "loss" in r] == [3, 6]
    assert cut == full


def test_grpo_reward_history_survives_a_resume(root, monkeypatch):
    def cfg(name, **kw):
        return GRPOConfig(model=str(root / "model"), data=str(root / "prompts.jsonl"), runs_dir=str(root / "runs"),
                          name=name, batch_size=2, num_generations=4, max_new_tokens=4, max_steps=4,
                          save_every=2, log_every=3, lr=1e-2, device="cpu", progress=False, **kw)

    def reward(prompts, completions, completion_ids, **_):
        return [len(c) / 10 for c in completions]
    full = train_grpo(cfg("grpo-full"), reward_funcs=[reward])
    kill_after_checkpoint(monkeypatch, 2)
    with pytest.raises(Killed):
        train_grpo(cfg("grpo-cut"), reward_funcs=[reward])
    monkeypatch.undo()
    cut = train_grpo(cfg("grpo-cut", resume=True), reward_funcs=[reward])
    assert len(full["reward_history"]) == 4
    assert cut["reward_history"] == full["reward_history"]


def test_max_abs_skips_empty_shards():
    """Under FSDP2 a rank's shard of a small parameter can be empty; the max-abs behind
    update_is_bounded must skip it (CUDA's inf-norm refuses one), keep NaN, and give 0 for none."""
    from tether.trainers.core.common import _max_abs
    assert _max_abs([torch.empty(0), torch.tensor([1.0, -3.0]), torch.empty(0, 4)]) == 3.0
    assert _max_abs([torch.empty(0)]) == 0.0
    assert math.isnan(_max_abs([torch.empty(0), torch.tensor([float("nan"), 1.0])]))
