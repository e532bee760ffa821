"""The arithmetic task: exact answers, disjoint splits, a verifier that cannot be gamed."""

import random

import pytest

from tether.tasks import arithmetic as A


def test_running_example_and_worked_solutions_end_in_the_answer():
    p = A.Problem(23, "×", 17)
    assert p.answer == 391 and p.question == "What is 23 × 17?"
    assert p.solution == "23 × 17 = 23 × 10 + 23 × 7 = 230 + 161 = 391"
    assert A.worked_solution(47, "+", 38) == "47 + 38 = 40 + 30 + 7 + 8 = 70 + 15 = 85"
    assert A.worked_solution(47, "-", 38) == "47 - 38 = 47 - 30 - 8 = 17 - 8 = 9"
    rng = random.Random(0)
    for level in A.LEVELS:
        for _ in range(300):
            p = rng.choice([A.sample_problem(rng, level)])
            # every intermediate step is a true equation: evaluate each '='-separated side
            sides = [s.replace("×", "*") for s in p.solution.split(" = ")]
            assert all(eval(s) == p.answer for s in sides), p.solution  # noqa: S307 (our own text)
            ex = A.sft_example(p)
            assert A.check_answer(ex["completion"], p.answer) == 1.0
            assert A.rl_example(p)["answer"] == str(p.answer)


def test_the_annotator_slip_forgets_exactly_the_ones_carry_or_borrow():
    assert A.slipped_answer(A.Problem(47, "+", 8)) == 45      # 55 with the carry forgotten
    assert A.slipped_answer(A.Problem(97, "+", 5)) == 92      # 102: the carry into the hundreds
    assert A.slipped_answer(A.Problem(75, "-", 7)) == 78      # 68 with the borrow forgotten
    assert A.slipped_answer(A.Problem(47, "-", 38)) == 19     # 9: ones 7 < 8 borrow
    assert A.slipped_answer(A.Problem(42, "+", 5)) is None    # no carry: nothing to forget
    assert A.slipped_answer(A.Problem(48, "-", 5)) is None
    assert A.slipped_answer(A.Problem(23, "×", 7)) is None
    p = A.Problem(58, "+", 6)
    slipped = A.sft_example(p, slip=True)["completion"]
    assert slipped == " 58 + 6 = 50 + 8 + 6 = 50 + 14 = 64\n#### 54"  # the worked solution stays right
    assert A.check_answer(slipped, p.answer) == 0.0
    assert A.sft_example(A.Problem(42, "+", 5), slip=True) == A.sft_example(A.Problem(42, "+", 5))


def test_diagnose_names_each_kind_of_miss():
    p = A.Problem(58, "+", 6)
    assert A.diagnose(" 58 + 6 = 50 + 8 + 6 = 50 + 14 = 64\n#### 64", p) == "correct"
    assert A.diagnose(" 58 + 6 = 50 + 8 + 6 = 50 + 14 = 64\n#### 54", p) == "slipped"
    assert A.diagnose(" 58 + 6 = 50 + 8 + 6 = 50 + 14 = 64\n#### 46", p) == "miscopied"
    assert A.diagnose(" 58 + 6 = 50 + 8 + 6 = 50 + 13 = 63\n#### 63", p) == "wrong solution"
    assert A.diagnose(" 58 + 6 = 50 + 8 + 6 = 50 + 14 = 64. The answer is 64.", p) == "no answer line"


def test_splits_are_disjoint_and_seeded():
    train, test = A.make_splits(3000, 200, level=2, seed=1)
    assert not set(train) & set(test) and len(set(test)) == 200
    assert A.make_splits(3000, 200, level=2, seed=1) == (train, test)
    assert A.make_splits(3000, 200, level=2, seed=2)[1] != test
    with pytest.raises(ValueError, match="distinct problems"):
        A.make_splits(10, 100, level=1)


@pytest.mark.parametrize("text, answer, score", [
    (" 40 + 45 = 85\n#### 85", 85, 1.0),
    ("#### 1,234", 1234, 1.0),
    ("####85", 85, 1.0),
    (" 40 + 45 = 85\n#### 86", 85, 0.0),
    ("85", 85, 0.0),                      # no committed final answer: no credit
    ("#### 8 or 85 or 850", 85, 0.0),     # only the first number after #### counts
    ("#### -9", -9, 1.0),
    ("", 3, 0.0),
])
def test_checker(text, answer, score):
    assert A.check_answer(text, answer) == score
