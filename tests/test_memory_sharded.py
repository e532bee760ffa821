"""`tether memory gpus=N`: the per-GPU accounting of N processes under torchrun (tether/memory/sharded.py
for FSDP2, tether/memory/replicated.py for sharding=replicate, the trainers' fsdp=false).

The model is a Qwen2.5-0.5B-shaped config (no weights). Its numbers, by hand:
    hidden h=896, 24 layers, 14 heads / 2 kv heads (head_dim 64, kv dim 128), intermediate 4864,
    vocab 151936, tied embeddings, q/k/v biases
    one layer  = q 896*896 + 896 + k, v 2*(896*128 + 128) + o 896*896 + MLP 3*896*4864 + norms 2*896
               = 803,712 + 229,632 + 802,816 + 13,074,432 + 1,792 = 14,912,384
    root       = embeddings 151936*896 + final norm 896 = 136,135,552 (the LM head is the embedding)
    n          = 24 * 14,912,384 + 136,135,552 = 494,032,768 (Qwen2.5-0.5B's published count)
    activations per token per layer in bf16 (docs/memory.md):
                 2*(4h + 2*2h) + 2*(3h + 2*128) + 4*2*4864 = 14,336 + 5,888 + 38,912 = 59,136 B
"""

import pytest

from tether.cli import main
from tether.config import ConfigError, load_config
from tether.memory import MemoryConfig, estimate
from tether.memory.replicated import GRAD_BUCKET_BYTES
from tether.memory.sharded import CUDA_CONTEXT_BYTES, FSDP_LIVE_LAYERS, NCCL_BYTES, SHARDED_ACT

N, LAYER, ROOT = 494_032_768, 14_912_384, 136_135_552


@pytest.fixture(scope="module")
def qwen05(tmp_path_factory):
    from transformers import Qwen2Config
    path = tmp_path_factory.mktemp("qwen05")
    Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True).save_pretrained(path)
    return str(path)


def _est(model, **kw):
    return estimate(load_config(MemoryConfig, overrides={"model": model, **kw}))


def _row(est, component):
    rows = [r for r in est["components"] if r["component"] == component]
    assert len(rows) == 1, f"{component}: {len(rows)} rows"
    return rows[0]["bytes"]


def _sum(est, *groups, device="gpu"):
    return sum(r["bytes"] for r in est["components"] if r["group"] in groups and r["device"] == device)


def test_shape_counts_match_the_hand_numbers(qwen05):
    est = _est(qwen05, algo="sft")
    assert est["params"] == N
    from tether.model_shape import Shape
    assert Shape(**est["shape"]).layer_params() == LAYER


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo", "ppo"])
@pytest.mark.parametrize("sharding", ["fsdp", "replicate", "none"])
def test_one_gpu_is_the_single_gpu_estimate(qwen05, algo, sharding):
    """In one process tether wraps no model (distributed.active() is False), whatever `sharding`
    says: every component and total is the single-GPU one, and no sharded line appears."""
    one, plain = _est(qwen05, algo=algo, gpus=1, sharding=sharding), _est(qwen05, algo=algo, sharding="none")
    assert one["components"] == plain["components"] and one["totals_bytes"] == plain["totals_bytes"]
    assert "per_gpu" not in one and {r["group"] for r in one["components"]} <= {"resident", "gradients", "training", "rollout"}


def test_fsdp_sft_by_hand(qwen05):
    """4 GPUs, fp32 master weights + bf16 compute (the trainers' defaults), 4 x 4 global batch:
    each GPU a micro-batch of 4 sequences of 1024 tokens, no checkpointing."""
    est = _est(qwen05, algo="sft", gpus=4, weight_dtype="fp32", batch_size=4, grad_accum=4, seq_len=1024)
    assert _row(est, "policy weights") == N * 4 // 4 == 494_032_768  # fp32, a quarter each
    assert _row(est, "policy gradients") == 494_032_768  # fp32 as the sharded weights
    assert _row(est, "policy optimizer state") == N * 8 // 4 == 988_065_536
    # no checkpointing: autograd keeps every layer's gathered bf16 weights for backward
    assert _row(est, "policy gathered layers") == N * 2 == 988_065_536
    # the root's bf16 gradients (accumulated through the backward, cast for their reduce at its
    # end) + one layer's bf16 gradients and their fp32 reduce-scatter input
    assert _row(est, "policy unsharded gradients") == ROOT * 2 + LAYER * 6 == 361_745_408
    # the formula's 59,136 B per token and layer, times the measured share under FSDP2's bf16 policy
    assert SHARDED_ACT == 0.8
    assert _row(est, "policy activations") == int(4 * 1024 * 24 * 59_136 * 0.8) == 4_650_644_275
    # 4 x 1024 x 151,936 bf16 logits + gradient (2.49 GB) exceed one chunk: SFT's loss goes through
    # the chunked head (sft._micro_loss), which holds one chunk of 2^25 logits, 4 B each (fitted)
    assert 4 * 1024 * 151_936 * 2 * 2 > _row(est, "policy logits") == (1 << 25) * 4 == 134_217_728
    t = est["totals_bytes"]
    assert t["weights_and_optimizer"] == 494_032_768 + 988_065_536
    assert t["training_step"] == t["peak"] == (494_032_768 + 988_065_536 + 494_032_768 + 988_065_536
                                               + 361_745_408 + 4_650_644_275 + 134_217_728)
    assert t["loading"] == 0  # loaded in CPU memory; fully_shard moves each rank's shards to its GPU
    assert t["rollout"] is None and t["frozen_forwards"] is None and t["cpu_offloaded"] == 0
    assert t["peak_device"] == t["peak"] + CUDA_CONTEXT_BYTES + NCCL_BYTES


