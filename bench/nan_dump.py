"""Session 20: save the training batch of a GRPO run's first steps (tensors, mask, advantages) and
the names of the parameters whose gradient is non-finite, for replay (bench/nan_diag.py's case).

    python bench/nan_dump.py OUT_DIR tether-args...   (e.g. grpo --config run/config.yaml)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tether.trainers import online  # noqa: E402

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
orig, count = online.assign_advantages, [0]


def assign(batch, *a, **k):
    orig(batch, *a, **k)
    count[0] += 1
    if count[0] <= 2:
        torch.save({"tensors": {k2: v.cpu() for k2, v in batch.tensors.items()}, "mask": batch.mask.cpu(),
                    "batch": {k2: (v.cpu() if torch.is_tensor(v) else None) for k2, v in vars(batch).items()}},
                   out / f"batch{count[0]}.pt")


online.assign_advantages = assign
_clip = torch.nn.utils.clip_grad_norm_


def clip(params, *a, **k):
    params = list(params)
    norm = _clip(params, *a, **k)
    if not torch.isfinite(norm):
        bad = [i for i, p in enumerate(params) if p.grad is not None and not torch.isfinite(p.grad).all()]
        with open(out / "bad.txt", "a") as f:
            f.write(f"{len(bad)} of {len(params)} params non-finite: {bad[:20]}\n")
    return norm


torch.nn.utils.clip_grad_norm_ = clip
from tether.cli import main  # noqa: E402
sys.exit(main(sys.argv[2:]))
