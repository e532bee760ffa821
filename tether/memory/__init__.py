"""`tether memory`: GPU memory per component for an algorithm, a model and a number of GPUs.

single.py is the one-GPU accounting (and the pieces every estimate uses); for N processes under
torchrun, sharded.py is the per-GPU accounting with FSDP2 (sharding=fsdp) and replicated.py with plain
replication (sharding=replicate: one process's accounting per GPU, plus what torchrun adds);
`estimate` picks by `gpus` and `sharding`. docs/memory.md has the formulas.
"""

from __future__ import annotations

import json

from tether.memory import single
from tether.memory.replicated import estimate_replicated, format_replicated
from tether.memory.sharded import estimate_sharded, format_sharded
from tether.memory.single import *  # noqa: F401,F403 - the public names (MemoryConfig, Shape, constants...)
from tether.memory.single import MemoryConfig, resolve_model


def estimate(cfg: MemoryConfig) -> dict:
    """Components and totals (bytes and GB) for `cfg`; the JSON output of `tether memory`."""
    if cfg.gpus > 1:
        info = resolve_model(cfg.model)
        return estimate_replicated(cfg, info) if cfg.sharding == "replicate" else estimate_sharded(cfg, info)
    return single.estimate(cfg)


def format_table(est: dict) -> str:
    """The estimate as the table `tether memory` prints."""
    replicated = est.get("per_gpu") and est["config"]["sharding"] == "replicate"
    return single.format_table(est, format_replicated if replicated else format_sharded)


def run_memory(cfg: MemoryConfig) -> dict:
    est = estimate(cfg)
    if cfg.format == "json":
        print(json.dumps(est, indent=2))
    else:
        print(format_table(est))
    return est
