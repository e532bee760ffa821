"""The offline preference trainers and the reward model under torchrun (2 processes, gloo, FSDP2)
compute what one process computes: every logged metric (train and held-out) and the final weights
(tether/distributed.py: ranks are micro-batches of one global batch).

The data is built so that an implementation that is right in one process but not global under
torchrun fails: completions of 1-9 characters (per-rank token counts differ), 7 held-out pairs in
batches of 2 (RM: of 4), so the ranks' held-out shares are 4 and 3 pairs (a mean of per-rank means
is not the mean), and KTO's labels fall unevenly on the ranks. Each test names the wrong variants
it catches.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_support import assert_same_metrics, assert_same_weights, metrics, ok, run_tether, weights
from extras import needs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo on Linux")

STEPS = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tether.models import make_tiny_model
    root = tmp_path_factory.mktemp("dist_offline")
    make_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    # the same with an output head of its own (as Qwen2.5-7B): sharded as an FSDP2 unit of its own
    model, tok = make_tiny_model(None, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 0.5 + 0.01)
    model.save_pretrained(root / "untied")
    tok.save_pretrained(root / "untied")
    rng = random.Random(0)
    with open(root / "pairs.jsonl", "w") as f:
        for _ in range(36):  # eval_fraction 0.2: 7 held-out pairs, 29 training pairs
            w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 9)))
            bad = "".join(rng.choice("klmnopqrst") for _ in range(rng.randint(1, 9)))
            f.write(json.dumps({"prompt": f"{w}=", "chosen": w, "rejected": bad}) + "\n")
    return root


def _args(root, name, **kw):
    base = dict(model=root / "model", data=root / "pairs.jsonl", runs_dir=root / "runs", name=name,
                batch_size=2, grad_accum=2, lr=5e-3, warmup_steps=1, log_every=1, device="cpu",
                progress="false", max_steps=STEPS, eval_fraction=0.2, eval_every=2, save_every=0)
    if not name.startswith("rm"):
        base["sample_max_new_tokens"] = 8  # samples are not compared; generating is slow
    base.update(kw)
    if base["model"] == "untied":
        base["model"] = root / "untied"
    return [f"{k}={v}" for k, v in base.items()]


# One torchrun launch runs every two-process job in turn (a process's imports and the process group
# are paid once, not per job: most of a tiny run's time); one process runs here, one thread (the
# ranks' arithmetic, OMP_NUM_THREADS=1).
DRIVER = """
import importlib, json, sys
from tether.cli import COMMANDS
from tether.config import load_config
for command, args in json.loads(sys.argv[1]):
    module, config, train = COMMANDS[command][:3]
    module = importlib.import_module(module)
    getattr(module, train)(load_config(getattr(module, config), None, args))
