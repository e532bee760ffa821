"""Studio page 7, process rewards: the best-of-n comparison of a PRM study — the selection curves
with their spread over reward-model seeds, and how well each scorer judges steps.

What the page reads (nothing is recomputed):
    <run>/summary.json    a run directory of `tether study prm` (tether/studies/prm.py) or the output
                          folder of bench/prm_real.py: "ns" (n = 1, 2, 4, ...), "selection"
                          {selector: pass@1 of the pick among n, one value per n}, "selection_sd"
                          (its sd over reward-model seeds), "candidate_metrics" (+ "_sd": each
                          scorer against the truth on every held-out candidate), "prm_step_metrics"
                          (`tether prm`'s eval), and the run's facts (policy or model, policy_errors,
                          rm_seeds, train / test sizes)
    <run>/config.yaml     the study's PRMStudyConfig (how a study is told apart before its summary)
    <run>/selection.png   the study's own figure
    benchmarks/prm/summary*.json with selection*.png: the published copies (`publish_dir`), in
                          benchmarks/prm/ beside the runs directory (<runs_dir>/../benchmarks/prm:
                          the repository's, for the default runs_dir=runs in a checkout)

A request never carries a path: a study is a run id of `common.known_runs` (`run=`) or the name of a
summary*.json file listed in the published folder (`published=`), both looked up afresh; the figure
is a fixed name derived from that (selection.png, selection<suffix>.png for summary<suffix>.json),
served only as a regular file inside that directory (symlinks refused). A summary that is not
what the study writes answers 422 naming the file and the field, never 500.

Selection is pass@1 of the candidate a selector picks among n samples of a held-out problem,
averaged over random subsets of size n (tether.studies.prm.selection_curves): a PRM by the min
or the product of its step probabilities (Lightman et al. 2023, "Let's Verify Step by Step"), PRMs
trained on Math-Shepherd labels (Wang et al. 2024), an ORM, majority vote over final answers,
random (the expected accuracy) and pass@n (the oracle).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import yaml
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from tether.studio.common import get_studio, known_runs, resolve_run, run_file, run_status

TITLE = "Process rewards"
router = APIRouter(prefix="/api/prm")

SELECTORS = {  # selection-curve key -> readable name, in the page's order (tether.studies.prm.CURVES)
    "prm": "PRM (min)", "prm_prod": "PRM (product)",
    "prm_ms": "PRM, Math-Shepherd hard (min)", "prm_ms_prod": "PRM, Math-Shepherd hard (product)",
    "prm_ms_soft": "PRM, Math-Shepherd soft (min)", "prm_ms_soft_prod": "PRM, Math-Shepherd soft (product)",
    "orm": "ORM", "majority": "majority vote", "random": "random", "oracle": "pass@n",
}
"readable names of the selectors; a key not listed is shown by its key, after these"

SCORERS = {"prm": "PRM", "prm_ms": "PRM, Math-Shepherd hard", "prm_ms_soft": "PRM, Math-Shepherd soft",
           "orm": "ORM"}
"readable names of the reward models whose step metrics are listed"

CANDIDATE_METRICS = {"step_accuracy": "step accuracy", "step_f1": "step F1", "error_f1": "error F1",
                     "first_error_accuracy": "first-error accuracy",
                     "first_error_accuracy_wrong": "first-error accuracy (wrong ones)",
                     "outcome_accuracy": "outcome accuracy"}
"columns of the scorers' table on every held-out candidate (tether.studies.prm.candidate_metrics)"

EVAL_METRICS = {"step_accuracy": "step accuracy", "step_f1": "step F1", "error_f1": "error F1",
                "first_error_accuracy": "first-error accuracy", "steps": "steps"}
"columns of the scorers' table from `tether prm`'s eval (the summary's prm_step_metrics)"

STUDY_KEYS = ("ms_train_k", "max_n", "rm_seeds", "prm_steps")
"config.yaml keys that tell a `tether study prm` run (PRMStudyConfig) from other runs"

PUBLISHED = Path("benchmarks") / "prm"
"the published copies, relative to the runs directory's parent"

MAX_BYTES = 16 << 20
"a summary bigger than this is refused (a study's is tens of kB)"

_PUBLISHED_NAME = re.compile(r"^summary([A-Za-z0-9_.-]*)\.json$")


class SummaryError(ValueError):
    """A summary that is not what a PRM study writes; the message names the field."""


# ---- where the studies are --------------------------------------------------------------------------

def published_dir(runs_dir: Path) -> Path:
    return Path(runs_dir).parent / PUBLISHED


def _config(run_dir: Path) -> dict:
    path = run_file(run_dir, "config.yaml")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _read(path: Path):
    """A JSON file's content; SummaryError when unreadable, too big or not JSON."""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise SummaryError(f"bigger than {MAX_BYTES >> 20} MB")
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SummaryError(f"cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SummaryError(f"is not valid JSON ({e})") from None


def is_prm_study(run_dir: Path) -> bool:
    """A run directory of `tether study prm` (its config.yaml, summary or not yet), or any run whose
    summary.json holds selection curves (bench/prm_real.py's output folder)."""
    cfg = _config(run_dir)
    if all(k in cfg for k in STUDY_KEYS):
        return True
    path = run_file(run_dir, "summary.json")
    if path is None:
        return False
    try:
        s = _read(path)
    except SummaryError:
        return False
    return isinstance(s, dict) and isinstance(s.get("selection"), dict)


def _inside(directory: Path, name: str) -> Path | None:
    """`directory/name` when it is a regular file whose real path stays inside `directory` (no
    symlink); None otherwise. `name` is one of this module's fixed names, never a request's."""
    p = directory / name
    if p.is_symlink() or not p.is_file():
        return None
    real = os.path.realpath(directory)
    if os.path.commonpath([os.path.realpath(p), real]) != real:
        return None
    return p


def published(runs_dir: Path) -> dict[str, tuple[Path, str]]:
    """{summary file name: (its path, the figure's name)} of the published folder (empty when it
    is absent or a symlink)."""
    d = published_dir(runs_dir)
    if d.is_symlink() or not d.is_dir():
        return {}
    out = {}
    for f in sorted(os.listdir(d)):
        m = _PUBLISHED_NAME.match(f)
        if m and _inside(d, f) is not None:
            out[f] = (d / f, f"selection{m.group(1)}.png")
    return out


def studies(studio) -> list[dict]:
    """Every PRM study the studio knows: the runs under runs_dir that are one (state: finished,
    running or failed, as the Runs page says), then the published summaries."""
    out = [{"kind": "run", "id": rid, "label": rid, "state": run_status(p),
            "has_summary": run_file(p, "summary.json") is not None}
           for rid, p in known_runs(studio).items() if is_prm_study(p)]
    out += [{"kind": "published", "id": name, "label": (PUBLISHED / name).as_posix(), "state": "published",
             "has_summary": True} for name in published(studio.runs_dir)]
    return out


def locate(request: Request, run: str | None, published_name: str | None) -> dict:
    """The chosen study: {kind, id, label, dir, summary (path or None), figure (path or None),
    config}. 400 unless exactly one of run / published is given, 404 for one the studio does not
    list."""
    studio = get_studio(request)
    if (run is None) == (published_name is None):
        raise HTTPException(400, "name a study with exactly one of run= or published=")
    if run is not None:
        run_dir = resolve_run(request, run)
        if not is_prm_study(run_dir):
            raise HTTPException(404, f"run {run!r} is not a PRM study (no selection curves in its summary.json)")
        return {"kind": "run", "id": run, "label": f"{run}/summary.json", "dir": run_dir,
                "summary": run_file(run_dir, "summary.json"), "figure": _inside(run_dir, "selection.png"),
                "config": _config(run_dir), "state": run_status(run_dir)}
    files = published(studio.runs_dir)
    if published_name not in files:
        raise HTTPException(404, f"no published PRM summary {published_name!r} in {PUBLISHED.as_posix()}/")
    path, figure = files[published_name]
    return {"kind": "published", "id": published_name, "label": (PUBLISHED / published_name).as_posix(),
            "dir": path.parent, "summary": path, "figure": _inside(path.parent, figure), "config": {},
            "state": "published"}


# ---- reading a summary ------------------------------------------------------------------------------

def _number(x, field: str, null_ok: bool = True) -> float | None:
    """A number of the summary (NaN / inf / null -> None: JSON cannot carry them)."""
    if x is None and null_ok:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise SummaryError(f"field {field!r} must be a number, got {type(x).__name__} {x!r:.40}")
    return float(x) if math.isfinite(x) else None


def _curves(s: dict, field: str, count: int, required: bool) -> dict[str, list]:
    """{selector: one number per n} of s[field], each list checked to have `count` values."""
    if field not in s:
        if required:
            raise SummaryError(f"field {field!r} is missing")
        return {}
    curves = s[field]
    if not isinstance(curves, dict) or (required and not curves):
        raise SummaryError(f"field {field!r} must be an object {{selector: [value per n]}}")
    out = {}
    for key, values in curves.items():
        where = f"{field}.{key}"
        if not isinstance(values, list):
            raise SummaryError(f"field {where!r} must be a list of numbers (one per n)")
        if len(values) != count:
            raise SummaryError(f"field {where!r} has {len(values)} values for the {count} n of field 'ns'")
        out[key] = [_number(v, f"{where}[{j}]") for j, v in enumerate(values)]
    return out


def _metrics(s: dict, field: str) -> dict[str, dict]:
    """{scorer: {metric: number}} of s[field] (absent: {})."""
    table = s.get(field)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise SummaryError(f"field {field!r} must be an object {{scorer: {{metric: value}}}}")
    out = {}
    for key, m in table.items():
        if not isinstance(m, dict):
            raise SummaryError(f"field '{field}.{key}' must be an object {{metric: value}}")
        out[key] = {k: _number(v, f"{field}.{key}.{k}") for k, v in m.items()
                    if not isinstance(v, (dict, list, str))}
    return out


def _ordered(keys, names: dict) -> list[str]:
    return [k for k in names if k in keys] + [k for k in keys if k not in names]


def _scorer_rows(mean: dict, sd: dict, columns: dict) -> list[dict]:
    return [{"key": k, "label": SCORERS.get(k, k),
             "metrics": {c: mean[k][c] for c in columns if c in mean[k]},
             "sd": {c: sd.get(k, {}).get(c) for c in columns if c in sd.get(k, {})}}
            for k in _ordered(mean, SCORERS)]


def _get(d, *path):
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def facts(s: dict, config: dict) -> list[dict]:
    """The run's facts the summary (or its config) holds, in order: [{key, label, value}]; a fact
    the file lacks (or holds as something else than a number, a word or a list of them) is left out."""
    subsets = _get(s, "config", "subsets")
    if subsets is None:
        subsets = config.get("subsets")
    target = s.get("target_met_at_n>=16")
    if isinstance(target, dict):
        target = ", ".join(f"n={n}: {'met' if ok else 'not met'}" for n, ok in target.items())
    rows = [
        ("policy", "policy", s.get("policy")), ("model", "model", s.get("model")),
        ("policy_errors", "policy errors (policy_errors)", s.get("policy_errors")),
        ("device", "device", s.get("device")),
        ("rm_seeds", "reward-model seeds", s.get("rm_seeds")),
        ("test_problems", "held-out problems", _get(s, "test", "problems")),
        ("candidates", "candidates per held-out problem", _get(s, "test", "samples_per_problem")),
        ("sample_accuracy", "held-out sample accuracy", _get(s, "test", "sample_accuracy")),
        ("subsets", "random subsets per problem and n", subsets),
        ("train_problems", "training problems", _get(s, "train", "problems")),
        ("train_samples", "training solutions", _get(s, "train", "samples")),
        ("train_steps", "training steps (wrong ones)",
         None if _get(s, "train", "steps") is None else
         f"{_get(s, 'train', 'steps')} ({_get(s, 'train', 'wrong_steps')})"),
        ("target", "PRM ≥ ORM ≥ majority (Lightman et al.)", target),
        ("total_s", "seconds (total)", _get(s, "timings", "total_s")),
    ]
    out = []
    for key, label, value in rows:
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        ok = (isinstance(value, (str, int, float)) or
              (isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value)))
        if value is not None and ok:
            out.append({"key": key, "label": label, "value": value})
    return out