def test_checkpointing_gathers_root_and_the_live_layers(qwen05):
    est = _est(qwen05, algo="sft", gpus=4, weight_dtype="fp32", batch_size=4, grad_accum=4,
               gradient_checkpointing=True)
    assert FSDP_LIVE_LAYERS == 4
    assert _row(est, "policy gathered layers") == (ROOT + 4 * LAYER) * 2 == 391_570_176
    # checkpointed: each layer's bf16 input (2h per token) + one layer recomputed (x SHARDED_ACT)
    assert _row(est, "policy activations") == int(4 * 1024 * (24 * 2 * 896 + 59_136) * 0.8) == 334_705_459


def test_units_of_several_layers_gather_and_reduce_that_many(qwen05):
    """fsdp_unit_layers=k: FSDP_LIVE_LAYERS units of k layers live (capped at the model), and the
    backward's unsharded gradients are the root's + one k-layer unit's."""
    kw = dict(algo="sft", gpus=4, weight_dtype="fp32", batch_size=4, grad_accum=4, gradient_checkpointing=True)
    est = _est(qwen05, fsdp_unit_layers=2, **kw)
    assert _row(est, "policy gathered layers") == (ROOT + 8 * LAYER) * 2
    assert _row(est, "policy unsharded gradients") == ROOT * 2 + 2 * LAYER * 6
    assert _row(_est(qwen05, fsdp_unit_layers=6, **kw), "policy gathered layers") == N * 2  # 24 of 24: all


def test_deferred_sync_holds_a_whole_gradient_only_with_several_micro_batches(qwen05):
    """fsdp_defer_sync: a whole fp32 gradient on every GPU, when a GPU runs more than one
    micro-batch a step (distributed.accumulation); none for one, or for PPO."""
    kw = dict(gpus=4, weight_dtype="fp32", fsdp_defer_sync=True, batch_size=4)
    assert _row(_est(qwen05, algo="sft", grad_accum=8, **kw), "policy accumulated gradients") == N * 4
    for algo, extra in (("sft", dict(grad_accum=4)), ("ppo", dict(rollout_batch=64))):
        rows = [r["component"] for r in _est(qwen05, algo=algo, **kw, **extra)["components"]]
        assert not any("accumulated" in c for c in rows), (algo, rows)
    grpo = _est(qwen05, algo="grpo", rollout_batch=16, num_generations=8, **kw)  # 32 sequences, micro 4
    assert _row(grpo, "policy accumulated gradients") == N * 4


@pytest.mark.parametrize("algo,lora", [("sft", False), ("dpo", False), ("grpo", False), ("ppo", False),
                                       ("sft", True), ("ppo", True)])
@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_optimizer_state_and_gradients_are_exactly_one_nth(qwen05, algo, lora, gpus):
    kw = dict(algo=algo, weight_dtype="fp32", lora=lora, lora_rank=8, rollout_batch=8, batch_size=8)
    # one process sampling from its own weights (sampler_copy=false): what a replica GPU holds besides its replica
    single, sharded = _est(qwen05, sampler_copy=False, **kw), _est(qwen05, gpus=gpus, **kw)
    for name in ("policy", "value model"):
        if algo != "ppo" and name == "value model":
            continue
        for part in ("optimizer state", "gradients", "weights"):
            assert _row(sharded, f"{name} {part}") * gpus == _row(single, f"{name} {part}")
    replicated = _est(qwen05, gpus=gpus, sharding="replicate", **kw)
    assert _sum(replicated, "resident") == _sum(single, "resident")  # one process's, on every GPU
    assert _sum(replicated, "gradients") == _sum(single, "gradients")
    # frozen models (the reference) are sharded from bf16 weights under the bf16 policy
    # (sharding.frozen_to_bf16): half their fp32 bytes, then 1/N
    frozen = [r["component"] for r in single["components"] if r["component"] in ("reference weights", "reward model weights")]
    assert "reference weights" in frozen or lora or algo == "sft"
    for f in frozen:
        assert _row(sharded, f) * gpus * 2 == _row(single, f)
    assert _sum(sharded, "resident") * gpus == pytest.approx(
        _sum(single, "resident") - sum(_row(single, f) for f in frozen) / 2, abs=gpus)


