"""Partial rollouts (tether/trajectories/partial.py): completions continue across weight updates,
each token tagged with the version that sampled it. The tags are checked against truth: every
token's sampler log-prob is recomputed with the weights of the version it names (and differs under
another version's); a budget that never splits a completion is the loop without partial rollouts,
bit for bit; the TIS weight is per token (a completion's tokens of the current version weigh 1,
its older tokens π_old / μ)."""

import contextlib

import pytest
import torch
from safetensors.torch import load_file

from queue_support import digit_frac, grpo_cfg, make_world, metric_rows, one_thread_for_the_module
from tether.config import ConfigError
from tether.models.load import load_model, load_tokenizer
from tether.models.logprobs import completion_token_logps
from tether.rollout import Sampler
from tether.trainers.grpo import loop as online
from tether.trainers.grpo import train_grpo
from tether.trajectories.partial import PartialRollouts

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    yield from one_thread_for_the_module()


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    # the runs' plots (plots/*.png) are most of a 3-step run's time and no part of what is tested here
    monkeypatch.setattr("tether.trainers.core.setup.plot_metrics", lambda path: [])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("online_partial"))


_cfg, _rows = grpo_cfg, metric_rows


def _logps(model, rollout):
    """The training forward's log-probs of the rollout's completion tokens [N, T]."""
    batch = rollout.training_batch()
    with torch.no_grad():
        lp, _ = completion_token_logps(model, batch, rollout.logprob_temperature, contextlib.nullcontext())
    return lp[:, -rollout.completion_ids.shape[1]:]


def test_partial_metrics_read_the_completion_columns_of_a_padded_batch():
    """partial_metrics finds the completion columns after the prompts, also when GRPO pads the
    training batch's width (training_batch(16)): the same numbers as from the unpadded batch."""
    from types import SimpleNamespace
    from tether.rollout import Rollout
    from tether.trajectories.partial import partial_metrics
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    versions = torch.tensor([[3, 4, 4, -1], [2, 2, 3, 4], [4, -1, -1, -1]])
    ro = Rollout(prompt_ids=[[1, 5, 6], [1, 7], [1, 8, 9, 10]], completion_ids=torch.full((3, 4), 11),
                 completion_mask=mask, logprobs=torch.zeros(3, 4), texts=[""] * 3, finish_reasons=["eos"] * 3,
                 group=torch.tensor([0, 0, 1]), logprob_temperature=1.0, versions=versions)
    got = [partial_metrics(SimpleNamespace(collected=SimpleNamespace(rollout=ro),
                                           mask=ro.training_batch(m)["completion_mask"]), step=5)
           for m in (1, 16)]
    assert ro.training_batch(16)["completion_mask"].shape[1] == 16
    # lags 2,1,1 / 3,3,2,1 / 1: mean 14/8, max 3; rows 0 and 1 span two or more versions, row 2 one
    assert got[0] == got[1]
    assert got[0] == pytest.approx({"partial/token_staleness/mean": 14 / 8, "partial/token_staleness/max": 3.0,
                                    "partial/spanning_completions": 2 / 3})


