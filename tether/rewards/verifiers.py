"""Built-in reward functions (TRL signature). Each factory returns a function named as its
built-in name, so metrics read `rewards/math/mean`, `rewards/format/mean`, ...

  math            final-answer checker: '#### n', else '\\boxed{n}', else the last number
  format          1.0 if the completion matches a regex (default <think>..</think><answer>..</answer>)
  length_penalty  soft overlong penalty: 0 until max_length - cache, then linear down to -1
  arithmetic      the embedded arithmetic task's verifier (strict: only the '#### n' line counts)
  code            the completion's Python, graded by the row's `tests` in the sandbox: 1 or 0
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any

# by module path, not `from tether.rewards import`: the package __init__ imports the registry,
# which imports this module, so going through the __init__ would be a cycle
from tether.rewards.sandbox import SandboxLimits, parse_tests, run_batch
from tether.tasks.arithmetic import check_answer

log = logging.getLogger(__name__)


def completion_text(c: Any) -> str:
    """A completion as text: a string, or (conversational) the last message's content."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    if isinstance(c, dict):
        return str(c.get("content", ""))
    return str(c)


def _named(fn, name):
    fn.__name__ = fn.__qualname__ = name
    return fn


# --- math ----------------------------------------------------------------------------------

# A number: '1,234.5', '-3', '.5', '3/4'. The minus only counts when it is not a hyphen between
# words or numbers ('3-4' is not minus four). Commas must group thousands, so '3,4' is two numbers.
_NUM = (r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
        r"|(?:(?<![\w)])-)?\.\d+")
_NUM_RE = re.compile(_NUM)
_FRAC_TEX = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]+?)\s*\}\s*\{\s*([^{}]+?)\s*\}")
_FINAL = re.compile(r"####\s*(.*)")


def _clean(s: str) -> str:
    s = s.replace("\u2212", "-").replace("\\!", "").replace("\\,", "").replace("\\$", "")
    s = s.replace("$", "").replace("\\%", "").replace("%", "")
    s = _FRAC_TEX.sub(r"\1/\2", s)
    # Thin spaces inside numbers ('1 000') are rare; spaces between sign and digits are not.
    return re.sub(r"-\s+(?=\d)", "-", s)


def parse_number(s: str) -> Fraction | None:
    """The first number in `s` as an exact Fraction ('1,200' -> 1200, '3/4', '0.75', '42.')."""
    m = _NUM_RE.search(_clean(s))
    if not m:
        return None
    tok = m.group(0).replace(",", "").replace(" ", "")
    try:
        if "/" in tok:
            num, den = tok.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(tok)
    except (ValueError, ZeroDivisionError):
        return None


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces matched (so \\boxed{\\frac{3}{4}} works)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_math_answer(text: str) -> Fraction | None:
    """GSM8K's '#### n' (last one), else the last \\boxed{}, else the last number in the text."""
    text = completion_text(text)
    finals = _FINAL.findall(text)
    if finals:
        return parse_number(finals[-1])
    boxed = _last_boxed(text)
    if boxed is not None:
        return parse_number(boxed)
    nums = _NUM_RE.findall(_clean(text))
    return parse_number(nums[-1]) if nums else None


def answers_match(got: Fraction | None, want: Fraction | None) -> bool:
    if got is None or want is None:
        return False
    # Exact for integers and fractions; a relative 1e-6 for decimals rounded by the writer.
    return got == want or abs(got - want) <= Fraction(1, 10**6) * max(1, abs(want))


def make_math(answer_column: str = "answer"):
    """1.0 if the completion's final answer equals the row's answer (which may itself be a full
    GSM8K solution ending in '#### n'), 0.0 if not, None if the row has no answer."""
    def math(prompts, completions, completion_ids=None, **columns):
        if answer_column not in columns:
            raise KeyError(f"needs a {answer_column!r} column; got {sorted(columns)}")
        out: list[float | None] = []
        for c, ref in zip(completions, columns[answer_column]):
            if ref is None:
                out.append(None)
                continue
            want = extract_math_answer(str(ref))
            out.append(float(answers_match(extract_math_answer(c), want)))
        return out
    return _named(math, "math")


