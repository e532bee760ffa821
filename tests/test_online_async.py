"""The trajectory queue (tether/trajectories/queue.py, tether/trajectories/asynchronous.py): at
max_staleness 0 the queue's placements compute exactly what the synchronous loop computes
(metrics and weights); at staleness 1 every batch is sampled one version behind, on a schedule that
does not depend on timing (two runs are identical); the off-policy correction sees the lag."""

import threading

import pytest
import torch
from safetensors.torch import load_file

from queue_support import digit_frac, grpo_cfg, make_world, metric_rows, one_thread_for_the_module
from tether.config import ConfigError
from tether.errors import UserError
from tether.trajectories.queue import Trajectories, TrajectoryQueue
from tether.trainers.grpo import train_grpo

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    yield from one_thread_for_the_module()


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    # the runs' plots (plots/*.png) are most of a 3-step run's time and no part of what is tested here
    monkeypatch.setattr("tether.trainers.core.setup.plot_metrics", lambda path: [])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("online_async"))


_cfg, _rows = grpo_cfg, metric_rows


def _weights(summary):
    return load_file(f"{summary['checkpoint']}/model.safetensors")


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("extra", [{}, {"is_correction": "tis", "dynamic_sampling": True}])
def test_staleness_0_through_the_queue_is_the_synchronous_loop(setup, extra):
    sync = train_grpo(_cfg(setup, "sync", **extra), reward_funcs=[digit_frac])
    queued = train_grpo(_cfg(setup, "queued", placement="interleaved", max_staleness=0, **extra),
                        reward_funcs=[digit_frac])
    a, b = _rows(setup, "sync"), _rows(setup, "queued", drop=("queue/staleness", "queue/dropped"))
    assert a == b  # every logged value, bit for bit
    assert all(r["queue/staleness"] == 0 for r in _rows(setup, "queued"))
    _same_weights(sync, queued)


def test_staleness_1_is_one_version_behind_and_reproducible(setup):
    kw = dict(placement="interleaved", max_staleness=1, is_correction="tis", is_cap=1.05, max_steps=4)
    first = train_grpo(_cfg(setup, "stale1a", **kw), reward_funcs=[digit_frac])
    second = train_grpo(_cfg(setup, "stale1b", **kw), reward_funcs=[digit_frac])
    rows = _rows(setup, "stale1a")
    assert rows == _rows(setup, "stale1b")  # the versions follow the schedule, not the timing
    _same_weights(first, second)
    assert [r["queue/staleness"] for r in rows] == [0, 1, 1, 1]
    # step 1 samples and trains on the same weights: the IS weights are 1 (up to float rounding);
    # later batches come from the previous version (lr 1e-2 moved the weights): weights ≠ 1
    assert rows[0]["is_weight/max"] == pytest.approx(1.0, abs=1e-4)
    assert rows[0]["is_weight/frac_truncated"] == 0.0
    assert all(abs(r["is_weight/mean"] - 1.0) > 1e-4 for r in rows[1:])
    assert any(r["is_weight/frac_truncated"] > 0 for r in rows[1:])


def test_queue_takes_by_version_drops_stale_and_is_bounded():
    q = TrajectoryQueue(capacity=2)
    q.put(Trajectories("a", version=0, index=0))
    q.put(Trajectories("b", version=2, index=1))
    with pytest.raises(TimeoutError):
        q.put(Trajectories("c", version=3, index=2), timeout=0.05)  # full
    item = q.get(current=3, max_staleness=1)  # version 0 < 3 - 1: dropped; version 2 taken
    assert item.batch == "b" and q.dropped == 1 and len(q) == 0
    with pytest.raises(TimeoutError):
        q.get(current=3, max_staleness=1, timeout=0.05)  # empty
    threading.Timer(0.05, lambda: q.put(Trajectories("d", 3, 2))).start()
    assert q.get(current=3, max_staleness=0, timeout=5).batch == "d"  # waits for the producer
    q.fail(ValueError("reward server down"))
    with pytest.raises(RuntimeError, match="reward server down"):
        q.get(current=4, max_staleness=0, timeout=5)