def test_a_completion_started_at_v_and_finished_at_v_plus_1_is_split_by_construction(setup):
    """Hand case: two prompts, 2 samples each, 4 tokens a round, 8 at most. A's samples end in round
    0 (each at an end token chosen from its own first tokens), B's run on; the weights change (version
    1) and B's samples finish: their first 4 tokens are round 0's, tagged 0, with round 0's log-probs
    (the v0 weights'), the rest tagged 1 with the v1 weights' log-probs."""
    model, tok = load_model(str(setup / "model"), device="cpu"), load_tokenizer(str(setup / "model"))
    model.eval()
    cfg = _cfg(setup, "hand", num_generations=2, partial=True, partial_tokens=4, max_new_tokens=8)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    A, B = {"prompt_ids": ids("a=")}, {"prompt_ids": ids("b=")}
    sampler = Sampler(model, tok, cfg.rollout.sampling())
    seed0 = cfg.run.seed * 1_000_003  # step 0's seed (the loop's)
    first = sampler.sample([A["prompt_ids"], B["prompt_ids"]], n=2, seed=seed0, max_new_tokens=4)
    assert first.finish_reasons == ["length"] * 4  # none ends by itself within 4 tokens
    b_tokens = set(first.completion_ids[2:].flatten().tolist())
    ends = [next(t for t in first.completion_ids[i].tolist() if t not in b_tokens) for i in (0, 1)]
    sampler = Sampler(model, tok, cfg.rollout.sampling(), stop_token_ids=ends)  # A's samples end there
    batches = iter([[A, B], [{"prompt_ids": ids("c=")}, {"prompt_ids": ids("d=")}]])
    produce = PartialRollouts(lambda: (next(batches), None),
                              lambda rows, ro: (torch.zeros(len(ro), 1), torch.zeros(len(ro))), cfg, start=0)
    b0 = produce(0, sampler)
    assert [r["prompt_ids"] for r in b0.prompt_rows] == [A["prompt_ids"]] and len(produce.pool) == 1
    ro0 = b0.rollout
    assert ro0.finish_reasons == ["eos", "eos"]
    for i in (0, 1):
        n = int(ro0.lengths[i])
        assert n <= 4 and int(ro0.completion_ids[i, n - 1]) in ends
        assert ro0.versions[i, :n].tolist() == [0] * n and (ro0.versions[i, n:] == -1).all()
        torch.testing.assert_close(ro0.logprobs[i, :n], first.logprobs[i, :n], atol=1e-6, rtol=0)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # version 1: the weights move
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    b1 = produce(1, sampler)
    assert b1.prompt_rows[0] is B  # the oldest group first
    ro1 = b1.rollout
    lp1 = _logps(model, ro1)
    model.load_state_dict(v0)
    lp0 = _logps(model, ro1)
    for i in (0, 1):  # B's two samples
        n = int(ro1.lengths[i])
        assert n > 4
        assert ro1.versions[i, :n].tolist() == [0] * 4 + [1] * (n - 4)
        assert torch.equal(ro1.completion_ids[i, :4], first.completion_ids[2 + i])
        torch.testing.assert_close(ro1.logprobs[i, :4], first.logprobs[2 + i], atol=1e-6, rtol=0)  # batch size differs
        torch.testing.assert_close(ro1.logprobs[i, :4], lp0[i, :4], atol=1e-5, rtol=0)
        torch.testing.assert_close(ro1.logprobs[i, 4:n], lp1[i, 4:n], atol=1e-5, rtol=0)
        assert (ro1.logprobs[i, 4:n] - lp0[i, 4:n]).abs().max() > 1e-2  # the tag matters


def test_every_token_logp_is_its_tagged_versions(setup, monkeypatch):
    """A partial run (3 tokens a round, 8 at most, lr 1e-2, at staleness 0 and 1): each trained token's
    sampler log-prob equals the training forward's under the checkpoint of the version it is tagged
    with, and not under the next version's; completions do span versions; two runs are equal."""
    seen = []
    real = online.prepare_batch

    def spy(t, collected, cfg):
        seen.append((t.step, collected.rollout))
        return real(t, collected, cfg)
    monkeypatch.setattr(online, "prepare_batch", spy)
    for S in (0, 1):
        seen.clear()
        kw = dict(partial=True, partial_tokens=3, max_steps=4, save_every=1, keep_last=0, max_staleness=S)
        train_grpo(_cfg(setup, f"tags{S}", **kw), reward_funcs=[digit_frac])
        rows = _rows(setup, f"tags{S}")
        ckpt = setup / "runs" / f"tags{S}" / "checkpoints"
        model = load_model(str(setup / "model"), device="cpu")
        weights = {0: {k: v.clone() for k, v in model.state_dict().items()}}
        for v in range(1, 4):
            weights[v] = load_file(str(ckpt / f"step-{v}" / "model.safetensors"))
        spanning = checked = 0
        for step, ro in seen:
            tags = ro.versions
            m = ro.completion_mask
            assert (tags[m] <= step).all() and (tags[m] >= 0).all() and (tags[~m] == -1).all()
            spanning += int(((torch.where(m, tags, 99).amin(1)) < tags.amax(1)).sum())
            for v in tags[m].unique().tolist():
                model.load_state_dict(weights[v], strict=False)
                at = m & (tags == v)
                torch.testing.assert_close(ro.logprobs[at], _logps(model, ro)[at], atol=1e-4, rtol=0)
                checked += int(at.sum())
                if v + 1 in weights:  # another version's weights do not explain these tokens
                    model.load_state_dict(weights[v + 1], strict=False)
                    assert (ro.logprobs[at] - _logps(model, ro)[at]).abs().max() > 1e-3
        assert spanning > 0 and checked == sum(int(ro.completion_mask.sum()) for _, ro in seen)
        assert max(r["partial/token_staleness/max"] for r in rows) >= 1
        # one update, no is_correction: π_old is the update's own forward (ratio exactly 1) even for
        # the tokens of older versions — staleness is corrected only on request (online.prepare_batch)
        assert all(r["ratio/mean"] == 1.0 for r in rows)
        assert any(r["partial/spanning_completions"] > 0 for r in rows)
    train_grpo(_cfg(setup, "tags1b", **kw), reward_funcs=[digit_frac])
    assert _rows(setup, "tags1") == _rows(setup, "tags1b")  # reproducible


