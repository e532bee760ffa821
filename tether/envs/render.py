"""An episode's environment messages as token ids (token-in/token-out).

A multi-turn episode is one token sequence that only grows: the prompt, then per turn the ids
the model generated, then the ids of the environment's answer. Nothing already in the sequence is
re-tokenized, so the log-probs the sampler recorded stay the log-probs of the ids trained on.

    prompt_ids(...)                     mask 0  the start messages + the generation prompt
    the model's ids, stop token too     mask 1  what the sampler generated, up to and including
                                                `end_of_turn_ids(tok).stop` (e.g. <|im_end|>)
    observation_ids(tok, messages, ...) mask 0  what the template writes after the stop token
                                                (`.after`, e.g. "\\n"), the environment's
                                                messages, and the next generation prompt
    the model's ids ...                 mask 1

`observation_ids` renders a fixed conversation ending in an assistant turn with and without the
new messages (as verifiers and SkyRL do) and takes the difference, starting right after the stop
token: the ids of the whole render past the ids of the render through the stop token. It checks
that the template's rendering of the earlier turns is unchanged by what follows them (as text) and
that their ids are too (no merge across the stop token); a template that fails either (e.g. one
that drops the reasoning of earlier turns once a user message follows) raises
:class:`ObservationTemplateError`.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

from tether.data.chat import ChatTemplateError, encode_text, render, special_ids

__all__ = ["EndOfTurn", "ObservationTemplateError", "end_of_turn_ids", "observation_ids",
           "prompt_ids", "template_renders_tools"]

# The fixed conversation observation_ids renders: its text never reaches the model.
_MARK = "ZQZQ"
_BASE = [{"role": "user", "content": "Q" + _MARK}, {"role": "assistant", "content": _MARK}]


class ObservationTemplateError(ChatTemplateError):
    """The chat template cannot be rendered incrementally: adding messages changes how it renders
    the turns before them, or tokenizing the added text alone differs from tokenizing it in
    place. The message says which, and where."""


@dataclass(frozen=True)
class EndOfTurn:
    """What the chat template writes after an assistant message's content.

    `stop`: the ids the model ends its turn with (generated, loss mask 1), through the last
    special token, e.g. [<|im_end|>]; sampling stops on them. `after`: what the template writes
    after them (e.g. "\\n"), the environment's side (mask 0): `observation_ids` starts with it.
    `text`: the whole string, e.g. "<|im_end|>\\n"; `after_text`: its part after the stop, "\\n"."""
    text: str
    stop: list[int]
    after: list[int]
    after_text: str

    @property
    def ids(self) -> list[int]:
        return self.stop + self.after


# Per tokenizer (weakly: a cache entry goes with its tokenizer), per (template, tools).
_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _cache(tokenizer, tools) -> dict:
    """The cache entry of this tokenizer, template and tools list."""
    key = (str(getattr(tokenizer, "chat_template", None)),
           json.dumps(tools or [], sort_keys=True, default=str))
    try:
        per_tokenizer = _CACHE.setdefault(tokenizer, {})
    except TypeError:  # an object that cannot be weakly referenced: no caching
        return {}
    return per_tokenizer.setdefault(key, {})


def end_of_turn_ids(tokenizer, tools: list[dict] | None = None) -> EndOfTurn:
    """The template's end of an assistant turn, split into the model's stop ids and what follows.

    Raises ChatTemplateError when the template writes no special token after an assistant's
    content (the model would have no token to end its turn on)."""
    cache = _cache(tokenizer, tools)
    if "eot" in cache:
        return cache["eot"]
    full = render(tokenizer, _BASE, tools=tools)
    # The user's content holds the mark too: found only once, the template dropped the assistant's.
    at = full.rfind(_MARK)
    if at < 0 or full.rfind(_MARK, 0, at) < 0:
        raise ChatTemplateError("chat template does not render the assistant's content verbatim; "
                                "cannot find where an assistant turn ends")
    text = full[at + len(_MARK):]
    ids = encode_text(tokenizer, text)
    specials = special_ids(tokenizer)
    last = max((i for i, t in enumerate(ids) if t in specials), default=None)
    if last is None:
        raise ChatTemplateError(f"chat template ends an assistant turn with {text!r}, which holds no "
                                "special token: the model has no token to end its turn on")
    stop_token = tokenizer.convert_ids_to_tokens(ids[last])
    cut = text.rfind(stop_token) + len(stop_token) if stop_token and stop_token in text else len(text)
    if encode_text(tokenizer, text[:cut]) != ids[:last + 1]:
        raise ChatTemplateError(f"cannot split the template's end of an assistant turn {text!r} at "
                                "its last special token")
    eot = EndOfTurn(text, ids[:last + 1], ids[last + 1:], text[cut:])
    cache["eot"] = eot
    return eot


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _base(tokenizer, tools, context) -> tuple[str, list[int]]:
    """The fixed (or given) conversation rendered through its last assistant turn's stop token:
    (text, ids)."""
    cache = _cache(tokenizer, tools)
    if context is None and "base" in cache:
        return cache["base"]
    conv = _BASE if context is None else context
    if not conv or conv[-1].get("role") != "assistant":
        raise ValueError("observation_ids: the context must end with an assistant message")
    eot = end_of_turn_ids(tokenizer, tools)
    text = render(tokenizer, conv, tools=tools)
    if not text.endswith(eot.text):
        raise ObservationTemplateError(
            f"chat template ends the last assistant turn with {text[-len(eot.text) - 10:]!r}, not "
            f"with its usual end of turn {eot.text!r}")
    cut = text[:len(text) - len(eot.after_text)]   # through the stop token
    out = (cut, encode_text(tokenizer, cut))
    if context is None:
        cache["base"] = out
    return out


def observation_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
                    context: list[dict] | None = None) -> list[int]:
    """Token ids of the environment's `messages` as the delta the chat template adds after an
    assistant turn that ended with its stop token, through the generation prompt of the next
    assistant turn. Every id is the environment's (loss mask 0).

    `tools`: what the prompt was rendered with (the template may print them in a header).
    `context`: the conversation so far, ending in the assistant's message, to check the template
    against it instead of a fixed stand-in conversation (slower: it is rendered every call)."""
    if not messages:
        raise ValueError("observation_ids: no messages")
    base_text, base_ids = _base(tokenizer, tools, context)
    conv = (_BASE if context is None else list(context)) + list(messages)
    text = render(tokenizer, conv, add_generation_prompt=True, tools=tools)
    if not text.startswith(base_text):
        i = _first_difference(base_text, text)
        raise ObservationTemplateError(
            "chat template renders the earlier turns differently once the environment's messages "
            f"follow them (at character {i}: {base_text[i:i + 40]!r} becomes {text[i:i + 40]!r}); "
            "token-in/token-out needs a template that leaves earlier turns as they were (templates "
            "that drop earlier reasoning do this)")
    # Tokenized in place, not alone: a tokenizer that prepends a space to the start of a text
    # (SentencePiece's prefix space) would otherwise add one the full render does not have.
    whole = encode_text(tokenizer, text)
    if whole[:len(base_ids)] != base_ids:
        i = next((j for j, (a, b) in enumerate(zip(whole, base_ids)) if a != b), len(whole))
        raise ObservationTemplateError(
            f"tokenizing the conversation with the environment's messages changes the ids of the "
            f"turns before them (at token {i}): the tokenizer merges across the end of the "
            "assistant's turn")
    return whole[len(base_ids):]


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of an episode's start messages through the first generation prompt (mask 0)."""
    return encode_text(tokenizer, render(tokenizer, messages, add_generation_prompt=True, tools=tools))


_PROBE = {"type": "function", "function": {
    "name": "tether_probe_tool", "description": "Probe.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template prints a `tools=` list (Qwen's does; SmolLM2's and Gemma 3's do
    not, so an episode writes the tool descriptions into a system message instead)."""
    try:
        text = render(tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=True,
                      tools=[_PROBE])
    except ChatTemplateError:
        return False
    return "tether_probe_tool" in text
