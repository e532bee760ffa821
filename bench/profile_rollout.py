"""Diagnostic: where a decode step's GPU time goes (not a benchmark: no comparison, no RESULTS row).

    python bench/profile_rollout.py [--batches 64,256]

For each batch size: ms/step with CUDA graphs and eager (256 new tokens after 128-token prompts),
then one profiled eager decode step: kernel count and the GPU time per kernel class. The sum of
kernel times is what a captured graph cannot go below; graph ms/step minus it is launch gaps.
"""
import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import build_model, mismatch  # noqa: E402
from tether.rollout import Sampler, SamplingConfig  # noqa: E402


def kind(name: str) -> str:
    n = name.lower()
    for k, keys in (("gemm", ("gemm", "cutlass", "sm90", "sm80", "ampere", "matmul", "xmma", "nvjet")),
                    ("attention", ("fmha", "attention", "flash", "cudnn", "sdpa")),
                    ("reduce/softmax", ("softmax", "reduce", "scan", "cumsum", "sort", "search")),
                    ("copy/index", ("copy", "index", "gather", "scatter", "cat", "roll", "fill"))):
        if any(x in n for x in keys):
            return k
    return "elementwise/other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--attn", default="sdpa,triton", help="native.DECODE_ATTN values to compare (graphs only)")
    ap.add_argument("--memory", action="store_true", help="only: where a warm call's reserved memory goes")
    ap.add_argument("--sweep", action="store_true", help="only: decode-attention kernel time per launch setting")
    ap.add_argument("--prefill", default="", help="only: prefill time and peak memory per prefill_tokens "
                    "value (comma-separated), then the kernels of one prefill")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a)
    model = build_model("qwen0.5b", "cuda")
    V = model.config.vocab_size
    from tether.rollout import native
    if a.memory:
        return memory(model, a)
    if a.prefill:
        return prefill(model, a)
    attns = a.attn.split(",")
    for B in map(int, a.batches.split(",")):
        ids = torch.randint(10, V, (B, 128), generator=torch.Generator().manual_seed(B)).tolist()
        for attn in attns + ["eager"]:
            graphs = attn != "eager"
            native.DECODE_ATTN = attn if graphs else attns[-1]
            s = Sampler(model, None, SamplingConfig(max_new_tokens=a.new_tokens, ignore_eos=True, cuda_graphs=graphs))
            t0 = time.perf_counter()
            s.sample(ids, seed=0)
            first = time.perf_counter() - t0
            ro = s.sample(ids, seed=1)
            mm = mismatch(model, ro, rows_max=32) if graphs else ""
            print(f"B={B} attn={native.DECODE_ATTN} graphs={graphs}: {ro.stats['ms_per_step']:.2f} ms/step, "
                  f"first call {first:.1f} s, prefill {ro.stats['prefill_s']:.3f} s {mm}", flush=True)
            if graphs:
                s.release()
        # s: the eager sampler, its state still allocated: profile 5 decode steps
        cfg, st = s.config, s.state
        st.slot.fill_(129)  # back inside the cache and RoPE table (the call above left them at the end)
        st.pos.fill_(129)
        st.step.fill_(1)
        steps = 5
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode():
                for _ in range(steps):
                    s._step(B, st.slots + 1, cfg)
            torch.cuda.synchronize()
        per = defaultdict(lambda: [0, 0.0])
        by_name = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                per[kind(e.name)][0] += 1
                per[kind(e.name)][1] += t
                by_name[e.name[:90]][0] += 1
                by_name[e.name[:90]][1] += t
        total = sum(v[1] for v in per.values()) / steps / 1e3
        count = sum(v[0] for v in per.values()) / steps
        print(f"  eager step, profiled: {count:.0f} kernels, {total:.2f} ms of kernel time per step")
        for k, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
            print(f"    {k:18s} {c / steps:6.0f} kernels {t / steps / 1e3:7.3f} ms")
        for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"    {c / steps:5.0f} x {t / c:8.1f} us  {n}")
        s.release()
        torch.cuda.empty_cache()