def test_refusals(setup):
    with pytest.raises(ConfigError, match="remax"):
        _cfg(setup, "x", advantage="remax", num_generations=1, max_staleness=1)
    with pytest.raises(ConfigError, match="sampler_ranks"):
        _cfg(setup, "x", placement="disaggregated", sampler_ranks=2, dynamic_sampling=True)
    with pytest.raises(UserError, match="nproc-per-node 2"):
        train_grpo(_cfg(setup, "x", placement="disaggregated"), reward_funcs=[digit_frac])


@pytest.mark.slow  # two or three torchrun processes: ~90 s on the 2 shared cores
@pytest.mark.parametrize("samplers,copy,S", [(1, False, 1), (2, False, 1), (1, True, 1), (1, True, 2)])
def test_disaggregated_sampler_process_matches_the_interleaved_schedule(setup, samplers, copy, S):
    """torchrun (gloo): one process trains, one or two sample (batches through the store, weights
    broadcast back; with two, batch j is sampler j mod 2's). At staleness S every batch is sampled
    with the same weights as the interleaved placement's, so the run is the same: every metric and
    the final weights. copy: both sample from rollout.sampler_copy's copy (on CPU of the same dtype),
    which the sampler process refreshes from each received version — received while the batch
    before is produced (at S = 2 a receive too early would sample fresher weights)."""
    import sys
    if sys.platform != "linux":
        pytest.skip("torchrun + gloo on Linux")
    from dist_support import ok, run_tether
    (setup / "rewards.py").write_text(
        "def digit_frac(prompts, completions, completion_ids, **_):\n"
        "    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n")
    kw = dict(max_staleness=S, is_correction="tis", is_cap=1.05, sampler_copy=copy)
    local = train_grpo(_cfg(setup, "inter1", placement="interleaved", max_steps=4, **kw), reward_funcs=[digit_frac])
    args = dict(model=setup / "model", data=setup / "prompts.jsonl", runs_dir=setup / "runs", name="dis1",
                batch_size=2, num_generations=4, max_new_tokens=8, max_steps=4, lr=1e-2, device="cpu",
                progress="false", seed=0, overwrite="true", placement="disaggregated",
                reward_funcs=f"[{setup / 'rewards.py'}:digit_frac]", sampler_ranks=samplers, **kw)
    ok(run_tether("grpo", [f"{k}={v}" for k, v in args.items()], nproc=1 + samplers, timeout=600))
    rows = _rows(setup, "dis1", drop=("queue/dropped", "queue/weights_overlapped"))
    assert rows == _rows(setup, "inter1", drop=("queue/dropped",))
    # the sampler's wait for each batch's weights, kept out of rollout/seconds (a timing: volatile)
    import json
    logged = [json.loads(x) for x in (setup / "runs" / "dis1" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "step_time" in r]
    assert all(r["queue/weights_wait_seconds"] >= 0 and r["queue/produce_seconds"] > 0 for r in steps)
    # the previous batch's packing + storing: none before the first batch, some time after
    sends = [r["queue/send_seconds"] for r in steps]
    assert (sends[0] == 0) if samplers == 1 else True
    assert all(x > 0 for x in sends[samplers:])
    assert [r["queue/staleness"] for r in rows] == [min(j, S) for j in range(4)]
    # with a sampling copy (one sampler) version v arrives while batch v + S − 1 is produced
    # (Incoming.post; versions 1 .. 3 − S): the same run as the interleaved one all the same
    overlapped = [float(copy and samplers == 1 and 1 <= j + 1 - S <= 3 - S) for j in range(4)]
    assert [r["queue/weights_overlapped"] for r in steps] == overlapped
    _same_weights(local, {"checkpoint": str(setup / "runs" / "dis1" / "checkpoints" / "step-4")})


@pytest.mark.slow  # three torchrun processes: ~60-90 s on the 2 shared cores
def test_disaggregated_with_two_sharded_trainers(setup):
    """torchrun, 3 processes: 2 trainers (FSDP2 among them, as plain torchrun) + 1 sampler, at
    staleness 1: the interleaved one-process run's metrics (1e-5) and weights (the ranks are
    micro-batches of the sampler's batch)."""
    import sys
    if sys.platform != "linux":
        pytest.skip("torchrun + gloo on Linux")
    from dist_support import TIMING, assert_same_metrics, assert_same_weights, ok, run_tether
    (setup / "rewards.py").write_text(
        "def digit_frac(prompts, completions, completion_ids, **_):\n"
        "    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n")
    kw = dict(max_staleness=1, is_correction="tis", is_cap=1.05)
    train_grpo(_cfg(setup, "inter1b", placement="interleaved", max_steps=4, **kw), reward_funcs=[digit_frac])
    args = dict(model=setup / "model", data=setup / "prompts.jsonl", runs_dir=setup / "runs", name="dis21",
                batch_size=2, num_generations=4, max_new_tokens=8, max_steps=4, lr=1e-2, device="cpu",
                progress="false", seed=0, overwrite="true", placement="disaggregated",
                reward_funcs=f"[{setup / 'rewards.py'}:digit_frac]", **kw)
    ok(run_tether("grpo", [f"{k}={v}" for k, v in args.items()], nproc=3, timeout=600))
    runs = setup / "runs"
    skip = TIMING | {"queue/dropped", "queue/weights_overlapped"}  # (interleaved / disaggregated only)
    one = [{k: v for k, v in r.items() if k not in skip} for r in _rows(setup, "inter1b")]
    three = [{k: v for k, v in r.items() if k not in skip} for r in _rows(setup, "dis21")]
    assert [r["queue/staleness"] for r in three] == [0, 1, 1, 1]
    assert {k for r in one for k in r} == {k for r in three for k in r}
    assert assert_same_metrics(runs / "inter1b", runs / "dis21", keys_may_differ=True) >= 4 * 30
    assert_same_weights(runs / "inter1b" / "checkpoints" / "step-4", runs / "dis21" / "checkpoints" / "step-4")


def test_interleaved_with_a_sampling_copy_evaluates_the_trained_policy(setup):
    """rollout.sampler_copy under the interleaved placement: the sampler thread takes its own copy;
    evaluation must sample the trained policy, not a copy frozen at the first step's weights (on a
    GPU the held-out pass@1 would stay at its step-0 value). On CPU the copy has the weights' dtype, so with and without it every logged value,
    evaluation included, is the same."""
    kw = dict(placement="interleaved", max_staleness=1, max_steps=4, eval_data=str(setup / "prompts.jsonl"),
              eval_every=2)
    train_grpo(_cfg(setup, "evalcopy", sampler_copy=True, **kw), reward_funcs=[digit_frac])
    train_grpo(_cfg(setup, "evalplain", **kw), reward_funcs=[digit_frac])
    copy, plain = (_rows(setup, name, drop=("eval/seconds",)) for name in ("evalcopy", "evalplain"))
    evals = [r for r in plain if any(k.startswith("eval/") for k in r)]
    assert len(evals) >= 2 and evals[0] != evals[-1]  # not vacuous: the policy moved between them
    assert copy == plain


def test_interleaved_evaluation_never_overlaps_the_sampler_thread(setup, monkeypatch):
    """Held-out evaluation runs with the producer thread paused (Interleaved.alone): beside it, on
    CUDA, graph captures fail (H200). The producer is slowed (each of its reward calls
    takes 0.15 s, 2 batches ahead of a fast trainer), so it is mid-batch whenever an eval point
    starts; every producer reward call notes, at its start and at its end, whether an evaluation
    was under way."""
    import time
    from tether.trainers.core import held_out
    state = {"eval": False}
    seen = []
    real = held_out.HeldOut.evaluate

    def flagged_eval(self, *a, **k):
        state["eval"] = True
        try:
            time.sleep(0.1)
            return real(self, *a, **k)
        finally:
            state["eval"] = False
    monkeypatch.setattr(held_out.HeldOut, "evaluate", flagged_eval)

    def reward(prompts, completions, completion_ids, **kw):
        if threading.current_thread().name == "tether-sampler":
            seen.append(state["eval"])
            time.sleep(0.15)
            seen.append(state["eval"])
        return digit_frac(prompts, completions, completion_ids, **kw)
    kw = dict(placement="interleaved", max_staleness=2, max_steps=6, eval_data=str(setup / "prompts.jsonl"),
              eval_every=1)
    train_grpo(_cfg(setup, "evalalone", **kw), reward_funcs=[reward])
    assert len(seen) == 2 * 6 and not any(seen)


def test_interleaved_evaluation_samples_the_sampling_copy_freed_between_eval_points(setup, monkeypatch):
    """With rollout.sampler_copy in bf16 (forced here on CPU, as on CUDA), the interleaved
    placement's eval points sample the trained policy *in bf16* — the numerics it is trained to
    sample with, and what its bf16 checkpoint holds — not the fp32 weights (SmolLM2 on an H100:
    the fp32 weights score greedy pass@1 0.1575, the same weights in bf16 0.4025). The
    trainer's copy is refreshed for each eval point and freed in between (every step's get sees it
    empty)."""
    from tether.trainers.core import held_out, sharding
    from tether.trajectories import asynchronous as online_async
    monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device: True)
    seen, sizes = [], []
    real_eval, real_get = held_out.HeldOut.evaluate, online_async.Interleaved.get

    def eval_dtype(self, model, tokenizer, sampler=None):
        seen.append((next(model.parameters()).dtype, sampler.model is model if sampler else None))
        return real_eval(self, model, tokenizer, sampler)

    def get(self, step):
        sizes.append(sum(p.numel() for p in self.t.replica.parameters()))
        return real_get(self, step)
    monkeypatch.setattr(held_out.HeldOut, "evaluate", eval_dtype)
    monkeypatch.setattr(online_async.Interleaved, "get", get)
    kw = dict(placement="interleaved", max_staleness=1, max_steps=4, eval_data=str(setup / "prompts.jsonl"),
              eval_every=2)
    train_grpo(_cfg(setup, "evalbf16", sampler_copy=True, **kw), reward_funcs=[digit_frac])
    assert seen == [(torch.bfloat16, True)] * 2  # step 2 and the final evaluation
    assert len(sizes) == 4 and set(sizes) == {0}


