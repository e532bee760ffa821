"""PPO-RLHF and best-of-n under torchrun (2 processes, gloo, FSDP2) compute what one process
computes (tether/trainers/ppo/update.py): every logged number, the samples, the policy's and the
critic's weights; a 2-process checkpoint resumes in one process; best-of-n (+ RFT) writes the same
outputs.

The data is built so that distributed shortcuts that look right fail. Completions end at stop
strings, so the ranks' completion-token counts differ (a per-rank whitening or token mean is not the
global one), and prompts repeat across the ranks' parts of a batch (a rank keying its sampling
streams by its own prompts alone draws other completions). The reward model is a sharded frozen
forward on both ranks and also initialises the critic. Which wrong variant each assertion catches
was checked by planting it: see the comments. LoRA PPO matches too."""

import json
import random
import shutil
import sys

import pytest

from dist_support import assert_same_metrics, assert_same_weights, ok, run_tether
from extras import needs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo on Linux")

STEPS, BATCH, GENERATIONS = 4, 8, 2


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import torch

    from tether.models import make_tiny_model
    from tether.models.heads import ScalarHeadModel
    root = tmp_path_factory.mktemp("dist_ppo")
    shape = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    make_tiny_model(root / "model", seed=0, **shape)
    body, tok = make_tiny_model(None, seed=1, **shape)
    rm = ScalarHeadModel(body, offset=0.3)
    with torch.no_grad():  # a head that tells completions apart (the fresh one is near 0)
        rm.head.weight.copy_(torch.linspace(-1, 1, rm.head.weight.numel()).view_as(rm.head.weight))
    rm.save_pretrained(root / "rm", tok)
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6))) for _ in range(12)]
    prompts += prompts[:4]  # repeated prompts: their occurrence numbers key the sampling streams
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (root / "reward.py").write_text(
        "def digits(prompts, completions, **_):\n"
        "    return [sum(c.isdigit() for c in x) / max(len(x), 1) for x in completions]\n\n"
        "def length(prompts, completions, **_):\n"
        "    return [float(len(x)) for x in completions]\n")
    return root


def test_a_share_of_the_prompts_draws_what_the_whole_batch_draws(world):
    # What lets a rank sample its part alone: streams keyed by the whole list (a repeated
    # prompt's occurrence number counts the copies other ranks sample).
    from tether.models import load_model, load_tokenizer
    from tether.rollout import Sampler
    sampler = Sampler(load_model(str(world / "model"), device="cpu"), load_tokenizer(str(world / "model")),
                      max_new_tokens=12)
    prompts = [[1, 5, 6], [1, 7], [1, 5, 6], [1, 8, 9, 10]]
    whole = sampler.sample(prompts, n=3, seed=11)
    part = sampler.sample(prompts, n=3, seed=11, only=[2, 3])
    assert part.texts == whole.texts[6:] and part.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert sampler.sample(prompts[2:], n=3, seed=11).texts != part.texts  # alone: other draws


def _ppo(root, name, **kw):
    base = dict(model=root / "model", data=root / "prompts.jsonl", runs_dir=root / "runs", name=name,
                batch_size=BATCH, num_generations=GENERATIONS, max_new_tokens=8, stop="[e,3]",
                max_steps=STEPS, save_every=2, lr=3e-3, kl_coef=0.05, ppo_epochs=2, num_minibatches=4,
                ent_coef=0.01, device="cpu", progress="false", seed=0, value_model="",
                reward_funcs=f"[rm:{root / 'rm'},{root / 'reward.py'}:digits]", reward_weights="[1.0,2.0]",
                num_samples=BATCH * GENERATIONS,
                # held-out greedy evaluation (every rank scores every prompt, the RM's sharded
                # forwards included) and keep_best's collective write of checkpoints/best
                eval_data=root / "prompts.jsonl", eval_every=2, keep_best="eval/reward")
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def one(world):
    ok(run_tether("ppo", _ppo(world, "one")))
    return world / "runs" / "one"


