"""The ecosystem's tasks as tether data and rewards (docs/environments.md, "The ecosystem's
environments"): reasoning-gym's procedural datasets load as `data=reasoning_gym:<task>?size=N&seed=S`,
deterministic in the seed, and the built-in reward `reasoning_gym` grades with each dataset's own
`score_answer` -- 1.0 for the entry's answer, less for a wrong one -- through a GRPO run."""

from __future__ import annotations

import builtins
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extras import needs
from tether.config import load_config
from tether.data import DataError, load_data, load_rows
from tether.data.reasoning_gym import decode_entry, encode_entry, parse_source
from tether.rewards import load_reward

TASKS = ["basic_arithmetic", "chain_sum", "leg_counting"]


def _score(rows, texts):
    """The built-in reward over `rows` with one completion text per row, as GRPO calls it."""
    fn = load_reward("reasoning_gym")
    prompts = [r["prompt"] for r in rows]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    return fn(prompts=prompts, completions=completions, completion_ids=None, **columns)


# -------------------------------------------------------------------- without the package

def test_the_source_parses_into_task_config_and_system_prompt():
    assert parse_source("reasoning_gym:chain_sum?size=32&seed=0") == \
        ("chain_sum", {"size": 32, "seed": 0}, "default")
    task, config, system = parse_source("reasoning_gym:chain_sum?max_terms=3&allow_negation=true&system=none")
    assert (task, system) == ("chain_sum", "none")
    assert config == {"max_terms": 3, "allow_negation": True, "size": 500, "seed": 0}
    for bad, words in [("reasoning_gym:?size=3", "no task"),
                       ("reasoning_gym:chain_sum?size=0", "size=0"),
                       ("reasoning_gym:chain_sum?seed=x", "seed='x'"),
                       ("reasoning_gym:chain_sum?system=loud", "system='loud'"),
                       ("reasoning_gym:chain_sum?seed=1&seed=2", "given twice")]:
        with pytest.raises(DataError, match=words) as e:
            parse_source(bad)
        assert "\n" not in str(e.value)


def test_without_the_extra_the_error_is_one_line_naming_it(monkeypatch):
    real = builtins.__import__

    def no_reasoning_gym(name, *args, **kwargs):
        if name == "reasoning_gym" or name.startswith("reasoning_gym."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_reasoning_gym)
    with pytest.raises(DataError) as e:
        load_rows("reasoning_gym:chain_sum?size=4")
    assert str(e.value) == "reasoning_gym:chain_sum?size=4 needs reasoning-gym: pip install 'tether[reasoning-gym]'"


nested = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (st.lists(inner, max_size=3) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=3)
                   | st.dictionaries(st.sampled_from(["__tuple__", "__set__", "__dict__"]), inner, max_size=2)
                   | st.frozensets(st.integers(), max_size=3).map(set)),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(nested)
def test_an_entry_survives_its_json_form_exactly(value):
    # tuples stay tuples and int keys stay ints: arc_agi's and rearc's scorers read them
    back = decode_entry(json.loads(json.dumps(encode_entry(value))))
    assert back == value and _types(back) == _types(value)


def _types(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_types(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(type(k).__name__, _types(v)) for k, v in value.items()])
    return type(value).__name__


def test_a_row_without_the_column_is_not_scored_and_no_column_is_an_error():
    fn = load_reward("reasoning_gym")
    assert fn(prompts=["a"], completions=["<answer>1</answer>"], completion_ids=None,
              reasoning_gym=[None]) == [None]
    with pytest.raises(KeyError, match="needs a 'reasoning_gym' column"):
        fn(prompts=["a"], completions=["x"], completion_ids=None, answer=["1"])


# -------------------------------------------------------------------- with reasoning-gym

@needs("reasoning_gym")
def test_rows_are_deterministic_in_the_seed():
    a = load_rows("reasoning_gym:chain_sum?size=16&seed=0").to_list()
    b = load_rows("reasoning_gym:chain_sum?size=16&seed=0").to_list()
    c = load_rows("reasoning_gym:chain_sum?size=16&seed=1").to_list()
    assert a == b and len(a) == 16
    assert [r["answer"] for r in a] != [r["answer"] for r in c]
    row = a[0]
    assert sorted(row) == ["answer", "prompt", "reasoning_gym"]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "<answer>" in row["prompt"][0]["content"]
    spec = json.loads(row["reasoning_gym"])
    assert (spec["task"], spec["config"], spec["index"]) == ("chain_sum", {"size": 16, "seed": 0}, 0)
    assert decode_entry(spec["entry"])["question"] == row["prompt"][1]["content"]
    # the rows are prompt-only data, and a split slice applies as to any source
    assert load_data("reasoning_gym:chain_sum?size=16&seed=0", expect="prompt-only").format == "prompt-only"
    assert load_rows("reasoning_gym:chain_sum?size=16&seed=0", "train[:4]").to_list() == a[:4]
    bare = load_rows("reasoning_gym:chain_sum?size=2&system=none").to_list()[0]["prompt"]
    assert [m["role"] for m in bare] == ["user"]


