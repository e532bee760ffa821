"""Many processes are one run: SFT under torchrun (2 processes, gloo, FSDP2) computes what one
process computes — losses, every metric, the final weights — resumes across process counts both
ways, says a bad input once, and stops whole when a rank dies (tether/distributed.py)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dist_support import assert_same_metrics, assert_same_weights, ok, run_tether, weights
from extras import needs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo on Linux")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tether.models import make_tiny_model
    root = tmp_path_factory.mktemp("dist")
    make_tiny_model(root / "model", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=128)
    rng = random.Random(1)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(200):  # lengths vary: per-rank token counts differ, the global mean must not
            d = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 9)))
            f.write(json.dumps({"prompt": f"Copy {d}:", "completion": f" {d}"}) + "\n")
    return root


def _args(root, name, **kw):
    base = dict(model=root / "model", data=root / "train.jsonl", runs_dir=root / "runs", name=name,
                batch_size=4, grad_accum=2, lr=3e-3, log_every=1, device="cpu", progress="false",
                max_steps=6, save_every=3, eval_fraction=0.1, eval_every=3, num_samples=2,
                warmup_steps=2, keep_best="eval/loss")
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def one(world):
    ok(run_tether("sft", _args(world, "one")))
    return world / "runs" / "one"


def test_two_processes_compute_what_one_computes(world, one):
    ok(run_tether("sft", _args(world, "two"), nproc=2))
    two = world / "runs" / "two"
    n = assert_same_metrics(one, two)
    assert n >= 6 * 4  # loss, grad_norm, lr, epoch on 6 steps, plus eval/loss
    assert any("eval/loss" in json.loads(r) for r in (two / "metrics.jsonl").read_text().splitlines())
    assert_same_weights(one / "checkpoints" / "step-6", two / "checkpoints" / "step-6")
    # the consolidated checkpoint is a plain HF model (rank 0 wrote it) with the optimizer's
    # shards beside it, one file per rank
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(two / "checkpoints" / "step-6")
    assert len(list((two / "checkpoints" / "step-6" / "optimizer").glob("*.distcp"))) == 2
    # keep_best: the same best eval point, its model written once (rank 0) after a collective gather
    best = [json.loads((run / "summary.json").read_text())["best"] for run in (one, two)]
    assert best[0]["step"] == best[1]["step"] and best[0]["value"] == pytest.approx(best[1]["value"], rel=1e-5)
    assert_same_weights(one / "checkpoints" / "best", two / "checkpoints" / "best")
    assert len(list((one / "checkpoints" / "step-6" / "optimizer").glob("*.distcp"))) == 1
    # rank 0 alone writes: one summary, one row per logged step, samples once
    steps = [json.loads(r)["step"] for r in (two / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(r)["step"] for r in (one / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_resume_in_another_number_of_processes(world, one, first, then):
    name = f"r{first}{then}"
    ok(run_tether("sft", _args(world, name), nproc=first))
    run = world / "runs" / name
    import shutil
    shutil.rmtree(run / "checkpoints" / "step-6")  # as if stopped after the checkpoint at step 3
    ok(run_tether("sft", _args(world, name, resume="true"), nproc=then))
    assert_same_metrics(one, run)
    assert_same_weights(one / "checkpoints" / "step-6", run / "checkpoints" / "step-6")


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_a_replicated_run_resumes_in_another_number_of_processes(world, one):
    # fsdp=false: the optimizer's plain (unsharded) state through DCP, written by 1 and read by 2
    ok(run_tether("sft", _args(world, "r12-replicated", fsdp="false")))
    run = world / "runs" / "r12-replicated"
    import shutil
    shutil.rmtree(run / "checkpoints" / "step-6")
    ok(run_tether("sft", _args(world, "r12-replicated", fsdp="false", resume="true"), nproc=2))
    assert_same_metrics(one, run)
    assert_same_weights(one / "checkpoints" / "step-6", run / "checkpoints" / "step-6")


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
@pytest.mark.parametrize("name, extra", [pytest.param("ddp", {"fsdp": "false"}, id="ddp"),
                                         pytest.param("lora", {"lora_r": 4, "lr": 1e-2}, id="lora", marks=needs("peft"))])
def test_replicated_and_lora_runs_equal_one_process(world, name, extra):
    args1 = _args(world, name + "1", max_steps=3, save_every=0, **extra)
    args2 = _args(world, name + "2", max_steps=3, save_every=0, **extra)
    ok(run_tether("sft", args1))
    ok(run_tether("sft", args2, nproc=2))
    a, b = world / "runs" / (name + "1"), world / "runs" / (name + "2")
    assert_same_metrics(a, b)
    assert_same_weights(a / "checkpoints" / "step-3", b / "checkpoints" / "step-3")
    if name == "lora":
        assert any("lora_A" in k for k in weights(b / "checkpoints" / "step-3"))  # the adapter alone


def test_a_bad_input_is_reported_once(world, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    proc = run_tether("sft", _args(world, "bad", data=bad), nproc=2)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "tether sft: error" in ln]
    assert len(lines) == 1 and "bad.jsonl" in lines[0] and "completion" in lines[0], proc.stderr[-2000:]


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_kill_9_of_one_rank_stops_the_job_and_resume_finishes_it(world, one):
    from dist_support import _free_port
    args = _args(world, "killed", max_steps=400, save_every=5, eval_every=0, log_every=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TETHER_DIST_TIMEOUT": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(_free_port()), "-m", "tether", "sft", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    run = world / "runs" / "killed"
    ckpts = run / "checkpoints"
    deadline = time.monotonic() + 300
    while not (ckpts.exists() and any(p.name == "step-10" for p in ckpts.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.2)
    ranks = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "tether"], capture_output=True,
                           text=True).stdout.split()
    assert len(ranks) == 2, ranks
    os.kill(int(ranks[-1]), signal.SIGKILL)
    # torchrun sees a rank gone and stops the other; the hang guard is far above its seconds
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    done = json.loads(run.joinpath("metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert done < 400
    # resume (here in 2 processes again, up to a shorter end) continues from the last checkpoint
    ok(run_tether("sft", _args(world, "killed", max_steps=400, save_every=5, eval_every=0,
                               log_every=1, resume="true"), nproc=2, timeout=900))
    rows = [json.loads(r) for r in run.joinpath("metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 401))  # each step once


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_two_nodes_by_rendezvous_on_one_host(world, one):
    """Multi-node as on a cluster: two torchrun agents ("nodes", one process each) meet through
    the c10d rendezvous at one endpoint; the run equals the one-process run."""
    from dist_support import _free_port
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TETHER_DIST_TIMEOUT": "120"}
    args = _args(world, "nodes")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tether-test",
                               "-m", "tether", "sft", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    for node in nodes:
        _, err = node.communicate(timeout=120)
        assert node.returncode == 0, err[-3000:]
    run = world / "runs" / "nodes"
    assert_same_metrics(one, run)
    assert_same_weights(one / "checkpoints" / "step-6", run / "checkpoints" / "step-6")


@pytest.mark.parametrize("shape", ["llama tied", pytest.param("qwen2 untied", marks=pytest.mark.slow)])
def test_chunked_lm_head_of_a_sharded_model_equals_the_plain_forward(shape):
    """The chunked LM head (no [N, V] logits held) runs inside the root module's FSDP2 call
    (models/logprobs._sharded_chunked_head): log-probs, entropy and every gradient — the head's
    and the tied embedding's included — equal the unsharded model's full-logits forward."""
    from dist_support import _free_port
    script = os.path.join(os.path.dirname(__file__), "dist_head_check.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), script, *shape.split()],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert out["lp_err"] < 1e-5 and out["ent_err"] < 1e-6 and out["grad_err"] < 1e-6, out
    assert out["head_grad_norm"] > 0.1  # the head did learn through the swapped forward


def test_cat_ranks_rebuilds_the_rows_in_rank_order():
    """distributed.cat_ranks (tensor all-gathers of row counts, then padded rows): uneven counts, an
    empty rank, float / bf16 / int64 / bool and non-contiguous rows come back exactly, in rank order,
    in their dtype; ranks disagreeing on dtype or trailing shape get one clear error each (no abort,
    no hang); max_float (one all-reduce): the largest value, NaN when any rank's is;
    distributed.accumulation with defer_grad_sync: no reduction before the last micro-batch, then
    the gradient a reduction after every backward gives; replicate + sum_gradients; an untied head
    as its own FSDP2 unit; the bf16 gradient reduction (fsdp_reduce=bf16)."""
    from dist_support import _free_port
    script = os.path.join(os.path.dirname(__file__), "dist_cat_check.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), script],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "OK", proc.stdout


def test_the_small_model_hint_says_replicate_only_when_the_state_fits_a_quarter_of_a_gpu():
    from tether.trainers.core.sharding import replication_hint
    gpu = 80 * 10**9
    # Qwen2.5-0.5B trained with an fp32 reference copy: 16 B x 494M + 2 GB = 9.9 GB of 80: replicate
    said = replication_hint(494_000_000, 4 * 494_000_000, gpu)
    assert said is not None and "fsdp=false" in said and "9.9 GB" in said
    # 7B: 122 GB of training state; and the edge: exactly a quarter says it, a byte more does not
    assert replication_hint(7_600_000_000, 0, gpu) is None
    assert replication_hint(gpu // 64, 0, gpu) is not None
    assert replication_hint(gpu // 64, 1, gpu) is None


def test_a_model_in_cpu_memory_is_sharded_for_bf16_compute_on_gpus(monkeypatch):
    """Under torchrun on GPUs setup_training loads the model into CPU memory and fully_shard moves
    the shards: the policy must follow the GPU the rank computes on, not the weights' device at that
    moment (reading the latter, every FSDP2 run on GPUs would gather fp32 weights and cast them at
    each use). Here: a CPU model, the group said to be NCCL on cuda:0 with bf16."""
    import types
    import torch
    import torch.distributed.fsdp as fsdp
    from tether import distributed
    from tether.models.tiny import tiny_config
    from tether.trainers.core import sharding
    from tether.trainers.core.sections import ModelSection
    from transformers import AutoModelForCausalLM
    seen = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: seen.append(kw["mp_policy"]))
    monkeypatch.setattr(distributed, "uses_cuda", lambda: True)
    monkeypatch.setattr(distributed, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    model = AutoModelForCausalLM.from_config(tiny_config(40, hidden_size=32, num_layers=2, num_heads=2,
                                                         num_kv_heads=1, intermediate_size=64))
    assert next(model.parameters()).device.type == "cpu"
    sharding.shard_model(model, types.SimpleNamespace(model=ModelSection(path="m")))
    assert len(seen) == 3 and all(p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32 for p in seen)
    seen.clear()  # fp32 compute asked for: no bf16 policy
    sharding.shard_model(model, types.SimpleNamespace(model=ModelSection(path="m", mixed_precision="no")))
    assert len(seen) == 3 and all(p.param_dtype is None for p in seen)


def test_a_scalar_head_is_its_own_fp32_unit_under_the_bf16_policy(monkeypatch):
    """A reward model's / critic's head (ScalarHeadModel, fp32 on purpose) gets an FSDP2 unit of its
    own without the bf16 policy, so its gathered weight stays fp32 as in one process; the body's
    layers and the root keep the bf16 policy. (Its forward goes through the module, or the unit's
    hooks would never gather it: bench/bf16_policy_cpu.py runs rm and ppo that way.)"""
    import types
    import torch
    import torch.distributed.fsdp as fsdp
    from tether.models.heads import ScalarHeadModel
    from tether.models.tiny import tiny_config
    from tether.trainers.core import sharding
    from tether.trainers.core.sections import ModelSection
    from transformers import AutoModelForCausalLM
    seen = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: seen.append((module, kw["mp_policy"])))
    monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device: True)
    lm = AutoModelForCausalLM.from_config(tiny_config(40, hidden_size=32, num_layers=2, num_heads=2,
                                                      num_kv_heads=1, intermediate_size=64))
    rm = ScalarHeadModel(lm)
    sharding.shard_model(rm, types.SimpleNamespace(model=ModelSection(path="m")))
    policies = {id(m): p for m, p in seen}
    assert policies[id(rm.head)].param_dtype is None  # fp32, as stored
    assert policies[id(rm)].param_dtype == torch.bfloat16
    from tether.models.load import decoder_layers
    assert all(policies[id(layer)].param_dtype == torch.bfloat16 for layer in decoder_layers(rm))


def test_a_frozen_model_is_stored_in_bf16_under_the_bf16_policy(monkeypatch):
    """Under the bf16 policy a frozen model (reference, reward model) is sharded from bf16
    parameters: the values the policy would all-gather (its fp32 rounded to bf16), half the shard,
    no cast before each gather. A reward model's scalar head stays fp32 (its own fp32 unit), buffers
    (RoPE's inv_freq) keep their dtype; a trained model, and any model without the policy, keep fp32."""
    import copy
    import types
    import torch
    import torch.distributed.fsdp as fsdp
    from tether.models.heads import ScalarHeadModel
    from tether.models.tiny import tiny_config
    from tether.trainers.core import sharding
    from tether.trainers.core.sections import ModelSection
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: None)
    policy = types.SimpleNamespace(model=ModelSection(path="m"))
    lm = AutoModelForCausalLM.from_config(tiny_config(40, hidden_size=32, num_layers=2, num_heads=2,
                                                      num_kv_heads=1, intermediate_size=64))
    buffers = {n: b.dtype for n, b in lm.named_buffers()}
    ref, rm, trained = copy.deepcopy(lm).requires_grad_(False), ScalarHeadModel(copy.deepcopy(lm)), copy.deepcopy(lm)
    rm.requires_grad_(False)
    monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device: False)  # no policy: nothing changes
    sharding.shard_model(ref, policy)
    assert all(p.dtype == torch.float32 for p in ref.parameters())
    monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device: True)
    for m in (ref, rm, trained):
        sharding.shard_model(m, policy)
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    assert all(p.dtype == torch.bfloat16 for p in ref.parameters())
    for name, p in ref.named_parameters():  # exactly the policy's rounding of the fp32 weights
        assert torch.equal(p, dict(lm.named_parameters())[name].detach().to(torch.bfloat16))
    assert {n: b.dtype for n, b in ref.named_buffers()} == buffers and buffers
    assert all(p.dtype == torch.float32 for p in rm.head.parameters())
    assert all(p.dtype == torch.bfloat16 for n, p in rm.named_parameters() if not n.startswith("head."))


