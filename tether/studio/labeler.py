"""Page 3, the preference labeler: a prompt and two responses, A / B / Tie / Skip (buttons and keys),
undo; every label appended to TRL-format preference JSONL (labeler_store.py); a Bradley–Terry
reward model (labeler_bt.py) retrained in a background thread every `retrain_every` labels,
showing its accuracy on held-out labelled pairs, its scores on pairs nobody labelled and, on the
gold-reward world, its expected accuracy next to the Bayes-optimal one
(tether.tasks.preference_world.bayes_optimal_accuracy).

A request names a pair by its index in the source; the server rebuilds the pair's texts itself, so
what is written is what the source holds, never text a request sent.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel

from tether.errors import UserError
from tether.studio.common import get_studio
from tether.studio.labeler_bt import expected_bt_accuracy, fit_bt, pair_accuracy
from tether.studio.labeler_store import LabelStore, make_source

TITLE = "Preference labeler"
router = APIRouter(prefix="/api/labeler")

HELD_OUT_EVERY = 5
"every 5th A/B label (the 5th, 10th, ...) is held out from the fit and measures it"
UNSEEN_SHOWN = 6
"pairs nobody labelled whose scores the page shows"
WORLD_EVAL_PAIRS = 500
"world pairs of held-out (test-split) prompts on which the expected accuracy is computed"


def split_labels(labels: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, held out) among the A/B labels, in label order: the k-th (1-based) is held out when
    k is a multiple of HELD_OUT_EVERY."""
    ab = [e for e in labels if e["choice"] in ("a", "b")]
    held = [e for k, e in enumerate(ab, 1) if k % HELD_OUT_EVERY == 0]
    train = [e for k, e in enumerate(ab, 1) if k % HELD_OUT_EVERY != 0]
    return train, held


def _sides(labels: list[dict]) -> tuple[list, list]:
    chosen = [e["a"] if e["choice"] == "a" else e["b"] for e in labels]
    rejected = [e["b"] if e["choice"] == "a" else e["a"] for e in labels]
    return chosen, rejected


def rm_report(labels: list[dict], source) -> dict:
    """Fit the BT model on the training labels and measure it: what the page shows (pure function
    of the labels and the source, so a test recomputes it)."""
    train, held = split_labels(labels)
    model = fit_bt(*_sides(train))
    report = {"n_labels": len(train) + len(held), "n_train": len(train), "n_held_out": len(held),
              "held_out_accuracy": pair_accuracy(model, *_sides(held)),
              "train_accuracy": pair_accuracy(model, *_sides(train)), "train_loss": model.train_loss}
    labelled = {e["index"] for e in labels if e.get("pair") == source.pair_id(e["index"])}
    unseen = []
    if hasattr(source, "world"):
        pairs = [source.pair(i, split="test") for i in range(getattr(source, "eval_pairs", WORLD_EVAL_PAIRS))]
        a, b = [p["a"] for p in pairs], [p["b"] for p in pairs]
        ga, gb = [p["gold_a"] for p in pairs], [p["gold_b"] for p in pairs]
        from tether.tasks.preference_world import bayes_optimal_accuracy

        tau = source.world.temperature
        decided = [(x, y, gx, gy) for x, y, gx, gy in zip(a, b, ga, gb) if gx != gy]
        report["world"] = {
            "pairs": len(pairs), "temperature": tau,
            "expected_accuracy": expected_bt_accuracy(model, a, b, ga, gb, tau),
            "bayes_optimal_accuracy": bayes_optimal_accuracy(ga, gb, tau),
            "gold_agreement": sum((model.score(x) > model.score(y)) == (gx > gy) for x, y, gx, gy in decided)
            / max(1, len(decided))}
        unseen = pairs[:UNSEEN_SHOWN]
    else:
        i = 0
        while len(unseen) < UNSEEN_SHOWN and i < len(source):
            if i not in labelled:
                unseen.append(source.pair(i))
            i += 1
    report["unseen"] = [{"prompt": p["prompt"], "a": p["a"], "b": p["b"], "score_a": model.score(p["a"]),
                         "score_b": model.score(p["b"]), **({"gold_a": p["gold_a"], "gold_b": p["gold_b"]}
                                                           if "gold_a" in p else {})} for p in unseen]
    return report


