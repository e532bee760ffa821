"""Environments: the protocol in both shapes behind one Episode, tool schemas, tool-call parsing per
family, error observations (never exceptions), reset failures, and loading by spec.

Rendering as token ids is tests/test_envs_render.py; the built-in environments'
game logic is tests/test_envs_builtins.py."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tether.envs import (Episode, EnvError, EnvResetError, ToolCall, Turn, builtin_envs, detect_tool_format,
                         env_rows, find_tools, get_tool_format, load_env)
from tether.envs.formats import parse_gemma, parse_hermes, parse_plain
from tether.errors import UserError


class Counter:
    """A class-based environment as TRL's environment_factory takes it."""

    def __init__(self):
        self.value = 0
        self.target = None

    def reset(self, target: int, **row) -> str:
        self.value, self.target = 0, int(target)
        return f"Reach {target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.value += by
        return self.value

    def scale(self, factor: float, labels: list[str] | None = None) -> float:
        """Multiply the counter.

        Args:
            factor: The factor.
            labels: Optional labels.
        """
        self.value *= factor
        return self.value

    def boom(self) -> str:
        """Always fails."""
        raise RuntimeError("kaput\nsecond line")

    def slow(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"

    def reward(self, completion: str) -> float:
        return float(self.value == self.target) + (0.5 if "done" in completion else 0.0)

    def _helper(self):  # private: not a tool
        return 1

    @classmethod
    def rows(cls, size, seed=0):
        return [{"prompt": "unused", "target": seed + i} for i in range(size)]


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def started(env=None, **kw):
    ep = Episode(env or Counter(), tool_format="hermes", **kw)
    ep.start({"prompt": "p", "target": 7})
    return ep


# --- schemas --------------------------------------------------------------------------------------

def test_tool_schemas_come_from_hints_and_docstrings():
    tools = {t.name: t.schema for t in find_tools(Counter())}
    assert list(tools) == ["increment", "scale", "boom", "slow"]  # definition order; no reset/reward/rows/_helper
    inc = tools["increment"]
    assert inc == {"type": "function", "function": {
        "name": "increment", "description": "Add to the counter.",
        "parameters": {"type": "object", "properties": {"by": {"type": "integer", "description": "How much to add."}},
                       "required": ["by"]},
        "return": {"type": "integer"}}}
    scale = tools["scale"]["function"]["parameters"]
    assert scale["required"] == ["factor"]
    assert scale["properties"]["labels"] == {"type": "array", "items": {"type": "string"}, "nullable": True,
                                             "description": "Optional labels."}
    assert tools["boom"]["function"]["parameters"]["properties"] == {}


def test_public_method_without_docstring_is_an_error_that_names_it():
    class Bad:
        def reset(self, **row):
            return "x"

        def helper(self, a: int) -> int:
            return a

    with pytest.raises(UserError, match=r"public method 'helper'.*name it _helper"):
        Episode(Bad())


# --- the class-based shape ------------------------------------------------------------------------

def test_class_based_episode_runs_tools_and_ends_without_a_call():
    ep = Episode(Counter(), tool_format="hermes")
    assert [t["function"]["name"] for t in ep.tools] == ["increment", "scale", "boom", "slow"]
    assert ep.start({"prompt": "ignored", "target": 5}) == [{"role": "user", "content": "Reach 5."}]
    turn = ep.respond("Let me count.\n" + call("increment", by=2) + "\n" + call("increment", by=3))
    assert turn == Turn([{"role": "tool", "name": "increment", "content": "2"},
                         {"role": "tool", "name": "increment", "content": "5"}], None, False, 2, 0)
    turn = ep.respond("I am done.")
    assert turn.done and turn.messages == [] and turn.tool_calls == 0
    assert ep.final_reward() == 1.5  # value == target, and "done" in the last message
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    with pytest.raises(RuntimeError, match="over"):
        ep.respond("more")


def test_reset_returning_none_uses_the_rows_prompt_and_messages_pass_through():
    class NoPrompt(Counter):
        def reset(self, **row):
            self.target = row["target"]

    ep = Episode(NoPrompt(), tool_format="hermes")
    assert ep.start({"prompt": "From the row.", "target": 1}) == [{"role": "user", "content": "From the row."}]
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert ep.start({"prompt": conv, "target": 1}) == conv


def test_reset_raising_or_giving_nothing_is_env_reset_error():
    class Raises(Counter):
        def reset(self, **row):
            raise KeyError("answer")

    with pytest.raises(EnvResetError, match=r"Raises: reset .*'p'.* raised KeyError: 'answer'"):
        Episode(Raises(), tool_format="hermes").start({"prompt": "p"})
    with pytest.raises(EnvResetError, match="missing 1 required positional argument: 'target'"):
        Episode(Counter(), tool_format="hermes").start({"prompt": "p"})  # the row lacks `target`

    class Nothing(Counter):
        def reset(self, **row):
            return None

    with pytest.raises(EnvResetError, match="no 'prompt'"):
        Episode(Nothing(), tool_format="hermes").start({"target": 1})

    class Step:
        def reset(self, row):
            raise ValueError("bad row")

        def step(self, text):
            return "", 0.0, True

    with pytest.raises(EnvResetError, match="bad row"):
        Episode(Step()).start({"prompt": "p"})


# --- error observations: counted, never raised -------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (call("nope", x=1), "error: unknown tool 'nope'; tools: increment, scale, boom, slow"),
    ("<tool_call>{\"name\": \"increment\", \"arguments\": {\"by\": 1}</tool_call>",
     "error: malformed tool call: invalid JSON"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", "error: malformed tool call: expected an object with a \"name\""),
    (call("increment"), "error: tool 'increment' is missing argument 'by' (arguments: by: integer)"),
    (call("increment", by=1, extra=2), "error: tool 'increment' has no argument 'extra' (arguments: by: integer)"),
    (call("increment", by="1"), "error: tool 'increment' argument 'by' must be integer, got str \"1\""),
    (call("increment", by=1.5), "error: tool 'increment' argument 'by' must be integer, got float 1.5"),
    (call("increment", by=True), "error: tool 'increment' argument 'by' must be integer, got bool true"),
    (call("scale", factor=2, labels=["a", 3]), "error: tool 'scale' argument 'labels' item 1 must be string"),
    (call("boom"), "error: tool 'boom' raised RuntimeError: kaput"),
])
def test_each_bad_call_is_an_error_observation(text, expected):
    ep = started()
    turn = ep.respond(text)
    assert (turn.tool_calls, turn.tool_errors, turn.done) == (1, 1, False)
    (msg,) = turn.messages
    assert msg["role"] == "tool" and msg["content"].startswith(expected), msg["content"]
    assert "\n" not in msg["content"]  # one line, the first of the exception's message
    assert ep.env.value == 0  # nothing ran