@needs("reasoning_gym")
@pytest.mark.parametrize("task", TASKS)
def test_the_reward_is_one_for_the_entrys_answer_and_less_for_a_wrong_one(task):
    rows = load_rows(f"reasoning_gym:{task}?size=8&seed=3").to_list()
    right = _score(rows, [f"Let me think.\n<answer>{r['answer']}</answer>" for r in rows])
    assert right == [1.0] * 8
    wrong = _score(rows, [f"<answer>{int(r['answer']) + 1}</answer>" for r in rows])
    assert all(0.0 <= w < 1.0 for w in wrong), wrong
    # the last answer block counts; none at all scores 0
    assert _score(rows[:2], [f"<answer>0</answer> no: <answer>{r['answer']}</answer>" for r in rows[:2]]) == [1.0, 1.0]
    assert _score(rows[:2], [r["answer"] for r in rows[:2]]) == [0.0, 0.0]
    assert load_reward("reasoning_gym", tag=None)(
        prompts=[rows[0]["prompt"]], completions=[f" {rows[0]['answer']}\n"], completion_ids=None,
        reasoning_gym=[rows[0]["reasoning_gym"]]) == [1.0]


@needs("reasoning_gym")
def test_a_scorer_that_raises_on_a_malformed_answer_scores_it_zero():
    rows = load_rows("reasoning_gym:prime_factorization?size=2&seed=0").to_list()
    assert _score(rows, ["<answer>not a product</answer>"] * 2) == [0.0, 0.0]
    assert _score(rows, [f"<answer>{r['answer']}</answer>" for r in rows]) == [1.0, 1.0]


@needs("reasoning_gym")
def test_bad_tasks_and_options_are_one_line_data_errors():
    for source, words in [("reasoning_gym:chain_summ?size=2", "unknown task 'chain_summ'; did you mean chain_sum"),
                          ("reasoning_gym:chain_sum?size=2&max_term=3", "TypeError"),
                          ("reasoning_gym:chain_sum?size=2&min_terms=5&max_terms=2", "AssertionError")]:
        with pytest.raises(DataError, match=words) as e:
            load_rows(source)
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="only one split"):
        load_rows("reasoning_gym:chain_sum?size=2", "test")


@needs("reasoning_gym")
def test_grpo_trains_on_a_reasoning_gym_task_from_the_command_line_form(tmp_path):
    """`tether grpo data=reasoning_gym:chain_sum?size=32&seed=0 reward_funcs=reasoning_gym`: the
    data loads, the reward runs on every completion, two steps finish, and held-out rows of
    another seed are scored at the eval point (a random model scores ~0: only the plumbing is
    under test)."""
    import torch

    from tether.models import make_tiny_model
    from tether.trainers.grpo import GRPOConfig, train_grpo

    make_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    cfg = load_config(GRPOConfig, None, [
        f"model={tmp_path / 'model'}", "data=reasoning_gym:chain_sum?size=32&seed=0",
        "reward_funcs=reasoning_gym", f"runs_dir={tmp_path / 'runs'}", "name=rg", "batch_size=2",
        "num_generations=4", "max_new_tokens=8", "max_steps=2", "device=cpu", "progress=false",
        "eval_data=reasoning_gym:chain_sum?size=4&seed=1", "eval_every=2"])
    assert cfg.data.path == "reasoning_gym:chain_sum?size=32&seed=0"
    assert cfg.reward.reward_funcs == ["reasoning_gym"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = train_grpo(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "runs" / "rg" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "rewards/reasoning_gym/mean" in r]
    assert len(scored) == 2 and all(0.0 <= r["rewards/reasoning_gym/mean"] <= 1.0 for r in scored)
    # held-out prompts from another seed, scored by the same reward at the eval point
    held = [r for r in rows if any(k.startswith("eval/") and "reasoning_gym" in k for k in r)]
    assert held, sorted({k for r in rows for k in r if k.startswith("eval/")})

