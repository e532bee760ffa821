"""`tether study prm` end to end (slow: it builds the quickstart's SFT policy when not cached):
the PRM trained on the arithmetic task's exact step labels beats a wrong-label control on the
held-out truth, and the study's tables hold what they claim. Fast: the step-error demonstrations
(policy_errors=steps) are wrong where they claim to be, and the study's small helpers by hand."""

from __future__ import annotations

import json
import random

import pytest

from tether.tasks import arithmetic as A


def test_step_error_solution_by_hand():
    from tether.studies.prm import step_error_solution

    # dropped carry: the ones' 15 written as 5 at step 2; dropped borrow: the tens not lowered at step 1
    carry = step_error_solution(A.Problem(47, "+", 8))
    borrow = step_error_solution(A.Problem(75, "-", 7))
    assert carry == " 47 + 8 = 40 + 7 + 8 = 40 + 5 = 45\n#### 45"
    assert borrow == " 75 - 7 = 70 + 15 - 7 = 70 + 8 = 78\n#### 78"
    assert A.stepwise_example(A.Problem(47, "+", 8), carry)["labels"] == [True, True, False, False]
    assert A.stepwise_example(A.Problem(75, "-", 7), borrow)["labels"] == [True, False, False, False]
    # no carry/borrow, or no middle step to hold one
    for p in (A.Problem(47, "+", 2), A.Problem(78, "-", 5), A.Problem(13, "-", 7), A.Problem(40, "+", 8),
              A.Problem(23, "×", 7)):
        assert step_error_solution(p) is None


def test_step_error_demonstrations_err_mid_chain_and_follow_it():
    """Every wrong demonstration is first wrong at a middle step (not the question, not the last
    step), that is its only broken link (the rest of the chain and the answer line follow the wrong
    value), its answer is the quickstart's slipped one; the wrong ones are exactly the quickstart's
    slipped demonstrations that have a middle step; the others are the right worked solutions."""
    import random

    from tether.studies.prm import step_error_demonstrations

    problems, _ = A.make_splits(3000, 50, 2, 0)
    rows = step_error_demonstrations(problems, 0.75, 0)
    draws = random.Random("0/slip")  # the quickstart's slip draws
    wrong = 0
    for p, row in zip(problems, rows):
        assert row["prompt"] == p.prompt
        checks = A.check_steps(row["completion"], p)
        quickstart = A.sft_example(p, slip=draws.random() < 0.75)["completion"]
        slipped = A.extract_answer(quickstart) != p.answer
        if checks[-1].correct:
            assert row == A.sft_example(p)
            assert not slipped or p.solution.count("=") < 3  # only a chain without a middle step is spared
            continue
        wrong += 1
        assert slipped
        first = A.first_error([c.correct for c in checks])
        assert 0 < first < len(checks) - 1
        assert [i for i, c in enumerate(checks) if not c.valid] == [first]
        assert A.extract_answer(row["completion"]) == checks[-1].value == A.slipped_answer(p)
    assert 0.25 < wrong / len(problems) < 0.40  # 3/4 of the ~45 % with a carry or borrow


def test_error_positions_and_across_seeds_by_hand():
    from tether.studies.prm import across_seeds, error_positions

    p = A.Problem(47, "+", 8)
    solutions = [" 47 + 8 = 40 + 7 + 8 = 40 + 15 = 55\n#### 55",   # right
                 " 47 + 8 = 40 + 7 + 8 = 40 + 15 = 55\n#### 45",   # slipped answer line: last step
                 " 47 + 8 = 40 + 7 + 8 = 40 + 5 = 45\n#### 45",    # dropped carry: middle step
                 " 47 + 9 = 40 + 7 + 9 = 40 + 16 = 56\n#### 56",   # miscopied question: step 0
                 " 47 + 8 = 40 + 7 + 8 = 40 + 15 = 54\n#### 54"]   # last link wrong: last step
    e = error_positions([A.check_steps(s, p) for s in solutions])
    assert e == {"solutions": 5, "wrong": 4, "question": 1, "middle": 1, "last": 2, "before_last": 0.5}
    mean, sd = across_seeds([{"a": 1.0, "b": [1.0, 2.0], "c": {"d": 0.5}},
                             {"a": 3.0, "b": [3.0, 2.0], "c": {"d": 0.5}}])
    assert mean == {"a": 2.0, "b": [2.0, 2.0], "c": {"d": 0.5}}
    assert sd["a"] == pytest.approx(2 ** 0.5) and sd["b"] == [pytest.approx(2 ** 0.5), 0.0] and sd["c"] == {"d": 0.0}


@pytest.mark.slow
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
