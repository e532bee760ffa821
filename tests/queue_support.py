"""What the trajectory queue's test modules share (test_online_async.py, test_online_partial.py):
a tiny random-init model with 64 prompts, a digit-fraction reward, a GRPO config of a few steps,
and the metrics rows without their timing columns."""
import json

import torch

from tether.models import make_tiny_model
from tether.trainers.grpo import GRPOConfig

VOLATILE = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds",
            "queue/wait_seconds", "gather_time", "queue/weights_wait_seconds", "queue/produce_seconds",
            "queue/send_seconds"}  # wall-clock (gather_time: only where a replica is kept)


def one_thread_for_the_module():
    """Body of an autouse module fixture: one torch thread (the same float sums in every run)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_world(root):
    """A tiny model and 64 prompts under `root`; returns `root`."""
    make_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Say {i}:"}) + "\n")
    return root


def digit_frac(prompts, completions, completion_ids, **_):
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]


def grpo_cfg(root, name, **kw):
    base = dict(model=str(root / "model"), data=str(root / "prompts.jsonl"), runs_dir=str(root / "runs"),
                name=name, batch_size=2, num_generations=4, max_new_tokens=8, max_steps=3,
                lr=1e-2, device="cpu", progress=False, seed=0, overwrite=True)
    base.update(kw)
    return GRPOConfig(**base)


def metric_rows(root, name, drop=()):
    rows = [json.loads(x) for x in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in VOLATILE and k not in drop} for r in rows]
