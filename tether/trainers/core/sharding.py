"""How a trainer's models are laid out over the GPUs under torchrun: FSDP2 sharding (or plain
replication with `fsdp=false`), the bf16 policy, the rollout sampler's whole copy of the policy, and
the note that says when replication would be faster. core/setup.py calls these while it builds
a run (docs/distributed.md, "What is sharded where")."""

from __future__ import annotations

import copy

import torch

from tether import distributed
from tether.models.load import decoder_layers
from tether.rollout import native
from tether.rollout.fuse import fuse_projections


def sampling_copy(model, device, bf16: bool) -> torch.nn.Module:
    """A frozen copy of `model` to sample from, on `device`; bf16: its *parameters* in bf16 (the
    compute dtype). Buffers keep their dtype: RoPE's inv_freq is a non-persistent fp32 buffer that no
    weight refresh (copy_full_weights walks state_dict) restores, and in bf16 it put the cos/sin
    tables up to 0.36 off at position 2047 — the trainer computes them in fp32 (autocast, FSDP2).
    With native.FUSE_PROJECTIONS each layer's q/k/v and gate/up weights are laid out in one buffer
    each (fuse.fuse_projections: the sampler runs one GEMM per group); the copy is only ever refreshed
    in place (copy_full_weights), which keeps that layout, and never saved."""
    # Each parameter is copied straight into its place on `device` in its dtype (deepcopy takes the
    # memo's copies in place of the originals, ties included): no whole fp32 copy first, on the GPU
    # (one process) nor in CPU memory (torchrun, where the model is still there; 30 GB a rank at 7B).
    dtype = torch.bfloat16 if bf16 else None
    memo = {id(p): torch.nn.Parameter(p.detach().to(device, dtype=dtype, copy=True), requires_grad=False)
            for p in model.parameters()}
    replica = copy.deepcopy(model, memo).requires_grad_(False).eval().to(device)  # (.to: the buffers)
    return fuse_projections(replica) if native.FUSE_PROJECTIONS else replica


def state_hint(models, gpu_bytes: int) -> str | None:
    """replication_hint for `models` (None entries skipped), each parameter counted once. A function
    of its own so that nothing here outlives the count: fully_shard moves each parameter's whole
    tensor to the GPU before it shards it, and a list of the parameters kept in setup's frame
    would hold the whole fp32 model on every GPU through sharding (28.4 GiB of a 7B run's 35.5 GiB
    DPO and 49.6 GiB GRPO peaks)."""
    seen: set[int] = set()
    trained = frozen = 0
    for m in models:
        for p in (m.parameters() if m is not None else ()):
            if id(p) not in seen:
                seen.add(id(p))
                if p.requires_grad:
                    trained += p.numel()
                else:
                    frozen += p.numel() * p.element_size()
    return replication_hint(trained, frozen, gpu_bytes)


def replication_hint(trainable_params: int, frozen_bytes: int, gpu_bytes: int) -> str | None:
    """Under torchrun with FSDP2: a note when the whole training state (fp32 weight, gradient and
    two AdamW moments: 16 B a trained parameter, plus the frozen weights) would fill at most a
    quarter of one GPU. Replication (fsdp=false) is then faster: FSDP2's per-layer hooks make a
    small model's step CPU-bound (0.5B DPO on 2 H200s: 0.84 s a step sharded, 0.41-0.46 replicated;
    replicated and compiled, 1.84x one GPU's throughput on 2 and 3.32x on 4; docs/distributed.md).
    A quarter leaves room for activations and rollouts."""
    need = 16 * trainable_params + frozen_bytes
    if need > gpu_bytes / 4:
        return None
    return (f"the models' training state ({need / 1e9:.1f} GB) fits one GPU ({gpu_bytes / 1e9:.0f} GB): "
            f"fsdp=false (a whole copy per GPU, gradients all-reduced; with model.compile=true fewer "
            f"kernel launches too) is faster at this size than FSDP2 sharding (docs/distributed.md, 'Which one')")


def sharding_bf16(cfg, device) -> bool:
    """Sharded compute in bf16 (fp32 master weights and gradient reduction): what autocast does
    in one process, on CUDA with mixed precision on and fp32 weights."""
    return device.type == "cuda" and cfg.model.mixed_precision in ("auto", "bf16") and \
        cfg.model.dtype == "fp32" and torch.cuda.is_bf16_supported()


def wants_sampler_copy(cfg, bf16: bool) -> bool:
    """One process: whether the sampler runs on a copy of the policy (rollout.sampler_copy). auto:
    exactly when the trainer computes in bf16 over fp32 weights (`bf16`: sharding_bf16). Sampling
    from the fp32 weights themselves then samples a policy the gradient is not taken for, and its
    evaluation scores the fp32 weights rather than what was trained (docs/grpo.md: the same weights
    after 30 steps score 0.16 held-out pass@1 in fp32 and 0.40 rounded to bf16)."""
    want = getattr(getattr(cfg, "rollout", None), "sampler_copy", False)
    return want is True or (want == "auto" and bf16)


def shard_model(model, cfg) -> torch.nn.Module:
    """Under torchrun: FSDP2 over `model`'s decoder layers per the `model` section
    (distributed.shard), or with `fsdp=false` the whole model on every rank (distributed.replicate:
    one process's numerics, gradients summed at each step)."""
    if not cfg.model.fsdp:
        return distributed.replicate(model)
    # The device it will compute on, not where its weights are now: under torchrun on GPUs the
    # model is still in CPU memory here (setup_training; fully_shard moves the shards). The weights'
    # device would leave every FSDP2 run on GPUs without the bf16 policy: fp32 all-gathers,
    # autocast casting each gathered weight at each use, fp32 activations between layers (a 7B DPO
    # trace: fp32 [18944, 3584] weights into aten::linear).
    device = distributed.device() if distributed.uses_cuda() else next(model.parameters()).device
    bf16 = sharding_bf16(cfg, device)
    if bf16 and not any(p.requires_grad for p in model.parameters()):
        frozen_to_bf16(model)
    return distributed.shard(model, decoder_layers(model), bf16=bf16,
                             reduce_bf16=cfg.model.fsdp_reduce == "bf16", offload=cfg.model.fsdp_offload,
                             reshard_after_forward=cfg.model.fsdp_reshard,
                             defer_grad_sync=cfg.model.fsdp_defer_sync, unit_layers=cfg.model.fsdp_unit_layers)


@torch.no_grad()
def frozen_to_bf16(model) -> torch.nn.Module:
    """A frozen model (the reference, a reward model) about to be sharded under the bf16 policy:
    its parameters cast to bf16 in place, but for a scalar head's fp32 unit (distributed.shard keeps
    that one fp32 on purpose). Exact: the policy all-gathers every other parameter in bf16, rounded
    from the fp32 shard; stored rounded, the gathered weights are the same bf16 values. What it saves:
    half the frozen model's shard on every GPU (at 7B on 4 GPUs, 3.8 of 7.6 GB a frozen copy) and the
    fp32 -> bf16 cast of that shard before each of its all-gathers. Buffers keep their dtype (RoPE's
    inv_freq: FSDP2 does not cast buffers either). Returns `model`."""
    keep = distributed.fp32_unit_params(model)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16 and id(p) not in keep:
            p.data = p.data.to(torch.bfloat16)
    return model
