"""Reward protocol, composition and the built-in verifiers (the code reward: test_rewards_sandbox)."""

import asyncio
import json
import math
import pathlib
import sys
import types

import pytest

from tether.errors import UserError
from tether.rewards import RewardError, RewardSet, compute_rewards, load_reward
from tether.rewards.verifiers import extract_math_answer, make_format, make_length_penalty

EXCERPT = pathlib.Path(__file__).parent / "fixtures" / "data" / "gsm8k_excerpt.jsonl"


def score(name, completions, **columns):
    return load_reward(name)(prompts=[""] * len(completions), completions=completions,
                             completion_ids=None, **columns)


# --- math ----------------------------------------------------------------------------------

def test_math_scores_every_gsm8k_reference_in_the_excerpt():
    rows = [json.loads(line) for line in EXCERPT.read_text().splitlines() if line.strip()]
    assert rows
    refs = [r["answer"] for r in rows]
    assert score("math", refs, answer=refs) == [1.0] * len(rows)
    # The reference is also the answer column for a *different* completion form.
    finals = [r.split("####")[-1].strip() for r in refs]
    assert score("math", [f"The answer is ${f}." for f in finals], answer=refs) == [1.0] * len(rows)
    # And a wrong answer is not accepted (the check is not vacuous).
    wrong = [f"#### {extract_math_answer(r) + 1}" for r in refs]
    assert score("math", wrong, answer=refs) == [0.0] * len(rows)


@pytest.mark.parametrize("completion, answer", [
    ("so she makes #### 18", "18"),
    ("#### 1,200", "1200"),
    ("####  -3", "-3"),
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("It is 3/4 of the cake", "0.75"),
    ("She pays $1,234.50 in total.", "1234.5"),
    ("42.0", "42"),
    ("The answer is 42.", "42"),
    ("The answer is 42 apples", "42"),
    ("so x = 5 - 3 = 2 dollars", "2"),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "Natalia ... \n#### 72"),
    ("The answer is 25%.", "25"),
    ("The answer is \u22127", "-7"),
])
def test_math_accepts(completion, answer):
    assert score("math", [completion], answer=[answer]) == [1.0]


@pytest.mark.parametrize("completion, answer", [
    ("#### 17", "18"), ("no number here", "3"), ("\\boxed{41}", "42"), ("3-4", "-4"),
    ("#### 5\nThe answer is 6", "6"),  # the marked answer wins over a later number
])
def test_math_rejects(completion, answer):
    assert score("math", [completion], answer=[answer]) == [0.0]


def test_math_none_answer_is_not_applicable():
    assert score("math", ["#### 1", "#### 2"], answer=[None, "2"]) == [None, 1.0]


def test_math_conversational_completion():
    assert score("math", [[{"role": "assistant", "content": "#### 9"}]], answer=["9"]) == [1.0]


# --- format / length / arithmetic ----------------------------------------------------------

def test_format_default_and_custom_pattern():
    good = "<think>add</think>\n<answer>5</answer>"
    assert score("format", [good, "5", "<answer>5</answer>"]) == [1.0, 0.0, 0.0]
    fmt = load_reward("format", pattern=r".*#### \d+")
    assert fmt([""], ["x\n#### 5"], None) == [1.0]
    assert make_format(r"\d+")([""], ["12 a"], None) == [0.0]


def test_length_penalty_is_soft():
    lp = make_length_penalty(max_length=10, cache=4)
    ids = [[0] * n for n in (3, 6, 8, 10, 15)]
    assert lp(None, [""] * 5, ids) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError):
        make_length_penalty(max_length=4, cache=8)


def test_arithmetic_reward_uses_the_task_checker():
    assert score("arithmetic", ["47 + 8 = 55\n#### 55", "55", "#### 54"],
                 answer=["55", "55", "55"]) == [1.0, 0.0, 0.0]


# --- loading -------------------------------------------------------------------------------

