"""SFT on a GPU: bf16 autocast over fp32 master weights, fused AdamW, checkpoint in HF format."""

import json

import pytest
import torch

from tether.models import make_tiny_model
from tether.trainers.sft import SFTConfig, train_sft

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_sft_trains_on_cuda_with_bf16_autocast(tmp_path):
    make_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=128)
    import random
    rng = random.Random(0)
    with open(tmp_path / "d.jsonl", "w") as f:
        for _ in range(2000):
            s = "".join(rng.choice("0123456789") for _ in range(5))
            f.write(json.dumps({"prompt": f"Copy {s}:", "completion": f" {s}"}) + "\n")
    summary = train_sft(SFTConfig(model=str(tmp_path / "model"), data=str(tmp_path / "d.jsonl"),
                                  runs_dir=str(tmp_path / "runs"), name="gpu", max_steps=300,
                                  batch_size=16, lr=3e-3, warmup_steps=10, device="cuda",
                                  progress=False, num_samples=2, sample_max_new_tokens=8))
    rows = [json.loads(x) for x in (tmp_path / "runs" / "gpu" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.3 * losses[0] and summary["skipped_steps"] == 0
    from safetensors import safe_open
    with safe_open(f"{summary['checkpoint']}/model.safetensors", "pt") as f:
        name = next(iter(f.keys()))
        assert f.get_tensor(name).dtype == torch.float32  # master weights stay fp32 under autocast
