"""Studio page 6, reward hacking: the over-optimization study of a run directory
(tether/studies/overoptimization.py), or one started from the page with a progress bar.

What the study writes, and so what this page reads (nothing is recomputed):
    <run>/config.yaml             the OveroptimizationConfig (betas, ppo_steps, ...)
    <run>/summary.json            per β: d = √KL, gold and proxy gain per PPO step, the gold peak
                                  (smoothed), the fitted Gao et al. RL form; best-of-n: n, d, gains
                                  and the fitted BoN form; the world's parameters; the RM's accuracy
    <run>/ppo_beta<β>/metrics.jsonl   one row per PPO step (the progress of a running study)
    <run>/ppo_beta<β>/samples.jsonl   sampled completions with their proxy score, every logged step
    <run>/world/policy, <run>/rm       the SFT policy and the proxy reward model
Samples get their gold reward and its parts (relevant words, repetitions, off-topic words,
length) from the study's own world, tether.tasks.preference_world.PreferenceWorld.gold_parts, so
the hack (a longer, repetitive answer the proxy loves) is shown term by term.

The fitted curves are the forms of Gao, Schulman & Hilton (2023, eqs. 1-2) with the coefficients
the study fitted (tether.studies.lab.fit_rl / fit_bon): RL R(d) = d(α − β log d), best-of-n
R(d) = d(α − βd).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field

from tether.run import read_jsonl
from tether.studio.common import get_studio, known_runs, resolve_run, run_status

TITLE = "Reward hacking"
router = APIRouter(prefix="/api/hacking")

SAMPLE_LIMIT = 8
"samples shown per side (hack / gold-optimal)"


def is_study(path: Path) -> bool:
    """A run directory of `tether study overoptimization` (finished or under way)."""
    cfg = _config(path)
    return "betas" in cfg and "n_pairs" in cfg and "bon_max_n" in cfg


def _config(path: Path) -> dict:
    import yaml

    f = Path(path) / "config.yaml"
    try:
        cfg = yaml.safe_load(f.read_text()) if f.exists() else {}
    except (OSError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _summary(path: Path) -> dict | None:
    try:
        s = json.loads((Path(path) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return s if isinstance(s, dict) and "ppo" in s and "bon" in s else None


def gao_curve(fit: dict, d) -> list[float]:
    """The fitted form of `fit` (its "form": "d(alpha - beta log d)" for RL, "d(alpha - beta d)"
    for best-of-n) at distances d; the RL form's term is 0 at d = 0, as in the fit."""
    d = np.asarray(d, float)
    if "log" in fit["form"]:
        shape = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)
    else:
        shape = d * d
    return (fit["alpha"] * d - fit["beta"] * shape).tolist()


def _grid(dmax: float, points: int = 60) -> list[float]:
    return np.linspace(0.0, max(dmax, 1e-3), points).tolist()


def study_progress(path: Path) -> dict:
    """How far a study has come, from the files it has written: the world (SFT policy), the
    proxy RM, PPO steps logged over all β (metrics.jsonl rows / ppo_steps each), the summary."""
    path, cfg = Path(path), _config(path)
    betas, steps = cfg.get("betas") or [], int(cfg.get("ppo_steps") or 0)
    ppo_done = sum(min(steps, len(read_jsonl(path / f"ppo_beta{float(b):g}" / "metrics.jsonl"))) for b in betas)
    parts = {"world": (path / "world" / "policy" / "config.json").exists(),
             "rm": (path / "rm" / "summary.json").exists(),
             "ppo_steps": ppo_done, "ppo_total": steps * len(betas),
             "done": _summary(path) is not None}
    # weights: building the world and the RM take about as long as a β's PPO sweep on a CPU
    units = [1.0 * parts["world"], 1.0 * parts["rm"],
             (ppo_done / parts["ppo_total"]) * len(betas) if parts["ppo_total"] else 0.0]
    parts["fraction"] = 1.0 if parts["done"] else min(0.99, sum(units) / (2 + max(1, len(betas)) + 0.5))
    return parts