def study_view(s, config: dict | None = None) -> dict:
    """What the page draws from a summary: ns; per selector (known ones in SELECTORS' order, then
    the others) its label, values and sd (None where selection_sd has none); the scorers' metrics
    on every candidate (with sd) and from `tether prm`'s eval; the facts. SummaryError naming the
    field when the summary is not what a PRM study writes."""
    if not isinstance(s, dict):
        raise SummaryError("is not a JSON object")
    if "ns" not in s:
        raise SummaryError("field 'ns' is missing")
    ns = s["ns"]
    if (not isinstance(ns, list) or not ns
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in ns)):
        raise SummaryError("field 'ns' must be a non-empty list of positive integers")
    mean = _curves(s, "selection", len(ns), required=True)
    sd = _curves(s, "selection_sd", len(ns), required=False)
    selectors = [{"key": k, "label": SELECTORS.get(k, k), "values": mean[k], "sd": sd.get(k)}
                 for k in _ordered(mean, SELECTORS)]
    seeds = s.get("rm_seeds")
    return {"ns": ns, "selectors": selectors,
            "seeds": len(seeds) if isinstance(seeds, list) else None,
            "candidate_metrics": _scorer_rows(_metrics(s, "candidate_metrics"), _metrics(s, "candidate_metrics_sd"),
                                              CANDIDATE_METRICS),
            "eval_metrics": _scorer_rows(_metrics(s, "prm_step_metrics"), {}, EVAL_METRICS),
            "columns": {"candidate_metrics": CANDIDATE_METRICS, "eval_metrics": EVAL_METRICS},
            "facts": facts(s, config or {})}


