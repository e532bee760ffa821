"""Studio page 2, training stages: the same held-out prompts answered by each stage's checkpoint
(pretrain → SFT → RL), generated live, with each stage's accuracy.

The quickstart (tether/quickstart.py) leaves under runs/<name>/: config.yaml (its
QuickstartConfig), summary.json (per stage its accuracy and the checkpoint it scored, `model`),
and the stages' own runs pretrain/, sft/, rl/ with checkpoints/step-<N>/. Its held-out problems are
not a file the page trusts but the quickstart's own split, regenerated from the config by
:func:`tether.tasks.arithmetic.make_splits` (what the quickstart scored). A chain the user lists
is any checkpoints of known runs, answered on the same kind of held-out arithmetic problems.

Scoring is the quickstart's: :func:`tether.quickstart.accuracy` (greedy pass@1 through the rollout
engine's generate, exact match of the '#### n' line) and :func:`tether.quickstart.misses`, so a
stage's bar over the quickstart's whole held-out set equals the accuracy it printed.
"""

from __future__ import annotations

import difflib
import json
import threading
from collections import OrderedDict
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field

from tether.studio import jobs
from tether.studio.checkpoints import known_checkpoints, latest_of, resolve_checkpoint
from tether.studio.common import get_studio, known_runs, resolve_run
from tether.tasks import arithmetic

STAGE_ORDER = ("pretrain", "sft", "rl")
"the quickstart's stages, in training order"
DEFAULT_PROMPTS = 20
"held-out problems answered per stage unless the page asks for more"

_LOCK = threading.Lock()  # one generation at a time: the machine's cores are shared with training
_CACHE: "OrderedDict[tuple, dict]" = OrderedDict()
CACHE_SIZE = 32  # stage answers kept (a chain of 3 stages at a few problem counts)


