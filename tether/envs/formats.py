"""Tool calls as model families write them, and tool results as those families read them.

A format reads the calls out of an assistant message (:meth:`ToolFormat.parse`), renders tool
results as the messages the model sees next (:meth:`ToolFormat.observation`) and, for a chat
template that does not render a `tools=` list itself, writes the tool descriptions into a system
message (:meth:`ToolFormat.system_prompt`).

  hermes  Qwen2.5/Qwen3, Hermes, SmolLM2 (ChatML templates): one or more blocks
              <tool_call>
              {"name": "add", "arguments": {"a": 2, "b": 3}}
              </tool_call>
          in a message; a block may also hold a JSON list of such objects, as SmolLM2 writes
          them (`<tool_call>[{...}, {...}]</tool_call>`). Results: one `{"role": "tool"}` message
          per call (Qwen's template wraps each in <tool_response>).
  gemma   Gemma 3 (its template has no tool role): a fenced Python call, as Google documents
          function calling for Gemma,
              ```tool_code
              add(a=2, b=3)
              ```
          results in one user message of ```tool_output fences, one per call.
  plain   any other template: a line `CALL add(a=2, b=3)` per call (Python call syntax, literal
          arguments); results in one user message of lines `RESULT add: 5`.

`detect_tool_format` picks one from the chat template's markers. Nothing here raises on model
output: a call that cannot be read comes back as a :class:`ToolCall` with `error` set, which the
episode turns into an error observation.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from tether.errors import UserError

__all__ = ["ToolCall", "ToolResult", "ToolFormat", "HermesFormat", "GemmaFormat", "PlainFormat",
           "FORMATS", "detect_tool_format", "get_tool_format", "chat_template_text", "type_text"]

# How a tool call is written, quoted in error observations so the model sees the fix.
_HERMES_SHAPE = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'


@dataclass
class ToolCall:
    """One call read from an assistant message. `error` set: the call could not be read (the
    episode answers with it as an error observation); `name` is then None when unknown."""
    name: str | None
    arguments: dict = field(default_factory=dict)   # keyword arguments
    positional: list = field(default_factory=list)  # positional arguments (Python-call formats)
    error: str | None = None
    text: str = ""                                  # the call as written


@dataclass
class ToolResult:
    """A call's outcome as the model will read it: `content` is the tool's output as text, or an
    error text starting with 'error: '."""
    name: str
    content: str
    error: bool = False


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# --- hermes: <tool_call>JSON</tool_call> ---------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _json_call(obj: Any, text: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(None, error=f"malformed tool call: expected an object with a \"name\" "
                                    f"and \"arguments\", as {_HERMES_SHAPE}", text=text)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's wire form: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(obj["name"], error=f"malformed tool call: arguments of "
                                               f"'{obj['name']}' are not valid JSON: {e}", text=text)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"malformed tool call: arguments of '{obj['name']}' must "
                                           f"be a JSON object, got {type(args).__name__}", text=text)
    return ToolCall(obj["name"], dict(args), text=text)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every <tool_call> block of `text`, in order. A block left open at the end of the message
    (the model stopped before '</tool_call>') is read to the end."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"malformed tool call: invalid JSON ({e}); write "
                                              f"{_HERMES_SHAPE}", text=m.group(0)))
            continue
        for item in (obj if isinstance(obj, list) else [obj]):  # a list: SmolLM2's form
            calls.append(_json_call(item, m.group(0)))
    return calls


# --- Python call syntax: gemma's ```tool_code and the plain CALL line --------------------------------

def _literal(node: ast.AST) -> Any:
    """A literal argument value; JSON's true/false/null are read as Python's True/False/None."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    return ast.literal_eval(node)