def test_activations_follow_the_per_gpu_micro_batch(qwen05):
    """A GPU trains its 1/N of the global batch in micro-batches of the single-process size."""
    def act(est):
        return _row(est, "policy activations")
    # bf16 weights: the compute dtype is the weight dtype, as in the single-GPU formula
    assert act(_est(qwen05, algo="sft", gpus=4, batch_size=4, grad_accum=4)) == act(_est(qwen05, algo="sft", batch_size=4))
    assert act(_est(qwen05, algo="sft", gpus=4, batch_size=4, grad_accum=1)) == act(_est(qwen05, algo="sft", batch_size=1))
    # pairs: chosen + rejected, 8 pairs over 4 GPUs = 2 pairs = 4 sequences each
    assert act(_est(qwen05, algo="dpo", gpus=4, batch_size=8)) == act(_est(qwen05, algo="sft", batch_size=4))
    # grpo: 8 prompts x 8 generations over 4 GPUs = 16 sequences each, micro-batches of 4
    assert act(_est(qwen05, algo="grpo", gpus=4, batch_size=4)) == act(_est(qwen05, algo="sft", batch_size=4))


def test_rollout_replica_counts_once_per_gpu(qwen05):
    two = _est(qwen05, algo="grpo", gpus=2, weight_dtype="fp32", reward="verifier", beta=0, seq_len=512)
    eight = _est(qwen05, algo="grpo", gpus=8, weight_dtype="fp32", reward="verifier", beta=0, seq_len=512)
    # a whole bf16 policy on every GPU, whatever N
    assert _row(two, "rollout replica") == _row(eight, "rollout replica") == N * 2
    # KV cache of this GPU's share: 8 prompts x 8 generations / N, bf16, 2 x 24 layers x 128 B
    kv_token = 2 * 24 * 2 * 64 * 2
    assert _row(two, "KV cache (rollouts)") == 32 * 512 * kv_token
    assert _row(eight, "KV cache (rollouts)") == 8 * 512 * kv_token
    for est in (two, eight):  # never inside the gradients under torchrun: held through the step
        t = est["totals_bytes"]
        assert not est["kv_in_gradient_buffer"]
        assert t["training_step"] == t["with_gradients"] + _sum(est, "gather", "training") + _sum(est, "rollout")
        # the replica's refresh gathers one whole fp32 parameter, the largest: the embedding
        assert _row(est, "replica refresh") == 151_936 * 896 * 4
        assert t["rollout"] == t["weights_and_optimizer"] + _sum(est, "rollout") + 151_936 * 896 * 4


def test_frozen_models_are_sharded_and_gathered_in_their_forward(qwen05):
    est = _est(qwen05, algo="grpo", gpus=4, weight_dtype="fp32", beta=0.04, reward="model")
    # sharded from bf16 weights (sharding.frozen_to_bf16; the scalar head's 896 fp32 ones rounded in)
    assert _row(est, "reference weights") == N * 2 // 4
    backbone = N + 896  # tied: no LM head to drop, a scalar head added
    assert _row(est, "reward model weights") == backbone * 2 // 4
    assert _row(est, "reference gathered layers") == (ROOT + 4 * LAYER) * 2
    assert _row(est, "reward model gathered layers") == (ROOT + 896 + 4 * LAYER) * 2
    t = est["totals_bytes"]
    assert t["frozen_forwards"] == t["weights_and_optimizer"] + _sum(est, "rollout") + (ROOT + 896 + 4 * LAYER) * 2
    # frozen models hold neither gradients nor optimizer state
    assert {r["component"] for r in est["components"] if r["group"] == "gradients"} == {"policy gradients"}
    # setup loads policy, reference and replica in CPU memory; the learned reward loads on the GPU
    assert t["loading"] == backbone * 4


def test_offload_leaves_gathered_layers_and_activations_on_the_gpu(qwen05):
    kw = dict(algo="sft", gpus=4, weight_dtype="fp32", batch_size=4, grad_accum=4)
    on, off = _est(qwen05, fsdp_offload=True, **kw), _est(qwen05, **kw)
    t = on["totals_bytes"]
    assert t["weights_and_optimizer"] == 0 and t["with_gradients"] == 0
    assert t["cpu_offloaded"] == off["totals_bytes"]["with_gradients"] == (4 + 4 + 8) * N // 4
    assert t["training_step"] == _sum(on, "gather", "training") == off["totals_bytes"]["training_step"] - t["cpu_offloaded"]


def test_no_reshard_keeps_the_model_gathered(qwen05):
    est = _est(qwen05, algo="sft", gpus=2, weight_dtype="fp32", fsdp_reshard=False)
    assert _row(est, "policy gathered layers") == 3 * N * 2  # measured: three bf16 copies' worth


def test_mixed_precision_off_computes_in_fp32(qwen05):
    est = _est(qwen05, algo="sft", gpus=2, weight_dtype="fp32", mixed_precision="no", batch_size=2)
    assert _row(est, "policy gathered layers") == N * 4
    assert _row(est, "policy unsharded gradients") == ROOT * 4 + LAYER * 8  # fp32 gradients, fp32 reduce
    assert _row(est, "policy logits") == (1 << 25) * 8  # fp32 logits + gradient (1.24 GB) > one chunk
    small = _est(qwen05, algo="sft", gpus=2, weight_dtype="fp32", mixed_precision="no", batch_size=2, seq_len=64)
    assert _row(small, "policy logits") == 1 * 64 * 151_936 * 4 * 2  # under one chunk: held whole


