"""Studio page "Process rewards" (tether/studio/prm.py) through its API: a fabricated `tether study
prm` run whose every number is known, a bench/prm_real.py output folder, the published
benchmarks/prm summaries; malformed summaries answer 4xx naming the file and the field; nothing
outside the listed studies is reached."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("httpx", reason="httpx not installed (fastapi's TestClient; pip install -e '.[test]')")

from studio_support import REPO, client, make_app  # noqa: E402

BENCH = REPO / "benchmarks" / "prm"
NS = [1, 2, 4, 8, 16, 32, 64]
SELECTORS = ["prm", "prm_prod", "prm_ms", "prm_ms_prod", "prm_ms_soft", "prm_ms_soft_prod", "orm",
             "majority", "random", "oracle"]
LABELS = {"prm": "PRM (min)", "prm_prod": "PRM (product)", "prm_ms": "PRM, Math-Shepherd hard (min)",
          "prm_ms_soft": "PRM, Math-Shepherd soft (min)", "orm": "ORM", "majority": "majority vote",
          "random": "random", "oracle": "pass@n"}


def fabricated_summary() -> dict:
    """A summary in the format `tether study prm` writes (rm_seeds=3, policy_errors=steps), every
    number distinct; an extra selector the page does not know ("verifier_x"), written out of the
    page's order; majority / random / oracle without spread; one NaN metric (JSON's NaN, as
    json.dumps writes it)."""
    keys = ["oracle", "verifier_x"] + SELECTORS[:-1]  # not in the page's order
    selection = {k: [round(0.05 + 0.07 * i + 0.009 * j, 6) for j in range(len(NS))] for i, k in enumerate(keys)}
    sd = {k: [0.0] + [round(0.001 * (i + 1) + 0.0005 * j, 6) for j in range(1, len(NS))]
          for i, k in enumerate(keys) if k not in ("majority", "random", "oracle")}
    sd.update({k: [0.0] * len(NS) for k in ("majority", "random", "oracle")})
    metric = lambda i, c: round(0.5 + 0.04 * i + 0.01 * c, 6)  # noqa: E731
    cols = ("step_accuracy", "step_f1", "error_f1", "first_error_accuracy", "first_error_accuracy_wrong",
            "outcome_accuracy")
    cand = {k: {c: metric(i, j) for j, c in enumerate(cols)} for i, k in enumerate(("prm", "prm_ms", "prm_ms_soft"))}
    cand["orm"] = {"outcome_accuracy": 0.8123}
    cand["prm_ms_soft"]["first_error_accuracy_wrong"] = float("nan")
    cand_sd = {k: {c: round(v / 100, 6) if v == v else float("nan") for c, v in m.items()} for k, m in cand.items()}
    evals = {k: {"loss": 0.3 + 0.01 * i, "step_accuracy": 0.9 - 0.02 * i, "step_f1": 0.93 - 0.02 * i,
                 "error_f1": 0.8 - 0.03 * i, "first_error_accuracy": 0.7 - 0.05 * i, "steps": 3043.0, "rows": 800.0}
             for i, k in enumerate(("prm", "prm_ms", "prm_ms_soft", "orm"))}
    return {
        "policy": "runs/study-prm-steps/policy-steps/checkpoints/step-400", "policy_errors": "steps",
        "rm_seeds": [0, 1, 2], "ns": NS, "selection": selection, "selection_sd": sd,
        "target_met_at_n>=16": {"16": False, "32": False, "64": True},
        "score_by_kind": {"prm": {"right": 0.7, "slipped answer line": 0.3, "wrong chain": 0.4}},
        "prm_step_metrics": evals, "candidate_metrics": cand, "candidate_metrics_sd": cand_sd,
        "per_seed": [{"selection": selection, "metrics": {}}],
        "train": {"problems": 400, "samples": 1600, "rows": 1599, "solution_accuracy": 0.51875, "steps": 6172,
                  "wrong_steps": 1569, "rollouts": 36576},
        "test": {"problems": 100, "samples_per_problem": 64, "sample_accuracy": 0.48640625},
        "timings": {"policy_s": 0.1, "total_s": 1044.7},
    }


def write_study(runs: Path, name: str = "study-prm", summary: dict | None = None, figure: bool = True) -> Path:
    """A `tether study prm` run directory: its config.yaml (PRMStudyConfig as the study writes it),
    summary.json, selection.png (the published figure's bytes) and a sub-run that is no study."""
    from tether.studies.prm import PRMStudyConfig

    root = runs / name
    root.mkdir(parents=True)
    cfg = asdict(PRMStudyConfig(name=name, runs_dir=str(runs), rm_seeds=3, policy_errors="steps", subsets=24))
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    if summary is not False:
        (root / "summary.json").write_text(json.dumps(fabricated_summary() if summary is None else summary, indent=2))
    if figure:
        shutil.copyfile(BENCH / "selection-steps.png", root / "selection.png")
    (root / "prm").mkdir()  # a reward model's run: a run, not a study
    (root / "prm" / "config.yaml").write_text("model: x\nstep_separator: '='\n")
    (root / "prm" / "summary.json").write_text(json.dumps({"eval/step_accuracy": 0.9}))
    return root


def publish(runs: Path) -> Path:
    """benchmarks/prm/ beside the runs directory: copies of the repository's published files."""
    out = runs.parent / "benchmarks" / "prm"
    out.mkdir(parents=True)
    for f in ("summary.json", "summary-steps.json", "summary-smollm2.json", "selection.png", "selection-steps.png",
              "selection-smollm2.png", "report.md"):
        shutil.copyfile(BENCH / f, out / f)
    return out


def _none_for_nan(xs):
    return [None if (x != x) else x for x in xs]


# ---- the list --------------------------------------------------------------------------------------

def test_pages_list_the_page_after_hacking(tmp_path):
    names = [p["name"] for p in client(make_app(tmp_path / "runs")).get("/api/pages").json()]
    assert names.index("prm") == names.index("hacking") + 1
    assert client(make_app(tmp_path / "runs")).get("/prm").status_code == 200


def test_studies_lists_prm_studies_and_published_summaries(tmp_path):
    runs = tmp_path / "runs"
    c = client(make_app(runs))
    assert c.get("/api/prm/studies").json()["studies"] == []  # nothing yet, no benchmarks/ beside runs/
    write_study(runs)
    write_study(runs, "running", summary=False)  # config.yaml only: a study under way
    (runs / "sft").mkdir()
    (runs / "sft" / "summary.json").write_text(json.dumps({"eval/loss": 1.0}))
    (runs / "bench" / "prm-real").mkdir(parents=True)  # bench/prm_real.py --out runs/bench/prm-real
    (runs / "bench" / "prm-real" / "summary.json").write_text(json.dumps(
        {"model": "/tmp/smollm2", "ns": [1, 2], "selection": {"prm": [0.1, 0.2]}, "selection_sd": {"prm": [0, 0.01]}}))
    publish(runs)
    listed = c.get("/api/prm/studies").json()["studies"]
    assert [(s["kind"], s["id"]) for s in listed] == [
        ("run", "bench/prm-real"), ("run", "running"), ("run", "study-prm"),
        ("published", "summary-smollm2.json"), ("published", "summary-steps.json"), ("published", "summary.json")]
    by_id = {s["id"]: s for s in listed}
    assert by_id["study-prm"]["state"] == "finished" and by_id["study-prm"]["has_summary"]
    assert by_id["running"]["state"] == "failed" and not by_id["running"]["has_summary"]  # no process, no summary
    assert by_id["summary-steps.json"]["label"] == "benchmarks/prm/summary-steps.json"
    r = c.get("/api/prm/study", params={"run": "running"})
    assert r.status_code == 404 and "running/summary.json is not written yet" in r.json()["detail"]


# ---- a study's numbers -----------------------------------------------------------------------------

def test_study_curves_tables_and_facts_are_the_files(tmp_path):
    runs = tmp_path / "runs"
    write_study(runs)
    s = json.loads((runs / "study-prm" / "summary.json").read_text())
    out = client(make_app(runs)).get("/api/prm/study", params={"run": "study-prm"})
    assert out.status_code == 200, out.text
    v = out.json()
    assert v["file"] == "study-prm/summary.json" and v["ns"] == NS and v["seeds"] == 3 and v["figure"] is True
    # every selector: the page's order, then the unknown one; its values and sd as in the file
    assert [x["key"] for x in v["selectors"]] == SELECTORS + ["verifier_x"]
    for x in v["selectors"]:
        assert x["values"] == s["selection"][x["key"]]
        assert x["sd"] == s["selection_sd"][x["key"]]
        assert x["label"] == LABELS.get(x["key"], x["label"])
    labels = {x["key"]: x["label"] for x in v["selectors"]}
    assert labels["verifier_x"] == "verifier_x" and labels["prm_ms_soft_prod"] == "PRM, Math-Shepherd soft (product)"
    at16 = {x["key"]: x["values"][NS.index(16)] for x in v["selectors"]}
    assert at16["prm"] == s["selection"]["prm"][4] and at16["oracle"] == s["selection"]["oracle"][4]
    assert len(set(at16.values())) == len(at16)  # distinct: a value shown under the wrong key would differ

    # the scorers: every candidate metric with its sd (NaN -> null); the ORM only its outcome accuracy
    rows = {r["key"]: r for r in v["candidate_metrics"]}
    assert [r["key"] for r in v["candidate_metrics"]] == ["prm", "prm_ms", "prm_ms_soft", "orm"]
    assert rows["prm"]["label"] == "PRM" and rows["prm_ms"]["label"] == "PRM, Math-Shepherd hard"
    for k, m in s["candidate_metrics"].items():
        assert rows[k]["metrics"] == {c: (None if x != x else x) for c, x in m.items()}
        assert rows[k]["sd"] == {c: (None if x != x else x) for c, x in s["candidate_metrics_sd"][k].items()}
    assert rows["prm_ms_soft"]["metrics"]["first_error_accuracy_wrong"] is None
    assert rows["orm"]["metrics"] == {"outcome_accuracy": 0.8123}
    evals = {r["key"]: r for r in v["eval_metrics"]}
    for k, m in s["prm_step_metrics"].items():
        assert evals[k]["metrics"] == {c: m[c] for c in ("step_accuracy", "step_f1", "error_f1",
                                                          "first_error_accuracy", "steps")}
        assert evals[k]["sd"] == {}
    facts = {f["key"]: f["value"] for f in v["facts"]}
    assert facts["policy"] == s["policy"] and facts["policy_errors"] == "steps" and facts["rm_seeds"] == [0, 1, 2]
    assert facts["test_problems"] == 100 and facts["candidates"] == 64 and facts["sample_accuracy"] == 0.48640625
    assert facts["subsets"] == 24  # from the run's config.yaml (the summary does not hold it)
    assert facts["train_steps"] == "6172 (1569)" and facts["target"] == "n=16: not met, n=32: not met, n=64: met"
    assert "model" not in facts

    fig = client(make_app(runs)).get("/api/prm/figure", params={"run": "study-prm"})
    assert fig.status_code == 200 and fig.headers["content-type"] == "image/png"
    assert fig.content == (runs / "study-prm" / "selection.png").read_bytes()


def test_published_summaries_are_read_as_written(tmp_path):
    runs = tmp_path / "runs"
    pub = publish(runs)
    c = client(make_app(runs))
    for name, figure in (("summary-steps.json", "selection-steps.png"), ("summary.json", "selection.png"),
                         ("summary-smollm2.json", "selection-smollm2.png")):
        s = json.loads((BENCH / name).read_text())
        v = c.get("/api/prm/study", params={"published": name}).json()
        assert v["file"] == f"benchmarks/prm/{name}" and v["ns"] == s["ns"] == NS
        assert {x["key"] for x in v["selectors"]} == set(s["selection"])
        for x in v["selectors"]:
            assert x["values"] == _none_for_nan(s["selection"][x["key"]])
            assert x["sd"] == (s["selection_sd"][x["key"]] if "selection_sd" in s else None)
        fig = c.get("/api/prm/figure", params={"published": name})
        assert fig.status_code == 200 and fig.content == (pub / figure).read_bytes()
        assert [r["key"] for r in v["eval_metrics"]] == list(s["prm_step_metrics"])
    steps = c.get("/api/prm/study", params={"published": "summary-steps.json"}).json()
    prm = next(x for x in steps["selectors"] if x["key"] == "prm")
    assert prm["values"][NS.index(16)] == json.loads((BENCH / "summary-steps.json").read_text())["selection"]["prm"][4]
    assert steps["seeds"] == 3 and {r["key"] for r in steps["candidate_metrics"]} == {"prm", "prm_ms", "prm_ms_soft", "orm"}
    old = c.get("/api/prm/study", params={"published": "summary.json"}).json()
    assert old["candidate_metrics"] == [] and old["seeds"] is None  # the three-model, one-seed form


def test_a_prm_real_output_folder(tmp_path):
    """bench/prm_real.py's summary: "model" instead of "policy", its sizes under "config"."""
    runs = tmp_path / "runs"
    out = runs / "prm-real"
    out.mkdir(parents=True)
    s = {**fabricated_summary(), "model": "/tmp/smollm2", "tiny": False, "device": "cuda",
         "config": {"n_train": 200, "subsets": 32, "max_n": 64}}
    del s["policy"], s["policy_errors"], s["target_met_at_n>=16"]
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    v = client(make_app(runs)).get("/api/prm/study", params={"run": "prm-real"}).json()
    facts = {f["key"]: f["value"] for f in v["facts"]}
    assert facts["model"] == "/tmp/smollm2" and facts["device"] == "cuda" and facts["subsets"] == 32
    assert "policy" not in facts and v["figure"] is False
    assert client(make_app(runs)).get("/api/prm/figure", params={"run": "prm-real"}).status_code == 404


# ---- malformed summaries: 4xx naming the file and the field -----------------------------------------

@pytest.mark.parametrize("change, field", [
    (lambda s: s.pop("ns"), "'ns'"),
    (lambda s: s.update(ns=[1, 2, "4", 8, 16, 32, 64]), "'ns'"),
    (lambda s: s.update(ns=[]), "'ns'"),
    (lambda s: s.pop("selection"), "'selection'"),
    (lambda s: s["selection"]["prm"].pop(), "'selection.prm' has 6 values for the 7 n of field 'ns'"),
    (lambda s: s["selection_sd"]["orm"].append(0.1), "'selection_sd.orm' has 8 values"),
    (lambda s: s["selection"].update(orm="0.5"), "'selection.orm'"),
    (lambda s: s["selection"]["majority"].__setitem__(3, "x"), "'selection.majority[3]' must be a number"),
    (lambda s: s.update(candidate_metrics=[1, 2]), "'candidate_metrics'"),
    (lambda s: s["candidate_metrics"].update(prm=0.9), "'candidate_metrics.prm'"),
])
def test_a_malformed_summary_names_the_field(tmp_path, change, field):
    runs = tmp_path / "runs"
    s = fabricated_summary()
    change(s)
    write_study(runs, summary=s)
    r = client(make_app(runs)).get("/api/prm/study", params={"run": "study-prm"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith("study-prm/summary.json: ") and field in detail and "\n" not in detail


def test_unreadable_summaries_are_4xx(tmp_path):
    runs = tmp_path / "runs"
    root = write_study(runs)
    c = client(make_app(runs))
    for text, what in (('{"ns": [1, 2], "selection": ', "not valid JSON"), ("[1, 2]", "not a JSON object")):
        (root / "summary.json").write_text(text)
        r = c.get("/api/prm/study", params={"run": "study-prm"})
        assert r.status_code == 422 and r.json()["detail"].startswith("study-prm/summary.json: ") and what in r.json()["detail"]
    pub = publish(runs)
    (pub / "summary-broken.json").write_text(json.dumps({"selection": {"prm": [0.5]}}))
    r = c.get("/api/prm/study", params={"published": "summary-broken.json"})
    assert r.status_code == 422 and r.json()["detail"] == "benchmarks/prm/summary-broken.json: field 'ns' is missing"


# ---- nothing outside the listed studies -------------------------------------------------------------

def test_paths_outside_the_studies_are_refused(tmp_path):
    runs = tmp_path / "runs"
    root = write_study(runs)
    pub = publish(runs)
    outside = tmp_path / "elsewhere"
    write_study(outside, "secret")
    c = client(make_app(runs))
    for params in ({"run": "../elsewhere/secret"}, {"run": str(outside / "secret")}, {"run": str(root)},
                   {"run": "study-prm/../../elsewhere/secret"}, {"run": "study-prm/prm"},  # a run, not a study
                   {"published": "../summary.json"}, {"published": "../../runs/study-prm/summary.json"},
                   {"published": "report.md"}, {"published": str(pub / "summary.json")},
                   {"published": "summary-nope.json"}):
        for endpoint in ("study", "figure"):
            r = c.get(f"/api/prm/{endpoint}", params=params)
            assert r.status_code == 404, (endpoint, params, r.text)
    assert c.get("/api/prm/study").status_code == 400
    assert c.get("/api/prm/study", params={"run": "study-prm", "published": "summary.json"}).status_code == 400

    # symlinks: a run directory, a figure and a published summary pointing out are not followed
    os.symlink(outside / "secret", runs / "linked")
    (root / "selection.png").unlink()
    os.symlink(outside / "secret" / "selection.png", root / "selection.png")
    os.symlink(outside / "secret" / "summary.json", pub / "summary-linked.json")
    ids = [s["id"] for s in c.get("/api/prm/studies").json()["studies"]]
    assert "linked" not in ids and "summary-linked.json" not in ids
    assert c.get("/api/prm/study", params={"run": "linked"}).status_code == 404
    assert c.get("/api/prm/study", params={"published": "summary-linked.json"}).status_code == 404
    assert c.get("/api/prm/study", params={"run": "study-prm"}).json()["figure"] is False
    assert c.get("/api/prm/figure", params={"run": "study-prm"}).status_code == 404


def test_nan_curves_reach_the_page_as_null(tmp_path):
    runs = tmp_path / "runs"
    s = fabricated_summary()
    s["selection"]["orm"][2] = float("nan")
    s["selection_sd"]["orm"][2] = float("inf")
    write_study(runs, summary=s)
    v = client(make_app(runs)).get("/api/prm/study", params={"run": "study-prm"}).json()
    orm = next(x for x in v["selectors"] if x["key"] == "orm")
    assert orm["values"][2] is None and orm["sd"][2] is None and math.isclose(orm["values"][3], s["selection"]["orm"][3])