@pytest.fixture(scope="module")
def two(world):
    ok(run_tether("ppo", _ppo(world, "two"), nproc=2))
    return world / "runs" / "two"


def _samples(run):
    return [json.loads(r) for r in (run / "samples.jsonl").read_text().splitlines()]


def test_ppo_in_two_processes_equals_one_process(one, two):
    # The premise: in some step the ranks' parts (every other prompt of the batch) hold different
    # numbers of completion tokens; a text's characters are its tokens here, EOS adds at most one.
    rows = _samples(one)
    assert len(rows) == STEPS * BATCH * GENERATIONS
    uneven = 0
    for s in range(STEPS):
        step = rows[s * BATCH * GENERATIONS:(s + 1) * BATCH * GENERATIONS]
        chars = [sum(len(r["completion"]) for i, r in enumerate(step) if i // GENERATIONS % 2 == rank)
                 for rank in (0, 1)]
        uneven += abs(chars[0] - chars[1]) > BATCH * GENERATIONS // 2
    assert uneven, "the ranks' token counts must differ for this test to mean anything"

    # Every logged number (rewards, KL, entropy, losses, clip fractions, grad norm, mismatch) of
    # every step. Each planted, each failed here: whitening advantages per rank (step 1), each
    # rank's token mean as its loss, i.e. the ranks' means averaged (step 1), statistics of a rank's
    # own sequences (step 1, rewards/*), a rank keying its sampling streams by its own prompts only
    # (step 2: the first batch with a repeated prompt on both ranks). A critic left unsharded, or
    # sharded after the optimizer was built, does not run at all (ok() fails).
    assert assert_same_metrics(one, two) >= STEPS * 30
    # the same completions of the same prompts, with the same scores, in the same order
    a, b = _samples(one), _samples(two)
    assert [(r["prompt"], r["completion"]) for r in a] == [(r["prompt"], r["completion"]) for r in b]
    assert all(abs(x["score"] - y["score"]) <= 1e-5 * max(1, abs(x["score"])) for x, y in zip(a, b))
    # the policy and the critic at each checkpoint: the updates of the global token means
    for step in ("step-2", f"step-{STEPS}"):
        assert_same_weights(one / "checkpoints" / step, two / "checkpoints" / step)
        assert_same_weights(one / "checkpoints" / step / "value", two / "checkpoints" / step / "value")
        assert json.loads((two / "checkpoints" / step / "ppo_state.json").read_text()) == \
            json.loads((one / "checkpoints" / step / "ppo_state.json").read_text())
    # the critic was gathered whole onto rank 0 (a plain scalar-head model), the optimizer's
    # state (policy + critic) written as one shard per rank
    from tether.models.heads import ScalarHeadModel
    critic = ScalarHeadModel.from_pretrained(two / "checkpoints" / f"step-{STEPS}" / "value", device="cpu")
    assert critic.kind == "value"
    assert len(list((two / "checkpoints" / f"step-{STEPS}" / "optimizer").glob("*.distcp"))) == 2
    rows = [json.loads(r) for r in (two / "metrics.jsonl").read_text().splitlines()]
    assert all("gather_time" in r for r in rows if "objective/kl" in r)
    # eval points at 2 and 4, compared above with one process's; the same best step and weights
    assert [r["step"] for r in rows if "eval/greedy/reward" in r] == [2, STEPS]
    best = [json.loads((run / "summary.json").read_text())["best"] for run in (one, two)]
    assert best[0]["step"] == best[1]["step"] and best[0]["value"] == pytest.approx(best[1]["value"], rel=1e-5)
    assert_same_weights(one / "checkpoints" / "best", two / "checkpoints" / "best")


def test_a_two_process_checkpoint_resumes_in_one_process(world, one, two):
    run = world / "runs" / "resumed"
    shutil.copytree(two, run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")  # as if stopped after the checkpoint at step 2
    ok(run_tether("ppo", _ppo(world, "resumed", resume="true")))
    assert_same_metrics(one, run)
    last = f"step-{STEPS}"  # the critic and its optimizer state came back too
    assert_same_weights(one / "checkpoints" / last, run / "checkpoints" / last)
    assert_same_weights(one / "checkpoints" / last / "value", run / "checkpoints" / last / "value")


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_replicated_ppo_in_two_processes_equals_one_process(world, one):
    # fsdp=false: policy, reference, critic and the rollout replica whole on every rank, gradients
    # summed at the step (distributed.sum_gradients) -- the same run as one process and as FSDP2
    ok(run_tether("ppo", _ppo(world, "replicated", fsdp="false"), nproc=2))
    run = world / "runs" / "replicated"
    assert assert_same_metrics(one, run) >= 2 * 30
    last = f"step-{STEPS}"
    assert_same_weights(one / "checkpoints" / last, run / "checkpoints" / last)
    assert_same_weights(one / "checkpoints" / last / "value", run / "checkpoints" / last / "value")


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
@needs("peft")
def test_lora_ppo_in_two_processes_equals_one_process(world):
    # Adapters on the sharded policy, the reference as the base with them disabled, the critic
    # trained in full; the checkpoint holds the adapter (gathered) and the critic.
    lora = dict(lora_r=4, lora_alpha=8, lora_targets="down_proj,o_proj", max_steps=2, save_every=0)
    ok(run_tether("ppo", _ppo(world, "lora1", **lora)))
    ok(run_tether("ppo", _ppo(world, "lora2", **lora), nproc=2))
    a, b = world / "runs" / "lora1", world / "runs" / "lora2"
    assert assert_same_metrics(a, b) >= 2 * 30
    assert_same_weights(a / "checkpoints" / "step-2", b / "checkpoints" / "step-2")
    assert_same_weights(a / "checkpoints" / "step-2" / "value", b / "checkpoints" / "step-2" / "value")
    assert (b / "checkpoints" / "step-2" / "adapter_model.safetensors").exists()


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_best_of_n_in_two_processes_writes_what_one_process_writes(world):
    def bon(name, nproc):
        args = dict(model=world / "model", data=world / "prompts.jsonl", runs_dir=world / "runs",
                    name=name, n=4, max_new_tokens=8, stop="[e,3]", batch_size=6, device="cpu",
                    dtype="fp32", seed=3, reward_funcs=f"[rm:{world / 'rm'},{world / 'reward.py'}:length]",
                    reward_weights="[1.0,10.0]", gold_reward=f"{world / 'reward.py'}:digits",
                    rft="true", rft_lr=1e-3, rft_batch_size=4, progress="false")
        ok(run_tether("bon", [f"{k}={v}" for k, v in args.items()], nproc=nproc))
        return world / "runs" / name
    a, b = bon("bon1", 1), bon("bon2", 2)
    # 16 prompts, 8 a rank; the repeated ones span both ranks. The kept completions, their proxy and
    # gold rewards, and the RFT data are byte for byte the same (a rank keying its streams by its
    # own prompts alone fails here, as does any order but the prompts').
    for f in ("samples.jsonl", "rft.jsonl"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert assert_same_metrics(a, b) >= 3 * 4  # the best-of-n' curve: kl_bon, d, proxy, gold
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    for s in (sa, sb):
        s.pop("sample_seconds")
        s["rft"].pop("data"), s["rft"].pop("checkpoint")
    assert sa == sb
    # RFT is train_sft under the same torchrun: the same steps, the same weights
    assert_same_metrics(a / "rft", b / "rft")
    last = sorted((a / "rft" / "checkpoints").iterdir())[-1].name
    assert_same_weights(a / "rft" / "checkpoints" / last, b / "rft" / "checkpoints" / last)
