"""Rows -> token ids (+ loss masks), with truncation that is counted and reported.

Conventions (see docs/data.md):

* ``completion_mask`` is aligned with ``input_ids``: ``completion_mask[t] == 1`` means token
  ``t`` is a training target, i.e. the loss includes ``-log p(input_ids[t] | input_ids[:t])``.
  A trainer computing logits for every position uses ``logits[:, :-1]`` against
  ``input_ids[:, 1:]`` weighted by ``completion_mask[:, 1:]``.
* Standard (string) text: ``tokenizer.bos_token`` is prepended when the tokenizer itself would
  prepend it (:func:`bos_ids`; unless the text already starts with it); ``eos_token`` is appended to every completion/response and to
  language-modelling text, so models learn to stop. Prompt and completion are tokenized
  separately — the completion tokens are exactly what the model would generate after the prompt.
* Conversational data goes through the tokenizer's chat template (see :mod:`tether.data.chat`).
* Rows longer than ``max_length``: ``truncation="truncate"`` keeps the start (cuts the end of
  the completion); a row whose prompt alone fills ``max_length`` is dropped. ``"drop"`` drops
  every row over ``max_length``. Rows left with nothing to train on are dropped. Everything is
  counted in an :class:`EncodeReport` and logged on ``logging.getLogger("tether.data")``.
* Prompts (prompt-only data, ``max_prompt_length``) are cut from the left, keeping BOS: for
  generation the *end* of the prompt — the latest turn — matters most.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .chat import ChatTemplateError, encode_messages, encode_prompt_response, encode_text, render
from .errors import DataError
from .formats import FORMATS, RowChecker, check_format, check_soft_labels
from .rows import as_rows

__all__ = ["EncodeReport", "encode_lm", "encode_prompt_completion", "encode_sft",
           "encode_preference", "encode_unpaired", "encode_prompts", "encode_stepwise", "bos_ids"]

logger = logging.getLogger("tether.data")
LISTED = 5  # row numbers kept in the report, and per-row warnings logged, per kind


@dataclass
class EncodeReport:
    """What tokenization did to the rows: counts plus the first few row numbers of each kind."""

    source: str
    max_length: int | None = None
    total: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    truncated_rows: list[int] = field(default_factory=list)
    dropped_rows: list[int] = field(default_factory=list)
    drop_reasons: Counter = field(default_factory=Counter)
    limit_name: str = "max_length"  # "max_prompt_length" for prompt-only data
    # 0-based position in the input rows of each returned example (rows may be dropped), so
    # ``rows[report.kept_index[j]]`` is the row that ``examples[j]`` came from.
    kept_index: list[int] = field(default_factory=list, repr=False)

    def truncate(self, row: int, detail: str) -> None:
        self.truncated += 1
        if len(self.truncated_rows) < LISTED:
            self.truncated_rows.append(row)
            logger.warning("%s:%s: truncated: %s", self.source, row, detail)

    def drop(self, row: int, reason: str, detail: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] += 1
        if len(self.dropped_rows) < LISTED:
            self.dropped_rows.append(row)
            logger.warning("%s:%s: dropped: %s", self.source, row, detail)

    def summary(self) -> str:
        """One line, e.g. ``data.jsonl: 1000 rows, 990 kept, 7 truncated (rows 3, 9, ...), 3
        dropped (prompt too long: 3; rows 17, ...) at max_length=512``."""
        def rows(listed: list[int], n: int) -> str:
            more = ", ..." if n > len(listed) else ""
            return ", ".join(map(str, listed)) + more
        text = f"{self.source}: {self.total} rows, {self.kept} kept, {self.truncated} truncated"
        if self.truncated:
            text += f" (rows {rows(self.truncated_rows, self.truncated)})"
        text += f", {self.dropped} dropped"
        if self.dropped:
            reasons = ", ".join(f"{r}: {c}" for r, c in self.drop_reasons.most_common())
            text += f" ({reasons}; rows {rows(self.dropped_rows, self.dropped)})"
        if self.max_length is not None:
            text += f" at {self.limit_name}={self.max_length}"
        return text

    def _finish(self, what: str) -> None:
        if self.truncated or self.dropped:
            logger.warning("%s", self.summary())
        if self.total and not self.kept:
            raise DataError(self.source, None, None, f"no rows left after tokenizing {what}: "
                            f"all {self.total} dropped ({', '.join(self.drop_reasons)})")


# ------------------------------------------------------------------ standard-text conventions

def bos_ids(tokenizer) -> list[int]:
    """``[bos_token_id]`` when the tokenizer itself starts an encoded text with BOS (its
    post-processor, or ``add_bos_token``: what ``tokenizer(text)`` does, as HF and TRL encode),
    else ``[]``. Having a BOS token is not enough: ChatML tokenizers (SmolLM2) name
    ``<|im_start|>`` as BOS but never prepend it, and prepending it to plain text gave a broken
    chat header (``<|im_start|>\\n\\nHuman: ...``). Qwen has no BOS token at all."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    probe = list(tokenizer("a", add_special_tokens=True)["input_ids"])  # any non-empty text
    return [bos] if probe[:1] == [bos] else []


