"""The GRPO family under torchrun (2 processes, gloo, FSDP2) computes what one process computes:
every logged metric and the final weights, for the KL-regularized multi-update GRPO, REINFORCE++'s
batch whitening and DAPO's token-mean loss with dynamic sampling; and a rank whose reward function
raises stops the job with its own message (tether/trainers/core/ranks.py).

Completions end at stop strings, so their lengths, and with them each rank's token count, differ:
a rank that divided by its own count instead of the batch's would log and learn something else."""

import json
import random
import sys

import pytest
import torch

from dist_support import assert_same_metrics, assert_same_weights, metrics, ok, run_tether

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo on Linux")

REWARDS = '''
import os

def digit_frac(prompts, completions, completion_ids, **_):
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]

def gated(prompts, completions, completion_ids, signal, **_):
    """digit_frac for the prompts whose `signal` is 1; 0 (a group with no variance) for the rest."""
    return [r if s else 0.0 for r, s in zip(digit_frac(prompts, completions, completion_ids), signal)]

def fails_on_rank_1(prompts, completions, completion_ids, **_):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("the reward server is unreachable from rank 1")
    return [0.0] * len(completions)
'''
BATCH, SEED = 8, 0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()  # the one-process runs below run in this process, as the ranks do:
    torch.set_num_threads(1)     # on one thread
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tether.models import make_tiny_model
    from tether.trainers.core.common import EpochSampler
    root = tmp_path_factory.mktemp("dist_online")
    make_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    (root / "rewards.py").write_text(REWARDS)
    rng = random.Random(0)
    prompts = [f"Add {rng.randint(0, 999)} and {i}:" for i in range(48)]
    order = EpochSampler(len(prompts), BATCH, SEED, rank=1, world_size=2)
    first = order.global_batch_at(0)
    # One prompt twice in step 1's batch, once on each rank: its sampling streams are numbered by
    # occurrence in the whole batch, so rank 1 must draw its copy's as the second occurrence.
    prompts[first[1]] = prompts[first[0]]
    # DAPO's step 1: every prompt rank 1 draws has no reward signal, so with one sampling round it
    # keeps no group at all (as one process keeps only rank 0's) and takes its turns on nothing
    silent = set(order.batch_at(0))
    with open(root / "prompts.jsonl", "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p, "signal": int(i not in silent)}) + "\n")
    return root


def _args(root, name, reward="digit_frac", **kw):
    base = dict(model=root / "model", data=root / "prompts.jsonl", runs_dir=root / "runs", name=name,
                batch_size=BATCH, num_generations=4, max_new_tokens=8, stop='["a","e","o"," "]',
                max_steps=3, lr=2e-3, device="cpu", progress="false", seed=SEED,
                reward_funcs=f"[{root / 'rewards.py'}:{reward}]")
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


def _one_process(args):
    from tether.cli import main
    assert main(["grpo", *args]) == 0


def _same_run(root, name, **kw):
    """Runs `name` in one process (here) and in two (torchrun); asserts equal metrics and weights;
    returns the metric rows."""
    _one_process(_args(root, name + "-1", **kw))
    ok(run_tether("grpo", _args(root, name + "-2", **kw), nproc=2, timeout=600))
    one, two = root / "runs" / (name + "-1"), root / "runs" / (name + "-2")
    rows = metrics(one)
    assert assert_same_metrics(one, two) >= 3 * 30
    assert_same_weights(one / "checkpoints" / "step-3", two / "checkpoints" / "step-3")
    assert all(r["completions/min_length"] < r["completions/max_length"] for r in rows)  # lengths vary
    assert "gather_time" in json.loads((two / "metrics.jsonl").read_text().splitlines()[0])
    return rows


def test_grpo_with_kl_and_two_updates(world):
    # Token-mean loss over micro-batches of 3 with the reference's KL in it, μ = 2 (old log-probs
    # recomputed by a sharded forward). Catches: per-rank token denominators (loss, grad_norm),
    # per-rank means of kl / clip / entropy, reference or old log-probs taken on the wrong rows.
    rows = _same_run(world, "grpo", beta=0.05, num_iterations=2, micro_batch_size=3)
    assert all(r["kl"] > 0 for r in rows[1:])


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_reinforce_pp_whitens_over_the_whole_batch(world):
    # KL in the reward, returns whitened over every token of the global batch. Catches: each rank
    # whitening its own half (its advantages would have mean 0 and std 1 on its own tokens).
    rows = _same_run(world, "rpp", advantage="reinforce_pp", beta=0.05, kl_in="reward",
                     num_generations=2)
    assert all("rewards/kl_penalty/mean" in r for r in rows)


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_dapo_token_mean_with_dynamic_sampling(world):
    # DAPO: token-mean loss over the kept, untruncated completions, clip-higher, one round of
    # dynamic sampling (no overlong shaping: its length penalty would give rank 1's groups signal).
    # Catches: per-rank token denominators (ranks keep different
    # numbers of groups and of untruncated tokens), per-rank kept/dropped counts, a rank with no
    # kept group falling back to its own zero-signal groups (one process trains on rank 0's only),
    # and a rank skipping forwards the others take (micro-batches of 3: their counts differ).
    # Gradients reduced once a step (model.fsdp_defer_sync) across those idle turns.
    rows = _same_run(world, "dapo", reward="gated", clip_high=0.28, mask_truncated_completions="true",
                     dynamic_sampling="true", max_sampling_rounds=1, micro_batch_size=3,
                     fsdp_defer_sync="true")
    first = rows[0]
    assert first["dynamic_sampling/dropped_groups"] >= BATCH // 2  # rank 1's, all
    assert 0 < first["dynamic_sampling/kept_groups"] <= BATCH // 2


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_replicated_grpo_and_dapo_equal_one_process(world):
    # fsdp=false (distributed.replicate / sum_gradients): KL in the loss and μ = 2; DAPO with a rank
    # that keeps no group and only takes empty turns (its gradient: zeros, or None where no rank had one)
    _same_run(world, "grpoR", beta=0.05, num_iterations=2, micro_batch_size=3, fsdp="false")
    rows = _same_run(world, "dapoR", reward="gated", clip_high=0.28, mask_truncated_completions="true",
                     dynamic_sampling="true", max_sampling_rounds=1, micro_batch_size=3, fsdp="false")
    assert rows[0]["dynamic_sampling/dropped_groups"] >= BATCH // 2


def test_a_rank_whose_reward_function_raises_stops_the_job_with_its_message(world):
    proc = run_tether("grpo", _args(world, "fails", reward="fails_on_rank_1"), nproc=2,
                      timeout=300)  # a hang guard only
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("[rank 1] tether grpo: error:")]
    assert len(said) == 1 and "unreachable from rank 1" in said[0] and "fails_on_rank_1" in said[0], \
        proc.stderr[-3000:]
