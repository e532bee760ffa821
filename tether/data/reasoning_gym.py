"""reasoning-gym's procedural tasks as prompt rows: ``data=reasoning_gym:<task>?size=N&seed=S``.

``reasoning_gym.create_dataset(task, size=N, seed=S, **options)`` generates entries
``{"question", "answer", "metadata"}``, each deterministic in the seed and its index; the dataset's
own ``score_answer(answer, entry)`` grades an answer against one entry. A row carries:

* ``prompt``: the question as chat messages, after reasoning-gym's system prompt (option
  ``system``: ``default``, ``DeepSeekZero``, ``simple``, ``direct``, ``chain_of_draft`` --
  reasoning_gym.utils.SYSTEM_PROMPTS -- or ``none``), which asks for the answer in
  ``<answer>...</answer>``;
* ``answer``: the entry's answer (None for tasks without a single one, e.g. graph_color);
* ``reasoning_gym``: a JSON string ``{"task", "config", "index", "entry"}`` -- everything the
  built-in reward ``reasoning_gym`` needs to score a completion with the dataset's own
  ``score_answer``, without regenerating the entry.

The entry travels in the row, encoded so that it decodes to an equal object: tuples, sets and
dicts with non-string keys are tagged (arc_agi's grids are tuples of tuples, graph_color's
colorings have int keys), since a plain JSON round trip changes what arc_agi's and rearc's
scorers return. Regenerating the entry from (task, config, index) instead would depend on every
generator being deterministic, which list_functions is not (two datasets built with seed 1 give
different questions at index 1).

Every other query option goes to the task's config dataclass, its value read as JSON when it
parses (``max_terms=3``, ``allow_negation=true``) and as a string otherwise.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
from typing import Any
from urllib.parse import parse_qsl

from .errors import DataError
from .rows import Rows

__all__ = ["SCHEME", "EXTRA_HINT", "is_reasoning_gym", "reasoning_gym_rows", "parse_source",
           "encode_entry", "decode_entry", "scorer", "score_completion"]

log = logging.getLogger(__name__)

SCHEME = "reasoning_gym:"
EXTRA_HINT = "pip install 'tether[reasoning-gym]'"
DEFAULT_SIZE = 500  # reasoning-gym's own default size
SYSTEM_OPTIONS = ("default", "DeepSeekZero", "simple", "direct", "chain_of_draft", "none")


def is_reasoning_gym(source: str) -> bool:
    return str(source).startswith(SCHEME)


def _import(what: str):
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(None, None, None, f"{what} needs reasoning-gym: {EXTRA_HINT}") from None
    return reasoning_gym


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_source(source: str) -> tuple[str, dict, str]:
    """``reasoning_gym:chain_sum?size=32&seed=0&max_terms=3`` -> ("chain_sum", {"size": 32,
    "seed": 0, "max_terms": 3}, system). ``size`` defaults to 500, ``seed`` to 0."""
    body = source[len(SCHEME):]
    task, _, query = body.partition("?")
    task = task.strip()
    if not task:
        raise DataError(None, None, None, f"{source!r}: no task; write reasoning_gym:<task>?size=N&seed=S")
    config: dict[str, Any] = {}
    for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key in config:
            raise DataError(None, None, None, f"{source!r}: option {key!r} given twice")
        config[key] = _value(text)
    system = config.pop("system", "default")
    if system not in SYSTEM_OPTIONS:
        raise DataError(None, None, None, f"{source!r}: system={system!r}; expected one of "
                        f"{', '.join(SYSTEM_OPTIONS)}")
    for key, default in (("size", DEFAULT_SIZE), ("seed", 0)):
        value = config.setdefault(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "size" else 0):
            raise DataError(None, None, None, f"{source!r}: {key}={value!r} is not an integer "
                            f">= {1 if key == 'size' else 0}")
    return task, config, system


@functools.lru_cache(maxsize=32)
def _dataset(task: str, config_json: str):
    rg = _import(f"reasoning_gym:{task}")
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else \
            f" ({len(DATASETS)} tasks: reasoning_gym.factory.DATASETS)"
        raise DataError(None, None, None, f"reasoning_gym: unknown task {task!r}{hint}")
    try:
        return rg.create_dataset(task, **json.loads(config_json))
    except Exception as e:  # an unknown option (TypeError), a failed validate() (AssertionError)
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(None, None, None, f"reasoning_gym:{task}: config "
                        f"{config_json}: {type(e).__name__}: {text}") from None


def scorer(task: str, config: dict):
    """The dataset built from (task, config), cached per process: its `score_answer` grades
    answers (some scorers read the config, so the row's own config rebuilds it)."""
    return _dataset(task, json.dumps(config, sort_keys=True))


# ---------------------------------------------------------------- the entry's exact JSON form

def encode_entry(value: Any) -> Any:
    """A reasoning-gym entry as JSON-able data that :func:`decode_entry` turns back into an equal
    object: tuples, sets and dicts with a non-string key are tagged; numpy scalars become Python
    numbers."""
    if isinstance(value, str) or value is None or isinstance(value, (bool, int, float)):
        return str(value) if isinstance(value, str) and type(value) is not str else value
    if isinstance(value, tuple):
        return {"__tuple__": [encode_entry(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [encode_entry(v) for v in value]}
    if isinstance(value, list):
        return [encode_entry(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {"__tuple__", "__set__", "__dict__"} & set(value):
            return {k: encode_entry(v) for k, v in value.items()}
        return {"__dict__": [[encode_entry(k), encode_entry(v)] for k, v in value.items()]}
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        return encode_entry(item())
    raise TypeError(f"cannot store a {type(value).__name__} in a row")


def decode_entry(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_entry(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag == "__tuple__":
                return tuple(decode_entry(v) for v in inner)
            if tag == "__set__":
                return {decode_entry(v) for v in inner}
            if tag == "__dict__":
                return {decode_entry(k): decode_entry(v) for k, v in inner}
        return {k: decode_entry(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- rows

def _prompt(question: str, system: str) -> list[dict]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    user = {"role": "user", "content": question}
    return [user] if system == "none" else [{"role": "system", "content": SYSTEM_PROMPTS[system]}, user]


def reasoning_gym_rows(source: str) -> Rows:
    """The rows of ``reasoning_gym:<task>?size=N&seed=S[&system=...][&<config option>=...]``
    (module docstring); one-line DataErrors, naming the extra when reasoning-gym is missing."""
    task, config, system = parse_source(source)
    _import(source)
    dataset = scorer(task, config)
    rows = []
    for index in range(len(dataset)):
        entry = dataset[index]
        try:
            stored = encode_entry(entry)
        except TypeError as e:
            raise DataError(source, index + 1, "entry", str(e)) from None
        spec = {"task": task, "config": config, "index": index, "entry": stored}
        rows.append({"prompt": _prompt(entry["question"], system), "answer": entry.get("answer"),
                     "reasoning_gym": json.dumps(spec, sort_keys=True)})
    return Rows(rows, source)


# ---------------------------------------------------------------- scoring

def score_completion(spec_json: str, text: str, tag: str | None = "answer") -> float:
    """The dataset's own ``score_answer`` for a completion, given a row's ``reasoning_gym``
    column. The answer is the last ``<tag>...</tag>`` (reasoning_gym.utils.extract_answer; with
    ``tag=None`` the whole stripped text); no such block scores 0.0. A scorer that raises on a
    malformed answer (boxnet, game_of_life and prime_factorization do) scores it 0.0."""
    from reasoning_gym.utils import extract_answer

    spec = json.loads(spec_json)
    answer = text.strip() if tag is None else extract_answer(text, tag_name=tag)
    if answer is None:
        return 0.0
    entry = decode_entry(spec["entry"])
    dataset = scorer(spec["task"], spec["config"])
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception as e:
        log.debug("reasoning_gym:%s: score_answer raised %s on %r: scored 0.0", spec["task"],
                  type(e).__name__, answer[:80])
        return 0.0
