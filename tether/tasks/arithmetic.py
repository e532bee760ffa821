"""Embedded arithmetic task: problems with known answers, the verifiable reward, and text forms.

The seeds' running example is "What is 23 × 17?". A problem has a question, an exact integer
answer and a worked solution that reduces it to small steps (place-value decomposition), so a
tiny model can learn the *procedure* rather than memorise a table. The same problems appear in
three text forms, one per training stage:

- pretraining: raw worked examples ('What is 47 + 8? 47 + 8 = ... = 55.'), no answer line;
- SFT: prompt "What is 47 + 8?" -> completion " <worked solution>\\n#### 55": the same question, now
  ending in the answer line a verifier can read (pretraining ends with a period instead);
- RL: prompt only, plus an `answer` column the verifier reads.

The final-answer line uses GSM8K's "#### <number>" so the same math checker scores both.

Difficulty levels (operand digits and operators):
  1: one-digit + and -
  2: two-digit ± one-digit, e.g. "47 + 8"                       (default)
  3: two-digit ± two-digit, two-digit × one-digit
  4: as 3, plus two-digit × two-digit ("23 × 17", the seeds' running example)
  5: three-digit ± three-digit, three-digit × one-digit, two-digit × two-digit

The default is what a ~1M-parameter model learns *partly* in two minutes of CPU pretraining:
enough that SFT lands well above zero, not so much that RL has nothing left to improve.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# The prompt is the bare question, as in pretraining text: SFT then has to teach the answer
# *format* (the "#### n" line), not re-teach reading operands after an unfamiliar prefix (which a
# tiny model learns slowly, forgetting arithmetic while it does).
PROMPT_TEMPLATE = "What is {a} {op} {b}?"
ANSWER_PREFIX = "#### "

LEVELS: dict[int, list[tuple[str, int, int]]] = {
    # (operator, digits of a, digits of b)
    1: [("+", 1, 1), ("-", 1, 1)],
    2: [("+", 2, 1), ("-", 2, 1)],
    3: [("+", 2, 2), ("-", 2, 2), ("×", 2, 1)],
    4: [("+", 2, 2), ("-", 2, 2), ("×", 2, 1), ("×", 2, 2)],
    5: [("+", 3, 3), ("-", 3, 3), ("×", 3, 1), ("×", 2, 2)],
}
DEFAULT_LEVEL = 2


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "×": self.a * self.b}[self.op]

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(a=self.a, op=self.op, b=self.b)

    @property
    def solution(self) -> str:
        """Worked steps ending in the result, e.g. '47 + 38 = 40 + 30 + 7 + 8 = 70 + 15 = 85'."""
        return worked_solution(self.a, self.op, self.b)


def _parts(n: int) -> list[int]:
    """Place-value parts, largest first, zeros dropped: 407 -> [400, 7]."""
    digits = str(n)
    parts = [int(d) * 10 ** (len(digits) - i - 1) for i, d in enumerate(digits)]
    return [p for p in parts if p] or [0]


def worked_solution(a: int, op: str, b: int) -> str:
    head = f"{a} {op} {b}"
    if op == "+":
        pa, pb = _parts(a), _parts(b)
        if len(pa) + len(pb) <= 2:
            return f"{head} = {a + b}"
        # Add the same places together: tens with tens, ones with ones.
        parts = sorted(pa + pb, key=lambda p: -len(str(p)))  # same places side by side
        steps = [" + ".join(str(p) for p in parts)]
        big = sum(p for p in pa + pb if p >= 10)
        small = sum(p for p in pa + pb if p < 10)
        if big and small:
            steps.append(f"{big} + {small}")
        steps.append(str(a + b))
        return " = ".join([head] + steps)
    if op == "-":
        pb = _parts(b)
        if len(pb) == 1:
            if a < 10:
                return f"{head} = {a - b}"
            # Split a into tens and ones, borrowing ten when the ones are too few, so the step
            # left is a one-digit fact: 75 - 7 = 60 + 15 - 7 = 60 + 8 = 68.
            tens, ones = a - a % 10, a % 10
            if ones < b:
                tens, ones = tens - 10, ones + 10
            if tens == 0:  # 13 - 7: already a one-digit fact
                return f"{head} = {a - b}"
            return f"{head} = {tens} + {ones} - {b} = {tens} + {ones - b} = {a - b}"
        # Subtract b one place at a time: 47 - 38 = 47 - 30 - 8 = 17 - 8 = 9.
        steps = [f"{a} - " + " - ".join(str(p) for p in pb)]
        acc = a
        for i, p in enumerate(pb[:-1]):
            acc -= p
            rest = pb[i + 1:]
            steps.append(f"{acc} - " + " - ".join(str(q) for q in rest))
        steps.append(str(a - b))
        return " = ".join([head] + steps)
    if op == "×":
        pa, pb = _parts(a), _parts(b)
        if len(pa) == 1 and len(pb) == 1:
            return f"{head} = {a * b}"
        if len(pb) == 1:
            # 23 × 7 = 20 × 7 + 3 × 7 = 140 + 21 = 161
            terms = [f"{p} × {b}" for p in pa]
            prods = [p * b for p in pa]
        else:
            # 23 × 17 = 23 × 10 + 23 × 7 = 230 + 161 = 391
            terms = [f"{a} × {p}" for p in pb]
            prods = [a * p for p in pb]
        steps = [" + ".join(terms), " + ".join(str(p) for p in prods), str(a * b)]
        if len(prods) == 1:
            steps = [terms[0], str(a * b)]
        return " = ".join([head] + steps)
    raise ValueError(f"unknown operator {op!r}")


def _operand(rng: random.Random, digits: int) -> int:
    lo = 10 ** (digits - 1) if digits > 1 else 0
    return rng.randint(lo, 10 ** digits - 1)


def sample_problem(rng: random.Random, level: int = DEFAULT_LEVEL) -> Problem:
    if level not in LEVELS:
        raise ValueError(f"arithmetic level must be one of {sorted(LEVELS)}; got {level}")
    op, da, db = rng.choice(LEVELS[level])
    a, b = _operand(rng, da), _operand(rng, db)
    if op == "-" and b > a:  # keep answers non-negative: negative numbers add a skill, not a step
        a, b = b, a
    return Problem(a, op, b)


def problem_space_size(level: int) -> int:
    """How many distinct problems a level can produce."""
    seen = set()
    for op, da, db in LEVELS[level]:
        ra = range(10 ** (da - 1) if da > 1 else 0, 10 ** da)
        rb = range(10 ** (db - 1) if db > 1 else 0, 10 ** db)
        if len(ra) * len(rb) > 200_000:
            return 10**9  # large enough; no need to enumerate
        for a in ra:
            for b in rb:
                if op == "-" and b > a:
                    a2, b2 = b, a
                else:
                    a2, b2 = a, b
                seen.add((a2, op, b2))
    return len(seen)


def make_splits(n_train: int, n_test: int, level: int = DEFAULT_LEVEL, seed: int = 0
                ) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train/test problem lists (no test problem appears in train)."""
    space = problem_space_size(level)
    if n_test > space // 2:
        # Otherwise the test set would swallow the problem space (or the loop below never ends).
        raise ValueError(f"level {level} has only {space} distinct problems; n_test={n_test} must "
                         f"be at most half of them")
    rng = random.Random(seed)
    test: list[Problem] = []
    seen: set[Problem] = set()
    while len(test) < n_test:
        p = sample_problem(rng, level)
        if p not in seen:
            seen.add(p)
            test.append(p)
    train = []
    while len(train) < n_train:
        p = sample_problem(rng, level)
        if p not in seen:  # duplicates inside train are fine (that is how a corpus looks)
            train.append(p)
    return train, test