class Labeler:
    """The page's state: the pair source, the label store and the background trainer."""

    def __init__(self, cfg, runs_dir: Path):
        self.cfg = cfg
        self.source = make_source(cfg)
        self.store = LabelStore(Path(cfg.labels_dir) if cfg.labels_dir else runs_dir / "studio-labels")
        self.report: dict | None = None
        self.history: list[dict] = []  # (labels, accuracy) of every fit: the page's learning curve
        self.fitting = False
        self._fitted_at: int | None = None
        self._lock = threading.Lock()
        self._pending = False

    def n_ab(self) -> int:
        return sum(e["choice"] in ("a", "b") for e in self.store.labels())

    def maybe_retrain(self, force: bool = False) -> None:
        """Start a fit when the A/B labels moved `retrain_every` away from the last fit's count."""
        n = self.n_ab()
        with self._lock:
            due = force or (self._fitted_at is None and n >= self.cfg.retrain_every) or \
                (self._fitted_at is not None and abs(n - self._fitted_at) >= self.cfg.retrain_every)
            if not due:
                return
            if self.fitting:
                self._pending = True
                return
            self.fitting = True
            self._fitted_at = n
        threading.Thread(target=self._fit, daemon=True).start()

    def _fit(self) -> None:
        while True:
            try:
                report = rm_report(self.store.labels(), self.source)
                with self._lock:
                    self.report = report
                    acc = report.get("world", {}).get("expected_accuracy", report["held_out_accuracy"])
                    self.history.append({"labels": report["n_labels"], "accuracy": acc})
            except Exception as e:  # noqa: BLE001 - shown on the page, the labeler keeps working
                with self._lock:
                    self.report = {"error": f"{type(e).__name__}: {e}"}
            with self._lock:
                if not self._pending:
                    self.fitting = False
                    return
                self._pending = False
                self._fitted_at = self.n_ab()

    def counts(self) -> dict:
        labels = self.store.labels()
        return {k: sum(e["choice"] == k for e in labels) for k in ("a", "b", "tie", "skip")} | {"labels": len(labels)}


_MAKING = threading.Lock()  # not studio._lock: loading a model= for live pairs takes seconds


def labeler(request: Request) -> Labeler:
    studio = get_studio(request)
    with _MAKING:
        lab = studio.pages.get("labeler")
        if lab is None:
            try:
                lab = studio.pages["labeler"] = Labeler(studio.cfg, studio.runs_dir)
            except UserError as e:
                raise HTTPException(400, str(e)) from None
    return lab


def _shown(pair: dict) -> dict:
    """A pair as the page gets it: no gold (the person must not see the answer)."""
    return {k: pair[k] for k in ("pair", "index", "prompt", "a", "b")}


class NextBody(BaseModel):
    session: str


class LabelBody(BaseModel):
    session: str
    index: int
    choice: str


class UndoBody(BaseModel):
    session: str
    id: str


@router.get("/state")
def state(request: Request):
    lab = labeler(request)
    with lab._lock:
        report, history, fitting = lab.report, list(lab.history), lab.fitting
    return {"source": lab.source.name, "counts": lab.counts(), "retrain_every": lab.cfg.retrain_every,
            "files": {"preferences": str(lab.store.preferences), "ties": str(lab.store.ties)},
            "model": report, "history": history, "fitting": fitting}


@router.post("/next")
def next_pair(request: Request, body: NextBody):
    lab = labeler(request)
    i = lab.store.next_index(lab.source, body.session)
    return {"pair": None if i is None else _shown(lab.source.pair(i))}


@router.post("/label")
def label(request: Request, body: LabelBody):
    lab = labeler(request)
    if not 0 <= body.index < len(lab.source):
        raise HTTPException(404, f"no pair {body.index}")
    try:
        entry = lab.store.add(lab.source.pair(body.index), body.choice, body.session)
    except UserError as e:
        raise HTTPException(400, str(e)) from None
    lab.maybe_retrain()
    return {"id": entry["id"], "counts": lab.counts()}


@router.post("/undo")
def undo(request: Request, body: UndoBody):
    lab = labeler(request)
    try:
        entry = lab.store.undo(body.id, body.session)
    except UserError as e:
        raise HTTPException(404, str(e)) from None
    lab.maybe_retrain()
    return {"pair": _shown(lab.source.pair(entry["index"])), "counts": lab.counts()}


@router.get("/mine")
def mine(request: Request, session: str):
    """This tab's labels in force, oldest first: what its undo takes back after a reload."""
    return {"ids": labeler(request).store.mine(session)}


@router.post("/retrain")
def retrain(request: Request):
    """Fit now, whatever the count (the page's "retrain now" button)."""
    lab = labeler(request)
    lab.maybe_retrain(force=True)
    return {"fitting": True}