def load_study(path: Path) -> dict:
    """The study's curves for the page: per β, d and the gold / proxy gains, the fitted RL curve
    on a grid, the gold peak (d, gain, step); best-of-n with its fitted curves; and the β whose
    gold peak is highest. {"status": "running"|"empty", "progress": ...} when no summary yet."""
    path = Path(path)
    s = _summary(path)
    if s is None:
        return {"status": "running" if (path / "config.yaml").exists() else "empty",
                "progress": study_progress(path)}
    ppo = {}
    for b, c in s["ppo"].items():
        grid = _grid(max(c["d"], default=0.0))
        ppo[b] = {"beta": float(b), "d": c["d"], "gold": c["gold"], "proxy": c["proxy"], "fit": c["fit"],
                  "fit_d": grid, "fit_gold": gao_curve(c["fit"], grid),
                  "peak": {"d": c["gold_peak_d"], "gain": c["gold_peak_gain"], "step": c["gold_peak_step"]},
                  "final": {"gold": c["gold_final_gain"], "proxy": c["proxy_final_gain"], "kl": c["final_kl"]}}
    bon = s["bon"]
    grid = _grid(max(bon["d"], default=0.0))
    betas = sorted(ppo, key=float)
    best = max(betas, key=lambda b: ppo[b]["peak"]["gain"]) if betas else None
    return {"status": "done", "betas": betas, "ppo": ppo, "best_beta": best,
            "bon": {"n": bon["n"], "d": bon["d"], "gold": bon["gold"], "proxy": bon["proxy"],
                    "fit_gold": bon["fit_gold"], "fit_proxy": bon["fit_proxy"], "fit_d": grid,
                    "fit_gold_curve": gao_curve(bon["fit_gold"], grid),
                    "fit_proxy_curve": gao_curve(bon["fit_proxy"], grid)},
            "rm": s.get("rm", {}), "world": s.get("world", {})}


