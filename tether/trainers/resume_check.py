"""A resume continues the checkpointed run: its config must be that run's (setup_training refuses
it before anything loads otherwise, on rank 0 under torchrun)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tether.config import ConfigError, load_config, to_dict
from tether.errors import UserError


def check_resumable(cfg, run_path: Path) -> None:
    """A resume continues the checkpointed run, so its config must be that run's, except the
    fields a section declares RESUMABLE (length, logging, saving). Else one line listing every
    difference. The saved config.yaml may be an old flat one: load_config routes its keys."""
    saved_file = run_path / "config.yaml"
    if not saved_file.exists():
        return
    try:
        saved = load_config(type(cfg), str(saved_file))
    except (ConfigError, UserError, ValueError) as e:
        raise UserError(f"{cfg.run.name}: cannot check the resume against {saved_file}: {e}") from None
    resumable, now, then = set(), _flat(cfg), _flat(saved)
    for f in dataclasses.fields(cfg):
        resumable |= {f"{f.name}.{k}" for k in getattr(getattr(cfg, f.name), "RESUMABLE", ())}
    changed = [f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(now) | set(then))
               if k not in resumable and now.get(k) != then.get(k)]
    if changed:
        raise UserError(f"{cfg.run.name}: resume=true with a config that differs from {saved_file}: "
                        f"{'; '.join(changed)}. Resume with the run's settings (only "
                        f"{', '.join(sorted(resumable))} may change), or start a new run (another "
                        f"name=, or overwrite=true)")


def _flat(cfg) -> dict:
    """{"section.key": value} (top-level non-section fields by their own name)."""
    out = {}
    for key, value in to_dict(cfg).items():
        if dataclasses.is_dataclass(getattr(cfg, key)):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out