def _eos(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if eos is not None else []


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    ids = encode_text(tokenizer, text)
    bos = bos_ids(tokenizer)
    return ids if ids[:1] == bos else bos + ids  # no double BOS if the text already has it


def _completion_ids(tokenizer, text: str) -> list[int]:
    ids = encode_text(tokenizer, text)
    eos = _eos(tokenizer)
    return ids if eos and ids[-1:] == eos else ids + eos


# ------------------------------------------------------------------------ row-level encoders
# Each may raise ChatTemplateError; the batch encoders turn it into a DataError naming the row.

def encode_lm(row: dict, tokenizer, *, completion_only_loss: bool = True) -> dict[str, list[int]]:
    """Language-modelling row (``text`` or ``messages``) -> ``{input_ids, completion_mask}``.
    Text: every token is a target except BOS. Messages: assistant turns only (all tokens but the
    first if ``completion_only_loss`` is False)."""
    if "messages" in row:
        ids, mask, _ = encode_messages(tokenizer, row["messages"], assistant_only=completion_only_loss,
                                       tools=row.get("tools"))
        return {"input_ids": ids, "completion_mask": mask}
    ids, eos, bos = text_prompt_ids(tokenizer, row["text"]), _eos(tokenizer), bos_ids(tokenizer)
    if ids[-1:] != eos:
        ids += eos
    start = 1 if bos and ids[:1] == bos else 0  # BOS is never a target
    return {"input_ids": ids, "completion_mask": [0] * start + [1] * (len(ids) - start)}


def encode_prompt_completion(row: dict, tokenizer, *, completion_only_loss: bool = True) -> dict[str, Any]:
    """Prompt-completion row -> ``{input_ids, completion_mask, prompt_length}``: mask 1 exactly
    on the completion (incl. EOS / end-of-turn), or on everything if not completion-only."""
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list):
        ids, mask, plen = encode_messages(tokenizer, prompt + completion, train_from=len(prompt),
                                          tools=row.get("tools"))
    else:
        p, c = text_prompt_ids(tokenizer, prompt), _completion_ids(tokenizer, completion)
        ids, mask, plen = p + c, [0] * len(p) + [1] * len(c), len(p)
    if not completion_only_loss:
        mask = [0] + [1] * (len(ids) - 1)
    return {"input_ids": ids, "completion_mask": mask, "prompt_length": plen}


def _encode_responses(row: dict, tokenizer, keys: tuple[str, ...]) -> tuple[list[int], list[list[int]]]:
    prompt = row["prompt"]
    if isinstance(prompt, list):
        return encode_prompt_response(tokenizer, prompt, [row[k] for k in keys], tools=row.get("tools"))
    return text_prompt_ids(tokenizer, prompt), [_completion_ids(tokenizer, row[k]) for k in keys]


def _encode_prompt(row: dict, tokenizer) -> list[int]:
    prompt = row["prompt"]
    if isinstance(prompt, list):
        # A prompt ending in an assistant message is a prefill: continue it, don't open a new turn.
        cont = prompt[-1].get("role") == "assistant"
        return encode_text(tokenizer, render(tokenizer, prompt, add_generation_prompt=not cont,
                                             continue_final_message=cont, tools=row.get("tools")))
    return text_prompt_ids(tokenizer, prompt)


# -------------------------------------------------------------------------- batch encoders

