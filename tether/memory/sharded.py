"""`tether memory gpus=N`: what each GPU holds when N processes train one model under torchrun with FSDP2.

The layout is tether/distributed.py's and trainers/core/sharding.py's: FSDP2 `fully_shard` on every decoder
layer, then the root (embeddings, final norm, head); frozen models sharded the same way; the RL
trainers' rollout replica (a whole policy per GPU) and their sampler's KV cache for the GPU's share
of the prompts. sharding=replicate (the trainers' fsdp=false: plain replication, no FSDP2) is
replicated.py's, which shares this module's per-GPU batch and the bytes outside the allocator.
Every formula, and what it leaves out, is in docs/memory.md ("Many GPUs"); comments here say why a
line is the way it is.

The components come in the single-GPU groups (resident, gradients, training, rollout) plus these:
`gather` (FSDP2's gathered weights and unsharded gradients around the micro-batch being trained),
`refresh` (the replica's refresh from the shards), `frozen` (a frozen model's gathered layers
during its forward), `load` (the models whole on each GPU while setup loads them, before sharding).
"""

from __future__ import annotations

from dataclasses import asdict

from tether.memory.single import (HEAD_CHUNK_LOGITS, DTYPE_BYTES, GB, ONLINE, OPT_BYTES, OPT_NOTE, PAIRWISE, MemoryConfig,
                           activation_bytes, component, held_models, whole_logits)

# The constants below are fitted to measurements (bench/memory_check.py and bench/scale.py, 4 x H200,
# torch 2.11, Qwen2.5-0.5B and -7B shapes, FSDP2's bf16 MixedPrecisionPolicy on; docs/memory.md,
# "Many GPUs: measured"). The model sums its rows as
# if all were live at once, which they are not quite (the head's chunk and a recomputed layer come
# at different moments); the constants absorb that, so read them as fitted, not as counts.
#
# Decoder layers whose gathered weights count as live (gradient checkpointing, frozen forwards):
# prefetch keeps 2, and the CPU issues all-gathers ahead of the GPU. 4 fits the bf16-gather runs
# (11 training-step peaks within 10 %); runs that gather fp32 weights fit 10.
FSDP_LIVE_LAYERS = 4
# Saved-for-backward bytes under the bf16 policy, as a share of single.activation_bytes's count:
# FSDP2 casts each unit's inputs to bf16, so the residual stream and the norms' inputs are bf16,
# where autocast over fp32 weights (what the formula was written for) keeps them fp32. Fitted:
# 0.76-0.81 from the no-checkpointing runs (0.5B, 4 x 1024 tokens a GPU, full and LoRA).
SHARDED_ACT = 0.8
# fsdp_reshard=false: gathered weights, measured, in units of the whole model in the compute dtype
# (0.5B: +1.98 GB = 2 x 0.99 over resharding, which itself holds the whole model without
# checkpointing). Measured with fp32 gathers only; not measured with the bf16 policy.
NO_RESHARD_WHOLE_MODELS = 3
# Bytes per logit per compute-dtype byte: the logits and their gradient (tether's token_logps is
# tiled and keeps no fp32 copy), where the whole logits are held: SFT's forward, and the others'
# when their logits fit one chunk (else the chunked head runs inside the root's FSDP2 call,
# models/logprobs._sharded_chunked_head). Measured: 3.96 B/logit in bf16 (0.5B, batch 4 vs 1).
# The chunked head's one chunk counts the same (on CUDA its kernels keep the bf16 logits and write
# their gradient over them; the one-process planner's 14 B, fitted before, stays there).
LOGIT_COPIES = 2
# Outside the caching allocator, so outside torch.cuda.max_memory_allocated (what `peak` predicts):
# the device's used memory minus torch's reserved memory. CUDA context with cuBLAS handles: 0.72 GB
# after the first matmul, 0.82-0.91 GB at the end of a one-process run (H100). NCCL: 2.17 GB (H100)
# and 2.27 GB (H200) at the end of 2-process runs, so ~1.35 GB for the communicators of 2 ranks;
# NCCL sizes its buffers by channels and peers, so more GPUs may take more (not yet measured).
CUDA_CONTEXT_BYTES = int(0.9 * GB)
NCCL_BYTES = int(1.4 * GB)