def test_lora_shards_base_and_adapters(qwen05):
    est = _est(qwen05, algo="sft", gpus=4, weight_dtype="fp32", lora=True, lora_rank=8)
    per_layer = 8 * (896 + 896 + 2 * (896 + 128) + 896 + 896 + 3 * (896 + 4864))  # r * (d_in + d_out)
    assert _row(est, "policy LoRA adapters") == 24 * per_layer * 4 // 4
    assert _row(est, "policy optimizer state") == 24 * per_layer * 8 // 4
    assert _row(est, "policy weights") == N  # frozen base, fp32, a quarter
    # only the adapters get gradients: no root gradients, one layer's adapters in flight
    assert _row(est, "policy unsharded gradients") == per_layer * 6


def test_refusals_are_config_errors(qwen05):
    with pytest.raises(ConfigError, match="sharding"):
        _est(qwen05, gpus=2, sharding="none")
    with pytest.raises(ConfigError, match="rollout_batch"):
        _est(qwen05, algo="grpo", gpus=3, rollout_batch=8)
    with pytest.raises(ConfigError, match="does not divide"):
        _est(qwen05, algo="sft", gpus=8, batch_size=2, grad_accum=2)


def test_cli_table_per_gpu(qwen05, capsys):
    assert main(["memory", "--model", qwen05, "--algo", "grpo", "gpus=4", "weight_dtype=fp32"]) == 0
    out = capsys.readouterr().out
    for text in ("per GPU of 4 (torchrun): FSDP2 sharding", "rollout replica", "1/4 shard",
                 "= loading", "total (peak per GPU)", "+ CUDA context + NCCL"):
        assert text in out, text


