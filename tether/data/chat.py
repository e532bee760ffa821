"""Chat templates -> token ids + which tokens are the assistant's.

The chat template comes from the tokenizer (``tokenizer.apply_chat_template``). To find the
assistant's tokens we do NOT rely on ``{% generation %}`` blocks (few templates have them).
Instead, for every assistant turn ``i`` we render two prefixes of the conversation —

* ``messages[:i]`` with ``add_generation_prompt=True``: ends where the assistant's text starts
* ``messages[:i+1]``: ends after the assistant's text and its end-of-turn tokens

— tokenize them, and take the length of their longest common token prefix with the full
conversation. The tokens between the two boundaries are the assistant turn: its content plus
end-of-turn markers (e.g. ``<|im_end|>``). Whitespace the template prints *after* the last
special token of the turn (ChatML's ``"\\n"``) is not part of what the model must generate, so it
is left out. Comparing token ids (not strings) keeps this exact even when a template renders
earlier turns slightly differently or BPE merges across a boundary: the boundary then moves to
the first token that differs, never into the wrong turn.

Rendered text is tokenized with ``add_special_tokens=False``: templates write BOS themselves
(that is also what ``apply_chat_template(tokenize=True)`` does).
"""

from __future__ import annotations

from typing import Any

__all__ = ["render", "encode_text", "special_ids", "common_prefix", "encode_messages",
           "encode_prompt_response", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """Rendering failed (no template, or the template raised); callers add file/row/field."""


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False,
           continue_final_message: bool = False, tools: Any = None) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("conversational data needs a chat template but the tokenizer has "
                                "none (set tokenizer.chat_template)")
    kwargs = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja TemplateError, raise_exception() in templates, ...
        msg = (str(e).strip().splitlines() or [""])[0]
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {msg}") from e
    if not isinstance(text, str):  # some versions return a list for batched input
        text = text[0]
    return text


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def special_ids(tokenizer) -> set[int]:
    """Ids of all special tokens, including added tokens flagged special (e.g. ``<|im_end|>``)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _trim_after_end(tokenizer, ids: list[int], start: int, end: int, specials: set[int]) -> int:
    """Move ``end`` back over whitespace-only tokens that follow the turn's last special token."""
    last = max((j for j in range(start, end) if ids[j] in specials), default=None)
    if last is None:
        return end
    tail = ids[last + 1:end]
    if tail and tokenizer.decode(tail).strip() == "":
        return last + 1
    return end


def encode_messages(tokenizer, messages: list[dict], *, train_from: int = 0,
                    assistant_only: bool = True, tools: Any = None) -> tuple[list[int], list[int], int]:
    """Render and tokenize a conversation.

    Returns ``(input_ids, completion_mask, prompt_length)``: mask 1 on the content + end-of-turn
    tokens of assistant messages with index >= ``train_from`` (all tokens after the first if
    ``assistant_only`` is False); ``prompt_length`` = tokens before message ``train_from``'s
    assistant text (i.e. up to and including the generation prompt).
    """
    turns = [i for i in range(train_from, len(messages)) if messages[i].get("role") == "assistant"]
    # Boundaries needed: (k, gen) = "render messages[:k], with the generation prompt or not".
    keys = sorted({(i, True) for i in turns} | {(i + 1, False) for i in turns}
                  | ({(train_from, True)} if train_from > 0 else set()))
    texts = [render(tokenizer, messages, tools=tools)]
    for k, gen in keys:
        if k == 0 and not gen:
            texts.append("")
            continue
        try:
            texts.append(render(tokenizer, messages[:k], add_generation_prompt=gen, tools=tools))
        except ChatTemplateError:
            if k > 0:
                raise
            texts.append("")  # templates may refuse an empty conversation: start at 0
    # one batched call: fast tokenizers encode the prefixes in parallel
    encoded = [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    full = encoded[0]
    bound = {key: common_prefix(ids, full) for key, ids in zip(keys, encoded[1:])}
    specials = special_ids(tokenizer)
    mask = [0] * len(full)
    prompt_length = bound[train_from, True] if train_from > 0 else 0
    for i in turns:
        start = bound[i, True]
        end = _trim_after_end(tokenizer, full, start, bound[i + 1, False], specials)
        for t in range(start, end):
            mask[t] = 1
    if not assistant_only:
        # everything is a target except the first token (nothing predicts it) / the prompt
        first = max(prompt_length, 1)
        mask = [0 if t < first else 1 for t in range(len(full))]
    return full, mask, prompt_length


def encode_prompt_response(tokenizer, prompt: list[dict], responses: list[list[dict]],
                           tools: Any = None) -> tuple[list[int], list[list[int]]]:
    """Conversational prompt + one or more alternative responses (preference/unpaired data).

    Returns ``(prompt_ids, [response_ids, ...])`` such that ``prompt_ids + response_ids`` is
    exactly the tokenized full conversation (trailing whitespace after the last end-of-turn
    token dropped). All responses share the same ``prompt_ids``.
    """
    specials = special_ids(tokenizer)
    p_ids = encode_text(tokenizer, render(tokenizer, prompt, add_generation_prompt=True, tools=tools))
    fulls = [encode_text(tokenizer, render(tokenizer, prompt + r, tools=tools)) for r in responses]
    k = min(common_prefix(p_ids, f) for f in fulls)  # == len(p_ids) for any sane template
    outs = []
    for f in fulls:
        end = _trim_after_end(tokenizer, f, k, len(f), specials)
        outs.append(f[k:end])
    return p_ids[:k], outs
