"""The built-in environments' game logic against hand-computed cases, each played through an
Episode as the episode loop would (hermes tool calls), and their rows."""

from __future__ import annotations

import json
import os
import re

import pytest

from tether.envs import Episode, env_rows
from tether.envs.calculator import CalculatorEnv, expression_problem
from tether.envs.guess_number import GuessNumberEnv, guess_reward, optimal_guesses
from tether.envs.python_code import PythonEnv, collatz_steps, divisor_count, fibonacci_number, primes_below
from tether.envs.wordle import WordleEnv, feedback
from tether.envs.wordle_words import WORDS


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def episode(env, row):
    ep = Episode(env, tool_format="hermes")
    ep.start(row)
    return ep


# --- wordle ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("guess, answer, marks", [
    ("speed", "abide", "--Y-Y"),   # one E in the answer: the first E of the guess takes it
    ("babes", "abbey", "YYGG-"),   # the green B uses one B; the other B of the answer makes the first B yellow
    ("eerie", "sweet", "YY---"),   # two Es in the answer, three in the guess: the third is '-'
    ("level", "hello", "YG--Y"),   # the green E is not also counted as yellow; both Ls of the answer are used
    ("crane", "crane", "GGGGG"),
    ("fghij", "crane", "-----"),
])
def test_wordle_feedback_with_repeated_letters(guess, answer, marks):
    assert feedback(guess, answer) == marks


def test_wordle_word_list():
    assert len(WORDS) >= 500 and len(set(WORDS)) == len(WORDS)
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in WORDS)


def test_wordle_game_solved_on_the_third_guess():
    ep = episode(WordleEnv(), {"prompt": "", "answer": "abide"})
    turn = ep.respond(call("guess", word="abc"))  # not five letters: an error, no guess spent
    assert turn.tool_errors == 1 and "is not five letters" in turn.messages[0]["content"]
    turn = ep.respond(call("guess", word="speed"))
    assert turn.messages[0]["content"] == "SPEED --Y-Y (5 guesses left)" and not turn.done
    assert ep.respond(call("guess", word="Aside")).messages[0]["content"] == "ASIDE G-GGG (4 guesses left)"
    turn = ep.respond(call("guess", word="abide"))
    assert turn.done and turn.messages[0]["content"] == "ABIDE GGGGG: solved in 3 guesses."
    assert ep.final_reward() == pytest.approx(4 / 6)


def test_wordle_game_lost_after_six_guesses_and_solved_first_try():
    ep = episode(WordleEnv(), {"prompt": "", "answer": "zebra"})
    for i in range(5):
        assert not ep.respond(call("guess", word="house")).done
    turn = ep.respond(call("guess", word="hello"))
    assert turn.done and turn.messages[0]["content"].endswith("no guesses left; the word was ZEBRA.")
    assert ep.final_reward() == 0.0
    ep = episode(WordleEnv(), {"prompt": "", "answer": "zebra"})
    assert ep.respond(call("guess", word="zebra")).done and ep.final_reward() == 1.0


def test_wordle_rows_and_bad_answer():
    rows = WordleEnv.rows(50, seed=7)
    assert all(r["answer"] in WORDS for r in rows) and len({r["answer"] for r in rows}) > 30
    from tether.envs import EnvResetError
    with pytest.raises(EnvResetError, match="not a 5-letter word"):
        episode(WordleEnv(), {"answer": "toolong"})


# --- guess_number -----------------------------------------------------------------------------------

def test_guess_number_higher_lower_and_found():
    ep = Episode(GuessNumberEnv())
    msgs = ep.start({"target": 37, "n": 100})
    assert "between 1 and 100" in msgs[0]["content"] and "at most 10 guesses" in msgs[0]["content"]
    t = ep.respond("50")
    assert t.messages[0]["content"] == "Lower. 9 guesses left." and (t.reward, t.done) == (0.0, False)
    assert ep.respond("Then 25.").messages[0]["content"] == "Higher. 8 guesses left."
    assert ep.respond("no idea").messages[0]["content"] == "Reply with one integer between 1 and 100. 7 guesses left."
    assert ep.respond("101").messages[0]["content"].startswith("Reply with one integer")
    t = ep.respond("Between 25 and 50, so 37")  # the last integer is the guess
    assert t.done and t.messages[0]["content"] == "Correct! Found in 5 guesses."
    assert t.reward == 1.0 and ep.final_reward() == 1.0  # 5 <= 7 = ceil(log2(101))


