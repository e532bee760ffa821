"""The CUDA configuration's dtypes on CPU: every trainer under torchrun (gloo, FSDP2) with the bf16
MixedPrecisionPolicy and bf16 autocast forced, as a GPU run has them (setup.shard_model). It finds
dtype mismatches in tether's own code (an fp32 input into a gathered bf16 weight outside autocast)
without a GPU; the numbers are CPU bf16, not results. A test drives it:
tests/test_distributed_bf16_policy.py (slow).

    python bench/bf16_policy_cpu.py [--nproc 2] [--work DIR] [--only sft,dpo,...]

Prints one line per command: its final logged loss (finite) or the error.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def world(root: Path) -> None:
    from tether.models import make_tiny_model
    from tether.models.heads import ScalarHeadModel
    shape = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    make_tiny_model(root / "model", **shape)
    # a frozen reward model for ppo (`rm:`): sharded from bf16 weights but for its fp32 scalar head
    body, tok = make_tiny_model(None, seed=1, **shape)
    ScalarHeadModel(body, offset=0.0).save_pretrained(root / "rm", tok)
    rng = random.Random(0)
    digits = lambda: "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 6)))  # noqa: E731
    with open(root / "sft.jsonl", "w") as f:
        for _ in range(64):
            d = digits()
            f.write(json.dumps({"prompt": f"Copy {d}:", "completion": f" {d}"}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:
        for _ in range(64):
            d = digits()
            f.write(json.dumps({"prompt": f"Copy {d}:", "chosen": f" {d}", "rejected": f" {d[::-1]}x"}) + "\n")
    with open(root / "kto.jsonl", "w") as f:
        for i in range(64):
            d = digits()
            f.write(json.dumps({"prompt": f"Copy {d}:", "completion": f" {d}" if i % 2 else " no",
                                "label": bool(i % 2)}) + "\n")
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(32):
            f.write(json.dumps({"prompt": f"Copy {digits()}:"}) + "\n")


def jobs(root: Path) -> dict:
    base = dict(model=root / "model", runs_dir=root / "runs", lr=1e-3, max_steps=2, log_every=1, device="cpu",
                progress="false", save_every=2, overwrite="true")
    prompt = dict(base, data=root / "prompts.jsonl", batch_size=2, num_generations=4, max_new_tokens=8,
                  reward_funcs=f"[{ROOT}/bench/scale.py:reward]")
    return {
        "sft": dict(base, data=root / "sft.jsonl", batch_size=4),
        "dpo": dict(base, data=root / "pairs.jsonl", batch_size=4),
        "kto": dict(base, data=root / "kto.jsonl", batch_size=4),
        "rm": dict(base, data=root / "pairs.jsonl", batch_size=4),
        "grpo": dict(prompt, beta=0.05),
        "ppo": dict(prompt, num_generations=2, reward_funcs=f"[rm:{root / 'rm'}]"),
        # LoRA with a KL term: the reference's forward (adapters off) comes first, and peft's
        # disable_adapter must not leave FSDP2's lazy init seeing no trained parameter
        "grpo-lora": dict(prompt, beta=0.05, lora_r=4),
        "dpo-lora": dict(base, data=root / "pairs.jsonl", batch_size=4, lora_r=4),
    }


def worker(spec: str) -> None:
    import torch

    from tether import cli, distributed
    from tether.trainers.core import common, setup, sharding
    sharding.sharding_bf16 = lambda cfg, device: cfg.model.mixed_precision in ("auto", "bf16") and cfg.model.dtype == "fp32"
    real_shard = distributed.shard

    def shard(*a, **kw):  # the forcing above must reach FSDP2, or this run proves nothing
        if not kw.get("bf16"):
            raise RuntimeError("the bf16 policy did not reach distributed.shard")
        return real_shard(*a, **kw)
    distributed.shard = shard
    common.autocast_context = lambda device, mp: torch.autocast("cpu", dtype=torch.bfloat16, enabled=mp in ("auto", "bf16"))
    setup.autocast_context = common.autocast_context
    command, args = json.loads(spec)
    sys.exit(cli.main([command, *args]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", default=None)
    ap.add_argument("--only", default="")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)
    sys.path.insert(0, str(ROOT))
    root = Path(a.work or tempfile.mkdtemp(prefix="bf16-policy-"))
    root.mkdir(parents=True, exist_ok=True)
    world(root)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TETHER_DIST_TIMEOUT": "120", "PYTHONPATH": str(ROOT)}
    for command, kw in jobs(root).items():
        if a.only and command not in a.only.split(","):
            continue
        args = [f"{k}={v}" for k, v in {**kw, "name": command}.items()]
        trainer = command.split("-")[0]
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
                               "--master-port", str(port), __file__, "--worker", json.dumps([trainer, args])],
                              capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            err = [line for line in proc.stderr.splitlines() if ("Error" in line or "error:" in line)
                   and "ChildFailedError" not in line]
            print(f"{command}: FAILED {err[0] if err else proc.stderr[-500:]}", flush=True)
            continue
        rows = [json.loads(x) for x in (root / "runs" / command / "metrics.jsonl").read_text().splitlines() if x]
        key = next((k for k in ("loss", "pg_loss", "loss/policy", "policy/loss") if any(k in r for r in rows)),
                   next((k for r in rows for k in r if "loss" in k), "loss"))
        values = [r[key] for r in rows if key in r]  # (a non-finite value is logged as null)
        finite = bool(values) and all(v is not None for v in values)
        print(f"{command}: {'ok' if finite else 'NOT FINITE'}, {key} {[v if v is None else round(v, 4) for v in values]}",
              flush=True)


if __name__ == "__main__":
    main()