# --- text forms -----------------------------------------------------------------------------

def pretrain_text(p: Problem) -> str:
    """A raw worked example, the kind of line a textbook or web page holds:
    'What is 47 + 8? 47 + 8 = 40 + 7 + 8 = 40 + 15 = 55. The answer is 55.'

    The question and the closing sentence are there on purpose: reading operands back out of a
    question, and restating a result, are copying skills the model must learn somewhere, and a
    tiny model learns them far faster here, in bulk, than in the few hundred steps of SFT. What
    SFT teaches is the answer *format* ("#### 55"), which never appears in pretraining."""
    return f"{p.question} {p.solution}. The answer is {p.answer}."


def slipped_answer(p: Problem) -> int | None:
    """The answer with the ones-place carry (addition) or borrow (subtraction) forgotten, the
    classic slip of a hurried person: 47 + 8 -> 45 (not 55), 75 - 7 -> 78 (not 68). None for a
    problem with no carry or borrow in the ones place, and for multiplication."""
    ones_a, ones_b = p.a % 10, p.b % 10
    if p.op == "+" and ones_a + ones_b >= 10:
        return p.answer - 10
    if p.op == "-" and ones_a < ones_b:
        return p.answer + 10
    return None


def sft_example(p: Problem, slip: bool = False) -> dict:
    """Prompt -> worked solution + answer line. `slip=True` writes the answer line as a hurried
    annotator would (`slipped_answer`) where the problem has a carry or borrow; the worked
    solution above it stays right."""
    slipped = slipped_answer(p) if slip else None
    final = p.answer if slipped is None else slipped
    return {"prompt": p.prompt, "completion": f" {p.solution}\n{ANSWER_PREFIX}{final}"}


