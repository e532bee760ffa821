"""A class-based environment's tools: found, described, checked and run.

Every public method of the environment's class (name not starting with '_') is a tool, except the
protocol's own names (:data:`RESERVED`). Its JSON schema (OpenAI function format) comes from its
type hints and its Google-style docstring through `transformers.utils.get_json_schema`, the
function transformers uses for `apply_chat_template(tools=...)`; a public method it cannot
describe is an error that names the method (make it private with a leading '_' to keep it out).

A call is checked against the schema (unknown tool, missing / unexpected / mistyped argument)
before it runs, and runs in a thread with a deadline. Every failure comes back as text starting
with 'error: ' that the model reads in its next observation; nothing here raises on a call.

A Python thread cannot be killed: a tool past its deadline is abandoned, still running, and the
episode moves on with a timeout error. Tools that run model-written code must therefore run it in
a process that can be killed -- the `python` environment runs it in tether's sandbox
(tether.rewards.sandbox), whose own wall-clock limit kills the whole process tree.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

from tether.envs.formats import ToolCall, ToolResult, type_text
from tether.errors import UserError

__all__ = ["RESERVED", "Tool", "find_tools", "check_arguments", "run_call", "result_text"]

# Protocol names that are never tools (the episode calls them, not the model).
RESERVED = frozenset({"reset", "step", "reward", "close", "rows", "done", "tools", "tool_timeout_s"})


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict   # {"type": "function", "function": {"name", "description", "parameters", ...}}

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {}) or {}


def _public_functions(cls: type) -> list[str]:
    """Names of the plain (or static) methods `cls` defines or inherits, in definition order."""
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") or name in RESERVED:
                continue
            if isinstance(member, staticmethod) or inspect.isfunction(member):
                names[name] = None
            else:
                names.pop(name, None)  # overridden by a property, a classmethod or a value
    return list(names)


def find_tools(env: Any) -> list[Tool]:
    """The tools of a class-based environment instance, with their schemas."""
    from transformers.utils import get_json_schema  # transformers is heavy; only when needed

    tools = []
    for name in _public_functions(type(env)):
        fn = getattr(env, name)
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # DocstringParsingException, TypeHintParsingException
            raise UserError(f"environment {type(env).__name__}: public method {name!r} cannot be a "
                            f"tool: {str(e).strip()} -- give it type hints and a Google-style "
                            f"docstring with an Args: section, or name it _{name} to keep it out "
                            "of the tools") from None
        tools.append(Tool(name, fn, schema))
    return tools


# --- argument checks ----------------------------------------------------------------------------

_JSON_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, (list, tuple)),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _type_error(value: Any, prop: dict) -> str | None:
    """Why `value` does not fit the JSON-schema property `prop` (None: it fits)."""
    if value is None and prop.get("nullable"):
        return None
    if "enum" in prop and value not in prop["enum"]:
        return "must be one of " + ", ".join(json.dumps(v) for v in prop["enum"])
    types = prop.get("type")
    if types is None:
        return None
    types = types if isinstance(types, list) else [types]
    if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in types):
        return f"must be {' or '.join(types)}"
    if "array" in types and isinstance(value, (list, tuple)) and isinstance(prop.get("items"), dict):
        for i, item in enumerate(value):
            why = _type_error(item, prop["items"])
            if why:
                return f"item {i} {why}"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def check_arguments(tool: Tool, call: ToolCall) -> tuple[dict | None, str | None]:
    """(keyword arguments to call the tool with, None) or (None, error text). Positional
    arguments of the Python-call formats are bound to the parameters in schema order."""
    params = tool.parameters
    props: dict = params.get("properties", {}) or {}
    required = list(params.get("required", []) or [])
    names = list(props)
    listing = ", ".join(f"{k}: {type_text(v)}" for k, v in props.items()) or "none"
    args = dict(call.arguments)
    if len(call.positional) > len(names):
        return None, (f"error: tool '{tool.name}' takes {len(names)} argument(s), "
                      f"{len(call.positional)} given (arguments: {listing})")
    for key, value in zip(names, call.positional):
        if key in args:
            return None, f"error: tool '{tool.name}' got argument '{key}' twice"
        args[key] = value
    extra = [k for k in args if k not in props]
    if extra:
        return None, (f"error: tool '{tool.name}' has no argument '{extra[0]}' "
                      f"(arguments: {listing})")
    missing = [k for k in required if k not in args]
    if missing:
        return None, (f"error: tool '{tool.name}' is missing argument '{missing[0]}' "
                      f"(arguments: {listing})")
    for key, value in args.items():
        why = _type_error(value, props[key])
        if why:
            return None, (f"error: tool '{tool.name}' argument '{key}' {why}, "
                          f"got {type(value).__name__} {_shown(value)}")
    return args, None


# --- running -------------------------------------------------------------------------------------

def result_text(value: Any, max_chars: int) -> str:
    """A tool's return value as the text the model reads: a string as is, a number or a JSON value
    as JSON (an integral float as an integer: 6.0 -> '6'), anything else by str(); longer than
    `max_chars` is cut with a note saying how much."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        text = str(int(value))
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[... {len(text) - max_chars} more characters cut]"
    return text


def _call(fn: Callable, args: dict) -> Any:
    out = fn(**args)
    if inspect.isawaitable(out):  # an async tool: its own event loop, in this worker thread
        async def wait():
            return await out
        out = asyncio.run(wait())
    return out


def run_call(call: ToolCall, tools: dict[str, Tool], timeout_s: float, max_chars: int) -> ToolResult:
    """Check and run one call; the result (or error) as the model will read it. Never raises."""
    name = call.name or "?"
    if call.error:
        return ToolResult(name, f"error: {call.error}", error=True)
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(tools) or "none"
        return ToolResult(name, f"error: unknown tool '{call.name}'; tools: {known}", error=True)
    args, why = check_arguments(tool, call)
    if why:
        return ToolResult(name, why, error=True)
    box: dict[str, Any] = {}

    def work():
        try:
            box["value"] = _call(tool.fn, args)
        except BaseException as e:  # noqa: BLE001 - the model reads it; the episode goes on
            box["error"] = e

    # daemon: an abandoned call (past its deadline) never keeps the process from exiting
    worker = threading.Thread(target=work, name=f"tether-tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return ToolResult(name, f"error: tool '{name}' timed out after {timeout_s:g} s", error=True)
    if "error" in box:
        e = box["error"]
        msg = str(e).strip().splitlines()
        return ToolResult(name, f"error: tool '{name}' raised {type(e).__name__}"
                                + (f": {msg[0]}" if msg else ""), error=True)
    try:
        return ToolResult(name, result_text(box.get("value"), max_chars))
    except Exception as e:  # a __str__ that raises
        return ToolResult(name, f"error: tool '{name}' returned an unprintable "
                                f"{type(box.get('value')).__name__}: {type(e).__name__}", error=True)