def test_load_module_function_and_errors(monkeypatch):
    mod = types.ModuleType("my_rewards_mod")
    mod.const = lambda prompts, completions, completion_ids, **kw: [0.5] * len(completions)
    mod.not_callable = 3
    monkeypatch.setitem(sys.modules, "my_rewards_mod", mod)
    fn = load_reward("my_rewards_mod:const")
    assert fn([""], ["a"], None) == [0.5]
    for spec, words in [("no_such_module_xyz:f", "cannot import"),
                        ("my_rewards_mod:missing", "no attribute"),
                        ("my_rewards_mod:not_callable", "not callable"),
                        ("nonsense", "neither a built-in")]:
        with pytest.raises(UserError, match=words) as e:
            load_reward(spec)
        assert "\n" not in str(e.value)


# --- composition ---------------------------------------------------------------------------

def test_custom_reward_receives_extra_columns():
    seen = {}

    def uses_columns(prompts, completions, completion_ids, difficulty, source, **kw):
        seen.update(difficulty=difficulty, source=source, ids=completion_ids)
        return [float(d) for d in difficulty]

    total, per = compute_rewards([uses_columns], None, ["p1", "p2"], ["c1", "c2"], [[1], [2, 3]],
                                 {"difficulty": [1, 2], "source": ["a", "b"]})
    assert seen == {"difficulty": [1, 2], "source": ["a", "b"], "ids": [[1], [2, 3]]}
    assert total == [1.0, 2.0] and per == {"uses_columns": [1.0, 2.0]}


def test_weights_combine_and_none_is_skipped():
    def a(prompts, completions, completion_ids, **kw):
        return [1.0, None, None]

    def b(prompts, completions, completion_ids, **kw):
        return [2.0, 3.0, None]

    batch = RewardSet([a, b], [0.5, 2.0]).score(["p"] * 3, ["c"] * 3)
    assert batch.total == [0.5 + 4.0, 6.0, 0.0]
    assert batch.n_all_none == 1
    m = batch.metrics()
    assert m["rewards/a/mean"] == 1.0 and m["rewards/b/mean"] == 2.5  # None not in the mean
    assert m["rewards/all_none_count"] == 1.0


def test_raising_reward_names_the_function():
    def picky(prompts, completions, completion_ids, **kw):
        raise ValueError("bad row\nsecond line")

    with pytest.raises(RewardError) as e:
        compute_rewards([load_reward("format"), picky], None, ["p"], ["c"], None, {})
    assert str(e.value) == "reward function 'picky' failed: ValueError: bad row"


def test_wrong_length_and_bad_values_name_the_function():
    def short(prompts, completions, completion_ids, **kw):
        return [1.0]

    def nan(prompts, completions, completion_ids, **kw):
        return [math.nan, 1.0]

    with pytest.raises(RewardError, match="'short' returned 1 values for 2"):
        compute_rewards([short], None, ["p"] * 2, ["c"] * 2, None, {})
    with pytest.raises(RewardError, match="'nan' returned NaN"):
        compute_rewards([nan], None, ["p"] * 2, ["c"] * 2, None, {})
    with pytest.raises(UserError, match="2 reward weights"):
        RewardSet([short], [1.0, 2.0])


def test_async_rewards_run_concurrently_and_errors_name_them():
    order = []

    async def slow(prompts, completions, completion_ids, **kw):
        order.append("slow start")
        await asyncio.sleep(0.05)
        order.append("slow end")
        return [1.0] * len(completions)

    async def fast(prompts, completions, completion_ids, **kw):
        order.append("fast")
        return [2.0] * len(completions)

    total, per = compute_rewards([slow, fast], [1.0, 1.0], ["p"], ["c"], None, {})
    assert total == [3.0] and order == ["slow start", "fast", "slow end"]

    async def broken(prompts, completions, completion_ids, **kw):
        raise RuntimeError("judge down")

    with pytest.raises(RewardError, match="'broken' failed: RuntimeError: judge down"):
        compute_rewards([broken], None, ["p"], ["c"], None, {})

    async def inside_a_loop():  # e.g. a notebook: asyncio.run would refuse; we must not
        return compute_rewards([fast], None, ["p"], ["c"], None, {})[0]
    assert asyncio.run(inside_a_loop()) == [2.0]


@pytest.mark.parametrize("split", ["train", "test"])
def test_math_scores_every_gsm8k_reference_when_the_data_is_at_hand(split):
    path = pathlib.Path("/work/shared/data/gsm8k") / f"{split}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    refs = [json.loads(line)["answer"] for line in path.read_text().splitlines() if line.strip()]
    assert score("math", refs, answer=refs) == [1.0] * len(refs)