from tether import distributed
distributed.leave()
"""
# job -> overrides; a job is named <command>[-<variant>]
# kto and orpo reduce their gradients once a step (model.fsdp_defer_sync; a no-op in one process):
# grad_accum 4 gives each of the 2 ranks two micro-batches a step, so the first one's are deferred
JOBS = {"dpo": {}, "kto": {"fsdp_defer_sync": "true", "grad_accum": 4}, "simpo": {},
        "orpo": {"fsdp_defer_sync": "true", "grad_accum": 4},
        "rm": {"batch_size": 1},
        "dpo-packed": {"packing": "true", "fsdp_unit_layers": 2},  # both layers in one FSDP2 unit
        "dpo-untied": {"model": "untied"},  # the LM head an FSDP2 unit of its own
        "rm-packed": {"batch_size": 2, "packing": "true"}}


def _run_here(command: str, args: list[str]) -> None:
    from tether.cli import main
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([command, *args, "--debug"]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two(world):
    """Every job of JOBS in 2 processes (runs <command>-2)."""
    from dist_support import _free_port
    driver = world / "driver.py"
    driver.write_text(DRIVER)
    jobs = [(c.split("-")[0], _args(world, c + "-2", **kw)) for c, kw in JOBS.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TETHER_DIST_TIMEOUT": "120"}
    ok(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(_free_port()), str(driver), json.dumps(jobs)],
                      capture_output=True, text=True, env=env, timeout=900))
    return world / "runs"


def _both(world, runs: Path, command: str):
    """The run in one process (here) and in two (the `two` launch, into `runs`): both run
    directories, after checking that every logged value and the final weights agree."""
    _run_here(command.split("-")[0], _args(world, command + "-1", **JOBS[command]))
    one, two = world / "runs" / (command + "-1"), runs / (command + "-2")
    assert_same_metrics(one, two)
    ckpt = f"checkpoints/step-{STEPS}"
    assert_same_weights(one / ckpt, two / ckpt)
    return one, two


def _rows(run, key):
    return [r for r in metrics(run) if key in r]


def test_dpo(world, two):
    """Catches: metrics of rank 0's rows only (loss, rewards/*); a micro-batch's loss divided by the
    rank's own pair count (twice the gradient: grad_norm); held-out metrics of rank 0's share, or
    the mean of the ranks' means (4 and 3 pairs); a reference cache of one rank's rows, or other
    forwards than one process's (asserted equal, and step 1's margins exactly 0)."""
    one, two = _both(world, two, "dpo")
    assert len(_rows(two, "rewards/accuracies")) == STEPS and len(_rows(two, "eval/rewards/accuracies")) == 2
    step1 = _rows(two, "rewards/margins")[0]
    assert step1["rewards/margins"] == 0.0 and step1["rewards/accuracies"] == 0.0  # policy == reference
    assert _rows(two, "rewards/accuracies")[-1]["rewards/accuracies"] > 0  # not vacuous: it moved
    # whole micro-batches per rank (grad_accum 2 over 2 processes): one process's cache, bit for bit
    a, b = (load_file(str(r / "reference_logps.safetensors")) for r in (one, two))
    assert set(a) == set(b) == {"train.chosen", "train.rejected", "eval.chosen", "eval.rejected"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    fingerprint = [json.loads((r / "reference_logps.json").read_text())["fingerprint"] for r in (one, two)]
    assert fingerprint[0] == fingerprint[1]


def test_kto(world, two):
    """Catches: KTO's reference point z0 from the rank's own mismatched pairs (kl, loss); reward
    means per label over rank 0's rows or averaged over ranks (the ranks' label counts differ)."""
    _, two = _both(world, two, "kto")
    rows = _rows(two, "kl")
    assert len(rows) == STEPS and any(r["kl"] > 0 for r in rows)  # z0 enters the loss
    assert any(r["count/chosen"] != r["count/rejected"] for r in rows)  # labels fall unevenly


@pytest.mark.parametrize("command", ["simpo", "orpo"])
def test_simpo_and_orpo(world, two, command):
    """Reference-free, length-normalised per sequence. Catches: rank-local metrics; log-probs (or
    ORPO's NLL term) averaged over the rank's tokens instead of per sequence (completion lengths
    vary); a micro-batch's loss divided by the rank's own pair count (grad_norm)."""
    one, two = _both(world, two, command)
    assert len(_rows(two, "rewards/accuracies")) == STEPS and _rows(two, "eval/rewards/accuracies")
    assert not any((r / "reference_logps.safetensors").exists() for r in (one, two))  # none needed


def test_rm(world, two):
    """Catches: accuracy / margin / reward_min / reward_max of rank 0's pairs; the loss weighted by the
    rank's own pair count; held-out metrics per rank (7 pairs in batches of 4: 4 and 3); a centering
    offset from one rank's share (the final eval and the saved offset). batch_size 1: the ranks' pairs
    differ in length, so do their micro-batches."""
    one, two = _both(world, two, "rm")
    rows = _rows(two, "accuracy")
    assert len(rows) == STEPS and all(r["reward_min"] < r["reward_max"] for r in rows)
    assert "eval/accuracy" in metrics(two)[-1] and "train/accuracy" in metrics(two)[-1]
    ckpt = f"checkpoints/step-{STEPS}/scalar_head.json"
    offsets = [json.loads((r / ckpt).read_text())["offset"] for r in (one, two)]
    assert offsets[0] != 0 and abs(offsets[0] - offsets[1]) <= 1e-5 * max(1, abs(offsets[0]))


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
@pytest.mark.parametrize("name,kw", [("dpoR", {"grad_accum": 4}), ("ktoR", {"grad_accum": 4}),
                                     pytest.param("dpoRlora", {"lora_r": 4}, marks=needs("peft"))])
def test_replicated_offline_runs_equal_one_process(world, name, kw):
    # fsdp=false: a separate reference model (the cache's forwards split over replicated ranks),
    # KTO's reference point over 4 micro-batches, LoRA adapters summed at the step
    kw = {**kw, "fsdp": "false", **({"ref_model": str(world / "model")} if name == "dpoR" else {})}
    command = name[:3]
    _run_here(command, _args(world, name + "-1", **kw))
    ok(run_tether(command, _args(world, name + "-2", **kw), nproc=2))
    one, two = world / "runs" / (name + "-1"), world / "runs" / (name + "-2")
    assert_same_metrics(one, two)
    assert_same_weights(one / f"checkpoints/step-{STEPS}", two / f"checkpoints/step-{STEPS}")


def test_untied_head(world, two):
    """An untied LM head is an FSDP2 unit of its own under torchrun (distributed.shard): the run,
    its evaluations and its consolidated checkpoint equal one process's."""
    one, two = _both(world, two, "dpo-untied")
    w = weights(two / f"checkpoints/step-{STEPS}")
    assert "lm_head.weight" in w and not torch.equal(w["model.embed_tokens.weight"], w["lm_head.weight"])


@pytest.mark.parametrize("command", ["dpo-packed", "rm-packed"])
def test_packed(world, two, command):
    """data.packing=true (padding-free micro-batches, tether.data.pack_batch) under torchrun: two
    processes log what one logs, and DPO's reference cache, packed alike, still gives step 1's
    exact zero margins. Catches: a rank packing other rows than its block, sequence sums or reward
    positions taken from another rank's layout, a cache computed unpacked."""
    one, two = _both(world, two, command)
    if command == "dpo-packed":
        step1 = _rows(two, "rewards/margins")[0]
        assert step1["rewards/margins"] == 0.0 and step1["rewards/accuracies"] == 0.0
        meta = json.loads((two / "reference_logps.json").read_text())
        assert meta["fingerprint"] != json.loads((world / "runs" / "dpo-2" / "reference_logps.json")
                                                 .read_text())["fingerprint"]
    else:
        assert len(_rows(two, "accuracy")) == STEPS and "eval/accuracy" in metrics(two)[-1]