def test_weight_broadcast_in_buckets_carries_every_tensor(monkeypatch):
    """The disaggregated weight broadcast sends buckets of same-dtype tensors (disaggregated._broadcast);
    with buckets far smaller than the model (and a dtype change among the tensors) the receiver
    (Incoming: its tensors re-homed as views of one flat buffer a bucket, received in place) ends
    with exactly the sender's weights and buffers, tied ones included. A posted version changes
    nothing before wait() (where the sampling copy is marked stale). The process group is faked
    in-process: what trainer rank 0 broadcasts, the sampler receives, in order, on wait()."""
    from types import SimpleNamespace
    from tether.models.tiny import tiny_config
    from tether.trajectories import disaggregated as od
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(od, "BROADCAST_BUCKET_BYTES", 20_000)
    sent = []

    class Work:
        def __init__(self, fn=lambda: None):
            self.fn = fn

        def wait(self):
            self.fn()

    class Sender:
        def broadcast(self, t, src):
            sent.append(t.clone())
            return Work()

    class Receiver:  # (the data lands at wait(), as a broadcast that is still in flight would)
        def broadcast(self, t, src):
            return Work(lambda: t.copy_(sent.pop(0)))
    cfg = tiny_config(40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)  # (tied)
    torch.manual_seed(0)
    a = AutoModelForCausalLM.from_config(cfg)
    a.register_buffer("counts", torch.arange(7, dtype=torch.int64))  # a second dtype in the state_dict
    torch.manual_seed(1)
    b = AutoModelForCausalLM.from_config(cfg)
    b.register_buffer("counts", torch.zeros(7, dtype=torch.int64))
    assert b.lm_head.weight is b.model.embed_tokens.weight
    values = od._tensors(a)  # the tied weight once: one tensor fewer than the state_dict's names
    assert len(values) == len(a.state_dict()) - 1
    buckets = od._buckets(values)
    assert len(buckets) > 3 and all(len({v.dtype for v in bk}) == 1 for bk in buckets)
    assert [v for bk in buckets for v in bk] == values  # order kept, nothing dropped
    t = SimpleNamespace(model=b, replica=object(), replica_stale=False,
                        cfg=SimpleNamespace(rollout=SimpleNamespace(release_replica=False)))
    before = {k: v.clone() for k, v in b.state_dict().items()}
    incoming = od.Incoming(od.Link(samples=True, store=None, weights=Receiver(), timeout=1), t)
    assert incoming.overlaps and len(incoming.flats) == len(buckets)
    sb = b.state_dict()
    assert all(torch.equal(sb[k], before[k]) for k in sb)  # re-homed, not changed
    flat_of = {f.untyped_storage().data_ptr() for f in incoming.flats}
    assert all(v.untyped_storage().data_ptr() in flat_of for v in sb.values())  # every tensor a view
    od._broadcast(od.Link(samples=False, store=None, weights=Sender(), timeout=1), a)
    incoming.post()
    assert all(torch.equal(b.state_dict()[k], before[k]) for k in sb) and not t.replica_stale
    incoming.wait()
    assert not sent and incoming.pending is None and t.replica_stale
    assert b.lm_head.weight is b.model.embed_tokens.weight  # still tied
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # a sampler without a copy to sample from reads the model itself: no receiving during a batch
    t.replica = None
    assert not od.Incoming(od.Link(samples=True, store=None, weights=Receiver(), timeout=1), t).overlaps


