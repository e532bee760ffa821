"""The decode step's attention kernel alone (tether/rollout/kernels.py, decode_attention_rope): µs a
call against the cache length, beside the time to read that cache once.

    python bench/decode_attention.py                          # batch 64 and 256, 64..512 cache slots
    python bench/decode_attention.py --no-rope --heads 4 --kv-heads 1 --head-dim 256   # Gemma 3 270M's
    python bench/decode_attention.py --compare OLD.py,...      # other kernels modules beside it, e.g. an
                                                               # earlier commit's (git show REV:path > OLD.py)

Shapes: Qwen2.5-0.5B's attention (14 query heads over 2 KV heads, head size 64), bf16. One call per
layer of a 24-layer step, each layer its own cache (so a call reads its cache from HBM, not from L2),
the 24 calls captured in one CUDA graph and replayed; µs a call = the replay's time / 24, median of
--repeats replays of --iters each. The new token's slot is the last of the S attended (the decode
step's), every slot unmasked. floor: the K and V slots read once at --hbm-gbps. A kernel's time
that moves little with S is fixed cost (launch, the dependent loads before the first block);
the slope over S is the per-block loop.

Prints a markdown table (--results FILE also appends it); --json FILE writes every number.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import tether.rollout.kernels as kernels  # noqa: E402

LAYERS = 24


def load_module(path: str):
    spec = importlib.util.spec_from_file_location(f"kernels_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_kernel(mod, B: int, S: int, H: int, Hkv: int, D: int, repeats: int, iters: int, rope: bool = True) -> float:
    """µs a call of ``mod.decode_attention_rope`` (``rope``; else ``mod.decode_attention``, q, k and v
    given apart: the layers with q/k norms, Gemma 3's) over S slots, 24 layers' caches in one graph."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    y = torch.randn(B, (H + 2 * Hkv) * D, device=dev, generator=g).to(dt)
    cos = torch.randn(S, D, device=dev, generator=g).to(dt)
    sin = torch.randn(S, D, device=dev, generator=g).to(dt)
    caches = [(torch.randn(B, Hkv, S, D, device=dev, generator=g).to(dt),
               torch.randn(B, Hkv, S, D, device=dev, generator=g).to(dt)) for _ in range(LAYERS)]
    bias = torch.zeros(B, S, device=dev, dtype=dt)
    pos = torch.full((B,), S - 1, device=dev, dtype=torch.long)
    slot = torch.tensor([S - 1], device=dev)

    q = y[:, :H * D].view(B, Hkv, H // Hkv, D)
    kn, vn = y[:, H * D:(H + Hkv) * D].view(B, Hkv, D), y[:, (H + Hkv) * D:].view(B, Hkv, D)

    def step():
        for k, v in caches:
            if rope:
                mod.decode_attention_rope(y, cos, sin, pos, k, v, bias, D ** -0.5, slot, H, Hkv, D)
            else:
                mod.decode_attention(q, k, v, bias, D ** -0.5, kn, vn, slot)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters / LAYERS)
    return statistics.median(times)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--slots", default="64,128,256,384,512")
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--no-rope", action="store_true",
                    help="time decode_attention (q, k, v apart; the q/k-norm layers') instead of decode_attention_rope")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="the card's HBM bandwidth (H200: 4800)")
    ap.add_argument("--compare", default=None, help="other kernels.py files to time beside this one (comma-separated)")
    ap.add_argument("--results", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mods = {"kernels.py": kernels}
    for path in (args.compare.split(",") if args.compare else []):
        mods[Path(path).name] = load_module(path)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    rows = []
    for B in map(int, args.batches.split(",")):
        for S in map(int, args.slots.split(",")):
            floor = 2 * B * Hkv * S * D * 2 / (args.hbm_gbps * 1e3)  # µs
            r = dict(batch=B, slots=S, floor_us=floor)
            for name, mod in mods.items():
                r[name] = time_kernel(mod, B, S, H, Hkv, D, args.repeats, args.iters, rope=not args.no_rope)
            rows.append(r)
            print(r, flush=True)
    names = list(mods)
    lines = [f"Decode attention alone ({torch.cuda.get_device_name()}, {datetime.date.today()}, "
             f"{git_commit()[:7]}; {'decode_attention' if args.no_rope else 'decode_attention_rope'}, "
             f"H={H}, Hkv={Hkv}, D={D}, bf16; µs a call)", "",
             "| batch | slots | " + " | ".join(names) + " | KV-read floor |",
             "|---:|---:|" + "---:|" * len(names) + "---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['slots']} | " + " | ".join(f"{r[n]:.2f}" for n in names)
                     + f" | {r['floor_us']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.results:
        with open(args.results, "a") as f:
            f.write(table + "\n\n")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   commit=git_commit(), command="python bench/decode_attention.py "
                                                   + " ".join(sys.argv[1:]), rows=rows), indent=1))


if __name__ == "__main__":
    main()
