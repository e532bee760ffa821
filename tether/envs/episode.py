"""The environment protocol, in the two shapes users know, behind one adapter: :class:`Episode`.

Class-based (TRL's `environment_factory`): a class constructed with no arguments, one instance per
episode::

    class Env:
        def reset(self, **row) -> str | list[dict] | None: ...   # the prompt; None: the row's own
        def add(self, a: int, b: int) -> int:                     # every public method is a tool
            '''Add two integers.

            Args:
                a: The first number.
                b: The second number.
            '''
        def reward(self, **kwargs) -> float: ...                  # optional: the episode's reward
        done: bool                                                # optional: True ends the episode

The model calls tools in its family's format (tether.envs.formats); a message without a tool call
ends the episode.

Step-based (SkyRL's BaseTextEnv, OpenEnv): the environment reads the assistant's text itself::

    class Env:
        def reset(self, row: dict) -> str | list[dict]: ...
        def step(self, assistant_text: str) -> tuple[str | list[dict], float | None, bool]: ...

An object with a callable `step` is step-based, any other is class-based.

The episode loop talks to :class:`Episode` only: `start(row)` -> the first messages, `tools` ->
the schemas to render with the chat template, `respond(text)` -> a :class:`Turn`,
`final_reward()` at the end.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from tether.envs.formats import ToolCall, ToolFormat, ToolResult, detect_tool_format, get_tool_format
from tether.envs.render import template_renders_tools
from tether.envs.tools import Tool, find_tools, run_call
from tether.errors import UserError

__all__ = ["Turn", "Episode", "EnvError", "EnvResetError", "load_env", "builtin_envs", "env_rows",
           "DEFAULT_TOOL_TIMEOUT_S"]

DEFAULT_TOOL_TIMEOUT_S = 10.0


class EnvError(UserError):
    """An environment broke the protocol or raised where it may not (step, reward); one line
    naming the environment."""


class EnvResetError(EnvError):
    """An environment's `reset` raised, or gave no prompt, for one row: the episode loop skips the
    row. The message names the environment and the row's prompt."""