def test_a_tool_past_its_deadline_is_an_error_and_the_episode_goes_on():
    ep = started(tool_timeout_s=0.2)
    t0 = time.monotonic()
    turn = ep.respond(call("slow", seconds=3) + call("increment", by=4))
    assert time.monotonic() - t0 < 2.0
    assert [m["content"] for m in turn.messages] == ["error: tool 'slow' timed out after 0.2 s", "4"]
    assert (turn.tool_calls, turn.tool_errors) == (2, 1)


def test_nullable_and_good_calls_mixed_with_bad_ones():
    ep = started()
    turn = ep.respond(call("increment", by=3) + call("scale", factor=2, labels=None) + call("nope"))
    assert [m["content"] for m in turn.messages][:2] == ["3", "6"]
    assert (turn.tool_calls, turn.tool_errors) == (3, 1)


def test_too_many_calls_in_one_message_are_refused_past_the_cap():
    ep = started(max_tool_calls=2)
    turn = ep.respond("".join(call("increment", by=1) for _ in range(4)))
    refused = "error: too many tool calls in one message (at most 2)"
    assert [m["content"] for m in turn.messages] == ["1", "2", refused, refused]
    assert (turn.tool_calls, turn.tool_errors, ep.env.value) == (4, 2, 2)


def test_done_attribute_ends_the_episode_after_the_calls():
    class Once(Counter):
        done = False

        def increment(self, by: int) -> int:
            """Add.

            Args:
                by: Amount.
            """
            self.value += by
            self.done = True
            return self.value

    ep = Episode(Once(), tool_format="hermes")
    ep.start({"prompt": "p", "target": 1})
    turn = ep.respond(call("increment", by=1))
    assert turn.done and turn.messages == [{"role": "tool", "name": "increment", "content": "1"}]
    assert ep.final_reward() == 1.0


def test_reward_attribute_absent_or_broken():
    class NoReward(Counter):
        reward = None

    ep = Episode(NoReward(), tool_format="hermes")
    ep.start({"prompt": "p", "target": 1})
    ep.respond("no call")
    assert ep.final_reward() is None

    class NaN(Counter):
        def reward(self):
            return float("nan")

    ep = Episode(NaN(), tool_format="hermes")
    ep.start({"prompt": "p", "target": 1})
    ep.respond("x")
    with pytest.raises(EnvError, match="not a finite number"):
        ep.final_reward()