# --- format --------------------------------------------------------------------------------

DEFAULT_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


def make_format(pattern: str = DEFAULT_FORMAT, flags: int = re.DOTALL):
    """1.0 if the whole completion matches `pattern` (re.fullmatch), else 0.0."""
    rx = re.compile(pattern, flags)

    def format(prompts, completions, completion_ids=None, **columns):
        return [float(rx.fullmatch(completion_text(c)) is not None) for c in completions]
    return _named(format, "format")


# --- length penalty ------------------------------------------------------------------------

def make_length_penalty(max_length: int = 512, cache: int = 128):
    """DAPO's soft overlong punishment, in tokens (completion_ids; whitespace words if absent):
    0 for length <= max_length - cache, then linear down to -1 at max_length, -1 beyond.
    Soft so that long-but-finished answers are nudged, not cliff-edged to the truncation score."""
    if not 0 <= cache <= max_length:
        raise ValueError(f"need 0 <= cache <= max_length; got cache={cache}, "
                         f"max_length={max_length}")

    def length_penalty(prompts, completions, completion_ids=None, **columns):
        out = []
        for i, c in enumerate(completions):
            ids = completion_ids[i] if completion_ids is not None else None
            n = len(ids) if ids is not None else len(completion_text(c).split())
            free = max_length - cache
            if n <= free:
                out.append(0.0)
            elif n >= max_length or cache == 0:
                out.append(-1.0)
            else:
                out.append(-(n - free) / cache)
        return out
    return _named(length_penalty, "length_penalty")


# --- arithmetic task -----------------------------------------------------------------------

def make_arithmetic(answer_column: str = "answer"):
    """tether.tasks.arithmetic.check_answer: only the '#### n' line counts (no guessing)."""
    def arithmetic(prompts, completions, completion_ids=None, **columns):
        refs = columns[answer_column]
        return [None if ref is None else check_answer(completion_text(c), ref)
                for c, ref in zip(completions, refs)]
    return _named(arithmetic, "arithmetic")


# --- code ----------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last fenced code block (```python ... ```), else the whole completion."""
    blocks = _FENCE.findall(completion_text(text))
    return blocks[-1] if blocks else completion_text(text)


def make_code(tests_column: str = "tests", limits: SandboxLimits | None = None,
              workers: int = 2):
    """1.0 if the completion's code passes the row's tests in the sandbox, 0.0 otherwise (the
    reason logged), None if the row has no tests. Tests: assert source (a string, or a list of
    strings), stdin/stdout pairs, or function-call/result pairs (sandbox_host.parse_tests).
    The verdict comes from outside the program: a grader process that never runs its code, or
    a comparison here of what it printed or returned -- never its exit status."""
    def code(prompts, completions, completion_ids=None, **columns):
        tests = columns.get(tests_column)
        if tests is None:
            raise KeyError(f"needs a {tests_column!r} column; got {sorted(columns)}")
        rows, programs, specs = [], [], []
        for i, (c, t) in enumerate(zip(completions, tests)):
            spec = parse_tests(t)
            if spec is None:
                continue
            rows.append(i)
            programs.append(extract_code(c))
            specs.append(spec)
        out: list[float | None] = [None] * len(completions)
        results = run_batch(programs, limits, workers, tests=specs)
        for i, res in zip(rows, results):
            out[i] = 1.0 if res.passed else 0.0
            if not res.passed:
                log.info("code reward row %d: 0 (%s)", i, res.reason)
        # Kept for inspection (samples.jsonl, tests): row -> SandboxResult of the last batch.
        code.last_results = dict(zip(rows, results))
        return out
    return _named(code, "code")


BUILTINS = {
    "math": make_math,
    "format": make_format,
    "length_penalty": make_length_penalty,
    "arithmetic": make_arithmetic,
    "code": make_code,
}