@dataclass
class Turn:
    """The environment's answer to one assistant message.

    `messages`: what the model reads next (tool results, game feedback), to be rendered with
    `observation_ids`; when `done` is True they are not shown to the model (no turn follows).
    `reward`: a step-based environment's reward for this step (None: none given).
    `tool_calls`: calls read from the message; `tool_errors`: those answered with an error."""
    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The part of `kwargs` that `fn` accepts by name (all of it if it takes **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return dict(kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def _as_messages(out: Any, role: str = "user") -> list[dict] | None:
    """A prompt or observation as messages: a string -> one `role` message; a message list as
    is (copied); None -> None."""
    if out is None:
        return None
    if isinstance(out, str):
        return [{"role": role, "content": out}]
    if isinstance(out, dict) and "role" in out:
        return [dict(out)]
    if isinstance(out, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in out):
        return [dict(m) for m in out]
    raise TypeError(f"expected a string or a list of messages, got {type(out).__name__}")


def _with_system(messages: list[dict], text: str, first: bool = False) -> list[dict]:
    """`text` joined to the system message that starts `messages` (after its content, or before it
    when `first`), or a system message of its own put first."""
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        parts = [text, messages[0].get("content", "")] if first else [messages[0].get("content", ""), text]
        messages[0]["content"] = "\n\n".join(parts).strip()
        return messages
    return [{"role": "system", "content": text}] + messages


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def _why(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _finite(value: Any, what: str) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise EnvError(f"{what} returned {_short(value)}, not a number or None") from None
    if not math.isfinite(f):
        raise EnvError(f"{what} returned {f}, not a finite number")
    return f


class Episode:
    """One episode of one environment instance, as the episode loop drives it.

    `tokenizer` (optional) picks the tool-call format (`tool_format='auto'`) and tells whether the
    chat template renders `tools=` itself; when it does not, `start` puts the tool descriptions
    into a system message and `tools` is empty. `tool_timeout_s`: each tool call's deadline
    (default: the environment's `tool_timeout_s` attribute, else 10 s). `max_tool_calls`: calls
    run per message; further ones are answered with an error."""

    def __init__(self, env: Any, tokenizer=None, *, tool_format: str | ToolFormat = "auto",
                 tool_timeout_s: float | None = None, max_tool_calls: int = 8,
                 max_tool_output_chars: int = 4000):
        self.env = env
        self.name = type(env).__name__
        self.step_based = callable(getattr(env, "step", None))
        self.format = get_tool_format(tool_format, tokenizer)
        self._tools: dict[str, Tool] = {} if self.step_based else {t.name: t for t in find_tools(env)}
        if self.step_based:
            schemas = list(getattr(env, "tools", None) or [])
        else:
            schemas = [t.schema for t in self._tools.values()]
        self.tool_schemas: list[dict] = schemas
        # The template describes the tools only when it can and the format is its own family's: a
        # template's tool instructions in one convention with calls parsed in another would
        # contradict each other. The plain format is always described by us.
        # A step-based environment reads its own actions: its `tools` go to the template as given.
        renders = self.step_based or self.format.name != "plain"
        if schemas and renders and tokenizer is not None and not self.step_based:
            renders = (detect_tool_format(tokenizer) == self.format.name
                       and template_renders_tools(tokenizer))
        # what to pass to the chat template as `tools=`; [] when the system message carries them
        self.tools: list[dict] = schemas if renders else []
        self._describe_in_prompt = bool(schemas) and not renders
        self.tool_timeout_s = float(tool_timeout_s or getattr(env, "tool_timeout_s", None)
                                    or DEFAULT_TOOL_TIMEOUT_S)
        self.max_tool_calls = int(max_tool_calls)
        self.max_tool_output_chars = int(max_tool_output_chars)
        self.row: dict = {}
        self.messages: list[dict] = []     # the conversation so far, as the model saw it
        self.step_rewards: list[float] = []
        self.done = False
        self.started = False

    # -- the loop's interface -------------------------------------------------------------------

    def start(self, row: dict, system: str | None = None) -> list[dict]:
        """Reset the environment for `row`; the episode's first messages (render them with
        add_generation_prompt=True and `tools=self.tools`). `system`: a system prompt the messages
        start with (a system message of the environment's, and the tool descriptions written into
        the prompt, follow it in the same message). Raises EnvResetError."""
        self.row = dict(row)
        where = f"environment {self.name}: reset on the row with prompt {_short(self.row.get('prompt'))}"
        try:
            if self.step_based:
                out = self.env.reset(dict(self.row))
                if isinstance(out, tuple) and out and isinstance(out[0], (str, list)):
                    out = out[0]  # SkyRL's (prompt, metadata)
            else:
                out = self.env.reset(**_accepted(self.env.reset, self.row))
        except Exception as e:
            raise EnvResetError(f"{where} raised {_why(e)}") from e
        try:
            messages = _as_messages(out)
            if messages is None:
                messages = _as_messages(self.row.get("prompt"))
        except TypeError as e:
            raise EnvResetError(f"{where}: {e}") from None
        if not messages:
            raise EnvResetError(f"{where}: reset returned None and the row has no 'prompt'")
        if system:
            messages = _with_system(messages, system, first=True)
        if self._describe_in_prompt:
            messages = _with_system(messages, self.format.system_prompt(self.tool_schemas))
        self.messages = copy.deepcopy(messages)
        self.step_rewards, self.done, self.started = [], False, True
        return messages

    def respond(self, assistant_text: str) -> Turn:
        """The environment's answer to the assistant's message (its text, without the stop
        token). A class-based environment's tool calls never raise out of here: each problem is an
        error observation, counted in Turn.tool_errors. A step-based environment whose `step`
        raises gives EnvError."""
        if not self.started or self.done:
            raise RuntimeError("Episode.respond: the episode is " + ("over" if self.done else "not started"))
        self.messages.append({"role": "assistant", "content": assistant_text})
        turn = self._step(assistant_text) if self.step_based else self._tool_turn(assistant_text)
        if not turn.done:
            self.messages.extend(copy.deepcopy(turn.messages))
        self.done = turn.done
        return turn

    def continue_with(self, messages: list[dict]) -> None:
        """Messages from outside the environment after the assistant's last message (a person's,
        in `tether chat`): the conversation goes on from them, and the episode with it, also after
        a message without tool calls ended it."""
        if not self.started:
            raise RuntimeError("Episode.continue_with: the episode is not started")
        self.messages.extend(copy.deepcopy(messages))
        self.done = False

    def final_reward(self) -> float | None:
        """The episode's reward: a class-based environment's `reward(...)` (called with the row's
        columns, `completion` = the last assistant message and `messages` = the conversation, each
        if its signature takes it) or `reward` attribute; a step-based one's step rewards summed.
        None: the environment gives none."""
        if self.step_based:
            return float(sum(self.step_rewards)) if self.step_rewards else None
        reward = getattr(self.env, "reward", None)
        if reward is None:
            return None
        if not callable(reward):
            return _finite(reward, f"environment {self.name}: reward")
        last = next((m["content"] for m in reversed(self.messages) if m.get("role") == "assistant"), "")
        kwargs = {**self.row, "completion": last, "messages": copy.deepcopy(self.messages)}
        try:
            value = reward(**_accepted(reward, kwargs))
        except Exception as e:
            raise EnvError(f"environment {self.name}: reward raised {_why(e)}") from e
        return _finite(value, f"environment {self.name}: reward")

    # -- inside -----------------------------------------------------------------------------------

    def _step(self, text: str) -> Turn:
        try:
            out = self.env.step(text)
        except Exception as e:
            raise EnvError(f"environment {self.name}: step raised {_why(e)}") from e
        if isinstance(out, dict):  # SkyRL's step output: {"observations", "reward", "done", ...}
            out = (out.get("observations", out.get("messages")), out.get("reward"), out.get("done"))
        if not isinstance(out, tuple) or len(out) not in (3, 4):
            raise EnvError(f"environment {self.name}: step must return (messages, reward, done), "
                           f"got {_short(out)}")
        messages, reward, done = out[:3]
        try:
            messages = _as_messages(messages) or []
        except TypeError as e:
            raise EnvError(f"environment {self.name}: step's messages: {e}") from None
        reward = _finite(reward, f"environment {self.name}: step")
        if reward is not None:
            self.step_rewards.append(reward)
        return Turn(messages, reward, bool(done))

    def _tool_turn(self, text: str) -> Turn:
        calls = self.format.parse(text)
        if not calls:
            return Turn([], None, True)
        results: list[ToolResult] = []
        for i, call in enumerate(calls):
            if i >= self.max_tool_calls:
                results.append(ToolResult(call.name or "?", f"error: too many tool calls in one "
                                          f"message (at most {self.max_tool_calls})", error=True))
                continue
            results.append(run_call(call, self._tools, self.tool_timeout_s, self.max_tool_output_chars))
        done = bool(getattr(self.env, "done", False))
        return Turn(self.format.observation(results), None, done, len(calls),
                    sum(r.error for r in results))

    def call(self, name: str, **arguments) -> ToolResult:
        """Run one tool as if the model had called it (tests, debugging)."""
        return run_call(ToolCall(name, arguments), self._tools, self.tool_timeout_s,
                        self.max_tool_output_chars)


# --- loading ---------------------------------------------------------------------------------------

def builtin_envs() -> dict[str, type]:
    """Built-in name -> environment class."""
    from tether.envs.calculator import CalculatorEnv
    from tether.envs.guess_number import GuessNumberEnv
    from tether.envs.python_code import PythonEnv
    from tether.envs.wordle import WordleEnv
    return {"calculator": CalculatorEnv, "python": PythonEnv, "wordle": WordleEnv,
            "guess_number": GuessNumberEnv}


def load_env(spec: str | type | Callable[[], Any]) -> Callable[[], Any]:
    """An environment factory (called with no arguments, once per episode) from a built-in name
    ('calculator', 'python', 'wordle', 'guess_number'), 'package.module:Class' or
    'path/to/file.py:Class' (resolved as reward_funcs are: tether.rewards.registry), or a class /
    factory given directly. Errors are one line naming the spec."""
    if not isinstance(spec, str):
        if not callable(spec):
            raise UserError(f"environment {spec!r} is neither a class nor a factory")
        return spec
    from tether.rewards.registry import import_object

    spec = spec.strip()
    builtins = builtin_envs()
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise UserError(f"environment {spec!r} is neither a built-in ({', '.join(sorted(builtins))}) "
                        "nor 'module:Class' / 'path/to/file.py:Class'")
    obj = import_object(spec, what="environment")
    if not callable(obj):
        raise UserError(f"environment {spec!r}: {spec.rpartition(':')[2]!r} is a "
                        f"{type(obj).__name__}, not a class or factory")
    return obj


def env_rows(env: str | type | Callable[[], Any], size: int, seed: int = 0, **options) -> list[dict]:
    """`size` rows (a `prompt` and the columns the environment reads) drawn from the environment's
    own `rows(size, seed, **options)`: deterministic in `seed`, no data file needed."""
    factory = load_env(env)
    base = factory.func if isinstance(factory, functools.partial) else factory
    rows = getattr(base, "rows", None)
    if not callable(rows):
        raise UserError(f"environment {getattr(base, '__name__', base)!r} has no rows(size, seed) to "
                        "draw data from: give it a data file")
    try:
        out = rows(size=int(size), seed=int(seed), **options)
    except TypeError as e:
        raise UserError(f"environment {getattr(base, '__name__', base)!r}: rows options "
                        f"{sorted(options)}: {e}") from None
    return list(out)

