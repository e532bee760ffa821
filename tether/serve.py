"""`tether serve model=<checkpoint | run directory | hub id>`: an OpenAI-compatible Chat Completions
endpoint over tether's own sampler.

    tether serve model=runs/my-grpo                         # http://127.0.0.1:8000/v1
    tether serve model=runs/my-sft/checkpoints/step-200 port=8001 save=calls.jsonl

For programs that only speak OpenAI's API (an environment library's rollout loop, an eval harness,
the `openai` package): their base URL is http://HOST:PORT/v1, any API key. The model is loaded as
`tether chat` loads it (a run directory: its latest checkpoint); replies come from the sampler
training and `tether eval` sample with (tether.rollout.Sampler), not from a second implementation.

- `GET /v1/models` lists the one model served (`max_model_len`: its context length).
- `POST /v1/chat/completions` reads `messages` (roles system, developer (read as system), user,
  assistant, tool; content a string or a list of text parts; the other keys of a message, such as
  `tool_calls` and `tool_call_id`, go to the chat template as given, except that a tool call's
  `function.arguments`, a JSON string on OpenAI's wire, reaches the template as the object it
  encodes, as HF chat templates read it), `temperature` (0 = greedy),
  `top_p`, `max_tokens` / `max_completion_tokens`, `n`, `seed`, `stop`, `tools` (the chat template's
  `tools=`), `logprobs` / `top_logprobs` and `stream` (server-sent events in OpenAI's chunk format,
  ending with `data: [DONE]`; `stream_options.include_usage` adds a usage chunk). Other fields
  (`model`, `user`, penalties, ...) are ignored. The prompt is the chat template's render of the
  messages through the generation prompt (tether.envs.render.prompt_ids); a completion ends at an
  end token (EOS, or the template's end of turn: finish_reason "stop"), a stop string (its text is
  left out of `content`, its tokens stay in the ids: "stop") or max_tokens / the model's context
  ("length").

Tool calls: when a request gives `tools`, each completion's text is read for calls in the tool-call
format of tether's environments (tether.envs.formats: `tool_format=auto` picks hermes, gemma or
plain from the chat template's markers, as an episode does; `tool_format=` sets it). The calls read
come back as `message.tool_calls` ([{"id", "type": "function", "function": {"name", "arguments":
<JSON string>}}]) with finish_reason "tool_calls", and `content` is the text outside them (trimmed;
null when none is left). A call block that does not read (bad JSON, no name, a non-literal or
unnamed argument) stays in `content` as the model wrote it, with no error. Streamed with `tools`,
a choice's reply comes whole in its last chunk (`delta.content` and `delta.tool_calls`, each call
complete, with its `index`), since text cannot be shown before it is known not to be a call.
Without `tools` nothing is parsed.

Token ids: every choice carries `"tether": {"prompt_token_ids", "completion_token_ids",
"completion_logprobs", "logprob_temperature"}` — the ids the model read and the ids it sampled,
end token included, with the sampler's log-probs (log_softmax(z / T) at each sampled token; T = 1
for greedy), so a trainer takes token-in/token-out trajectories without re-tokenizing the text. A
client that drops unknown fields (a library's own response types) can still have them: `save=`
appends each call's ids to a JSONL file, under the `X-Session-ID` header the call carried.

A bad request is a 400 in OpenAI's error shape {"error": {"message", "type", "param"}}, one line
saying what to change; a failure while sampling is a 500 of the same shape. The server goes on
either way.

One request at a time: a lock around the sampler, so concurrent requests wait their turn and are
never batched together (a request's `n` choices are one batched call). No KV cache is kept between
requests: every call prefills its whole transcript.
"""

import json
import math
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

from tether.chat import decode, resolve_model_path
from tether.config import ConfigError
from tether.constraints import PositiveInt, Range
from tether.data.chat import ChatTemplateError
from tether.envs.formats import FORMATS, ToolFormat, get_tool_format
from tether.envs.render import end_of_turn_ids, prompt_ids
from tether.errors import UserError
from tether.rollout import Sampler, SamplingConfig
from tether.rollout.native import unwrap

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 128
MAX_TOP_LOGPROBS = 20


