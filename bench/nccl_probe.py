"""How fast do the GPUs of this host talk? (issue 16: FSDP2's reduce-scatters looked slow in the
session-11 profile: 5.6 ms for one 60 MB fp32 reduce-scatter on 2 H200s, ~10 GB/s.)

    torchrun --nproc-per-node 2 bench/nccl_probe.py          # NCCL_DEBUG=INFO shows the transport

Times all-reduce, reduce-scatter and all-gather over NCCL at the sizes FSDP2 moves for the
Qwen2.5-0.5B shape (one decoder layer: 15M parameters, 60 MB fp32 / 30 MB bf16) and at 1 GiB,
after warm-up, each rank in step (a barrier before each timed loop), and prints algorithm and bus
bandwidth as nccl-tests defines them (bus = alg × 2(n−1)/n for all-reduce, (n−1)/n otherwise).
"""
import os
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for label, numel, dtype in (("layer fp32", 15_000_000, torch.float32), ("layer bf16", 15_000_000, torch.bfloat16),
                                ("1 GiB fp32", 2 ** 28, torch.float32)):
        numel -= numel % n
        full = torch.randn(numel, device="cuda", dtype=dtype)
        shard = torch.empty(numel // n, device="cuda", dtype=dtype)
        size = full.numel() * full.element_size()
        for op, fn, factor in (
                ("all_reduce", lambda: dist.all_reduce(full), 2 * (n - 1) / n),
                ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full), (n - 1) / n),
                ("all_gather", lambda: dist.all_gather_into_tensor(full, shard), (n - 1) / n)):
            s = timed(fn)
            rows.append(f"| {n} | {label} | {op} | {s * 1e3:.3f} | {size / s / 1e9:.1f} | {size / s / 1e9 * factor:.1f} |")
    if rank == 0:
        print(f"| GPUs | tensor | op | ms | alg GB/s | bus GB/s |  ({torch.cuda.get_device_name()})")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