# ---- the page's API ---------------------------------------------------------------------------------

@router.get("/studies")
def list_studies(request: Request):
    """The PRM studies the studio knows: runs under runs_dir, then the published summaries."""
    return {"studies": studies(get_studio(request)), "published_dir": PUBLISHED.as_posix()}


@router.get("/study")
def study(request: Request, run: str | None = None, published: str | None = None):
    """The chosen study's curves, tables and facts. 404 when it has no summary yet; 422 naming the
    file and the field when its summary is not what a PRM study writes."""
    where = locate(request, run, published)
    if where["summary"] is None:
        raise HTTPException(404, f"{where['label']} is not written yet (the study writes it last; "
                                 f"the run is {where['state']})")
    try:
        view = study_view(_read(where["summary"]), where["config"])
    except SummaryError as e:
        raise HTTPException(422, f"{where['label']}: {e}") from None
    return {"kind": where["kind"], "id": where["id"], "file": where["label"], "state": where["state"],
            "figure": where["figure"] is not None, **view}


@router.get("/figure")
def figure(request: Request, run: str | None = None, published: str | None = None):
    """The study's own figure (selection.png; a published summary<suffix>.json: selection<suffix>.png)."""
    where = locate(request, run, published)
    if where["figure"] is None:
        raise HTTPException(404, f"{where['label']} has no figure beside it")
    return FileResponse(where["figure"], media_type="image/png")