# --- the step-based shape -----------------------------------------------------------------------------

class Echo:
    """A step-based environment (SkyRL / OpenEnv shape): three turns, reward 1 per 'yes'."""

    def reset(self, row):
        self.n = 0
        return [{"role": "system", "content": "Say yes."}, {"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text):
        self.n += 1
        reward = 1.0 if "yes" in assistant_text else 0.0
        return f"turn {self.n}", reward, self.n == 3


def test_step_based_episode():
    ep = Episode(Echo())
    assert ep.tools == [] and ep.step_based
    assert ep.start({"prompt": "go"})[1] == {"role": "user", "content": "go"}
    t1 = ep.respond("yes")
    assert t1 == Turn([{"role": "user", "content": "turn 1"}], 1.0, False, 0, 0)
    assert ep.respond("no").reward == 0.0
    t3 = ep.respond("<tool_call>{}</tool_call> yes")  # a step env reads the text itself: no tool parsing
    assert t3.done and t3.tool_calls == 0
    assert ep.final_reward() == 2.0


def test_step_based_output_forms_and_a_raising_step():
    class Dict(Echo):
        def step(self, text):
            return {"observations": [{"role": "user", "content": "ok"}], "reward": None, "done": False}

    ep = Episode(Dict())
    ep.start({"prompt": "p"})
    assert ep.respond("a") == Turn([{"role": "user", "content": "ok"}], None, False)
    assert ep.final_reward() is None

    class Raises(Echo):
        def step(self, text):
            raise IndexError("oops")

    ep = Episode(Raises())
    ep.start({"prompt": "p"})
    with pytest.raises(EnvError, match="Raises: step raised IndexError: oops"):
        ep.respond("a")


# --- parsers per family ---------------------------------------------------------------------------------

def test_hermes_parser_blocks_lists_and_malformed():
    text = ('Thinking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>[{"name": "mul", "arguments": {"a": 3}}, '
            '{"name": "neg", "arguments": "{\\"x\\": 1}"}]</tool_call>\n'
            '<tool_call>{"name": "sub", "arguments": {"a": 1,}}</tool_call>\n'
            '<tool_call>{"name": "open", "arguments": {}}')
    calls = parse_hermes(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("add", {"a": 1, "b": 2}, True), ("mul", {"a": 3}, True), ("neg", {"x": 1}, True),
        (None, {}, False), ("open", {}, True)]  # the last block, left open at the end, is read
    assert calls[3].error.startswith("malformed tool call: invalid JSON")
    assert parse_hermes("no calls here") == [] and parse_hermes("<tool_call>[]</tool_call>") == []
    (bad,) = parse_hermes('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    assert bad.error == "malformed tool call: arguments of 'f' must be a JSON object, got list"


def test_gemma_parser_tool_code_fences():
    text = ("I'll compute.\n```tool_code\nadd(a=1, b=2)\nprint(mul(3, b=4.5))\n```\n"
            "```tool_code\nflag(on=true, items=['x', None])\n```")
    calls = parse_gemma(text)
    assert [(c.name, c.positional, c.arguments, c.error) for c in calls] == [
        ("add", [], {"a": 1, "b": 2}, None), ("mul", [3], {"b": 4.5}, None),
        ("flag", [], {"on": True, "items": ["x", None]}, None)]
    (bad,) = parse_gemma("```tool_code\nadd(a=1,\n```")
    assert bad.name is None and bad.error.startswith("malformed tool call: invalid Python call syntax")
    (bad,) = parse_gemma("```tool_code\nadd(a=os.system('x'))\n```")
    assert bad.name == "add" and "must be literal values" in bad.error
    (bad,) = parse_gemma("```tool_code\nx = 1\n```")
    assert bad.error == "malformed tool call: expected a call name(argument=value, ...)"
    assert parse_gemma("```python\nadd(a=1)\n```") == []  # only tool_code fences are calls


def test_plain_parser_call_lines():
    calls = parse_plain("First:\nCALL add(a=1, b=2)\n  CALL increment(4)\nnot CALL this(x=1)\nCALL broken(")
    assert [(c.name, c.positional, c.arguments) for c in calls[:2]] == [("add", [], {"a": 1, "b": 2}),
                                                                       ("increment", [4], {})]
    assert len(calls) == 3 and calls[2].error.startswith("malformed tool call")



@pytest.mark.parametrize("name", ["hermes", "gemma", "plain"])
def test_a_call_written_by_a_format_parses_back_to_itself(name):
    fmt = get_tool_format(name)
    args = {"a": 12, "b": -3.5, "s": "it's", "flags": [True, None]}
    text = fmt.call_text("add", args)
    assert {"hermes": "<tool_call>", "gemma": "```tool_code", "plain": "CALL add("}[name] in text
    (call,) = fmt.parse(f"Let me compute.\n{text}")
    assert (call.name, call.arguments, call.positional, call.error) == ("add", args, [], None)

def test_positional_arguments_bind_in_schema_order_and_gemma_observation_is_one_user_message():
    ep = Episode(Counter(), tool_format="gemma")
    ep.start({"prompt": "p", "target": 1})
    turn = ep.respond("```tool_code\nincrement(2)\nscale(3, factor=2)\nincrement(1, 2)\n```")
    assert turn.messages == [{"role": "user", "content":
                              "```tool_output\n2\n```\n"
                              "```tool_output\nerror: tool 'scale' got argument 'factor' twice\n```\n"
                              "```tool_output\nerror: tool 'increment' takes 1 argument(s), 2 given "
                              "(arguments: by: integer)\n```"}]
    assert (turn.tool_calls, turn.tool_errors) == (3, 2)


def test_plain_observation_lines():
    ep = Episode(Counter(), tool_format="plain")
    ep.start({"prompt": "p", "target": 1})
    turn = ep.respond("CALL increment(by=5)\nCALL nope()")
    assert turn.messages == [{"role": "user", "content":
                              "RESULT increment: 5\n"
                              "RESULT nope: error: unknown tool 'nope'; tools: increment, scale, boom, slow"}]


class _Tok:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize("template, name", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}{% if tools %}<tool_call>{% endif %}", "hermes"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", "hermes"),
    ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}{% endfor %}", "gemma"),
    ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}", "plain"),
    (None, "plain"),
])
def test_format_detected_from_the_template(template, name):
    assert detect_tool_format(_Tok(template)) == name
    assert get_tool_format("auto", _Tok(template)).name == name


