"""The checkpoints the live pages (training stages, GRPO explorer) may load, and a small cache of
loaded models.

As for run files (common.py), a request never carries a path: it names a checkpoint by an id from
:func:`known_checkpoints`, "<run id>/<checkpoint>" for each checkpoints/<name>/ of a known run (a
real directory holding config.json, not a symlink, inside the run), or "model" for the studio's
`model=`. Anything else is a 404.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from fastapi import HTTPException

from tether.studio.common import Studio, known_runs

MODEL_ID = "model"
"the id of the studio's own `model=` policy"
_MODELS: OrderedDict = OrderedDict()
_LOCK = threading.Lock()
KEEP_MODELS = 3  # loaded models kept (a chain of three stages is the common case)


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    base = run_dir / "checkpoints"
    if not base.is_dir() or base.is_symlink():
        return []
    real = os.path.realpath(run_dir)
    out = []
    for d in sorted(base.iterdir(), key=lambda p: (not p.name.startswith("step-"), _step(p), p.name)):
        if d.is_symlink() or not d.is_dir() or d.name.endswith(".tmp") or not (d / "config.json").is_file():
            continue
        if os.path.commonpath([os.path.realpath(d), real]) == real:
            out.append(d)
    return out


def _step(p: Path) -> int:
    try:
        return int(p.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def known_checkpoints(studio: Studio) -> dict[str, Path]:
    """{id: directory} of every loadable checkpoint (see the module docstring)."""
    out: dict[str, Path] = {}
    model = getattr(studio.cfg, "model", "") or ""
    if model and (Path(model) / "config.json").is_file():
        out[MODEL_ID] = Path(model)
    for run_id, run_dir in known_runs(studio).items():
        for d in _checkpoint_dirs(run_dir):
            out[f"{run_id}/{d.name}"] = d
    return out


def latest_of(run_dir: Path) -> Path | None:
    """The newest step-<N> checkpoint of a run (tether.run's order), within the same checks."""
    steps = [d for d in _checkpoint_dirs(run_dir) if d.name.startswith("step-")]
    return max(steps, key=_step) if steps else None


def resolve_checkpoint(studio: Studio, ckpt_id: str) -> Path:
    path = known_checkpoints(studio).get(ckpt_id)
    if path is None:
        raise HTTPException(404, f"no checkpoint {ckpt_id!r}")
    return path


def load(path: Path):
    """(model, tokenizer) of a checkpoint on the CPU, kept for the next request (a few at most)."""
    from tether.models import load_model, load_tokenizer

    key = str(path)
    with _LOCK:
        if key in _MODELS:
            _MODELS.move_to_end(key)
            return _MODELS[key]
        pair = (load_model(key, dtype="fp32", device="cpu").eval(), load_tokenizer(key))
        _MODELS[key] = pair
        while len(_MODELS) > KEEP_MODELS:
            _MODELS.popitem(last=False)
        return pair