@dataclass
class ServeConfig:
    model: str = ""
    "the model: a checkpoint directory, a run directory (its latest checkpoint: a finished run's final model), a hub id or a .gguf file"
    host: str = "127.0.0.1"
    "address to bind (the endpoint has no authentication: keep it on loopback unless the network is yours)"
    port: Annotated[int, Range(ge=0, le=65535)] = 8000
    "TCP port (0: any free port)"
    name: str = ""
    "the model id /v1/models lists and responses carry ('' = model as given)"
    max_tokens: PositiveInt = 1024
    "most tokens of a completion when a request gives no max_tokens (always within the model's context)"
    save: str = ""
    "a JSONL file every call is appended to: its X-Session-ID header, prompt and completion token ids, log-probs, finish reasons ('' = none)"
    dtype: str = "auto"
    "weight dtype: auto (bf16 on a GPU that has it, else fp32) | fp32 | bf16 | fp16"
    device: str = "auto"
    "cuda | cpu | auto"
    tool_format: str = "auto"
    "how the model writes tool calls, read when a request gives tools: auto (from the chat template), hermes, gemma or plain"

    def __post_init__(self):
        if not self.model:
            raise ConfigError("config key 'model' is required: model=<checkpoint, run directory or hub id>")
        if self.tool_format.strip().lower() not in ("auto", *FORMATS):
            raise ConfigError(f"tool_format={self.tool_format!r}: expected one of auto, {', '.join(FORMATS)}")


# -- requests ---------------------------------------------------------------------------------------

class BadRequest(Exception):
    """A request the server cannot serve as given: a 400 naming the field (`param`)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.message, self.param = message, param


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _kind(v: Any) -> str:
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"'{key}' must be a number, got {_kind(v)}", key)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise BadRequest(f"'{key}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}", key)
    return float(v)


def _integer(body: dict, key: str, default: Optional[int], lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {_kind(v)}", key)
    if v < lo or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be at least {lo}" + (f" and at most {hi}" if hi is not None else "")
                         + f", got {v}", key)
    return v


def _boolean(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be true or false, got {_kind(v)}", key)
    return v


def _messages(value: Any) -> list[dict]:
    """The request's messages as the chat template reads them: text content, developer -> system."""
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects, got "
                         + ("an empty list" if isinstance(value, list) else _kind(value)), "messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{at} must be an object with 'role' and 'content', got {_kind(m)}", at)
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{at}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"{at}.content: only text parts ({{'type': 'text', 'text': ...}}) are read",
                                     f"{at}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise BadRequest(f"{at} has no content", f"{at}.content")
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"{at}.content must be a string or a list of text parts, got {_kind(content)}",
                             f"{at}.content")
        out.append({**m, "role": "system" if role == "developer" else role, "content": content})
        if m.get("tool_calls") is not None:
            out[-1]["tool_calls"] = _call_objects(m["tool_calls"], f"{at}.tool_calls")
    return out


def _call_objects(calls: Any, at: str) -> list[dict]:
    """An assistant message's OpenAI tool calls with each `function.arguments` JSON string read
    into the object it encodes: HF chat templates write the arguments with `| tojson`."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise BadRequest(f"{at} must be a list of tool call objects, got {_kind(calls)}", at)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn = {**fn, "arguments": json.loads(fn["arguments"]) if fn["arguments"].strip() else {}}
            except json.JSONDecodeError as e:
                raise BadRequest(f"{at}[{j}].function.arguments is not JSON: {e}",
                                 f"{at}[{j}].function.arguments") from None
            call = {**call, "function": fn}
        out.append(call)
    return out


@dataclass
class ChatRequest:
    """A validated /v1/chat/completions request."""
    messages: list[dict]
    tools: Optional[list[dict]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    n: int = 1
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


def parse_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """A request body checked field by field; BadRequest names the first field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_kind(body)}")
    messages = _messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of tool objects ({'type': 'function', 'function': {...}})", "tools")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "stop")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, default_max_tokens, 1)
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(f"'stream_options' must be an object, got {_kind(options)}", "stream_options")
    return ChatRequest(
        messages=messages, tools=tools or None,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        max_tokens=max_tokens, n=_integer(body, "n", 1, 1, MAX_N),
        seed=_integer(body, "seed", None, -2**63, 2**63 - 1), stop=stop or [],
        logprobs=logprobs, top_logprobs=top, stream=_boolean(body, "stream"),
        include_usage=_boolean(options or {}, "include_usage"))


