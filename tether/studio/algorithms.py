"""Studio page 5, the algorithm and memory explorer: what each post-training algorithm holds and
needs, and what it costs in GPU memory.

Every number is `tether memory`'s: :func:`tether.memory.estimate` on a
:class:`tether.memory.MemoryConfig` built from the page's controls (the same dataclass the CLI
builds from key=value), so the bars equal the CLI's table. The cards are derived, not written:
the models an algorithm holds are :func:`tether.memory.single.held_models` for the same config
(so LoRA removes the reference copy on the card as in the estimate), online or offline is
:data:`tether.memory.single.ONLINE`, the data columns are :data:`tether.data.formats.FORMATS` of
the format each trainer asks `load_data` for, and the objective is the tether.objectives function
the trainer calls, with the first line of its docstring.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import fields
from pathlib import Path

from typing import Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from tether import objectives
from tether.data.formats import FORMATS
from tether.errors import UserError
from tether.memory import MemoryConfig, estimate
from tether.memory.single import ONLINE, held_models
from tether.model_shape import parse_count, resolve_model

TITLE = "Algorithms & memory"
router = APIRouter(prefix="/api/algorithms")

ALGORITHMS = ("ppo", "dpo", "grpo", "kto", "simpo", "orpo")
"the cards, in the order the page shows them"
MODEL_SIZES = ("1B", "7B", "13B", "70B")
"the size buttons (any count like 0.5B, or a pasted HF config.json, works too)"
MARKERS_GB = (12, 24, 40, 80, 141)
"GPU memory sizes drawn across the bars (consumer 12/24 GB, A100 40/80, H100 80, H200 141)"

# The format each trainer asks load_data for (grpo/loop.py / ppo/loop.py: "prompt-only"; preference/data.py:
# "preference", KTO also "unpaired-preference"), and the objective functions it calls.
DATA_FORMATS = {"ppo": ("prompt-only",), "grpo": ("prompt-only",), "dpo": ("preference",),
                "simpo": ("preference",), "orpo": ("preference",),
                "kto": ("unpaired-preference", "preference")}
OBJECTIVES = {"ppo": ("policy_loss", "value_loss", "gae", "kl_penalized_rewards"),
              "grpo": ("compute_advantages", "policy_loss"), "dpo": ("preference_loss",),
              "kto": ("kto_loss",), "simpo": ("simpo_loss",), "orpo": ("orpo_loss",)}
# what the page's option switches set in MemoryConfig (anything else keeps the CLI's default)
OPTIONS = ("algo", "lora", "lora_rank", "gradient_checkpointing", "gpus", "sharding", "grad_accum", "weight_dtype",
           "optimizer", "batch_size", "seq_len", "reward", "num_generations", "rollout_batch")


def model_spec(size: str | None = None, hf_config: str | None = None, tmp: Path | None = None) -> str:
    """The `model=` the CLI would get: a parameter count (never a path: a request names no file),
    or a pasted HF config.json written into the directory `tmp` (the caller's, removed after use)."""
    if hf_config:
        try:
            cfg = json.loads(hf_config)
        except json.JSONDecodeError as e:
            raise UserError(f"HF config: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(cfg, dict) or "model_type" not in cfg:
            raise UserError("HF config: expected a config.json object with a `model_type` field")
        if tmp is None:
            raise ValueError("model_spec: a pasted config needs a directory to be written to")
        d = Path(tmp)
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)
    if parse_count(str(size or "")) is None:
        raise UserError(f"model size {size!r}: expected a parameter count like 7B, 0.5B or 7e9")
    return str(size).strip()


def memory_config(spec: str, options: dict) -> MemoryConfig:
    """MemoryConfig(model=spec, **the page's options); unknown keys are a one-line error."""
    names = {f.name for f in fields(MemoryConfig)}
    bad = sorted(k for k in options if k not in OPTIONS or k not in names)
    if bad:
        raise UserError(f"memory options: unknown {', '.join(bad)}; allowed: {', '.join(OPTIONS)}")
    try:
        return MemoryConfig(model=spec, format="json", **options)
    except (TypeError, ValueError) as e:
        raise UserError(str(e).splitlines()[0]) from None


def _bar(label: str, est: dict, groups: tuple, total_key: str, extra: list | None = None) -> dict:
    rows = [r for r in est["components"] if r["group"] in groups and r["device"] == "gpu"] + (extra or [])
    total = est["totals_bytes"][total_key]
    return {"label": label, "total_gb": total / 1e9, "total_key": total_key,
            "segments": [{"component": r["component"], "group": r["group"], "gb": r["gb"]} for r in rows],
            # the stack is the estimate's own sum (tested for every algorithm and option)
            "adds_up": sum(r["bytes"] for r in rows) == total}


def memory_bars(est: dict) -> list[dict]:
    """The estimate's totals as stacked bars of its components: the training step, and (when
    they exist) rollout generation, frozen forwards and loading. Each bar's total is the
    estimate's; `adds_up` says its segments sum to it exactly."""
    t, online = est["totals_bytes"], est["algo"] in ONLINE
    if est.get("per_gpu"):
        bars = [_bar("training step", est, ("resident", "gradients", "rollout", "gather", "training"), "training_step")]
        if online:
            bars.append(_bar("rollout generation", est, ("resident", "rollout", "refresh"), "rollout"))
        frozen = [r for r in est["components"] if r["group"] == "frozen"]
        if frozen:
            largest = max(frozen, key=lambda r: r["bytes"])
            bars.append(_bar("frozen forwards", est, ("resident", "rollout"), "frozen_forwards", [largest]))
        if t["loading"]:
            bars.append(_bar("loading", est, ("load",), "loading"))
        return bars
    lent = est["kv_in_gradient_buffer"]
    bars = [_bar("training step", est, ("resident", "gradients", "training") + (() if lent else ("rollout",)),
                 "training_step")]
    if online:
        bars.append(_bar("rollout generation", est, ("resident",) + (("gradients",) if lent else ("rollout",)),
                         "rollout"))
    return bars


def explore(size: str | None = None, hf_config: str | None = None, options: dict | None = None) -> dict:
    """Everything the page draws for one choice of model and options: `tether memory`'s estimate
    (the CLI's JSON, unchanged), its bars, the markers, and the card of the chosen algorithm."""
    with tempfile.TemporaryDirectory(prefix="tether-studio-config-") as tmp:
        spec = model_spec(size, hf_config, Path(tmp))
        est = estimate(memory_config(spec, options or {}))
    if hf_config:  # the directory was the page's own, and is gone: name what the user gave
        est["model"] = est["config"]["model"] = f"pasted config.json ({json.loads(hf_config)['model_type']})"
    return {"estimate": est, "bars": memory_bars(est), "markers_gb": list(MARKERS_GB),
            "peak_gb": est["totals_gb"]["peak"], "fits": {str(m): est["totals_gb"]["peak"] <= m for m in MARKERS_GB}}


def card(algo: str, options: dict | None = None, model: str = "7B") -> dict:
    """One algorithm's card: models held (trained or frozen, from held_models for the same
    options), the data it reads (format and columns), online or offline, and its objectives."""
    if algo not in ALGORITHMS:
        raise UserError(f"algorithm {algo!r}: expected one of {', '.join(ALGORITHMS)}")
    opts = {k: v for k, v in (options or {}).items() if k != "algo"}
    cfg = memory_config(model_spec(model), {**opts, "algo": algo})
    info = resolve_model(cfg.model)
    held = held_models(cfg, info["params"], info["shape"])
    return {"algo": algo, "online": algo in ONLINE,
            "models": [{"name": m.name, "trained": bool(m.trainable), "note": m.note} for m in held],
            "data": [{"format": f, "columns": list(FORMATS[f][0])} for f in DATA_FORMATS[algo]],
            "objectives": [{"name": n, "summary": " ".join((getattr(objectives, n).__doc__ or "").split("\n\n")[0].split())}
                           for n in OBJECTIVES[algo]]}


def cards(options: dict | None = None) -> list[dict]:
    return [card(a, options) for a in ALGORITHMS]


# ---- the page's API --------------------------------------------------------------------------------

class ExploreIn(BaseModel):
    size: str | None = "7B"
    "a parameter count (1B, 7B, 0.5B, 7e9)"
    hf_config: str | None = Field(None, max_length=200_000)
    "a pasted HF config.json (wins over `size`)"
    algo: str = "grpo"
    lora: bool = False
    gradient_checkpointing: bool = False
    gpus: int = Field(1, ge=1, le=1024)
    sharding: Literal["fsdp", "replicate"] = "fsdp"
    "gpus > 1: FSDP2 sharding or a replica per GPU (the trainers' fsdp=false)"


@router.get("/choices")
def choices():
    from typing import get_args, get_type_hints

    return {"algorithms": list(ALGORITHMS), "memory_algos": list(get_args(get_type_hints(MemoryConfig)["algo"])),
            "sizes": list(MODEL_SIZES), "markers_gb": list(MARKERS_GB), "gpus": [1, 2, 4, 8]}


@router.post("/explore")
def explore_route(body: ExploreIn):
    """`tether memory`'s estimate for the page's choices, its bars, and every algorithm's card."""
    options = {"algo": body.algo, "lora": body.lora, "gradient_checkpointing": body.gradient_checkpointing,
               "gpus": body.gpus}
    if body.gpus > 1:
        options["sharding"] = body.sharding
        # every process takes an equal share of the global batch (MemoryConfig refuses otherwise):
        # more GPUs than the micro-batch's sequences accumulate, as a user would set it
        size = MemoryConfig.batch_size if body.algo not in ONLINE else MemoryConfig.rollout_batch
        if body.gpus > size and body.algo not in ONLINE:
            options["grad_accum"] = -(-body.gpus // size)
    try:
        out = explore(body.size, body.hf_config, options)
        out["cards"] = cards({k: v for k, v in options.items() if k != "algo"})
    except UserError as e:
        raise HTTPException(400, str(e)) from None
    # what to type for the same numbers (the page shows it; the tests run it)
    out["command"] = cli_command(body, options)
    return out


def cli_command(body: ExploreIn, options: dict) -> str:
    model = "<your config dir>" if body.hf_config else str(body.size)
    flags = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
    return f"tether memory model={model} {flags}"
