"""`tether memory gpus=N sharding=replicate`: what each GPU holds when N processes train one model
replicated under torchrun (the trainers' fsdp=false: distributed.replicate and sum_gradients).

Nothing is wrapped or hooked: each rank's model is exactly what one process holds (same dtype, fp32
weights under bf16 autocast by default, the same activation and logit formulas). So each GPU's rows
are single.py's `one_process_rows` for the GPU's share of the global batch (sharded.per_gpu_batch:
its micro-batch, its 1/N of the prompts), plus what torchrun changes:

- online algorithms sample from a rollout replica (sharding.sampling_copy: the whole policy in the
  compute dtype, kept all run), and the sampler's KV cache (the replica's dtype, the GPU's share of
  the prompts) is memory of its own: under torchrun `common.flat_grad_buffer` returns None, so the
  cache never lives inside the gradients as it can in one process, and is held through the step;
- `sum_gradients`, once per optimizer step after the last backward, concatenates each bucket of
  gradients (at most GRAD_BUCKET_BYTES, a larger gradient alone) into one flat temporary;
- the CUDA context and NCCL's buffers outside the allocator (sharded.py's constants).

No FSDP2 row exists here (gathered layers, unsharded gradients, accumulated gradients, the replica's
refresh from shards, a load window before sharding), and the fsdp_* options are ignored, as the
trainers ignore them under fsdp=false. docs/memory.md ("Many GPUs") has the formulas.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from tether.memory.sharded import CUDA_CONTEXT_BYTES, NCCL_BYTES, per_gpu_batch
from tether.memory.single import DTYPE_BYTES, GB, ONLINE, PAIRWISE, MemoryConfig, component, held_models, one_process_rows

# distributed.GRAD_BUCKET_BYTES (a test keeps the two equal; importing it here would import torch)
GRAD_BUCKET_BYTES = 256 << 20
# options of FSDP2 only, with the defaults the table compares against to say they are ignored
# (fsdp_offload=true never gets here: MemoryConfig refuses it with replicate, as the trainers do)
FSDP_ONLY = {"fsdp_offload": False, "fsdp_reshard": True, "fsdp_unit_layers": 1, "fsdp_defer_sync": False,
             "fsdp_reduce": "fp32"}


def per_gpu_config(cfg: MemoryConfig) -> MemoryConfig:
    """The one-process configuration each GPU runs: its micro-batch (pairs for the pairwise
    algorithms) and its share of the global batch or of the rollout's prompts."""
    seqs, _ = per_gpu_batch(cfg)
    if cfg.algo in ONLINE:
        return replace(cfg, gpus=1, sharding="none", batch_size=seqs, rollout_batch=cfg.rollout_batch // cfg.gpus)
    micro = seqs // (2 if cfg.algo in PAIRWISE else 1)
    share = cfg.batch_size * cfg.grad_accum // cfg.gpus
    return replace(cfg, gpus=1, sharding="none", batch_size=micro, grad_accum=-(-share // micro))


def bucket_bytes(cfg: MemoryConfig, n: int, shape) -> tuple[int, str]:
    """(bytes, why) of `sum_gradients`' largest flat temporary: buckets of at most
    GRAD_BUCKET_BYTES in parameter order, a gradient larger than that alone in its own bucket (full
    fine-tuning: the embedding, V x h, is often one), never more than all the gradients."""
    trained = [m for m in held_models(cfg, n, shape) if m.trainable]
    grads = sum(m.trainable * m.trainable_bytes for m in trained)
    largest = 0 if cfg.lora else max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate,
                                      shape.hidden * shape.heads * shape.head_dim) * max(m.trainable_bytes for m in trained)
    b = min(grads, max(GRAD_BUCKET_BYTES, largest))
    why = ("all the gradients, in one bucket" if b == grads else
           "the largest gradient, alone in its bucket" if b == largest else "one full bucket (256 MiB)")
    return b, why


def estimate_replicated(cfg: MemoryConfig, info: dict) -> dict:
    """Per-GPU components and totals for cfg.gpus > 1 with sharding=replicate: the keys of
    sharded.estimate_sharded (`loading` and `frozen_forwards` None: no phase of their own), plus
    `gradient_sum`, the optimizer step's all-reduce phase."""
    n, shape = info["params"], info["shape"]
    one = per_gpu_config(cfg)
    d = DTYPE_BYTES[cfg.weight_dtype]
    mixed = d == 4 and cfg.mixed_precision != "no"
    c = 2 if mixed else d
    cdt = "bf16" if c == 2 else "fp32"
    rows = one_process_rows(one, n, shape)
    for r in rows:
        if r["group"] == "resident":
            r["note"] = f"{r['note']}; whole on every GPU" if r["note"] else "whole on every GPU"
    if cfg.algo in ONLINE:
        lora = shape.lora_params(cfg.lora_rank, cfg.lora_targets) if cfg.lora else 0
        # sharding.sampling_copy: a deep copy of the (PEFT) policy, its parameters cast to bf16 under
        # mixed precision; otherwise the weights' dtype, PEFT's adapters staying fp32
        ab = 2 if mixed else 4
        rows.append(component("rollout replica", "rollout", n * c + lora * ab, n + lora, None,
                              f"whole policy in {cdt} on every GPU, kept all run"
                              + (f" (adapters {ab} B)" if lora else "")))
        _, gen = per_gpu_batch(cfg)
        kv = shape.kv_bytes_per_token(c)
        rows.append(component("KV cache (rollouts)", "rollout", gen * cfg.seq_len * kv,
                              note=f"{gen} seq per GPU ({cfg.rollout_batch}/{cfg.gpus} prompts) x {cfg.seq_len} tok x "
                                   f"{kv} B/token; never inside the gradients under torchrun"))
    b, why = bucket_bytes(cfg, n, shape)
    rows.append(component("gradient all-reduce bucket", "reduce", b,
                          note=f"sum_gradients' flat temporary after the last backward: {why}"))

    def total(*groups, device="gpu"):
        return sum(r["bytes"] for r in rows if r["group"] in groups and r["device"] == device)

    resident, grads, held = total("resident"), total("gradients"), total("rollout")
    # the training step holds activations; the gradient sum runs after backward freed them
    kept = 0 if cfg.release_replica else held  # rollout.release_replica: freed for the training pass
    step_total = resident + grads + kept + total("training")
    summing = resident + grads + kept + total("reduce")
    during_rollout = resident + held if cfg.algo in ONLINE else None  # gradients freed while sampling
    peak = max(step_total, summing)
    outside = CUDA_CONTEXT_BYTES + NCCL_BYTES
    totals = {"weights_and_optimizer": resident, "with_gradients": resident + grads,
              "loading": None, "training_step": step_total, "gradient_sum": summing,
              "rollout": during_rollout, "frozen_forwards": None,
              "peak": peak, "cpu_offloaded": total("resident", "gradients", device="cpu"),
              "outside_allocator": outside, "peak_device": peak + outside}
    return {"model": info["name"], "params": n, "source": info["source"], "shape": asdict(shape),
            "algo": cfg.algo, "config": asdict(cfg), "unit": "GB = 1e9 bytes", "components": rows,
            "kv_in_gradient_buffer": False, "per_gpu": True, "one_process_config": asdict(one),
            "totals_bytes": totals, "totals_gb": {k: None if v is None else v / GB for k, v in totals.items()}}


def format_replicated(est: dict, head: list[str], row, tot, rule: str) -> list[str]:
    """The table body for a replicated per-GPU estimate (memory.format_table's header and row helpers)."""
    c, t = est["config"], est["totals_gb"]
    by = {g: [x for x in est["components"] if x["group"] == g] for g in ("resident", "gradients", "training", "rollout", "reduce")}
    held = " + replica + KV cache" if by["rollout"] and not est["config"]["release_replica"] else ""
    lines = [*head, rule, *map(row, by["resident"]), rule,
             tot("= weights + optimizer state", t["weights_and_optimizer"], "per GPU"),
             *map(row, by["gradients"]), tot("= + gradients", t["with_gradients"]),
             *map(row, by["rollout"] + by["training"]),
             tot("= training step", t["training_step"], "resident + gradients + activations" + held),
             *map(row, by["reduce"]),
             tot("= gradient sum", t["gradient_sum"], f"resident + gradients{held} + one bucket")]
    if by["rollout"]:
        lines.append(tot("= rollout generation", t["rollout"], "resident + replica + KV cache (gradients freed)"))
    lines += [rule, tot("total (peak per GPU)", t["peak"], "what torch.cuda.max_memory_allocated() should read"),
              tot("+ CUDA context + NCCL", t["outside_allocator"], "outside the allocator (measured, H100)"),
              tot("= device memory per GPU", t["peak_device"], f"x {c['gpus']} GPUs")]
    if t["cpu_offloaded"]:
        lines.append(f"(in CPU memory per process, not counted above: {t['cpu_offloaded']:.2f} GB)")
    ignored = [f"{k}={c[k]}".lower() for k, v in FSDP_ONLY.items() if c[k] != v]
    if ignored:
        lines.append(f"(FSDP2 options, ignored under replicate as by the trainers' fsdp=false: {', '.join(ignored)})")
    return lines
