"""Every trainer under 2-process FSDP2 with the bf16 MixedPrecisionPolicy and bf16 autocast forced
on CPU — the dtypes a GPU run has (bench/bf16_policy_cpu.py drives it), so the policy's paths run
without a GPU. LoRA with a KL term is the case it guards: peft's disable_adapter switches
requires_grad off, and before FSDP2's lazy init that crashes the first backward
(models.lora.adapters_off)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from extras import needs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo on Linux"),
              needs("peft")]  # two of its eight runs train LoRA adapters


def test_every_trainer_runs_under_the_bf16_policy(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bf16_policy_cpu.py"), "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=1500)
    lines = [line for line in proc.stdout.splitlines() if ": " in line]
    assert proc.returncode == 0 and len(lines) == 8, proc.stdout + proc.stderr[-3000:]
    assert all(": ok," in line for line in lines), "\n".join(lines)
    # the reference, frozen, is sharded from bf16 weights (sharding.frozen_to_bf16; its dtypes are
    # pinned in test_distributed.py): the policy gathers the same bf16 values from its fp32 shards, so
    # at step 1 (policy = reference) the KL is exactly 0 — a cast of the buffers too (RoPE) breaks it
    first = json.loads((tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["kl"] == 0.0, first