def visible(text: str, stops: list[str], final: bool) -> str:
    """What of a completion's text is shown: up to its first stop string; while it is still being
    sampled, without a tail that may start a stop string or end in an incomplete character."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut >= 0:
        return text[:cut]
    if final:
        return text
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold].rstrip("\ufffd")


def tool_reply(text: str, fmt: ToolFormat, tools: list[dict]) -> tuple[Optional[str], list[dict]]:
    """A completion's text as OpenAI's (content, tool_calls): the calls `fmt` reads in it, each
    {"id", "type": "function", "function": {"name", "arguments": <JSON string>}}, and the text
    outside them (trimmed; None when empty). A block (a <tool_call> element, a tool_code fence, a
    CALL line) any of whose calls does not read stays in the content as written; so does one with
    positional arguments (Python-call formats) that `tools` cannot name (its parameters, in
    order), or arguments JSON cannot write. No call read: (text, [])."""
    params = {}  # each tool's parameter names, in order
    for t in tools:
        fn = t.get("function") if isinstance(t.get("function"), dict) else {}
        schema = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        if isinstance(fn.get("name"), str):
            params[fn["name"]] = list(schema.get("properties") or {}) if isinstance(
                schema.get("properties") or {}, dict) else []
    found, kept, calls, pos = fmt.parse(text), [], [], 0
    i = 0
    while i < len(found):
        start = text.find(found[i].text, pos)
        if start < 0:  # not where the parser says: leave the rest as text
            break
        end = start + len(found[i].text)
        block = fmt.parse(text[start:end]) or found[i:i + 1]  # this block's calls alone
        i += len(block)
        read = []
        for c in block:
            if c.error is not None:
                break
            names = params.get(c.name, [])
            if c.positional and (len(c.positional) > len(names) or set(names[:len(c.positional)]) & set(c.arguments)):
                break
            args = {**dict(zip(names, c.positional)), **c.arguments}
            try:
                arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError):
                break
            read.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": c.name, "arguments": arguments}})
        else:
            kept.append(text[pos:start])
            calls += read
            pos = end
    if not calls:
        return text, []
    content = ("".join(kept) + text[pos:]).strip()
    return content or None, calls


# -- the server -------------------------------------------------------------------------------------

class Server:
    """The model, its tokenizer and one Sampler, behind a lock: one request samples at a time."""

    def __init__(self, model, tokenizer, name: str, max_tokens: int = 1024, save: str = "",
                 tool_format: str = "auto"):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("tether serve answers chat completions through the tokenizer's chat "
                            "template, and this tokenizer has none")
        self.model, self.tok, self.name = model.eval(), tokenizer, name
        self.max_tokens, self.save = max_tokens, save
        get_tool_format(tool_format, tokenizer)  # a name that is none: said at start
        self.tool_format = tool_format
        try:
            stop = end_of_turn_ids(tokenizer).stop[-1:]
        except ChatTemplateError:  # no special token closes a turn: EOS ends a completion
            stop = []
        self.sampler = Sampler(model, tokenizer, SamplingConfig(max_new_tokens=max_tokens, stop_token_ids=stop))
        self.context = getattr(unwrap(model).config, "max_position_embeddings", None)
        self.lock = threading.Lock()
        self.created = int(time.time())

    def prompt(self, req: ChatRequest) -> tuple[list[int], int]:
        """The prompt's ids and the most tokens its completion may have."""
        try:
            ids = prompt_ids(self.tok, req.messages, req.tools)
        except ChatTemplateError as e:
            raise BadRequest(f"the chat template rejects these messages: {e}", "messages") from None
        if not ids:
            raise BadRequest("the messages render to no tokens", "messages")
        room = req.max_tokens
        if self.context:
            if len(ids) >= self.context:
                raise BadRequest(f"the messages are {len(ids)} tokens; the model reads at most {self.context}",
                                 "messages")
            room = min(room, self.context - len(ids))
        return ids, room

    def sample(self, req: ChatRequest, prompt: list[int], room: int, stream=None):
        with self.lock:
            ro = self.sampler.sample([prompt], n=req.n, seed=req.seed, stream=stream, max_new_tokens=room,
                                     temperature=req.temperature, top_p=req.top_p, stop=req.stop,
                                     sync_every=1 if stream is not None else 0)
            ids = ro.completion_lists()
            logps = [row[:len(c)] for row, c in zip(ro.logprobs.cpu().tolist(), ids)]
            tops = [self.top_logprobs(prompt, c, req.top_logprobs, ro.logprob_temperature) for c in ids] \
                if req.top_logprobs else [None] * len(ids)
        return ids, logps, ro.finish_reasons, ro.logprob_temperature, tops

    def top_logprobs(self, prompt: list[int], completion: list[int], k: int, temperature: float):
        """The k likeliest tokens at each completion position, from one forward pass over prompt +
        completion: [(id, log_softmax(z / T)[id]), ...] per position."""
        import torch

        dev = next(self.model.parameters()).device
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + completion], device=dev)).logits[0, len(prompt) - 1:-1]
            lp = torch.log_softmax(logits.float() / temperature, -1)
            vals, idx = lp.topk(k, -1)
        return [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]

    # -- the response's parts -------------------------------------------------------------------------

    def token(self, t: int, lp: float) -> dict:
        text = self.tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, ids: list[int], logps: list[float], top) -> dict:
        content = []
        for j, (t, lp) in enumerate(zip(ids, logps)):
            entry = self.token(t, lp)
            entry["top_logprobs"] = [self.token(a, b) for a, b in top[j]] if top is not None else []
            content.append(entry)
        return {"content": content}

    def choice(self, req, i, prompt, ids, logp, reason, temperature, top) -> dict:
        """A choice's closing fields: finish reason, log-probs, the token ids."""
        return {"index": i, "logprobs": self.logprobs(ids, logp, top) if req.logprobs else None,
                "finish_reason": "length" if reason == "length" else "stop",
                "tether": {"prompt_token_ids": prompt, "completion_token_ids": ids,
                           "completion_logprobs": logp, "logprob_temperature": temperature}}

    def message(self, req: ChatRequest, text: str) -> dict:
        """The assistant message of a completion's visible text: with `tools` in the request, the
        tool calls read from it (tool_reply, in the format the chat template implies)."""
        if not req.tools:
            return {"role": "assistant", "content": text}
        content, calls = tool_reply(text, get_tool_format(self.tool_format, self.tok), req.tools)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def record(self, call_id: str, session: Optional[str], prompt, ids, logps, reasons, temperature) -> None:
        if not self.save:
            return
        line = {"id": call_id, "session": session, "created": int(time.time()), "model": self.name,
                "prompt_token_ids": prompt, "logprob_temperature": temperature,
                "choices": [{"completion_token_ids": c, "completion_logprobs": lp, "finish_reason": r}
                            for c, lp, r in zip(ids, logps, reasons)]}
        p = Path(self.save).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        with self.lock, p.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    @staticmethod
    def usage(prompt, ids) -> dict:
        done = sum(map(len, ids))
        return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}

    def completion(self, req: ChatRequest, session: Optional[str] = None) -> dict:
        """A non-streamed response."""
        prompt, room = self.prompt(req)
        ids, logps, reasons, temperature, tops = self.sample(req, prompt, room)
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.record(call_id, session, prompt, ids, logps, reasons, temperature)
        choices = []
        for i, (c, lp, r, top) in enumerate(zip(ids, logps, reasons, tops)):
            choice = self.choice(req, i, prompt, c, lp, r, temperature, top)
            choice["message"] = self.message(req, visible(decode(self.tok, c), req.stop, True))
            if "tool_calls" in choice["message"]:
                choice["finish_reason"] = "tool_calls"
            choices.append(choice)
        return {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": self.usage(prompt, ids)}

    def events(self, req: ChatRequest, prompt: list[int], room: int, session: Optional[str] = None):
        """A streamed response: server-sent events, each a `data: {chunk}` line, then `data: [DONE]`.
        The text comes as it is sampled; each choice's last chunk carries its finish reason, its
        log-probs and its token ids. With `tools`, a choice's text and tool calls come together
        in its last chunk (module docstring)."""
        call_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": self.name}

        def chunk(choices, **extra) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        q: queue.Queue = queue.Queue()

        def work():
            try:
                q.put(("done", self.sample(req, prompt, room, stream=lambda i, ids: q.put(("ids", i, ids)))))
            except Exception as e:  # noqa: BLE001 - said in the stream; the server goes on
                q.put(("error", e))

        threading.Thread(target=work, daemon=True).start()
        for i in range(req.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        sampled: list[list[int]] = [[] for _ in range(req.n)]
        sent = [""] * req.n
        while True:
            kind, *rest = q.get()
            if kind == "ids":
                if req.tools:  # held to the end: the text may turn out to be a call
                    continue
                i, new = rest
                sampled[i] += new
                text = visible(decode(self.tok, sampled[i]), req.stop, False)
                if len(text) > len(sent[i]) and text.startswith(sent[i]):
                    yield chunk([{"index": i, "delta": {"content": text[len(sent[i]):]}, "logprobs": None,
                                  "finish_reason": None}])
                    sent[i] = text
            elif kind == "error":
                e = rest[0]
                yield f"data: {json.dumps(error_body(f'sampling failed: {type(e).__name__}: {e}', 'server_error'))}\n\n"
                yield "data: [DONE]\n\n"
                return
            else:
                ids, logps, reasons, temperature, tops = rest[0]
                self.record(call_id, session, prompt, ids, logps, reasons, temperature)
                for i, (c, lp, r, top) in enumerate(zip(ids, logps, reasons, tops)):
                    text = visible(decode(self.tok, c), req.stop, True)
                    choice = self.choice(req, i, prompt, c, lp, r, temperature, top)
                    if req.tools:
                        message = self.message(req, text)
                        choice["delta"] = {} if message["content"] is None else {"content": message["content"]}
                        if "tool_calls" in message:
                            choice["delta"]["tool_calls"] = [{"index": j, **call}
                                                             for j, call in enumerate(message["tool_calls"])]
                            choice["finish_reason"] = "tool_calls"
                    else:
                        choice["delta"] = {"content": text[len(sent[i]):]} if text.startswith(sent[i]) else {}
                    yield chunk([choice])
                if req.include_usage:
                    yield chunk([], usage=self.usage(prompt, ids))
                yield "data: [DONE]\n\n"
                return


def make_app(model_path: str, device: str = "auto", dtype: str = "auto", name: str = "",
             max_tokens: int = 1024, save: str = "", tool_format: str = "auto"):
    """The FastAPI app serving `model_path` (a checkpoint, a run directory: its latest checkpoint, a
    hub id) at /v1 (module docstring). Needs the studio extra (fastapi)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.concurrency import run_in_threadpool
        from fastapi.responses import JSONResponse, StreamingResponse
        from starlette.exceptions import HTTPException
    except ImportError as e:
        raise UserError(f"tether serve needs fastapi and uvicorn: pip install 'tether[studio]' ({e})") from None
    from tether.models.load import hf_progress, load_model, load_tokenizer

    path = resolve_model_path(model_path)
    tokenizer = load_tokenizer(path)
    with hf_progress(False):
        model = load_model(path, dtype=dtype, device=device)
    server = Server(model, tokenizer, name or model_path, max_tokens=max_tokens, save=save,
                    tool_format=tool_format)

    app = FastAPI(title="tether serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(BadRequest)
    async def bad_request(_request, e: BadRequest):
        return JSONResponse(error_body(e.message, param=e.param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "tether", "max_model_len": server.context}]}

    # (no `from __future__ import annotations` in this module: FastAPI reads `request: Request`, a
    # name local to this function, from the annotation itself)
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not JSON: {e}") from None
        req = parse_request(body, server.max_tokens)
        session = request.headers.get("x-session-id")
        try:
            if req.stream:
                prompt, room = server.prompt(req)  # a bad request is a 400 before the stream starts
                return StreamingResponse(server.events(req, prompt, room, session), media_type="text/event-stream")
            return await run_in_threadpool(server.completion, req, session)
        except BadRequest:
            raise
        except Exception as e:  # noqa: BLE001 - one request failed; the server goes on
            return JSONResponse(error_body(f"sampling failed: {type(e).__name__}: {e}", "server_error"),
                                status_code=500)

    return app


def run_serve(cfg: ServeConfig) -> dict:
    """Serve until Ctrl-C."""
    try:
        import uvicorn
    except ImportError as e:
        raise UserError(f"tether serve needs fastapi and uvicorn: pip install 'tether[studio]' ({e})") from None
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # bound before the model loads: a port in use is one line, at once
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sock.close()
        raise UserError(f"serve: cannot bind {cfg.host}:{cfg.port}: {e.strerror}") from None
    app = make_app(cfg.model, device=cfg.device, dtype=cfg.dtype, name=cfg.name, max_tokens=cfg.max_tokens,
                   save=cfg.save, tool_format=cfg.tool_format)
    sock.listen(2048)
    port = sock.getsockname()[1]
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    server = app.state.server
    device = next(server.model.parameters()).device
    print(f"tether serve: {server.name} on {device.type} at http://{shown}:{port}/v1 "
          "(OpenAI chat completions; one request at a time)", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return {}


__all__ = ["ServeConfig", "Server", "make_app", "run_serve", "parse_request", "BadRequest"]