def _python_calls(source: str, text: str) -> list[ToolCall]:
    """Calls `name(arg, key=value)` in `source`, one per statement; `print(name(...))` counts as
    the call inside it. Arguments must be literals (numbers, strings, lists, dicts, ...)."""
    try:
        tree = ast.parse(source.strip(), mode="exec")
    except SyntaxError as e:
        return [ToolCall(None, error=f"malformed tool call: invalid Python call syntax ({e.msg}); "
                                     "write name(argument=value, ...)", text=text)]
    calls = []
    for stmt in tree.body:
        node = stmt.value if isinstance(stmt, ast.Expr) else None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
                and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Call)):
            node = node.args[0]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            calls.append(ToolCall(None, error="malformed tool call: expected a call "
                                              "name(argument=value, ...)", text=text))
            continue
        name = node.func.id
        try:
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                raise ValueError("*args / **kwargs are not accepted")
            positional = [_literal(a) for a in node.args]
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
            calls.append(ToolCall(name, error=f"malformed tool call: arguments of '{name}' must be "
                                              f"literal values ({_one_line(e)})", text=text))
            continue
        calls.append(ToolCall(name, arguments, positional, text=text))
    return calls


_TOOL_CODE = re.compile(r"```tool_code[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)


def parse_gemma(text: str) -> list[ToolCall]:
    """Every ```tool_code fence of `text`; a fence may hold several calls, one per line."""
    calls = []
    for m in _TOOL_CODE.finditer(text):
        calls.extend(_python_calls(m.group(1), m.group(0)))
    return calls


_CALL_LINE = re.compile(r"^[ \t]*CALL[ \t]+(.*)$", re.MULTILINE)


def parse_plain(text: str) -> list[ToolCall]:
    """Every line `CALL name(argument=value, ...)` of `text`."""
    calls = []
    for m in _CALL_LINE.finditer(text):
        found = _python_calls(m.group(1), m.group(0))
        if len(found) != 1:
            found = [ToolCall(None, error="malformed tool call: one call per CALL line", text=m.group(0))]
        calls.extend(found)
    return calls


# --- the formats -------------------------------------------------------------------------------------

def type_text(prop: dict) -> str:
    """A JSON-schema property's type in words: 'integer', 'array of string', 'string (one of "a", "b")'."""
    t = prop.get("type", "any")
    if isinstance(t, list):
        t = " | ".join(t)
    if t == "array" and isinstance(prop.get("items"), dict):
        t = f"array of {type_text(prop['items'])}"
    if "enum" in prop:
        t += " (one of " + ", ".join(json.dumps(v) for v in prop["enum"]) + ")"
    return t


def _signature(schema: dict) -> str:
    """A tool as a Python signature with its docstring: `add(a: integer, b: integer)` + text."""
    fn = schema.get("function", schema)
    props = fn.get("parameters", {}).get("properties", {})
    required = set(fn.get("parameters", {}).get("required", []))
    params = ", ".join(f"{k}: {type_text(v)}" + ("" if k in required else " = None")
                       for k, v in props.items())
    lines = [f"{fn['name']}({params})"]
    if fn.get("description"):
        lines.append(f"    {fn['description']}")
    for k, v in props.items():
        if v.get("description"):
            lines.append(f"    {k}: {v['description']}")
    return "\n".join(lines)


def _python_call(name: str, arguments: dict) -> str:
    """`add(a=2, b=3)`: keyword arguments as Python literals (what parse_gemma / parse_plain read)."""
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")"


class ToolFormat:
    """How one model family writes tool calls and reads their results."""
    name = ""

    def parse(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def observation(self, results: list[ToolResult]) -> list[dict]:
        raise NotImplementedError

    def system_prompt(self, schemas: list[dict]) -> str:
        raise NotImplementedError

    def call_text(self, name: str, arguments: dict) -> str:
        """One call written as this family writes it (what `parse` reads back): scripted
        demonstrations for an SFT before RL use it."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"


class HermesFormat(ToolFormat):
    name = "hermes"

    def parse(self, text: str) -> list[ToolCall]:
        return parse_hermes(text)

    def call_text(self, name: str, arguments: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def observation(self, results: list[ToolResult]) -> list[dict]:
        return [{"role": "tool", "name": r.name, "content": r.content} for r in results]

    def system_prompt(self, schemas: list[dict]) -> str:
        tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return ("You can call tools. Their signatures, as JSON:\n<tools>\n" + tools + "\n</tools>\n"
                "To call tools, write for each call a block\n<tool_call>\n"
                '{"name": <tool name>, "arguments": <the arguments as a JSON object>}\n</tool_call>\n'
                "and end your message there; the results come back in the next message. "
                "When you need no tool, answer without any <tool_call>.")


class GemmaFormat(ToolFormat):
    name = "gemma"

    def parse(self, text: str) -> list[ToolCall]:
        return parse_gemma(text)

    def call_text(self, name: str, arguments: dict) -> str:
        return f"```tool_code\n{_python_call(name, arguments)}\n```"

    def observation(self, results: list[ToolResult]) -> list[dict]:
        # One user message: Gemma 3's template has no tool role and requires user and model
        # turns to alternate.
        body = "\n".join(f"```tool_output\n{r.content}\n```" for r in results)
        return [{"role": "user", "content": body}]

    def system_prompt(self, schemas: list[dict]) -> str:
        sigs = "\n\n".join(_signature(s) for s in schemas)
        return ("You can call these Python functions:\n\n" + sigs + "\n\n"
                "To call functions, write the calls in a fenced block\n```tool_code\n"
                "function_name(argument=value)\n```\nand end your message there; the results come "
                "back in ```tool_output blocks. When you need no function, answer without a "
                "tool_code block.")


class PlainFormat(ToolFormat):
    name = "plain"

    def parse(self, text: str) -> list[ToolCall]:
        return parse_plain(text)

    def call_text(self, name: str, arguments: dict) -> str:
        return f"CALL {_python_call(name, arguments)}"

    def observation(self, results: list[ToolResult]) -> list[dict]:
        return [{"role": "user", "content": "\n".join(f"RESULT {r.name}: {r.content}" for r in results)}]

    def system_prompt(self, schemas: list[dict]) -> str:
        sigs = "\n\n".join(_signature(s) for s in schemas)
        return ("You can call these tools:\n\n" + sigs + "\n\n"
                "To call a tool, write a line\nCALL tool_name(argument=value, ...)\n(one line per "
                "call) and end your message there; each result comes back as a line "
                "'RESULT tool_name: ...'. When you need no tool, answer without a CALL line.")


FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "gemma": GemmaFormat, "plain": PlainFormat}


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template as one string ('' without one; named templates joined)."""
    t = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    if isinstance(t, list):  # [{"name": ..., "template": ...}, ...]
        return "\n".join(str(x.get("template", "")) if isinstance(x, dict) else str(x) for x in t)
    return t or ""


def detect_tool_format(tokenizer) -> str:
    """The family's format, from the chat template's markers: '<tool_call>' (Qwen, Hermes) or
    ChatML's '<|im_start|>' (SmolLM2) -> hermes; '<start_of_turn>' or 'tool_code' (Gemma) ->
    gemma; anything else -> plain."""
    t = chat_template_text(tokenizer)
    if "<tool_call>" in t:
        return "hermes"
    if "<start_of_turn>" in t or "tool_code" in t:
        return "gemma"
    if "<|im_start|>" in t:
        return "hermes"
    return "plain"


def get_tool_format(tool_format: str | ToolFormat = "auto", tokenizer=None) -> ToolFormat:
    """A format by name ('hermes', 'gemma', 'plain'), or 'auto': detected from the tokenizer's
    chat template (hermes without a tokenizer)."""
    if isinstance(tool_format, ToolFormat):
        return tool_format
    name = str(tool_format).strip().lower()
    if name == "auto":
        name = detect_tool_format(tokenizer) if tokenizer is not None else "hermes"
    if name not in FORMATS:
        raise UserError(f"tool_format {tool_format!r}: expected one of auto, {', '.join(FORMATS)}")
    return FORMATS[name]()
