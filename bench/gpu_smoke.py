"""Every trainer under torchrun on CUDA (NCCL, FSDP2), a few steps each: does it run, are its
metrics finite, did it write a loadable checkpoint? The CPU tests (gloo) prove the arithmetic; this
catches what only CUDA does (e.g. its inf-norm refusing an empty shard: a [1, hidden] value head
split over 2 ranks leaves rank 1 nothing).

    python bench/gpu_smoke.py --nproc 2 --out smoke.json       # on a machine with >= 2 GPUs
    python bench/gpu_smoke.py --nproc 2 --device cpu           # the same on CPU (gloo), a dry run

Tiny random-init models (hidden 64: shards of its smallest tensors are empty on 2+ ranks). Writes
one JSON line per command: return code, seconds, the last metrics row's finite-ness, the tail of
stderr when it failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def world(root: Path) -> None:
    import torch

    from tether.models import make_tiny_model
    from tether.models.heads import ScalarHeadModel
    shape = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    make_tiny_model(root / "model", seed=0, **shape)
    body, tok = make_tiny_model(None, seed=1, **shape)
    rm = ScalarHeadModel(body, offset=0.0)
    with torch.no_grad():
        rm.head.weight.copy_(torch.linspace(-1, 1, rm.head.weight.numel()).view_as(rm.head.weight))
    rm.save_pretrained(root / "rm", tok)
    rng = random.Random(0)
    words = lambda a: "".join(rng.choice(a) for _ in range(rng.randint(1, 8)))  # noqa: E731
    rows = [(words("abcdefghij"), words("klmnopqrst")) for _ in range(64)]
    (root / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"{w}=", "chosen": w, "rejected": b}) + "\n" for w, b in rows))
    (root / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"{w}=", "completion": w}) + "\n" for w, _ in rows))
    (root / "kto.jsonl").write_text("".join(json.dumps({"prompt": f"{w}=", "completion": c, "label": i % 2 == 0}) + "\n"
                                            for i, (w, b) in enumerate(rows) for c in ([w] if i % 2 == 0 else [b])))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{w}="}) + "\n" for w, _ in rows))
    (root / "reward.py").write_text("def digits(prompts, completions, **_):\n"
                                    "    return [sum(c.isdigit() for c in x) / max(len(x), 1) for x in completions]\n")


def jobs(root: Path, device: str) -> dict[str, dict]:
    common = dict(model=root / "model", runs_dir=root / "runs", device=device, progress="false",
                  log_every=1, save_every=0)
    reward = f"[{root / 'reward.py'}:digits]"
    online = dict(data=root / "prompts.jsonl", batch_size=4, max_new_tokens=8, reward_funcs=reward, lr=1e-3)
    return {  # ppo first: its [1, hidden] value head leaves an empty shard on rank 1 (the crash fixed)
        "ppo": dict(online, num_generations=1, value_model="", reward_funcs=f"[rm:{root / 'rm'}]", kl_coef=0.05,
                    ppo_epochs=2, num_minibatches=2),
        "sft": dict(data=root / "sft.jsonl", batch_size=8, lr=1e-3),
        "dpo": dict(data=root / "pairs.jsonl", batch_size=4, lr=1e-3),
        "kto": dict(data=root / "kto.jsonl", batch_size=8, lr=1e-3),
        "simpo": dict(data=root / "pairs.jsonl", batch_size=4, lr=1e-3),
        "orpo": dict(data=root / "pairs.jsonl", batch_size=4, lr=1e-3),
        "rm": dict(data=root / "pairs.jsonl", batch_size=4, lr=1e-3),
        "grpo": dict(online, num_generations=4, beta=0.04),
        "rloo": dict(online, num_generations=4),
        "remax": dict(online),
        "bon": dict(data=root / "prompts.jsonl", n=4, max_new_tokens=8, reward_funcs=reward, max_prompts=8),
        # LoRA under FSDP2 with the bf16 policy: with a KL term the reference is the base with the
        # adapters off, which crashed the first backward until session 16 (models.lora.adapters_off)
        "grpo-lora": dict(online, num_generations=4, beta=0.04, lora_r=8, lr=1e-3),
        "dpo-lora": dict(data=root / "pairs.jsonl", batch_size=4, lora_r=8, lr=1e-3),
        # the trajectory queue over NCCL: the last process samples from its bf16 copy and receives
        # each next version while it produces a batch (online_disaggregated.Incoming): the row's
        # "overlapped" counts those steps (4 of 6 at staleness 1: none before batch 1, none after
        # the last version)
        "grpo-disagg": dict(online, num_generations=4, placement="disaggregated", max_staleness=1,
                            sampler_copy="true", max_steps=6),
    }, common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=None, help="comma-separated commands")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tether_smoke_"))
    world(root)
    table, common = jobs(root, args.device)
    env = dict(os.environ, OMP_NUM_THREADS="1", TETHER_DIST_TIMEOUT="60")
    if args.device == "cpu":
        env["TETHER_DIST_BACKEND"] = "gloo"
    results = []
    for i, (command, kw) in enumerate(table.items()):
        if args.only and command not in args.only.split(","):
            continue
        kv = {**common, **({} if command == "bon" else {"max_steps": 3}), **kw, "name": command}
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                "--master-port", str(29600 + i), "-m", "tether", command.split("-")[0]] + [f"{k}={v}" for k, v in kv.items()]
        t0 = time.time()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=ROOT)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)
        metrics = root / "runs" / command / "metrics.jsonl"
        last = json.loads(metrics.read_text().splitlines()[-1]) if metrics.exists() and metrics.read_text().strip() else {}
        finite = all(math.isfinite(v) for v in last.values() if isinstance(v, (int, float)))
        row = {"command": command, "nproc": args.nproc, "device": args.device, "rc": rc,
               "seconds": round(time.time() - t0, 1), "metric_rows": bool(last), "finite": finite,
               "checkpoint": any((root / "runs" / command).glob("checkpoints/*/config.json"))  # (LoRA: the adapters')
               or any((root / "runs" / command).glob("checkpoints/*/adapter_config.json"))}
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        if any("queue/weights_overlapped" in r for r in rows):
            row["overlapped"] = sum(r.get("queue/weights_overlapped", 0) for r in rows)
        if rc != 0:
            row["stderr"] = err[-2500:]
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "stderr"}), flush=True)
        if rc != 0:
            print(err[-2500:], file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    sys.exit(0 if all(r["rc"] == 0 and r["finite"] for r in results) else 1)


if __name__ == "__main__":
    main()