def _run(rows, fmt_expected, source, fmt, max_length, truncation, what,
         one: Callable[[int, dict, EncodeReport], dict | None]) -> tuple[list[dict], EncodeReport]:
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    rows = as_rows(rows, source)
    src = rows.source
    columns = rows.columns
    if not columns:
        raise DataError(src, None, None, "dataset is empty (0 rows)")
    fmt = check_format(columns, fmt or fmt_expected, src)
    checker = RowChecker(fmt, src, columns)
    report = EncodeReport(src, max_length, limit_name="max_prompt_length" if what == "prompts" else "max_length")
    out = []
    for pos, (n, row) in enumerate(rows.numbered()):
        checker(row, n)  # cheap next to tokenization; guarantees one-line errors
        report.total += 1
        try:
            ex = one(n, row, report)
        except ChatTemplateError as e:
            main = next(f for f in FORMATS[fmt][0] if f in row) if fmt != "language-modeling" else \
                ("messages" if "messages" in row else "text")
            raise DataError(src, n, main, str(e)) from None
        if ex is not None:
            report.kept += 1
            report.kept_index.append(pos)
            out.append(ex)
    report._finish(what)
    return out, report


def _keep_prompt_end(ids: list[int], limit: int, bos: list[int]) -> list[int]:
    head = bos if bos and ids[:1] == bos else []
    keep = max(limit - len(head), 0)
    return head + ids[len(ids) - keep:] if keep else head[:limit]


def encode_sft(rows: Any, tokenizer, max_length: int | None = None, truncation: str = "truncate", *,
               source: str | None = None, fmt: str | tuple[str, ...] | None = None,
               completion_only_loss: bool = True) -> tuple[list[dict[str, list[int]]], EncodeReport]:
    """Language-modelling or prompt-completion rows -> ``[{input_ids, completion_mask}]``."""
    def one(n: int, row: dict, rep: EncodeReport) -> dict | None:
        if "prompt" in row:
            ex = encode_prompt_completion(row, tokenizer, completion_only_loss=completion_only_loss)
            plen = ex.pop("prompt_length")
        else:
            ex, plen = encode_lm(row, tokenizer, completion_only_loss=completion_only_loss), 0
        ids, mask = ex["input_ids"], ex["completion_mask"]
        if max_length is not None and len(ids) > max_length:
            if truncation == "drop":
                return rep.drop(n, "too long", f"{len(ids)} tokens > max_length={max_length}")
            if plen >= max_length:
                return rep.drop(n, "prompt too long", f"prompt alone is {plen} tokens >= max_length={max_length}")
            rep.truncate(n, f"{len(ids)} -> {max_length} tokens")
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            return rep.drop(n, "nothing to train on", "no target tokens (no assistant turn within max_length)")
        return {"input_ids": ids, "completion_mask": mask}

    return _run(rows, ("language-modeling", "prompt-completion"), source, fmt, max_length,
                truncation, "SFT data", one)


def _fit_responses(n: int, prompt: list[int], responses: list[list[int]], rep: EncodeReport,
                   bos: list[int], max_length, max_prompt_length, truncation):
    """Shared truncation for preference/unpaired data. Returns (prompt, responses) or None."""
    cut = False
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        if truncation == "drop":
            return rep.drop(n, "prompt too long", f"prompt {len(prompt)} tokens > max_prompt_length={max_prompt_length}")
        prompt, cut = _keep_prompt_end(prompt, max_prompt_length, bos), True
    if max_length is not None:
        longest = len(prompt) + max(len(r) for r in responses)
        if longest > max_length:
            if truncation == "drop":
                return rep.drop(n, "too long", f"{longest} tokens > max_length={max_length}")
            if len(prompt) >= max_length:
                return rep.drop(n, "prompt too long", f"prompt alone is {len(prompt)} tokens >= max_length={max_length}")
            responses, cut = [r[:max_length - len(prompt)] for r in responses], True
    if cut:
        rep.truncate(n, f"prompt {len(prompt)} tokens, responses cut to fit max_length={max_length}")
    return prompt, responses


def _extras(row: dict, fmt: str) -> dict:
    return {k: v for k, v in row.items() if k not in FORMATS[fmt][0]}


def encode_preference(rows: Any, tokenizer, max_length: int | None = None, truncation: str = "truncate", *,
                      max_prompt_length: int | None = None, source: str | None = None):
    """Preference rows -> ``[{prompt_ids, chosen_ids, rejected_ids, **extra columns}]``.
    ``prompt_ids + chosen_ids`` is the full chosen sequence; responses end with EOS/end-of-turn.
    ``max_length`` bounds prompt + each response."""
    bos = bos_ids(tokenizer)

    def one(n: int, row: dict, rep: EncodeReport) -> dict | None:
        prompt, responses = _encode_responses(row, tokenizer, ("chosen", "rejected"))
        fit = _fit_responses(n, prompt, responses, rep, bos, max_length, max_prompt_length, truncation)
        if fit is None:
            return None
        prompt, (chosen, rejected) = fit
        return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected,
                **_extras(row, "preference")}

    return _run(rows, "preference", source, None, max_length, truncation, "preference data", one)