def rl_example(p: Problem) -> dict:
    return {"prompt": p.prompt, "answer": str(p.answer)}


# --- the verifier ---------------------------------------------------------------------------

_FINAL = re.compile(r"####\s*(-?[\d,]*\d)")
_NUMBER = re.compile(r"-?\d[\d,]*")


def extract_answer(text: str) -> int | None:
    """The final answer: the number after the first '####', else None.

    Only the marked line counts: a model that rambles numbers without committing to an answer
    gets no credit, which keeps the reward from being hacked by listing candidates.
    """
    m = _FINAL.search(text)
    if not m:
        return None
    try:
        return int(m.group(1).replace(",", ""))
    except ValueError:
        return None


def check_answer(completion: str, answer: int | str) -> float:
    """1.0 if the completion's final answer equals `answer` exactly, else 0.0."""
    got = extract_answer(completion)
    return float(got is not None and got == int(answer))


def diagnose(completion: str, p: Problem) -> str:
    """Why a completion scores what it does, one of: "correct"; "slipped" (the answer line is
    `slipped_answer`: the annotator's carry/borrow slip, imitated); "no answer line"; "wrong
    solution" (the worked solution's last number is already wrong); "miscopied" (the solution is
    right but the answer line holds some other number)."""
    got = extract_answer(completion)
    if got is None:
        return "no answer line"
    if got == p.answer:
        return "correct"
    if got == slipped_answer(p):
        return "slipped"
    numbers = _NUMBER.findall(completion.split(ANSWER_PREFIX.strip())[0])
    solved = numbers and int(numbers[-1].replace(",", "")) == p.answer
    return "miscopied" if solved else "wrong solution"



# --- steps: the truth a process reward model is measured against ----------------------------
#
# A worked solution is a chain of expressions joined by "=": '47 + 8 = 40 + 7 + 8 = 40 + 15 = 55'
# then the answer line '\n#### 55'. For a process reward model (PRM) a *step* is one expression of
# the chain closed by the separator "=" that follows it: the PRM reads the text up to and
# including that "=" and scores the step there (TRL's stepwise format: each step followed by the
# separator; the last step, which carries the answer line, gets a separator appended). So
#     ' 47 + 8 = 40 + 7 + 8 = 40 + 15 = 55\n#### 55'
# has the steps ' 47 + 8 ', ' 40 + 7 + 8 ', ' 40 + 15 ', ' 55\n#### 55': step 0 restates the
# question, step i >= 1 is the "=" link from expression i-1 to expression i, and the last step also
# commits to the answer line. Every step's truth is exact integer arithmetic.