def _micro_batches(cfg: MemoryConfig) -> int:
    """Backward passes per optimizer step on one GPU: what fsdp_defer_sync accumulates over (PPO
    steps after each minibatch's single backward: never more than one)."""
    if cfg.algo == "ppo":
        return 1
    per, gen = per_gpu_batch(cfg)
    if cfg.algo in ONLINE:
        return -(-gen // max(per, 1))
    return -(-cfg.grad_accum // cfg.gpus)


def per_gpu_batch(cfg: MemoryConfig) -> tuple[int, int]:
    """(sequences per micro-batch on one GPU, rollout sequences on one GPU). Each process takes
    1/N of the global batch (distributed.py: ranks are micro-batches) and cuts its share into
    micro-batches of the single-process size."""
    n = cfg.gpus
    if cfg.algo in ONLINE:
        gen = cfg.rollout_batch // n * (cfg.num_generations if cfg.algo != "ppo" else 1)
        return min(cfg.batch_size, gen), gen
    micro = min(cfg.batch_size, cfg.batch_size * cfg.grad_accum // n)
    return micro * (2 if cfg.algo in PAIRWISE else 1), 0


def estimate_sharded(cfg: MemoryConfig, info: dict) -> dict:
    """Per-GPU components and totals for cfg.gpus > 1 under FSDP2 (same keys as memory.estimate,
    plus `loading`, `frozen_forwards`, `outside_allocator` and `peak_device` among the totals)."""
    n, shape = info["params"], info["shape"]
    gpus = split = cfg.gpus  # split: what a resident or gradient byte is divided by
    d, opt = DTYPE_BYTES[cfg.weight_dtype], OPT_BYTES[cfg.optimizer]
    # trainers/core/sharding.sharding_bf16: fp32 weights + mixed precision -> MixedPrecisionPolicy(bf16, reduce fp32,
    # or bf16 with fsdp_reduce=bf16); other dtypes compute and reduce in their own (FSDP2's default)
    mixed = d == 4 and cfg.mixed_precision != "no"
    c, r = (2, 2 if cfg.fsdp_reduce == "bf16" else 4) if mixed else (d, d)
    rows: list[dict] = []

    def add(*args, **kw):
        rows.append(component(*args, **kw))

    where = "cpu" if cfg.fsdp_offload else "gpu"
    opt_where = "cpu" if cfg.fsdp_offload or cfg.offload else "gpu"
    part = f"1/{gpus} shard"
    models = held_models(cfg, n, shape)
    for m in models:
        # sharding.frozen_to_bf16: a frozen model under the bf16 policy is sharded from bf16 weights
        wd = c if mixed and not m.trainable else d
        add(f"{m.name} weights", "resident", m.weights * wd / split, m.weights, wd / split,
            f"{m.note}{', bf16' if wd != d else ''}; {part}", where)
        if m.adapters:
            add(f"{m.name} LoRA adapters", "resident", m.adapters * 4 / split, m.adapters, 4 / split,
                f"rank {cfg.lora_rank}, fp32; {part}", where)
    for m in (m for m in models if m.trainable):
        if cfg.master_weights and m.trainable_bytes < 4:
            add(f"{m.name} fp32 master weights", "resident", m.trainable * 4 / split, m.trainable, 4 / split,
                part, opt_where)
        add(f"{m.name} optimizer state", "resident", m.trainable * opt / split, m.trainable, opt / split,
            f"{OPT_NOTE[cfg.optimizer]}; {part}", opt_where)
    for m in (m for m in models if m.trainable):
        add(f"{m.name} gradients", "gradients", m.trainable * m.trainable_bytes / split, m.trainable,
            m.trainable_bytes / split, f"{m.trainable_bytes} B each, as the sharded weights; {part}", where)
        if cfg.fsdp_defer_sync and _micro_batches(cfg) > 1:  # (distributed.accumulation)
            # FSDP2 keeps them in the reduce dtype until the step's last backward
            add(f"{m.name} accumulated gradients", "gradients", m.trainable * r, m.trainable, r,
                f"fsdp_defer_sync: the whole gradient ({r} B each) on every GPU between micro-batches")

    # FSDP2 units: each decoder layer, and the root holding the rest (embeddings, final norm, LM or
    # scalar head). With a parameter count for a model the root is what the count leaves beyond the
    # guessed shape's layers.
    lora_layer = shape.lora_params(cfg.lora_rank, cfg.lora_targets) // shape.layers if cfg.lora else 0
    unit = shape.layer_params()
    cdt = "bf16" if c == 2 else "fp32"
    k_units = max(1, min(cfg.fsdp_unit_layers, shape.layers))  # layers per FSDP2 unit
    live = min(FSDP_LIVE_LAYERS * k_units, shape.layers)  # FSDP_LIVE_LAYERS units (measured at k = 1)

    def gathered(m, trained: bool, head: int = 0):
        """(bytes, what): the model's gathered weights live at once. Trained without checkpointing,
        autograd keeps every layer's gathered weights for its backward (measured: all 25 units of
        the 0.5B shape live after the forward); with checkpointing, and in frozen forwards, the
        root + FSDP_LIVE_LAYERS units of fsdp_unit_layers layers (measured with one layer a unit),
        less `head` (a trained untied LM head: its own phase, see below)."""
        whole = m.weights + m.adapters
        if not cfg.fsdp_reshard:
            k = NO_RESHARD_WHOLE_MODELS if trained else 1
            return k * whole * c, f"{k} x the whole model (fsdp_reshard=false; measured)"
        if trained and not cfg.gradient_checkpointing:
            return whole * c, "the whole model (saved for backward layer by layer; measured)"
        layer = unit + (lora_layer if m.adapters else 0)
        root = max(0, whole - shape.layers * layer - head)
        return (root + live * layer) * c, (f"root{' without the LM head' if head else ''} + {live} decoder "
                                           f"layers (all-gathers run ahead of the GPU)")

    for m in (m for m in models if m.layered):
        if not m.trainable:
            g, what = gathered(m, False)
            add(f"{m.name} gathered layers", "frozen", g, note=f"during its forward: {what}, {cdt}")
            continue
        layer_tr = lora_layer if cfg.lora else unit
        unit_grads = k_units * layer_tr * (c + r)  # one unit's gradients + its reduce-scatter input
        units = f"one unit's ({k_units} layer{'s' if k_units > 1 else ''}) + its {'fp32' if r == 4 else cdt} reduce-scatter input"
        # A trained untied LM head (not LoRA's frozen one) is an FSDP2 unit of its own
        # (distributed.shard), differentiated first: its backward is a phase of its own — its
        # gathered weight, its gradient and that gradient's reduce-scatter input at once, all the
        # activations still saved — and it is resharded and reduced before the decoder layers'
        # backward starts. The embeddings' gradient comes last in backward, once the activations
        # and gathered layers are gone (not counted). Fitted on the 7B DPO run (33.47 GB measured;
        # counting head + embedding gradients through the whole backward beside root + 4 layers
        # gives measured/predicted 0.855) and checked on the 7B GRPO rows (measured/predicted 0.995;
        # 0.956 under that count).
        head = shape.lm_head() if m.activations == "lm" and not cfg.lora else 0
        ckpt_like = cfg.fsdp_reshard and cfg.gradient_checkpointing
        g, what = gathered(m, True, head if ckpt_like else 0)
        add(f"{m.name} gathered layers", "gather", g, note=f"{what}, {cdt}")
        if head and ckpt_like:  # two phases: the head's, then the layers' (their gathered weights in g)
            add(f"{m.name} unsharded gradients", "gather", unit_grads, note=f"backward: {units}")
            layers_phase = live * unit * c + unit_grads
            add(f"{m.name} LM head in backward", "gather", max(0, head * (2 * c + r) - layers_phase),
                note=f"the untied head's phase (its gathered weight, gradient and reduce-scatter input: "
                     f"{head * (2 * c + r) / 1e9:.2f} GB) beyond the layers' ({layers_phase / 1e9:.2f} GB)")
            continue
        if head:  # the whole model gathered already: the head's gradient or a unit's, the larger
            add(f"{m.name} unsharded gradients", "gather", max(unit_grads, head * (c + r)),
                note=f"backward: {units}, or the untied LM head's gradient + its reduce-scatter input "
                     f"(the larger; the embeddings' come at the end)")
            continue
        root_tr = max(0, m.trainable - shape.layers * layer_tr)
        # the root (embeddings, a tied head) is reduced last: its gradients accumulate unsharded
        # through the whole backward (c bytes each) and are cast for their reduce-scatter at the end,
        # once the activations and gathered layers are gone (so that copy is not counted); a layer's
        # are reduced, in the reduce dtype, as its backward ends. Only a tied head makes the
        # embeddings' gradient at the start of backward; otherwise (a reward or value model's
        # scalar head, its own unit) it comes last, with nothing else live (not counted).
        if not (m.activations == "lm" and shape.tied) and not cfg.lora:
            root_tr = max(0, root_tr - shape.vocab * shape.hidden)
        add(f"{m.name} unsharded gradients", "gather", root_tr * c + unit_grads,
            note=f"backward: the root's {cdt} gradients and {units}")

    seqs, gen = per_gpu_batch(cfg)
    ckpt = "checkpointed" if cfg.gradient_checkpointing else "no checkpointing"
    for m in (m for m in models if m.activations):
        share = SHARDED_ACT if mixed else 1  # (bf16 weights: the formula as on one GPU; not measured sharded)
        add(f"{m.name} activations", "training", activation_bytes(cfg, shape, seqs, c) * share,
            note=f"{seqs} seq x {cfg.seq_len} tok per GPU, {ckpt}, {cfg.attention}, {cdt}"
                 + (f", x {share} (fitted, bf16 policy)" if share != 1 else ""))
        if m.activations == "lm":
            full = seqs * cfg.seq_len * shape.vocab * c * LOGIT_COPIES
            chunk = HEAD_CHUNK_LOGITS * c * LOGIT_COPIES  # (the CUDA head kernels: see LOGIT_COPIES)
            if whole_logits(cfg, shape, seqs):  # SFT too (sft._micro_loss)
                add(f"{m.name} logits", "training", full,
                    note=f"{seqs} x {cfg.seq_len} x {shape.vocab} vocab, {cdt} logits + their gradient")
            else:  # the chunked head, as in one process
                add(f"{m.name} logits", "training", chunk,
                    note=f"chunked LM head: {HEAD_CHUNK_LOGITS} logits at a time (no [N, V] held)")
    if cfg.algo in ONLINE:
        lora = shape.lora_params(cfg.lora_rank, cfg.lora_targets) if cfg.lora else 0
        # setup_training(rollout_replica=True): a plain copy of the (PEFT) policy, bf16 under mixed
        # precision, kept for the whole run; the sampler keeps its cache between calls and, under
        # torchrun, never inside the gradients (common.flat_grad_buffer returns None)
        add("rollout replica", "rollout", (n + lora) * c, n + lora, c,
            f"whole policy in {cdt} on every GPU, not sharded")
        add("KV cache (rollouts)", "rollout", gen * cfg.seq_len * shape.kv_bytes_per_token(c),
            note=f"{gen} seq per GPU ({cfg.rollout_batch}/{gpus} prompts) x {cfg.seq_len} tok x "
                 f"{shape.kv_bytes_per_token(c)} B/token")
        # distributed.copy_full_weights gathers one whole parameter at a time, in its own dtype
        big = max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate)
        add("replica refresh", "refresh", big * d, big, d, "largest parameter gathered whole (after each step)")

    # setup._setup (and PPO's build, for policy and critic) loads into CPU memory and fully_shard
    # moves only each rank's shards to its GPU, so they never sit whole on a GPU. A learned reward
    # model (rewards/learned.py) loads onto the GPU first: that moment is counted
    on_gpu = [m for m in models if m.name == "reward model"]
    loaded = sum(m.weights * d + m.adapters * 4 for m in on_gpu)
    add("models loaded whole", "load", loaded,
        note=f"before sharding: {', '.join(m.name for m in on_gpu) or 'none'} whole on each GPU "
             f"(setup's models load in CPU memory)")

    def total(*groups, device="gpu"):
        return sum(x["bytes"] for x in rows if x["group"] in groups and x["device"] == device)

    resident, grads, held = total("resident"), total("gradients"), total("rollout")
    # rollout.release_replica: the replica and the KV cache are freed once a batch is sampled, so the
    # training step and the reference's forward (and PPO's reward model's) run without them; the
    # grpo family's reward model scores inside the rollout step, beside them
    kept = 0 if cfg.release_replica else held
    frozen = [(x["bytes"], held if cfg.algo != "ppo" and x["component"].startswith("reward model") else kept)
              for x in rows if x["group"] == "frozen"]  # (its gathered layers, what is held beside them)
    step_total = resident + grads + kept + total("gather", "training")
    during_rollout = resident + held + total("refresh") if cfg.algo in ONLINE else None
    during_frozen = resident + max(b + h for b, h in frozen) if frozen else None
    loading = total("load")
    peak = max(v for v in (step_total, during_rollout, during_frozen, loading) if v is not None)
    outside = CUDA_CONTEXT_BYTES + NCCL_BYTES
    totals = {"weights_and_optimizer": resident, "with_gradients": resident + grads,
              "loading": loading, "training_step": step_total, "rollout": during_rollout,
              "frozen_forwards": during_frozen,
              "peak": peak, "cpu_offloaded": total("resident", "gradients", device="cpu"),
              "outside_allocator": outside, "peak_device": peak + outside}
    return {"model": info["name"], "params": n, "source": info["source"], "shape": asdict(shape),
            "algo": cfg.algo, "config": asdict(cfg), "unit": "GB = 1e9 bytes", "components": rows,
            "kv_in_gradient_buffer": False, "per_gpu": True,
            "totals_bytes": totals, "totals_gb": {k: None if v is None else v / GB for k, v in totals.items()}}


def format_sharded(est: dict, head: list[str], row, tot, rule: str) -> list[str]:
    """The table body for a per-GPU estimate (memory.format_table's header and row helpers)."""
    c, t = est["config"], est["totals_gb"]
    by = {g: [x for x in est["components"] if x["group"] == g]
          for g in ("resident", "gradients", "gather", "training", "rollout", "refresh", "frozen", "load")}
    lines = [*head, rule, *map(row, by["resident"]), rule,
             tot("= weights + optimizer state", t["weights_and_optimizer"], "per GPU"),
             *map(row, by["gradients"]), tot("= + gradients", t["with_gradients"]),
             *map(row, by["rollout"] + by["gather"] + by["training"]),
             tot("= training step", t["training_step"],
                 "resident + gradients + gathered + unsharded gradients (+ an untied head's phase) + activations"
                 + (" + replica + KV cache" if by["rollout"] and not est["config"]["release_replica"] else ""))]
    if by["rollout"]:
        lines += [*map(row, by["refresh"]), tot("= rollout generation", t["rollout"],
                                                "resident + replica + KV cache (+ its refresh)")]
    if by["frozen"]:
        lines += [*map(row, by["frozen"]), tot("= frozen forwards", t["frozen_forwards"],
                                               "resident (+ replica + KV cache, unless released) + the largest frozen gather")]
    lines += [*map(row, by["load"]), tot("= loading", t["loading"], "setup, before the models are sharded"),
              rule, tot("total (peak per GPU)", t["peak"], "what torch.cuda.max_memory_allocated() should read"),
              tot("+ CUDA context + NCCL", t["outside_allocator"], "outside the allocator (measured, H100)"),
              tot("= device memory per GPU", t["peak_device"], f"x {c['gpus']} GPUs")]
    if t["cpu_offloaded"]:
        lines.append(f"(in CPU memory per process, not counted above: {t['cpu_offloaded']:.2f} GB)")
    return lines