def test_the_reduce_dtype_reaches_fsdp2s_policy(monkeypatch):
    """model.fsdp_reduce picks MixedPrecisionPolicy's reduce dtype for every unit — each layer, an
    untied head's own, the root — through sharding.shard_model (fp32 by default); the compute dtype
    stays bf16 either way."""
    import types
    import torch
    import torch.distributed.fsdp as fsdp
    from tether.models.tiny import tiny_config
    from tether.trainers.core import sharding
    from tether.trainers.core.sections import ModelSection
    from transformers import AutoModelForCausalLM
    seen = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: seen.append((module, kw["mp_policy"])))
    monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device: True)  # CUDA's mixed precision, here
    cfg = tiny_config(40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cfg.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(cfg)
    for reduce, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        seen.clear()
        sharding.shard_model(model, types.SimpleNamespace(model=ModelSection(path="m", fsdp_reduce=reduce)))
        assert [m for m, _ in seen] == [*model.model.layers, model.lm_head, model]
        assert all(p.reduce_dtype == want and p.param_dtype == torch.bfloat16 for _, p in seen)


def test_the_state_hint_counts_each_parameter_once_and_keeps_none_of_them():
    """setup's small-model hint counts the policy, the reference and the critic, each parameter once
    (a tied or shared one too), and holds no parameter after it returns: fully_shard replaces the
    module's parameters with shards, and a list of the old ones kept in setup's frame held the whole
    fp32 model on every GPU through sharding (28.4 GiB of a 7B run's peak on 4 x H200)."""
    import copy
    import gc
    import weakref
    import torch
    from tether.models.tiny import tiny_config
    from tether.trainers.core.sharding import replication_hint, state_hint
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(tiny_config(40, hidden_size=32, num_layers=2, num_heads=2,
                                                         num_kv_heads=1, intermediate_size=64))
    ref = copy.deepcopy(model).requires_grad_(False)
    n = sum(p.numel() for p in model.parameters())  # (tied embeddings: parameters() yields them once)
    gpu = 10**12
    assert state_hint((model, ref, model, None), gpu) == replication_hint(n, 4 * n, gpu) is not None
    olds = [weakref.ref(p) for p in model.parameters()]
    for mod in model.modules():  # what fully_shard does to a module: new parameters in place of the old
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = torch.nn.Parameter(p.detach()[:1].clone())
    gc.collect()
    assert all(r() is None for r in olds)


def test_the_sampling_copy_is_made_one_parameter_at_a_time_in_the_compute_dtype():
    """sampling_copy makes each parameter in its place and dtype (no whole fp32 copy first, on the
    GPU or in CPU memory); buffers (RoPE's inv_freq) keep their fp32; ties stay tied; the copy
    shares no storage with the model."""
    import torch
    from tether.models.tiny import tiny_config
    from tether.trainers.core.sharding import sampling_copy
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(tiny_config(40, hidden_size=32, num_layers=2, num_heads=2,
                                                         num_kv_heads=1, intermediate_size=64))
    replica = sampling_copy(model, torch.device("cpu"), bf16=True)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in replica.parameters())
    assert all(b.dtype == torch.float32 for b in replica.buffers() if b.is_floating_point())
    assert replica.lm_head.weight is replica.model.embed_tokens.weight
    for a, b in zip(model.parameters(), replica.parameters()):
        torch.testing.assert_close(b, a.detach().to(torch.bfloat16))
    same = sampling_copy(model, torch.device("cpu"), bf16=False)  # same device and dtype: still a copy
    assert all(p.dtype == torch.float32 for p in same.parameters())
    assert not {p.data_ptr() for p in same.parameters()} & {p.data_ptr() for p in model.parameters()}
    assert same.lm_head.weight is same.model.embed_tokens.weight