@pytest.mark.parametrize("extra", [{}, {"placement": "interleaved", "max_staleness": 1}])
def test_a_budget_that_never_splits_is_the_loop_without_partial_rollouts(setup, extra):
    plain = train_grpo(_cfg(setup, "plain", **extra), reward_funcs=[digit_frac])
    partial = train_grpo(_cfg(setup, "part", partial=True, partial_tokens=8, **extra), reward_funcs=[digit_frac])
    new = {"partial/token_staleness/mean", "partial/token_staleness/max", "partial/spanning_completions",
           "partial/groups_in_flight", "partial/groups"}
    rows = _rows(setup, "part")
    assert _rows(setup, "plain") == _rows(setup, "part", drop=new)  # every logged value, bit for bit
    assert all(r["partial/spanning_completions"] == 0 and r["partial/groups_in_flight"] == 0
               and r["partial/groups"] == 2 for r in rows)
    assert [r["partial/token_staleness/max"] for r in rows] == ([0, 0, 0] if not extra else [0, 1, 1])
    wa, wb = (load_file(f"{s['checkpoint']}/model.safetensors") for s in (plain, partial))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_tis_on_a_partial_rollout_weighs_each_token(setup, monkeypatch):
    """is_correction=tis at staleness 0: within one spanning completion the tokens sampled with the
    trainer's current weights weigh 1 (π_old = μ up to float rounding), its older tokens
    min(π_old / μ, cap) ≠ 1 — one weight per token, from the per-token behaviour log-probs."""
    got = []
    real = online.correct_off_policy

    def spy(batch, grpo):
        before = batch.advantages.clone()
        out = real(batch, grpo)
        got.append((batch, before))
        return out
    monkeypatch.setattr(online, "correct_off_policy", spy)
    cap = 1.5
    train_grpo(_cfg(setup, "tis", partial=True, partial_tokens=3, max_steps=3, is_correction="tis", is_cap=cap),
               reward_funcs=[digit_frac])
    older = 0
    for step, (batch, before) in enumerate(got):
        ro = batch.collected.rollout
        T = ro.completion_ids.shape[1]
        tags, m = ro.versions, batch.mask[:, -T:]
        nz = m & (before[:, -T:] != 0)
        w = batch.advantages[:, -T:][nz] / before[:, -T:][nz]
        rho = (batch.old_logps[:, -T:] - batch.tensors["logprobs"][:, -T:]).exp()[nz]
        torch.testing.assert_close(w, rho.clamp(max=cap), atol=1e-6, rtol=1e-6)
        current = tags[nz] == step
        assert (w[current] - 1).abs().max() < 1e-4
        if (~current).any():
            assert (w[~current] - 1).abs().max() > 1e-3
            older += int((~current).sum())
    assert older > 0


def test_refusals(setup, monkeypatch):
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        _cfg(setup, "x", partial=True, dynamic_sampling=True)
    with pytest.raises(ConfigError, match="sampler_ranks"):
        _cfg(setup, "x", partial=True, placement="disaggregated", sampler_ranks=2)
    for world, kw in (("2", {}), ("3", {"placement": "disaggregated"})):  # 2 trainers: refused up front
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(ConfigError, match="one trainer process"):
            _cfg(setup, "x", partial=True, **kw)
    monkeypatch.setenv("WORLD_SIZE", "2")
    _cfg(setup, "x", partial=True, placement="disaggregated")  # 1 trainer + 1 sampler: allowed
    monkeypatch.delenv("WORLD_SIZE")
    from tether.trainers.preference.online import ODPOConfig  # shares the queue's section: refused at once
    with pytest.raises(ConfigError, match="does not sample partial rollouts"):
        ODPOConfig(model=str(setup / "model"), data=str(setup / "prompts.jsonl"), runs_dir=str(setup / "runs"),
                   name="odpo", batch_size=2, num_generations=2, max_new_tokens=4, max_steps=1, device="cpu",
                   progress=False, overwrite=True, partial=True, reward_funcs=["self"])


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("extra", [{"max_staleness": 0}, {"max_staleness": 1},
                                   {"max_staleness": 2, "partial": True, "partial_tokens": 3},
                                   {"max_staleness": 0, "partial": True, "partial_tokens": 3}])