def test_bench_dry_run_plans_every_configuration(capsys):
    """bench/memory_check.py --dry (no GPU): each planned configuration, its command and predictions."""
    import importlib.util
    import json
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("memory_check", Path(__file__).parents[1] / "bench" / "memory_check.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--dry", "--gpus", "1,2"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 * len(bench.PLAN)
    assert [x["command"].split(" bench/")[0] for x in lines[:2]] == ["python", "torchrun --nproc-per-node 2"]
    # 7.6B parameters: one GPU holds 16 B each (fp32 weights, gradients, AdamW m + v) and more;
    # two GPUs hold half of that each, plus what is not sharded
    big = [x["predicted"]["peak_gb"] for x in lines if "qwen2.5-7b" in x["command"]]
    assert big[0] > 7.6e9 * 16 / 1e9 > big[1] > 7.6e9 * 8 / 1e9


def test_sharded_rl_and_dpo_hold_one_logit_chunk(qwen05):
    """The chunked LM head runs under FSDP2 too (models/logprobs._sharded_chunked_head): every
    trainer, SFT included, holds one chunk of 2^25 logits whatever the number of GPUs — 4 B each
    there (fitted to the sharded runs with FSDP2's bf16 policy on 4 x H200: the CUDA head kernels
    keep the bf16 logits and write their gradient in place); the one-process rows keep the 14 B they were fitted with."""
    for algo in ("grpo", "dpo", "sft"):
        assert _row(_est(qwen05, algo=algo), "policy logits") == (1 << 25) * 14
        for gpus in (2, 4):
            assert _row(_est(qwen05, algo=algo, gpus=gpus), "policy logits") == (1 << 25) * 4


# One process, fp32 weights under bf16 autocast (the trainers' default), measured on 1 x H200
# (bench/memory_check.py, 2026-11-27, benchmarks/memory_check.jsonl): peak max_memory_allocated in GB.
# The two SFT rows were measured with SFT's loss on whole logits (2.5 GB of them); SFT's loss goes
# through the chunked LM head, which holds one chunk, and the planner follows the code. Strict
# xfail until they are measured again on a GPU (bench/memory_check.py).
STALE_SFT = pytest.mark.xfail(strict=True, reason="measured before SFT's chunked head; re-measure on GPU")


@pytest.mark.parametrize("kw, measured", [
    pytest.param(dict(algo="sft", batch_size=4, grad_accum=4, seq_len=1024), 18.21, marks=STALE_SFT),
    (dict(algo="grpo", batch_size=16, seq_len=512, rollout_batch=16, num_generations=8, reward="verifier", beta=0), 22.88),
    (dict(algo="ppo", batch_size=4, seq_len=512, rollout_batch=16, num_generations=1, reward="verifier", beta=0.05), 25.96),
    pytest.param(dict(algo="sft", batch_size=4, grad_accum=4, seq_len=1024, lora=True, gradient_checkpointing=True),
                 5.52, marks=STALE_SFT),
])
def test_one_gpu_fp32_autocast_within_ten_percent_of_measured(qwen05, kw, measured):
    est = _est(qwen05, gpus=1, weight_dtype="fp32", optimizer="adamw", **kw)
    assert 0.9 <= measured / est["totals_gb"]["peak"] <= 1.1
    assert _row(est, "policy bf16 weight casts") > 0  # autocast's saved bf16 weights
    # bf16 (no autocast) keeps the single-GPU formulas as they were: no cast row
    assert not [x for x in _est(qwen05, gpus=1, **kw)["components"] if "casts" in x["component"]]


# --- sharding=replicate: plain replication (distributed.replicate, sum_gradients), no FSDP2 ---

FSDP_ROWS = ("gathered", "unsharded", "accumulated", "refresh", "loaded whole")


def _one_process_part(est):
    """(component, group, bytes) of the rows one process holds too (not the KV cache: its home differs)."""
    return [(r["component"], r["group"], r["bytes"]) for r in est["components"]
            if r["group"] in ("resident", "gradients", "training")]


def _no_fsdp_rows(est):
    return not [r["component"] for r in est["components"] if any(w in r["component"] for w in FSDP_ROWS)]


def test_replicate_dpo_is_one_process_plus_the_gradient_sum(qwen05):
    """Each GPU holds what one process holds for its share of the batch: 16 pairs over 2 GPUs are
    8 pairs a GPU in micro-batches of 4, i.e. one process with batch_size=4 grad_accum=2 (bf16
    autocast weight casts and all). The only row torchrun adds is sum_gradients' flat temporary,
    after the last backward (activations freed): a phase of its own, not on top of the step."""
    kw = dict(algo="dpo", weight_dtype="fp32", seq_len=1024)
    rep = _est(qwen05, gpus=2, sharding="replicate", batch_size=4, grad_accum=4, **kw)
    one = _est(qwen05, batch_size=4, grad_accum=2, **kw)
    assert _one_process_part(rep) == _one_process_part(one)
    assert _row(rep, "policy bf16 weight casts") == N * 2  # autocast, as in one process
    assert {r["group"] for r in rep["components"]} == {"resident", "gradients", "training", "reduce"}
    assert _no_fsdp_rows(rep)
    # fp32 gradients (1.98 GB) go in buckets of 256 MiB, but the tied embedding's gradient
    # (151936 x 896 x 4 B) is larger: a bucket of its own, the largest temporary
    assert _row(rep, "gradient all-reduce bucket") == 151_936 * 896 * 4 == 544_538_624 > GRAD_BUCKET_BYTES
    t, o = rep["totals_bytes"], one["totals_bytes"]
    assert t["training_step"] == o["training_step"] == t["peak"]
    assert t["gradient_sum"] == o["with_gradients"] + 544_538_624
    assert t["peak_device"] == t["peak"] + CUDA_CONTEXT_BYTES + NCCL_BYTES
    assert t["loading"] is None and t["frozen_forwards"] is None and t["rollout"] is None
    assert rep["one_process_config"]["batch_size"] == 4 and rep["one_process_config"]["grad_accum"] == 2


def test_replicate_bucket_is_at_most_256_mib_unless_one_gradient_is_larger(qwen05):
    from tether import distributed
    assert GRAD_BUCKET_BYTES == distributed.GRAD_BUCKET_BYTES == 256 << 20
    # 7B guess in bf16: the largest gradient (32000 x 4096 x 2 B = 262 MB) fits one bucket
    assert _row(_est("7e9", algo="sft", gpus=2, sharding="replicate"), "gradient all-reduce bucket") == 256 << 20
    lora = _est(qwen05, algo="sft", gpus=2, sharding="replicate", lora=True, lora_rank=8)
    assert _row(lora, "gradient all-reduce bucket") == _sum(lora, "gradients") < 256 << 20  # all in one


def test_replicate_grpo_holds_a_replica_and_a_kv_cache_of_its_own(qwen05):
    """Online: the rollout replica (whole bf16 policy) and the KV cache for the GPU's prompts in
    the replica's dtype, never inside the gradients (flat_grad_buffer returns None under torchrun),
    where one process lends the cache its gradient buffer."""
    kw = dict(algo="grpo", weight_dtype="fp32", reward="verifier", beta=0, seq_len=384, batch_size=8,
              num_generations=8, gradient_checkpointing=True)
    rep = _est(qwen05, gpus=2, sharding="replicate", rollout_batch=16, **kw)
    one = _est(qwen05, rollout_batch=8, sampler_copy=False, **kw)  # sampling from its own weights
    assert _one_process_part(rep) == _one_process_part(one)
    kv = 64 * 384 * (2 * 24 * 2 * 64 * 2)  # 8 prompts x 8 per GPU, bf16
    assert _row(rep, "rollout replica") == N * 2 and _row(rep, "KV cache (rollouts)") == kv
    assert one["kv_in_gradient_buffer"] and not rep["kv_in_gradient_buffer"]
    assert _no_fsdp_rows(rep)
    t, o = rep["totals_bytes"], one["totals_bytes"]
    assert t["training_step"] == o["training_step"] + N * 2 + kv == t["peak"]
    assert t["rollout"] == t["weights_and_optimizer"] + N * 2 + kv  # gradients freed while sampling
    assert t["gradient_sum"] == t["with_gradients"] + N * 2 + kv + 544_538_624


def test_replicate_ignores_the_fsdp_options(qwen05, capsys):
    kw = dict(algo="sft", gpus=4, sharding="replicate", weight_dtype="fp32", batch_size=4, grad_accum=8)
    plain = _est(qwen05, **kw)
    odd = _est(qwen05, fsdp_reshard=False, fsdp_unit_layers=4, fsdp_defer_sync=True, **kw)
    assert odd["components"] == plain["components"] and odd["totals_bytes"] == plain["totals_bytes"]
    with pytest.raises(ValueError, match="fsdp_offload"):  # refused, as the trainers refuse it
        _est(qwen05, fsdp_offload=True, **kw)
    assert main(["memory", "--model", qwen05, "--algo", "grpo", "gpus=2", "sharding=replicate",
                 "fsdp_defer_sync=true"]) == 0
    out = capsys.readouterr().out
    for text in ("replicated (fsdp=false)", "whole on every GPU", "rollout replica", "= gradient sum",
                 "gradient all-reduce bucket", "ignored under replicate", "fsdp_defer_sync=true"):
        assert text in out, text
    assert "gathered" not in out and "1/2 shard" not in out


# fsdp=false as plain replication, measured on 4 x H200 (bench/scale.py --set fsdp=false, results in
# benchmarks/scale/, Qwen2.5-0.5B shape, 2026-11-27): max_memory_allocated per GPU, GiB. DPO's is
# the same at 1, 2 and 4 GPUs (8 pairs a GPU); GRPO's grows from 8.825 GiB at 1 GPU (sampling from its fp32 weights, cache inside
# the gradients) by the replica + KV cache.
DPO_REPLICATE = dict(algo="dpo", batch_size=4, seq_len=1024, precompute_ref=True)
GRPO_REPLICATE = dict(algo="grpo", batch_size=8, seq_len=384, num_generations=8, reward="verifier", beta=0)


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("kw, measured_gib", [(DPO_REPLICATE, 9.266), (GRPO_REPLICATE, 10.037)])
def test_replicate_within_ten_percent_of_measured(qwen05, gpus, kw, measured_gib):
    share = dict(grad_accum=2 * gpus) if kw["algo"] == "dpo" else dict(rollout_batch=8 * gpus)
    est = _est(qwen05, gpus=gpus, sharding="replicate", weight_dtype="fp32", gradient_checkpointing=True, **kw, **share)
    assert 0.9 <= measured_gib * 2**30 / est["totals_bytes"]["peak"] <= 1.1
    if kw["algo"] == "grpo":  # what 2+ GPUs add over one process: measured 1.30 GB
        one = _est(qwen05, weight_dtype="fp32", gradient_checkpointing=True, rollout_batch=8, sampler_copy=False, **kw)
        added = est["totals_bytes"]["peak"] - one["totals_bytes"]["peak"]
        assert abs((10.037 - 8.825) * 2**30 - added) < 0.05e9


def test_bf16_reduction_drops_the_fp32_copy_of_the_unsharded_gradients(qwen05):
    """fsdp_reduce=bf16 (accelerate's FSDP2 default): a unit's bf16 gradients are reduce-scattered
    as they are, no fp32 copy: 2 + 2 bytes a parameter in place of 2 + 4 (the root's fp32 copy comes
    at the backward's end, when the rest is freed: not counted either way); the rest is unchanged."""
    kw = dict(algo="sft", gpus=4, weight_dtype="fp32", batch_size=4, grad_accum=4, gradient_checkpointing=True)
    fp32, bf16 = _est(qwen05, **kw), _est(qwen05, fsdp_reduce="bf16", **kw)
    assert _row(fp32, "policy unsharded gradients") == ROOT * 2 + LAYER * 6
    assert _row(bf16, "policy unsharded gradients") == ROOT * 2 + LAYER * 4
    others = lambda e: {r["component"]: r["bytes"] for r in e["components"] if "unsharded" not in r["component"]}  # noqa: E731
    assert others(fp32) == others(bf16)
    # with deferred sync FSDP2 would add the micro-batches' gradients in bf16: refused, as the trainers do
    with pytest.raises(ValueError, match="fsdp_reduce"):
        _est(qwen05, fsdp_reduce="bf16", fsdp_defer_sync=True, **kw)
    from tether.config import load_config as load
    from tether.trainers.preference.offline import DPOConfig
    with pytest.raises(Exception, match="fsdp_defer_sync"):
        load(DPOConfig, overrides={"model": "m", "data": "d", "fsdp_reduce": "bf16", "fsdp_defer_sync": True})
    load(DPOConfig, overrides={"model": "m", "data": "d", "fsdp": False, "fsdp_reduce": "bf16", "fsdp_defer_sync": True})


@pytest.mark.parametrize("sharding", ["fsdp", "replicate"])
def test_release_replica_takes_the_replica_and_cache_out_of_the_training_step(qwen05, sharding):
    """release_replica (rollout.release_replica): the training step's total drops exactly the
    rollout group (replica + KV cache); the rollout phase and the components are unchanged."""
    kw = dict(algo="grpo", gpus=2, sharding=sharding, weight_dtype="fp32", rollout_batch=8,
              gradient_checkpointing=True)
    kept, freed = _est(qwen05, **kw), _est(qwen05, release_replica=True, **kw)
    held = _sum(kept, "rollout")
    assert held > 0 and kept["components"] == freed["components"]
    assert freed["totals_bytes"]["training_step"] == kept["totals_bytes"]["training_step"] - held
    assert freed["totals_bytes"]["rollout"] == kept["totals_bytes"]["rollout"]
    with pytest.raises(ValueError, match="release_replica"):
        _est(qwen05, algo="dpo", gpus=2, sharding=sharding, release_replica=True)


def test_release_replica_frees_the_copy_for_the_frozen_forwards_it_follows(qwen05):
    """The copy is released once the batch is sampled: the reference's forward (grpo, ppo) and PPO's
    reward model's run without it; the grpo family's reward model scores inside the rollout step,
    beside it."""
    def frozen(algo, release, **kw):
        e = _est(qwen05, algo=algo, gpus=2, weight_dtype="fp32", rollout_batch=8, release_replica=release, **kw)
        return e["totals_bytes"]["frozen_forwards"], _sum(e, "rollout")
    (kept, held), (freed, _) = (frozen("grpo", r, reward="verifier", beta=0.04) for r in (False, True))
    assert freed == kept - held
    (kept, held), (freed, _) = (frozen("grpo", r, reward="model", beta=0) for r in (False, True))
    assert freed == kept
    (kept, held), (freed, _) = (frozen("ppo", r, reward="model") for r in (False, True))
    assert freed == kept - held


# FSDP2 with its bf16 policy, measured on 4 x H200 (bench/memory_check.py and bench/scale.py,
# results in benchmarks/memory/ and benchmarks/scale/, 2026-11-28): per-GPU peak
# max_memory_allocated, GB, of the training step. The planner's FSDP2 constants were refitted on these rows (in-sample).
BF16_SFT = dict(algo="sft", batch_size=4, grad_accum=4, seq_len=1024)
BF16_DPO = dict(algo="dpo", batch_size=4, seq_len=1024, precompute_ref=True)  # bench/scale.py: 8 pairs a GPU
BF16_GRPO = dict(algo="grpo", batch_size=8, seq_len=384, num_generations=8, reward="verifier", beta=0)


@pytest.mark.parametrize("gpus, kw, measured", [
    (2, dict(algo="dpo", batch_size=2, grad_accum=4, seq_len=1024, precompute_ref=True), 10.409),
    (2, dict(BF16_SFT, fsdp_offload=True), 6.457),
    (4, dict(BF16_SFT, lora=True, lora_rank=16), 6.452),
    (4, dict(BF16_SFT, gradient_checkpointing=True), 2.890),
    # (measured with the reference sharded in fp32; frozen_to_bf16 halves it, 0.25 GB here, and the
    # prediction follows the code: measured / predicted 1.02 until measured again; 0.99 against a
    # prediction with the fp32 reference)
    (4, dict(algo="ppo", batch_size=4, seq_len=512, rollout_batch=16, num_generations=1, reward="verifier",
             beta=0.05, gradient_checkpointing=True), 7.334),
    (2, dict(BF16_DPO, grad_accum=4, gradient_checkpointing=True), 5.678),
    (4, dict(BF16_DPO, grad_accum=8, gradient_checkpointing=True), 3.701),
    (2, dict(BF16_GRPO, rollout_batch=16, gradient_checkpointing=True), 6.404),
    (4, dict(BF16_GRPO, rollout_batch=32, gradient_checkpointing=True), 4.428),
])
def test_fsdp_bf16_policy_within_ten_percent_of_measured(qwen05, gpus, kw, measured):
    est = _est(qwen05, gpus=gpus, weight_dtype="fp32", optimizer="adamw", **kw)
    assert 0.9 <= measured / est["totals_gb"]["peak"] <= 1.1


@pytest.mark.parametrize("release, measured", [(False, 53.358), (True, 40.397)])
def test_fsdp_7b_grpo_within_ten_percent_of_measured(tmp_path, release, measured):
    """Qwen2.5-7B shape, 4 GPUs, 2 prompts x 8 x (128 + 512) a GPU, micro-batch 8, checkpointing. The
    replica kept: 53.36 GB measured (49 MB above setup's moment, so the update's).
    rollout.release_replica: 40.40 GB measured (out of sample: predicted 40.85 before it was
    measured, the rollout phase's peak)."""
    from transformers import Qwen2Config
    Qwen2Config(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False).save_pretrained(tmp_path)
    est = _est(str(tmp_path), algo="grpo", gpus=4, weight_dtype="fp32", optimizer="adamw", batch_size=8,
               seq_len=640, rollout_batch=8, num_generations=8, reward="verifier", beta=0, gradient_checkpointing=True,
               release_replica=release)
    assert 0.9 <= measured / est["totals_gb"]["peak"] <= 1.1


def test_fsdp_7b_dpo_within_ten_percent_of_measured(tmp_path):
    """Qwen2.5-7B shape, 4 GPUs, bench/scale.py's DPO (2 pairs x 1,024 tokens a GPU, precomputed
    reference, checkpointing, bf16 reduce): 33.47 GB measured (a peak without setup's moment).
    Counting the untied head's and the embeddings' gradients through the whole backward beside
    root + 4 layers predicts 39.17 (measured/predicted 0.855, out of sample); the untied head's
    backward as a phase of its own (memory/sharded.py), fitted on this row, predicts 36.38 (0.920,
    in-sample), and the 7B GRPO rows come to 0.995 (0.956 under the whole-backward count) and 0.989."""
    from transformers import Qwen2Config
    Qwen2Config(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False).save_pretrained(tmp_path)
    est = _est(str(tmp_path), algo="dpo", gpus=4, weight_dtype="fp32", optimizer="adamw", batch_size=2, grad_accum=4,
               seq_len=1024, precompute_ref=True, gradient_checkpointing=True, fsdp_reduce="bf16")
    assert 0.9 <= 33.468 / est["totals_gb"]["peak"] <= 1.1


def test_an_untied_trained_head_is_a_backward_phase_of_its_own(tmp_path):
    """A trained untied LM head (its own FSDP2 unit, differentiated first): with checkpointing the
    step holds the root without the head + the larger of the head's phase (its gathered weight,
    gradient and reduce-scatter input: H (2c + r)) and the layers' (4 gathered layers + one
    layer's gradient and reduce-scatter input); the embeddings' gradient (last in backward) is not
    counted. Without checkpointing the unsharded gradients are the head's or a layer's, the larger."""
    from transformers import Qwen2Config
    Qwen2Config(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False).save_pretrained(tmp_path)
    kw = dict(algo="dpo", gpus=4, weight_dtype="fp32", batch_size=2, grad_accum=4, seq_len=1024, precompute_ref=True)
    H, c = 152064 * 3584, 2
    root_without_head = H + 3584  # the embeddings (vocab x hidden, as the head) + the final norm
    for r, reduce in ((2, "bf16"), (4, "fp32")):
        est = _est(str(tmp_path), gradient_checkpointing=True, fsdp_reduce=reduce, **kw)
        layer = (est["params"] - root_without_head - H) // 28  # one decoder layer's parameters
        rows = {x["component"]: x["bytes"] for x in est["components"]}
        assert rows["policy gathered layers"] == (root_without_head + FSDP_LIVE_LAYERS * layer) * c
        assert rows["policy unsharded gradients"] == layer * (c + r)  # no embeddings' gradient
        gather = rows["policy gathered layers"] + rows["policy unsharded gradients"] + rows["policy LM head in backward"]
        assert gather == root_without_head * c + max(H * (2 * c + r), FSDP_LIVE_LAYERS * layer * c + layer * (c + r))
        whole = _est(str(tmp_path), gradient_checkpointing=False, fsdp_reduce=reduce, **kw)
        rows = {x["component"]: x["bytes"] for x in whole["components"]}
        assert "policy LM head in backward" not in rows
        assert rows["policy unsharded gradients"] == max(layer * (c + r), H * (c + r)) == H * (c + r)


def test_a_scalar_head_models_embeddings_gradient_comes_last(qwen05):
    """A value model (separate, scalar head: a unit of its own) gets its embeddings' gradient at the
    end of backward, when activations and gathered layers are gone: its unsharded gradients are one
    layer's (+ reduce-scatter input) and the root's rest (final norm + head), not the embeddings;
    the tied policy's root (its embeddings are its head) is held through the whole backward."""
    est = _est(qwen05, algo="ppo", gpus=4, weight_dtype="fp32", batch_size=4, rollout_batch=16, beta=0.05,
               gradient_checkpointing=True)
    c, r = 2, 4
    assert _row(est, "value model unsharded gradients") == (896 + 896) * c + LAYER * (c + r)
    assert _row(est, "policy unsharded gradients") == ROOT * c + LAYER * (c + r)


def test_one_process_sampling_copy_holds_the_policy_in_bf16_and_its_cache_in_bf16(qwen05):
    """rollout.sampler_copy in one process (bench/scale.py's one-GPU GRPO): the
    policy once more in bf16, kept all run, and a bf16 KV cache (still inside the fp32 gradients)."""
    kw = dict(algo="grpo", weight_dtype="fp32", batch_size=8, seq_len=384, rollout_batch=8, num_generations=8,
              reward="verifier", beta=0)
    plain, copy = _est(qwen05, sampler_copy=False, **kw), _est(qwen05, sampler_copy=True, **kw)
    assert _est(qwen05, **kw)["totals_bytes"] == copy["totals_bytes"]  # auto: fp32 weights, bf16 compute
    assert _est(qwen05, mixed_precision="no", **kw)["totals_bytes"] == \
        _est(qwen05, mixed_precision="no", sampler_copy=False, **kw)["totals_bytes"]
    assert _row(copy, "sampling copy") == N * 2
    assert _row(copy, "KV cache (rollouts)") * 2 == _row(plain, "KV cache (rollouts)")
    assert copy["totals_bytes"]["peak"] == plain["totals_bytes"]["peak"] + N * 2  # the cache lent in both
    assert not [r for r in _est(qwen05, gpus=2, sampler_copy=True, **kw)["components"] if r["component"] == "sampling copy"]
    with pytest.raises((ValueError, ConfigError), match="sampler_copy"):
        _est(qwen05, algo="dpo", sampler_copy=True)