STEP_SEPARATOR = "="
_EXPR_TOKEN = re.compile(r"\s*(\d+|[+\-×])")


def evaluate_expression(text: str) -> int | None:
    """The exact value of an expression of integers joined by '+', '-' and '×' ('40 + 7 + 8' -> 55,
    '23 × 10 + 23 × 7' -> 391; × binds tighter; a '-' where a number is due is its sign, as in the
    level-3 solutions' '60 + -6'), or None when the text is not such an expression (empty, a
    dangling operator, any other character)."""
    tokens, pos, text = [], 0, text.strip()
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if not m:
            return None
        tokens.append(m.group(1))
        pos = m.end()
    numbers, ops, sign = [], [], 1
    for t in tokens:
        if len(numbers) == len(ops):  # a number is due
            if t == "-":
                sign = -sign
                continue
            if not t.isdigit():
                return None
            numbers.append(sign * int(t))
            sign = 1
        elif t.isdigit():
            return None
        else:
            ops.append(t)
    if not numbers or len(numbers) != len(ops) + 1:
        return None
    total, term, sign = 0, numbers[0], 1
    for op, num in zip(ops, numbers[1:]):
        if op == "×":
            term *= num
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), num
    return total + sign * term


def split_solution(completion: str) -> list[str]:
    """A completion's steps: its text cut at every STEP_SEPARATOR (the separators removed, as in
    TRL's stepwise `completions`; tether.data.steps.split_steps, as the PRM reward cuts any text)."""
    # here, not at the top: the data layer imports torch, which the verifiers built on this module
    # (tether.rewards) do not need
    from tether.data.steps import split_steps
    return split_steps(completion, STEP_SEPARATOR)


@dataclass(frozen=True)
class StepCheck:
    """One step of a worked solution, checked exactly."""
    text: str
    "the step's text (between separators; the last one holds the answer line)"
    value: int | None
    "the step's expression evaluated exactly (None: not an expression)"
    valid: bool
    "the '=' link holds: value equals the previous expression's (step 0: the question's value); the last step's answer line must also repeat its value"
    correct: bool
    "the solution is still right after this step: value equals the problem's answer (the last step: and so does its answer line). The PRM's truth label"


def check_steps(completion: str, p: Problem) -> list[StepCheck]:
    """Split `completion` into steps (:func:`split_solution`) and check each exactly.

    `valid` is the local check of the link, `correct` is whether the chain is still on the
    problem's answer: after a wrong link every later step is incorrect (even one whose own link is
    valid) until an error happens to cancel it. `correct` is what a PRM is trained and measured on,
    and what Math-Shepherd's Monte-Carlo labels estimate (can the right answer still be reached?).
    """
    steps, out, previous = split_solution(completion), [], p.answer
    for i, text in enumerate(steps):
        last = i == len(steps) - 1
        expression = text.split("\n", 1)[0] if last else text
        value = evaluate_expression(expression)
        valid = value is not None and value == previous
        correct = value is not None and value == p.answer
        if last:  # the answer line must exist and repeat the chain's result
            line = extract_answer(text)
            valid = valid and line == value
            correct = correct and line == p.answer
        out.append(StepCheck(text, value, valid, correct))
        previous = value
    return out


def stepwise_example(p: Problem, completion: str) -> dict:
    """A completion as one row of TRL's stepwise format with the exact truth labels:
    {"prompt", "completions": steps, "labels": [step.correct, ...]}."""
    checks = check_steps(completion, p)
    return {"prompt": p.prompt, "completions": [c.text for c in checks],
            "labels": [c.correct for c in checks]}


def first_error(labels) -> int | None:
    """Index of the first false step label (None when every step is right)."""
    return next((i for i, ok in enumerate(labels) if not ok), None)