@pytest.mark.parametrize("S", [0, 1, 2, 4, 7])  # (7: no version after the first)
def test_sampler_process_schedule_with_weights_received_during_batches(S):
    """disaggregated.serve with a fake link: batch j is sampled with version max(0, j − S)
    exactly (the interleaved placement's schedule), whether or not the next version arrives during
    a batch; a version is received only once the batch the trainer makes it from is stored, every
    version the trainer broadcasts (1 .. total − 1 − S) is received once, and each is received
    during a batch wherever the schedule allows (the batch before the one that needs it)."""
    from types import SimpleNamespace
    from tether.trajectories import disaggregated as od
    total, log = 8, []
    stored = {}

    class Store:
        def set(self, key, raw):
            stored[key] = od._unpack(raw)
            log.append(("stored", int(key.split("/")[1])))

    class Work:
        def __init__(self, v):
            self.v = v

        def wait(self):
            log.append(("arrived", self.v))

    class Weights:
        posted = 0

        def broadcast(self, flat, src):
            self.posted += 1
            log.append(("posted", self.posted))
            return Work(self.posted)
    model = torch.nn.Linear(2, 2)
    t = SimpleNamespace(model=model, replica=object(), replica_stale=False, total_steps=total,
                        cfg=SimpleNamespace(rollout=SimpleNamespace(release_replica=False)),
                        order=SimpleNamespace(next=lambda: None), rollout_model=lambda: None)

    def produce(j, sampler):
        log.append(("produce", j))
        return SimpleNamespace(rollout=SimpleNamespace(stats={}))
    link = od.Link(samples=True, store=Store(), weights=Weights(), timeout=1)
    counts = od.serve(t, link, produce, None, S)
    last = max(0, total - 1 - S)
    assert counts == {"batches": total, "sampling_seconds": counts["sampling_seconds"], "last_version": last}
    assert [stored[f"batch/{j}"].version for j in range(total)] == [max(0, j - S) for j in range(total)]
    posts = [e[1] - 1 for e in log if e[0] == "posted"]  # version 0 is the first broadcast
    assert posts == list(range(last + 1))
    for v in range(1, last + 1):  # version v is made from batch v - 1: posted only after it is stored
        assert log.index(("stored", v - 1)) < log.index(("posted", v + 1))
    overlapped = [stored[f"batch/{j}"].batch.rollout.stats["weights_overlapped"] for j in range(total)]
    # batch j needs version j − S: received during batch j − 1 when S >= 1 (none at S = 0)
    assert overlapped == [float(S >= 1 and 1 <= j + 1 - S <= last) for j in range(total)]