def test_guess_number_reward_falls_with_extra_guesses():
    assert [optimal_guesses(n) for n in (1, 2, 3, 7, 8, 100, 1000)] == [1, 2, 2, 3, 4, 7, 10]
    assert guess_reward(7, 100, 10) == 1.0
    assert guess_reward(8, 100, 10) == 0.75
    assert guess_reward(10, 100, 10) == 0.25
    assert guess_reward(None, 100, 10) == 0.0
    ep = Episode(GuessNumberEnv())
    ep.start({"target": 1, "n": 100})
    for k in range(1, 9):
        assert ep.respond(str(k + 1)).messages[0]["content"].startswith("Lower.")
    assert ep.respond("1").reward == 0.5  # found with guess 9 of a budget of 10: 1 - (9 - 7) / (10 - 7 + 1)
    ep = Episode(GuessNumberEnv())
    ep.start({"target": 64, "n": 100, "max_guesses": 2})
    assert not ep.respond("1").done
    t = ep.respond("2")
    assert t.done and t.messages[0]["content"] == "No guesses left; the number was 64." and ep.final_reward() == 0.0


def test_guess_number_rows():
    rows = GuessNumberEnv.rows(200, seed=3, n=20)
    assert all(1 <= r["target"] <= 20 and r["n"] == 20 for r in rows)
    assert {r["target"] for r in rows} == set(range(1, 21))


# --- calculator ---------------------------------------------------------------------------------------

def test_calculator_tools_are_exact():
    env = CalculatorEnv()
    assert env.div(84, 2) == 42 and isinstance(env.div(84, 2), int)
    assert env.div(7, 2) == 3.5
    assert env.add(0.5, 0.5) == 1 and isinstance(env.add(0.5, 0.5), int)
    assert env.mul(12, -3) == -36 and env.sub(5, 8) == -3
    with pytest.raises(ZeroDivisionError):
        env.div(1, 0)


def _numbers(text):
    return [int(x) for x in re.findall(r"\d+", text)]


# Each word problem recomputed from the numbers its text states, in the order it states them.
WORD_FORMULAS = {
    "boxes of": lambda a, b, c: a * b - c,
    "classes of": lambda a, b, c: a * b // c,
    "dollars a day": lambda a, b, c, d: a + b * c - d,
    "km per hour": lambda a, b, c, d: a * b + c * d,
    "apples are shared": lambda a, b, c: a // b + c,
    "cents each": lambda a, b, c: c - a * b,
    "rows of": lambda a, b, c, d: a * b - c + d,
    "pages every day": lambda a, b, c: b - a * c,
}


def test_calculator_word_problems_answers_follow_from_their_text():
    rows = CalculatorEnv.rows(400, seed=11, word_fraction=1.0)
    seen = set()
    for r in rows:
        (key,) = [k for k in WORD_FORMULAS if k in r["prompt"]]
        seen.add(key)
        nums = _numbers(r["prompt"])
        assert int(r["answer"]) == WORD_FORMULAS[key](*nums), r
        assert int(r["answer"]) >= 0 and r["kind"] == "word"
        if key in ("classes of", "apples are shared"):  # the division in the text comes out even
            a, b = (nums[0] * nums[1], nums[2]) if key == "classes of" else (nums[0], nums[1])
            assert a % b == 0
    assert seen == set(WORD_FORMULAS)


