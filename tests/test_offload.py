"""model.offload_activations, its wiring on the CPU (the copies themselves are CUDA's:
tests/test_offload_gpu.py): a run with it trains every micro-batch's forward inside the saved-tensor
hooks' context, its evaluation forwards (no gradients) outside it, the layers checkpoint so that
their inputs reach the hooks, and the process goes back to no offload when the run ends."""

import contextlib
import json

import pytest
import torch

from tether.models import logprobs, make_tiny_model, offload
from tether.trainers.sft import SFTConfig, train_sft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    make_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    with open(root / "train.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Copy {i:03d}:", "completion": f" {i:03d}"}) + "\n")
    return root


def test_a_run_with_offloaded_activations_trains_inside_the_hooks(tiny, monkeypatch):
    entered, reentrant = [], []

    def recording(device):
        entered.append((torch.device(device).type, torch.is_grad_enabled()))
        return contextlib.nullcontext()
    monkeypatch.setattr(offload, "host_activations", recording)
    plain = torch.utils.checkpoint.checkpoint

    def checkpoint(fn, *args, use_reentrant=None, **kw):
        reentrant.append(use_reentrant)
        return plain(fn, *args, use_reentrant=use_reentrant, **kw)
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", checkpoint)
    import transformers.modeling_utils as mu
    if hasattr(mu, "checkpoint"):  # where transformers binds the checkpoint it wraps layers with
        monkeypatch.setattr(mu, "checkpoint", checkpoint)

    cfg = SFTConfig(model=str(tiny / "model"), data=str(tiny / "train.jsonl"), runs_dir=str(tiny / "runs"),
                    name="offload", batch_size=8, grad_accum=2, max_steps=3, device="cpu", progress=False,
                    num_samples=0, eval_fraction=0.25, eval_every=3, gradient_checkpointing=True,
                    offload_activations=True)
    train_sft(cfg)
    assert entered and all(dev == "cpu" and grad for dev, grad in entered)  # evaluation: never entered
    assert len(entered) == 3 * 2  # every micro-batch of every step
    assert reentrant and all(r is True for r in reentrant)  # eager layers: inputs saved through the hooks
    assert logprobs.OFFLOAD_ACTIVATIONS is False
