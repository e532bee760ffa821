"""Diagnostic: where a GRPO step's training time and memory go on GPU (not a benchmark).

    python bench/profile_grpo.py [--micro-batches 8,16,32] [--profile 16]

Same shapes as `bench/grpo_step.py --device cuda` (8 prompts x 8 generations, 128 + 256 tokens,
bf16 weights, gradient checkpointing, fused AdamW). For each micro-batch size: wall time of the
forward+backward over the 64 sequences and of the optimizer step, the allocated memory held between
steps and the peak of each phase. Then one profiled pass at `--profile` sequences per micro-batch:
GPU kernel time vs wall time (their gap is CPU-side launch overhead) and the top kernels.
"""
import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import build, load_tok, make_prompts  # noqa: E402
from profile_rollout import kind  # noqa: E402
from tether.models import load_model  # noqa: E402
from tether.objectives import policy_loss  # noqa: E402
from tether.rollout import Sampler, SamplingConfig  # noqa: E402
from tether.models.logprobs import completion_token_logps  # noqa: E402
from tether.trainers.common import autocast_context, make_optimizer  # noqa: E402

GB = 1e9


def train_pass(model, tb, adv, mb_size, amp):
    n = tb["input_ids"].shape[0]
    for i in range(0, n, mb_size):
        mb = {k: v[i:i + mb_size] for k, v in tb.items()}
        logps, _ = completion_token_logps(model, mb, 1.0, amp)
        loss, m = policy_loss(logps, mb["logprobs"], adv[i:i + mb_size], mb["completion_mask"], agg="token-mean")
        (loss * mb_size / n).backward()
        float(loss.detach())  # the trainer syncs here too (loss value, metrics)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", default="8,16,32")
    ap.add_argument("--profile", type=int, default=16)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--compile", action="store_true", help="also time with each decoder layer compiled")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    V = build("qwen0.5b", work / "m")
    tok = load_tok(work / "m")
    model = load_model(str(work / "m"), dtype="bf16", device="cuda")
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = make_optimizer(model, 1e-6, 0.0, betas=(0.9, 0.99))
    amp = autocast_context(torch.device("cuda"), "auto")
    prompts = [tok(p).input_ids for p in make_prompts(8, 128, V)]
    s = Sampler(model, tok, SamplingConfig(max_new_tokens=256, temperature=1.0, ignore_eos=True))
    sync = torch.cuda.synchronize
    for mb_size in map(int, a.micro_batches.split(",")):
        for rep in range(2):
            sync(); torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter(); ro = s.sample(prompts, n=8, seed=rep); sync()
            t_s, peak_s, held = time.perf_counter() - t, torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            tb = {k: v.cuda() for k, v in ro.training_batch().items()}
            adv = torch.randn(tb["input_ids"].shape[0], 1, device="cuda")
            sync(); torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter(); train_pass(model, tb, adv, mb_size, amp); sync()
            t_fb, peak_fb = time.perf_counter() - t, torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad(set_to_none=True); sync()
            t_o, peak_o = time.perf_counter() - t, torch.cuda.max_memory_allocated()
            print(f"mb {mb_size} rep {rep}: sample {t_s:.3f}s fwd+bwd {t_fb:.3f}s opt {t_o:.3f}s | GB held at "
                  f"sampling {held / GB:.2f}, peak sample {peak_s / GB:.2f} fwd+bwd {peak_fb / GB:.2f} "
                  f"opt {peak_o / GB:.2f}; reserved peak {torch.cuda.max_memory_reserved() / GB:.2f}", flush=True)

    if a.compile:  # each decoder layer through torch.compile (fuses norms, RoPE, SiLU·up; fewer launches)
        import os
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
        for layer in model.model.layers:
            layer.compile(dynamic=False)
        for rep in range(3):
            for mb_size in map(int, a.micro_batches.split(",")):
                sync(); torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter(); train_pass(model, tb, adv, mb_size, amp); sync()
                print(f"compiled layers, mb {mb_size} rep {rep}: fwd+bwd {time.perf_counter() - t:.3f}s peak "
                      f"{torch.cuda.max_memory_allocated() / GB:.2f}", flush=True)
                opt.zero_grad(set_to_none=True)
    mb_size = a.profile
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter(); train_pass(model, tb, adv, mb_size, amp); sync()
        wall = time.perf_counter() - t
    per, by_name = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            dt = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            for d, key in ((per, kind(e.name)), (by_name, e.name[:100])):
                d[key][0] += 1
                d[key][1] += dt
    gpu = sum(v[1] for v in per.values()) / 1e6
    print(f"profiled fwd+bwd at mb {mb_size}: wall {wall:.3f}s (profiler on), GPU kernel time {gpu:.3f}s, "
          f"{sum(v[0] for v in per.values())} kernels")
    for k, (c, dt) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k:18s} {c:7d} kernels {dt / 1e6:7.3f} s")
    for n, (c, dt) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"  {c:6d} x {dt / c:9.1f} us = {dt / 1e6:6.3f} s  {n}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))


if __name__ == "__main__":
    main()
