"""Diagnostic: where the CPU decode step's time goes (not a benchmark: no comparison, no RESULTS row).

    python bench/profile_cpu_step.py [--batches 8,64,256] [--threads 1]

Builds rollout/cpu_decode.c with -DTETHER_PROFILE (timers around each part of the step), then for
each batch size runs the C decode step of the bench's tiny model over a cache of 97 slots with 64 in
use (the middle of bench/rollout.py's 32 + 64 tokens) and prints ms per step for: the norm + q/k/v
matmuls, the attention, the o projection + MLP, the final norm + lm_head. Then the prefill of
32-token prompts, C against the torch path of the same backend.
"""
import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import build_model  # noqa: E402
from tether.rollout import cpu, native  # noqa: E402

PARTS = ("norm + q/k/v", "attention", "o + MLP", "head")


def per_step(fn, n):
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = cpu._build(("-DTETHER_PROFILE",))
    if lib is None:
        sys.exit("the C step did not build")
    prof = (ctypes.c_double * 4).in_dll(lib, "tether_profile")
    model = build_model("tiny", "cpu")
    for B in map(int, a.batches.split(",")):
        be = native.NativeBackend(model)
        be.cstep.lib = lib
        be.alloc(B, 97)
        be.k.normal_(), be.v.normal_()
        tokens, pos, slot = torch.randint(3, 100, (B,)), torch.full((B,), 63), torch.tensor([63])
        bias = torch.zeros(B, 97)
        bias[:, 64:] = float("-inf")
        n = max(20, 4000 // B)
        for i in range(4):
            prof[i] = 0.0
        total = per_step(lambda: be.decode(tokens, pos, slot, bias, 64), n)
        parts = ", ".join(f"{name} {prof[i] / (n + 5) * 1e3:.3f}" for i, name in enumerate(PARTS))
        print(f"batch {B}: decode step {total:.3f} ms ({parts})")
        ids, mask = torch.randint(3, 100, (B, 32)), torch.ones(B, 32, dtype=torch.bool)
        with torch.inference_mode():
            c = per_step(lambda: be.prefill(ids, mask, 0), max(3, 200 // B))
            step, be.cstep = be.cstep, None  # the torch path over the same (plain) cache layout
            be.release()
            be.alloc(B, 97)
            t = per_step(lambda: be.prefill(ids, mask, 0), max(3, 200 // B))
            be.cstep = step
        print(f"batch {B}: prefill of {B} x 32 tokens {c:.1f} ms in C, {t:.1f} ms torch ops")


if __name__ == "__main__":
    main()