def quickstart_chain(run_path: Path) -> dict | None:
    """The stages of a quickstart run directory, [{"stage", "checkpoint", "accuracy"}] in training
    order: each stage's own run (<run>/pretrain, sft, rl) and its newest checkpoint, which is the
    one the quickstart scored; `accuracy` is what its summary says (None while it runs). Also the
    held-out split's settings from config.yaml. None when the directory is not a quickstart."""
    import yaml

    run_path = Path(run_path)
    try:
        cfg = yaml.safe_load((run_path / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    split = {k: cfg.get(k) for k in ("n_train", "n_test", "level", "seed")} if isinstance(cfg, dict) else {}
    if not split or any(v is None for v in split.values()) or "sft_steps" not in cfg:
        return None
    try:
        summary = json.loads((run_path / "summary.json").read_text()).get("stages") or {}
    except (OSError, ValueError, AttributeError):
        summary = {}
    stages = []
    for name in STAGE_ORDER:
        ckpt = latest_of(run_path / name) if (run_path / name).is_dir() else None
        if ckpt is not None:
            stages.append({"stage": name, "checkpoint": ckpt,
                           "accuracy": (summary.get(name) or {}).get("accuracy")})
    return {"stages": stages, "split": split, "max_new_tokens": int(cfg.get("max_new_tokens", 64))}


def default_split() -> dict:
    """The quickstart's default held-out split (QuickstartConfig's defaults), for a listed chain."""
    from tether.quickstart import QuickstartConfig

    c = QuickstartConfig()
    return {"n_train": c.n_train, "n_test": c.n_test, "level": c.level, "seed": c.seed}


def held_out(split: dict, count: int | None = None) -> list:
    """The quickstart's held-out problems (its make_splits), the first `count` of them."""
    test = arithmetic.make_splits(int(split["n_train"]), int(split["n_test"]), int(split["level"]),
                                  int(split["seed"]))[1]
    return test if count is None else test[:max(1, int(count))]


def answer(checkpoint: str, problems: list, max_new_tokens: int = 64) -> dict:
    """One stage's answers: quickstart.accuracy (greedy, exact match) and quickstart.misses on
    `problems`; per problem the completion and whether it is right. Cached per checkpoint and
    problem set (a checkpoint never changes once written)."""
    from tether.models import load_model, load_tokenizer
    from tether.quickstart import accuracy, misses

    key = (str(checkpoint), tuple(p.prompt for p in problems), int(max_new_tokens))
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        model, tok = load_model(str(checkpoint), device="cpu"), load_tokenizer(str(checkpoint))
        acc, comps = accuracy(model, tok, problems, max_new_tokens)
        out = {"checkpoint": str(checkpoint), "accuracy": acc, "misses": misses(problems, comps),
               "answers": [{"prompt": p.prompt, "answer": p.answer, "completion": c,
                            "correct": bool(arithmetic.check_answer(c, p.answer)),
                            "kind": arithmetic.diagnose(c, p)} for p, c in zip(problems, comps)]}
        _CACHE[key] = out
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
        return out


def diff_words(a: str, b: str) -> list[dict]:
    """Word-level diff of two completions: [{"op": "equal"|"delete"|"insert", "text"}], `delete`
    being words only in `a`, `insert` words only in `b` (difflib's longest matching blocks)."""
    wa, wb = a.split(" "), b.split(" ")
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).get_opcodes():
        if op == "equal":
            out.append({"op": "equal", "text": " ".join(wa[i1:i2])})
            continue
        if i2 > i1:
            out.append({"op": "delete", "text": " ".join(wa[i1:i2])})
        if j2 > j1:
            out.append({"op": "insert", "text": " ".join(wb[j1:j2])})
    return out


def diff_stages(a: dict, b: dict) -> list[dict]:
    """Per prompt, the word diff of stage a's completion to stage b's, and both verdicts."""
    return [{"prompt": x["prompt"], "answer": x["answer"], "a_correct": x["correct"], "b_correct": y["correct"],
             "same": x["completion"] == y["completion"], "diff": diff_words(x["completion"], y["completion"])}
            for x, y in zip(a["answers"], b["answers"])]


# ---- the page's API --------------------------------------------------------------------------------

TITLE = "Training stages"
router = APIRouter(prefix="/api/stages")


class AnswerRequest(BaseModel):
    checkpoints: list[str] = Field(min_length=1, max_length=12)
    "the chain: checkpoint ids (GET /api/stages/sources), in training order"
    labels: list[str] | None = None
    "a name per stage (default: the checkpoint ids)"
    run: str | None = None
    "a quickstart run id: its held-out split; none = the quickstart's default split"
    count: int = Field(DEFAULT_PROMPTS, ge=1, le=1000)
    "held-out problems answered (the first `count` of the split)"


class DiffRequest(BaseModel):
    checkpoint: str
    other: str
    "the two checkpoint ids to compare"
    run: str | None = None
    count: int = Field(DEFAULT_PROMPTS, ge=1, le=1000)


def _chain_ids(studio, chain: dict) -> list[dict]:
    ids = {str(p): k for k, p in known_checkpoints(studio).items()}
    return [{"stage": s["stage"], "checkpoint": ids[str(s["checkpoint"])], "accuracy": s["accuracy"]}
            for s in chain["stages"] if str(s["checkpoint"]) in ids]


@router.get("/sources")
def sources(request: Request):
    """Quickstart runs (each a chain of stages) and every checkpoint a chain may list."""
    studio = get_studio(request)
    chains = []
    for run_id, path in known_runs(studio).items():
        chain = quickstart_chain(path)
        if chain and chain["stages"]:
            chains.append({"run": run_id, "stages": _chain_ids(studio, chain), "split": chain["split"]})
    return {"quickstarts": chains, "checkpoints": sorted(known_checkpoints(studio)),
            "default_split": default_split(), "default_count": DEFAULT_PROMPTS}


def _problems(request: Request, run: str | None, count: int) -> tuple[list, int]:
    if run:
        chain = quickstart_chain(resolve_run(request, run))
        if chain is None:
            raise HTTPException(404, f"run {run!r} is not a quickstart")
        split, tokens = chain["split"], chain["max_new_tokens"]
    else:
        split, tokens = default_split(), 64
    try:
        return held_out(split, count), tokens
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


@router.post("/answer")
def answer_route(req: AnswerRequest, request: Request):
    """Start answering: each stage in turn (a job; GET /api/stages/job/<id> has the stages done so
    far in `partial`: checkpoint, label, accuracy, misses, answers)."""
    studio = get_studio(request)
    paths = [resolve_checkpoint(studio, c) for c in req.checkpoints]  # all 404s before any work
    labels = req.labels if req.labels and len(req.labels) == len(paths) else list(req.checkpoints)
    problems, tokens = _problems(request, req.run, req.count)

    def work(job):
        for i, (ckpt, label, path) in enumerate(zip(req.checkpoints, labels, paths)):
            job.message = f"answering with {label} ({i + 1}/{len(paths)})"
            out = answer(str(path), problems, tokens)
            job.partial.append({"stage": label, **out, "checkpoint": ckpt})
            job.progress = (i + 1) / len(paths)
        return {"stages": len(paths), "problems": len(problems)}

    return jobs.start(studio, "stages", work).view()


@router.get("/job/{job_id}")
def job_route(job_id: str, request: Request):
    return jobs.get(get_studio(request), "stages", job_id)


@router.post("/diff")
def diff_route(req: DiffRequest, request: Request):
    """Stage `checkpoint` against stage `other`, prompt by prompt (word diff of the completions);
    both stages' answers are cached by the time a page asks."""
    studio = get_studio(request)
    a, b = resolve_checkpoint(studio, req.checkpoint), resolve_checkpoint(studio, req.other)
    problems, tokens = _problems(request, req.run, req.count)
    return {"a": req.checkpoint, "b": req.other,
            "rows": diff_stages(answer(str(a), problems, tokens), answer(str(b), problems, tokens))}