def _scored(world, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        try:
            parts = world.gold_parts(r["prompt"], r["completion"])
        except Exception:  # noqa: BLE001 - a row that is not a world prompt is shown without gold
            parts = {}
        out.append({"step": r.get("step"), "prompt": r.get("prompt"), "completion": r.get("completion"),
                    "proxy": r.get("score"), **parts})
    return out


def _at_step(rows: list[dict], step: int) -> list[dict]:
    """The logged samples of the logged step nearest `step`."""
    steps = sorted({r.get("step") for r in rows if isinstance(r.get("step"), int)})
    if not steps:
        return []
    near = min(steps, key=lambda s: (abs(s - step), s))
    return [r for r in rows if r.get("step") == near]


def hack_samples(path: Path, beta: str | None = None) -> dict:
    """Samples of PPO at β (default: the lowest, where the proxy is exploited most) at its last
    logged step, next to the gold-optimal ones: the samples of the β with the highest gold peak,
    at the logged step nearest that peak. Each with proxy score, gold and the parts of gold."""
    from tether.tasks.preference_world import PreferenceWorld

    study = load_study(path)
    if study["status"] != "done" or not study["betas"]:
        return {"hack": [], "optimal": [], "beta": None, "best_beta": None}
    beta = beta if beta in study["ppo"] else study["betas"][0]
    world = PreferenceWorld(**{k: v for k, v in study["world"].items()
                               if k in PreferenceWorld.__dataclass_fields__})
    low = read_jsonl(Path(path) / f"ppo_beta{beta}" / "samples.jsonl")
    last = max((r["step"] for r in low if isinstance(r.get("step"), int)), default=0)
    best = study["best_beta"]
    good = read_jsonl(Path(path) / f"ppo_beta{best}" / "samples.jsonl")
    return {"beta": beta, "best_beta": best, "hack_step": last,
            "hack": _scored(world, _at_step(low, last)[:SAMPLE_LIMIT]),
            "optimal_step": study["ppo"][best]["peak"]["step"],
            "optimal": _scored(world, _at_step(good, study["ppo"][best]["peak"]["step"])[:SAMPLE_LIMIT])}


# The page's "run the study" button: a small study (minutes on a CPU), as a child process running
# the CLI, so the server stays responsive and the study writes exactly what `tether study
# overoptimization` writes. Progress is read back from its files (study_progress).
QUICK_STUDY = {"n_pairs": 400, "betas": [0.001, 0.05, 0.5], "ppo_steps": 12, "ppo_batch_size": 16,
               "bon_max_n": 16, "rm_epochs": 1}


def study_command(runs_dir: Path, name: str, settings: dict | None = None) -> list[str]:
    args = {**QUICK_STUDY, **(settings or {})}
    return [sys.executable, "-m", "tether", "study", "overoptimization", f"runs_dir={runs_dir}", f"name={name}",
            *(f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in args.items())]


def start_study(runs_dir: Path, name: str, settings: dict | None = None, log: Path | None = None):
    """Start the study in a child process (stdout/stderr to `log`); returns the Popen."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen(study_command(runs_dir, name, settings), stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def beta_view(study: dict, beta: str) -> dict:
    """What the β slider shows for one β: where gold peaks (d, gain, step) and how the run ends
    (gold and proxy gain, KL), straight from the study's summary."""
    c = study["ppo"][beta]
    return {"beta": beta, **{f"peak_{k}": v for k, v in c["peak"].items()},
            **{f"final_{k}": v for k, v in c["final"].items()},
            "overoptimized": c["final"]["gold"] < c["peak"]["gain"] - 1e-9 and not math.isclose(
                c["final"]["gold"], c["peak"]["gain"])}


# ---- the page's API --------------------------------------------------------------------------------

class StartIn(BaseModel):
    name: str = Field("overoptimization-studio", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    "the new run's directory name under runs_dir (must not exist yet)"
    n_pairs: int = Field(QUICK_STUDY["n_pairs"], ge=20, le=20000)
    betas: list[float] = Field(QUICK_STUDY["betas"], min_length=1, max_length=8)
    ppo_steps: int = Field(QUICK_STUDY["ppo_steps"], ge=2, le=1000)
    bon_max_n: int = Field(QUICK_STUDY["bon_max_n"], ge=2, le=1024)


def _state(studio, path: Path) -> str:
    if _summary(path) is not None:
        return "done"
    proc = studio.pages.get("hacking", {}).get("started", {}).get(str(path))
    if proc is not None and proc.poll() is None:
        return "running"
    if proc is not None and proc.returncode:
        return "failed"
    return "running" if run_status(path) == "running" else "stopped"


@router.get("/studies")
def studies(request: Request):
    """Every over-optimization study under runs_dir (finished, running or stopped), and those this
    studio started whose directory is not written yet."""
    studio = get_studio(request)
    out = [{"run": rid, "state": _state(studio, p)} for rid, p in known_runs(studio).items() if is_study(p)]
    known = {o["run"] for o in out}
    for path, proc in studio.pages.get("hacking", {}).get("started", {}).items():
        rid = Path(path).relative_to(studio.runs_dir).as_posix()
        if rid not in known:
            out.append({"run": rid, "state": "starting" if proc.poll() is None else "failed"})
    return {"studies": out, "quick_study": QUICK_STUDY}


def _study_path(request: Request, run: str) -> Path:
    studio = get_studio(request)
    for path in studio.pages.get("hacking", {}).get("started", {}):
        if Path(path).relative_to(studio.runs_dir).as_posix() == run:
            return Path(path)  # started here (perhaps nothing written yet)
    path = resolve_run(request, run)
    if not is_study(path):
        raise HTTPException(404, f"run {run!r} is not an over-optimization study")
    return path


@router.get("/study")
def study(run: str, request: Request):
    """The study's curves (status "done"), or its progress while it runs."""
    path = _study_path(request, run)
    out = load_study(path) if path.exists() else {"status": "empty", "progress": None}
    out["state"] = _state(get_studio(request), path)
    proc = get_studio(request).pages.get("hacking", {}).get("started", {}).get(str(path))
    if out["state"] == "failed" and getattr(proc, "log", None):  # why: the last lines the study printed
        out["log"] = Path(proc.log).read_text(errors="replace")[-1500:]
    if out["status"] != "done":
        out["progress"] = study_progress(path)
    if out["status"] == "done":
        out["views"] = {b: beta_view(out, b) for b in out["betas"]}
    return out


@router.get("/samples")
def samples(run: str, request: Request, beta: str | None = None):
    """Samples at β (default the lowest) at its last step next to the gold-optimal ones."""
    path = _study_path(request, run)
    study_ = load_study(path)
    if beta is not None and beta not in study_.get("ppo", {}):
        raise HTTPException(404, f"no β {beta!r} in this study")
    if beta is not None and (Path(path) / f"ppo_beta{beta}").is_symlink():
        raise HTTPException(404, f"no β {beta!r} in this study")
    return hack_samples(path, beta)


@router.post("/start")
def start(body: StartIn, request: Request):
    """Run a small study (a child process running the CLI) into runs_dir/<name>."""
    studio = get_studio(request)
    path = studio.runs_dir / body.name
    if path.exists():
        raise HTTPException(409, f"{body.name!r} already exists under the runs directory; pick another name")
    started = studio.pages.setdefault("hacking", {}).setdefault("started", {})
    if any(p.poll() is None for p in started.values()):
        raise HTTPException(409, "a study started here is still running")
    settings = body.model_dump(exclude={"name"})
    log = Path(tempfile.mkdtemp(prefix="tether-studio-study-")) / "study.log"
    proc = started[str(path)] = start_study(studio.runs_dir, body.name, settings, log)
    proc.log = log
    return {"run": body.name, "command": "tether " + " ".join(study_command(studio.runs_dir, body.name, settings)[3:])}