def sweep(a):
    """µs per decode-attention call (Qwen2.5-0.5B heads: 2 KV heads x 7, head 64; 400 slots) for
    each BLOCK / num_warps / num_stages."""
    from triton.testing import do_bench
    from tether.rollout import kernels
    for B in map(int, a.batches.split(",")):
        S, Hkv, G, D = 400, 2, 7, 64
        q = torch.randn(B, Hkv, G, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, 448, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        bias = torch.zeros(B, 448, device="cuda", dtype=torch.bfloat16)
        kn, vn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16), torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16)
        slot = torch.tensor([300], device="cuda")
        res = []
        for blk in (32, 64, 128):
            for w in (2, 4, 8):
                for st in (1, 2, 3, 4):
                    kernels.BLOCK, kernels.NUM_WARPS, kernels.NUM_STAGES = blk, w, st
                    try:
                        t = do_bench(lambda: kernels.decode_attention(q, k[:, :, :S], v[:, :, :S], bias[:, :S], 0.125, kn, vn, slot))
                    except Exception as e:  # noqa: BLE001 (a setting that does not fit shared memory)
                        print(f"B={B} BLOCK={blk} warps={w} stages={st}: {type(e).__name__}")
                        continue
                    res.append((t * 1e3, blk, w, st))
        for t, blk, w, st in sorted(res)[:8]:
            print(f"B={B} BLOCK={blk} warps={w} stages={st}: {t:.1f} us")
        kv_bytes = 2 * B * Hkv * S * D * 2
        print(f"B={B}: KV read {kv_bytes / 1e6:.1f} MB = {kv_bytes / 3.35e12 * 1e6:.1f} us at 3.35 TB/s")


def prefill(model, a):
    """Prefill seconds and whole-call peak memory per prefill chunk size; kernels of the last one."""
    for B in map(int, a.batches.split(",")):
        ids = torch.randint(10, model.config.vocab_size, (B, 128), generator=torch.Generator().manual_seed(B)).tolist()
        from tether.rollout import native
        chunks = [int(c) for c in a.prefill.split(",")]
        for chunk, causal in [(c, True) for c in chunks] + [(chunks[-1], False), (chunks[-1], True)]:
            native.PREFILL_CAUSAL = causal
            s = Sampler(model, None, SamplingConfig(max_new_tokens=a.new_tokens, ignore_eos=True, prefill_tokens=chunk))
            s.sample(ids, seed=0)
            torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
            ro = [s.sample(ids, seed=i) for i in (1, 2)][-1]
            print(f"B={B} prefill_tokens={chunk} causal_fast={causal}: prefill {ro.stats['prefill_s']:.4f} s, "
                  f"{ro.stats['ms_per_step']:.2f} ms/step, total {ro.stats['total_s']:.3f} s, peak alloc "
                  f"{torch.cuda.max_memory_allocated() / 1e9:.3f} reserved {torch.cuda.max_memory_reserved() / 1e9:.3f} GB",
                  flush=True)
            if not (chunk == chunks[-1] and causal):
                s.release(); del s; torch.cuda.empty_cache()
        be = s.backend
        x = torch.tensor(ids, device="cuda")
        m = torch.ones_like(x, dtype=torch.bool)
        step = min(B, max(1, chunk // 128))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode():
                for r in range(0, B, step):
                    be.prefill(x[r:r + step], m[r:r + step], r)
            torch.cuda.synchronize()
        by_name = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                by_name[kind(e.name) + " | " + e.name[:80]][0] += 1
                by_name[kind(e.name) + " | " + e.name[:80]][1] += t
        total = sum(v[1] for v in by_name.values()) / 1e3
        print(f"  one eager prefill of {B} prompts, {step} per chunk: {total:.1f} ms of kernels")
        for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"    {c:5d} x {t / c:8.1f} us = {t / 1e3:7.2f} ms  {n}")
        s.release(); del s; torch.cuda.empty_cache()


def memory(model, a):
    """Reserved memory after a warm call, split into the general pool and the CUDA-graph pool(s)."""
    gb = lambda x: f"{x / 1e9:.3f}"  # noqa: E731
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for B in map(int, a.batches.split(",")):
        ids = torch.randint(10, model.config.vocab_size, (B, 128), generator=torch.Generator().manual_seed(B)).tolist()
        s = Sampler(model, None, SamplingConfig(max_new_tokens=a.new_tokens, ignore_eos=True))
        s.sample(ids, seed=0)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        s.sample(ids, seed=1)
        torch.cuda.synchronize()
        pools = defaultdict(lambda: [0, 0])
        for seg in torch.cuda.memory_snapshot():
            pools[str(seg.get("segment_pool_id"))][0] += seg["total_size"]
            pools[str(seg.get("segment_pool_id"))][1] += seg["allocated_size"]
        kv = 2 * s.backend.k.numel() * s.backend.k.element_size()
        print(f"B={B}: peak reserved {gb(torch.cuda.max_memory_reserved())} peak alloc "
              f"{gb(torch.cuda.max_memory_allocated())} now reserved {gb(torch.cuda.memory_reserved())}; "
              f"weights {gb(weights)} KV cache {gb(kv)} graphs {len(s.graphs)}")
        for pid, (tot, used) in pools.items():
            print(f"   pool {pid}: reserved {gb(tot)} allocated {gb(used)}")
        s.release()
        del s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