def test_calculator_hand_computed_cases():
    assert CalculatorEnv.rows(1, seed=1)[0] == {
        "prompt": "A school has 18 classes of 26 students each. All the students are split into teams of 6. "
                  "How many teams are there?", "answer": "78", "kind": "word"}   # 18 × 26 ÷ 6 = 78
    for r in CalculatorEnv.rows(300, seed=5, word_fraction=0.0):
        m = re.fullmatch(r"What is \((\d+) ([+\-×]) (\d+)\) ([+\-×÷]) (\d+)\?", r["prompt"])
        a, op1, b, op2, c = int(m[1]), m[2], int(m[3]), m[4], int(m[5])
        v = {"+": a + b, "-": a - b, "×": a * b}[op1]
        if op2 == "÷":
            assert v % c == 0
        assert int(r["answer"]) == {"+": v + c, "-": v - c, "×": v * c, "÷": v // max(c, 1)}[op2] >= 0


def test_calculator_episode_rewards_only_the_exact_answer_line():
    row = {"prompt": "What is (12 × 30) - 18?", "answer": "342", "kind": "expression"}
    ep = episode(CalculatorEnv(), row)
    turn = ep.respond(call("mul", a=12, b=30))
    assert turn.messages[0]["content"] == "360"
    assert ep.respond(call("sub", a=360, b=18)).messages[0]["content"] == "342"
    assert ep.respond("So it is 342.\n#### 342").done
    assert ep.final_reward() == 1.0
    for last in ("It is 342.", "#### 341", "#### 3420"):
        ep = episode(CalculatorEnv(), row)
        ep.respond(last)
        assert ep.final_reward() == 0.0, last


# --- python --------------------------------------------------------------------------------------------

def test_python_reference_answers():
    assert sum(primes_below(30)) == 129 and primes_below(2) == []
    assert [fibonacci_number(k) for k in (1, 2, 10, 50)] == [1, 1, 55, 12586269025]
    assert collatz_steps(27) == 111 and collatz_steps(1) == 0
    assert divisor_count(360) == 24 and divisor_count(49) == 3


def test_python_tool_computes_in_the_sandbox_and_the_episode_scores_it():
    row = next(r for r in PythonEnv.rows(40, seed=2) if r["kind"] == "fibonacci")
    k = int(re.search(r"the (\d+)th Fibonacci", row["prompt"])[1])
    ep = episode(PythonEnv(), row)
    code = f"a, b = 0, 1\nfor _ in range({k}):\n    a, b = b, a + b\nprint(a)\n"
    turn = ep.respond(call("run_python", code=code))
    assert (turn.tool_calls, turn.tool_errors) == (1, 0)
    assert turn.messages[0]["content"].strip() == row["answer"]
    ep.respond(f"#### {row['answer']}")
    assert ep.final_reward() == 1.0


def test_python_tool_reports_failures_as_output():
    env = PythonEnv()
    env.reset(prompt="x", answer=1)
    out = env.run_python("print('partial')\n1/0")
    assert out.startswith("partial\n[program failed: exit code 1") and "ZeroDivisionError" in out
    assert env.run_python("x = 1") == "(the program printed nothing)"


def test_python_tool_blocks_hostile_snippets(tmp_path):
    marker = tmp_path / "escaped"
    env = PythonEnv()
    env.reset(prompt="x", answer=1)
    out = env.run_python(f"open({str(marker)!r}, 'w').write('out')\nprint('wrote')\n")
    assert not marker.exists() and "wrote" not in out and "[program failed" in out
    out = env.run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint('connected')\n")
    assert "connected" not in out and "[program failed" in out
    if os.geteuid() == 0:                          # as root the sandbox gets every isolation layer
        assert all(r.missing == [] for r in env.results), [r.missing for r in env.results]


def test_every_builtin_rows_work_with_its_reset():
    for name, cls in (("calculator", CalculatorEnv), ("python", PythonEnv), ("wordle", WordleEnv),
                      ("guess_number", GuessNumberEnv)):
        for row in env_rows(name, 5, seed=0):
            msgs = Episode(cls(), tool_format="hermes").start(row)
            assert msgs[-1]["role"] == "user" and msgs[-1]["content"]


def test_expression_problem_is_deterministic():
    import random
    assert expression_problem(random.Random(3)) == expression_problem(random.Random(3))