def test_explicit_format_overrides_and_unknown_is_a_user_error():
    assert get_tool_format("gemma", _Tok("<|im_start|>")).name == "gemma"
    with pytest.raises(UserError, match="tool_format 'xml'"):
        get_tool_format("xml")


# --- loading ---------------------------------------------------------------------------------------------

def test_load_env_builtins_module_and_file(tmp_path, monkeypatch):
    assert set(builtin_envs()) == {"calculator", "python", "wordle", "guess_number"}
    assert load_env("wordle") is builtin_envs()["wordle"]
    assert load_env(Counter) is Counter
    assert load_env("tests.test_envs:Counter").__name__ == "Counter"
    f = tmp_path / "my_env.py"
    f.write_text("class Game:\n    def reset(self, **row):\n        return 'hi'\n")
    monkeypatch.chdir(tmp_path)
    game = load_env("./my_env.py:Game")
    assert Episode(game()).start({}) == [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match="environment 'nope' is neither a built-in"):
        load_env("nope")
    with pytest.raises(UserError, match=r"environment './my_env.py:Nope': module .* has no attribute 'Nope'"):
        load_env("./my_env.py:Nope")
    with pytest.raises(UserError, match=r"environment './missing.py:Game': file './missing.py' does not exist"):
        load_env("./missing.py:Game")


def test_env_rows_are_deterministic_and_need_rows():
    assert env_rows(Counter, 2, seed=5) == [{"prompt": "unused", "target": 5}, {"prompt": "unused", "target": 6}]
    for name in builtin_envs():
        a, b = env_rows(name, 20, seed=3), env_rows(name, 20, seed=3)
        assert a == b and len(a) == 20 and all(isinstance(r["prompt"], str) and r["prompt"] for r in a)
        assert a != env_rows(name, 20, seed=4)
    with pytest.raises(UserError, match="has no rows"):
        env_rows(Echo, 3)


def test_tool_call_dataclass_defaults():
    c = ToolCall("f")
    assert (c.arguments, c.positional, c.error) == ({}, [], None)


def test_the_docs_example_environment_runs_as_shown(tmp_path, monkeypatch):
    doc = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    section = doc.split("## Writing an environment in 20 lines", 1)[1].split("\n## ", 1)[0]
    env_code, usage = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(env_code.splitlines()) <= 25
    (tmp_path / "vault.py").write_text(env_code)
    monkeypatch.chdir(tmp_path)
    ns = {"tokenizer": None}
    exec(compile(usage, "docs/environments.md", "exec"), ns)
    ep = ns["ep"]
    assert ns["row"] == {"prompt": "", "code": "6311"}
    assert ep.messages[2] == {"role": "tool", "name": "check", "content": "yes"}
    assert ep.done and ep.final_reward() == pytest.approx(0.98)