def test_resume_under_the_queue_is_exact(setup, extra):
    """A run that dies after its step-2 checkpoint (its sampler fails on batch 4), resumed, logs
    and learns exactly what the uninterrupted run does: the checkpoint holds the batches in flight
    (sampled with versions older than its weights), the data position after them and the groups
    partial rollouts had in flight."""
    kw = dict(placement="interleaved", max_steps=5, save_every=2, keep_last=0, **extra)
    tag = "-".join(f"{k}{v}" for k, v in extra.items())
    whole = train_grpo(_cfg(setup, f"whole{tag}", **kw), reward_funcs=[digit_frac])
    calls = []

    def dies(prompts, completions, completion_ids, **cols):
        calls.append(1)
        if len(calls) == 5:  # scoring batch 4: steps 0-3 trained, the step-2 checkpoint written
            raise Crash("the sampler's machine went away")
        return digit_frac(prompts, completions, completion_ids)
    dies.__name__ = dies.__qualname__ = "digit_frac"  # the same metric names as the whole run's
    with pytest.raises(RuntimeError, match="went away"):
        train_grpo(_cfg(setup, f"cut{tag}", **kw), reward_funcs=[dies])
    cut = setup / "runs" / f"cut{tag}" / "checkpoints"
    # at S > 0 the step-4 checkpoint needs batch 4 (in flight), which failed: it is not written
    written = sorted(p.name for p in cut.iterdir() if not p.name.endswith(".tmp"))  # .tmp: abandoned (atomic)
    assert written == ["step-2"] + (["step-4"] if extra["max_staleness"] == 0 else [])
    assert (cut / "step-2" / "queue.pt").exists()
    resumed = train_grpo(_cfg(setup, f"cut{tag}", resume=True, **kw), reward_funcs=[digit_frac])
    assert _rows(setup, f"whole{tag}") == _rows(setup, f"cut{tag}")
    wa, wb = (load_file(f"{s['checkpoint']}/model.safetensors") for s in (whole, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # two torchrun processes: ~60-90 s on the 2 shared cores
@pytest.mark.parametrize("copy", [False, True])
def test_disaggregated_partial_rollouts_match_the_interleaved_run(setup, copy):
    """torchrun (gloo): one trainer + one sampler process with partial rollouts at staleness 1 run
    the interleaved placement's schedule: every metric (the per-token versions' included) and the
    final weights are the one-process run's. copy: both sample from rollout.sampler_copy's copy, the
    sampler receiving each next version while it produces a batch (disaggregated.Incoming)."""
    import sys
    if sys.platform != "linux":
        pytest.skip("torchrun + gloo on Linux")
    from dist_support import ok, run_tether
    (setup / "rewards.py").write_text(
        "def digit_frac(prompts, completions, completion_ids, **_):\n"
        "    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n")
    kw = dict(max_staleness=1, partial=True, partial_tokens=3, max_steps=4, sampler_copy=copy)
    local = train_grpo(_cfg(setup, "pinter", placement="interleaved", **kw), reward_funcs=[digit_frac])
    args = dict(model=setup / "model", data=setup / "prompts.jsonl", runs_dir=setup / "runs", name="pdis",
                batch_size=2, num_generations=4, max_new_tokens=8, lr=1e-2, device="cpu", progress="false",
                seed=0, overwrite="true", placement="disaggregated",
                reward_funcs=f"[{setup / 'rewards.py'}:digit_frac]", **kw)
    ok(run_tether("grpo", [f"{k}={v}" for k, v in args.items()], nproc=2, timeout=600))
    rows = _rows(setup, "pdis", drop=("queue/dropped", "queue/weights_overlapped"))
    assert rows == _rows(setup, "pinter", drop=("queue/dropped",))
    assert max(r["partial/token_staleness/max"] for r in rows) >= 2
    overlapped = [r["queue/weights_overlapped"] for r in _rows(setup, "pdis")]
    assert overlapped == ([0.0, 1.0, 1.0, 0.0] if copy else [0.0] * 4)
    wa = load_file(f"{local['checkpoint']}/model.safetensors")
    wb = load_file(str(setup / "runs" / "pdis" / "checkpoints" / "step-4" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
