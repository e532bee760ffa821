"""`tether study prm` end to end (slow: it builds the quickstart's SFT policy when not cached):
the PRM trained on the arithmetic task's exact step labels beats a wrong-label control on the
held-out truth, and the study's tables hold what they claim."""

from __future__ import annotations

import json
import random

import pytest

pytestmark = pytest.mark.slow


def test_prm_study_truth_labels_beat_shuffled_control(tmp_path):
    from tether.studies.prm import PRMStudyConfig, run_prm_study
    from tether.trainers.prm import PRMConfig, train_prm

    cfg = PRMStudyConfig(runs_dir=str(tmp_path), n_train=200, n_test=30, max_n=16, subsets=8,
                         ms_k=[1, 4], ms_train_k=4, prm_steps=300)
    s = run_prm_study(cfg)
    root = tmp_path / cfg.name
    # the control: the same training rows, their step labels shuffled over the whole set
    rows = [json.loads(line) for line in (root / "data" / "prm_true.jsonl").read_text().splitlines()]
    flat = [y for r in rows for y in r["labels"]]
    random.Random(0).shuffle(flat)
    it = iter(flat)
    (tmp_path / "shuffled.jsonl").write_text("".join(
        json.dumps({**r, "labels": [next(it) for _ in r["labels"]]}) + "\n" for r in rows))
    control = train_prm(PRMConfig(model=s["policy"], data=str(tmp_path / "shuffled.jsonl"),
                                  eval_data=str(root / "data" / "prm_eval.jsonl"), step_separator="=",
                                  max_steps=cfg.prm_steps, lr=cfg.prm_lr, batch_size=cfg.batch_size,
                                  runs_dir=str(tmp_path), name="control", device="cpu", progress=False))
    truth = s["prm_step_metrics"]["prm"]
    assert truth["error_f1"] > control["eval/error_f1"] + 0.2
    assert truth["first_error_accuracy"] > control["eval/first_error_accuracy"] + 0.1
    # the curves' fixed points: n = 1 is one random sample for every selector
    first = {k: v[0] for k, v in s["selection"].items()}
    assert len(set(round(v, 9) for v in first.values())) == 1
    assert all(a <= b + 1e-9 for a, b in zip(s["selection"]["oracle"], s["selection"]["oracle"][1:]))