def encode_unpaired(rows: Any, tokenizer, max_length: int | None = None, truncation: str = "truncate", *,
                    max_prompt_length: int | None = None, source: str | None = None):
    """Unpaired preference rows -> ``[{prompt_ids, completion_ids, label, **extra columns}]``."""
    bos = bos_ids(tokenizer)

    def one(n: int, row: dict, rep: EncodeReport) -> dict | None:
        prompt, responses = _encode_responses(row, tokenizer, ("completion",))
        fit = _fit_responses(n, prompt, responses, rep, bos, max_length, max_prompt_length, truncation)
        if fit is None:
            return None
        return {"prompt_ids": fit[0], "completion_ids": fit[1][0], "label": row["label"],
                **_extras(row, "unpaired-preference")}

    return _run(rows, "unpaired-preference", source, None, max_length, truncation, "unpaired data", one)


def encode_prompts(rows: Any, tokenizer, max_prompt_length: int | None = None, truncation: str = "truncate", *,
                   source: str | None = None):
    """Prompt rows (any format with ``prompt``) -> ``[{**row, prompt_ids}]``: every original
    column is kept (reward functions need e.g. ``answer``). Conversational prompts get the
    generation prompt; too-long prompts keep their end (and BOS) or are dropped."""
    bos = bos_ids(tokenizer)

    def one(n: int, row: dict, rep: EncodeReport) -> dict | None:
        ids = _encode_prompt(row, tokenizer)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if truncation == "drop":
                return rep.drop(n, "prompt too long", f"prompt {len(ids)} tokens > max_prompt_length={max_prompt_length}")
            rep.truncate(n, f"prompt {len(ids)} -> {max_prompt_length} tokens (kept the end)")
            ids = _keep_prompt_end(ids, max_prompt_length, bos)
        return {**row, "prompt_ids": ids}

    return _run(rows, "prompt-only", source, None, max_prompt_length, truncation, "prompts", one)


def encode_stepwise(rows: Any, tokenizer, max_length: int | None = None, truncation: str = "truncate", *,
                    step_separator: str = "\n", source: str | None = None, soft: bool = False):
    """Stepwise rows -> ``[{input_ids, step_labels}]`` for process reward models (as TRL's PRM):
    ``prompt`` then each step followed by ``step_separator``; ``step_labels`` is -100 everywhere
    except the last token of each step (its separator), which holds the step's 0/1 label, or with
    ``soft`` its ``soft_labels`` value (a float in [0, 1]; a row without valid ones is a DataError).
    Truncation keeps whole steps only; a row with no step fitting is dropped."""
    rows = as_rows(rows, source)

    def one(n: int, row: dict, rep: EncodeReport) -> dict | None:
        if soft and (problem := check_soft_labels(row)):
            raise DataError(rows.source, n, "soft_labels" + problem[0], problem[1])
        targets = [float(y) for y in row["soft_labels"]] if soft else [int(y) for y in row["labels"]]
        ids = text_prompt_ids(tokenizer, row["prompt"])
        labels = [-100] * len(ids)
        steps = [encode_text(tokenizer, s + step_separator) for s in row["completions"]]
        kept = 0
        for step, label in zip(steps, targets):
            if max_length is not None and len(ids) + len(step) > max_length:
                if truncation == "drop":
                    total = len(ids) + sum(len(s) for s in steps[kept:])
                    return rep.drop(n, "too long", f"{total} tokens > max_length={max_length}")
                break
            ids += step
            labels += [-100] * (len(step) - 1) + [label]
            kept += 1
        if kept == 0:
            return rep.drop(n, "prompt too long", f"prompt and first step exceed max_length={max_length}")
        if kept < len(steps):
            rep.truncate(n, f"kept {kept} of {len(steps)} steps within max_length={max_length}")
        return {"input_ids": ids, "step_labels": labels}

    return _run(rows, "stepwise", source, None, max_length, truncation, "stepwise data", one)