def test_setup_holds_no_unsharded_parameter_once_sharding_replaced_them(tmp_path, monkeypatch):
    """setup_training under torchrun on GPUs (simulated on CPU): once shard_model has replaced a
    model's parameters by shards — as fully_shard does, after moving each whole tensor to the GPU —
    nothing in setup may keep the old ones alive: a list of them (the small-model hint's) would hold
    the whole fp32 model on every GPU until setup returned (7B: 28.4 GiB)."""
    import gc
    import json
    import types
    import weakref
    import torch
    from tether import distributed
    from tether.models import make_tiny_model
    from tether.trainers.core import setup
    from tether.trainers.sft import SFTConfig, train_sft
    make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                                              for i in range(8)))
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "uses_cuda", lambda: True)
    monkeypatch.setattr(distributed, "device", lambda: torch.device("cpu"))
    monkeypatch.setattr(distributed, "on_main", lambda fn: fn())
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    monkeypatch.setattr(distributed, "world_size", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=10**12))
    olds = []

    def shard_model(model, cfg):  # what fully_shard does to the module: new parameters for the old
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    olds.append(weakref.ref(p))
                    mod._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        return model

    class Stop(Exception):
        pass

    alive = []

    def start(*a, **k):
        gc.collect()
        alive.append(sum(r() is not None for r in olds))
        raise Stop
    monkeypatch.setattr(setup, "shard_model", shard_model)
    monkeypatch.setattr(setup, "_start", start)
    with pytest.raises(Stop):
        train_sft(SFTConfig(model=str(tmp_path / "m"), data=str(tmp_path / "d.jsonl"), runs_dir=str(tmp_path / "runs"),
                            device="cpu", max_steps=1))
    assert olds and alive == [0]
