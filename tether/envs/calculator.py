"""`calculator`: arithmetic and multi-step word problems, solved with four tools.

Tools: add, sub, mul, div (numbers in, the exact result out: integers stay integers, a division
that does not come out even gives a decimal; dividing by zero is an error observation).
The final answer is the last message's line '#### <integer>' (GSM8K's form, the arithmetic
task's: tether.tasks.arithmetic.extract_answer reads it); reward 1.0 when it equals the row's
`answer` exactly, else 0.0.

Rows (`CalculatorEnv.rows(size, seed)`): {"prompt": question, "answer": "<integer>", "kind":
"expression" | "word"}. Expressions are "(a op b) op c" with 2- and 3-digit operands; word
problems take two or three operations each. Every answer is a non-negative integer, computed
exactly from the numbers the text states.
"""

from __future__ import annotations

import random

from tether.tasks.arithmetic import check_answer

__all__ = ["CalculatorEnv", "INSTRUCTIONS", "expression_problem", "word_problem"]

INSTRUCTIONS = ("Use the tools add, sub, mul and div for the arithmetic. When you know the answer, "
                "write it on the last line of your reply as '#### <number>', for example '#### 42'.")

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena",
         "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Vik", "Wren", "Yara"]


def _exact(x):
    """An integral float as an int: 12.0 -> 12."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _word_templates():
    """Each maker: rng -> (question, answer). Numbers are drawn so that every step stays a
    non-negative integer."""

    def boxes(r):
        name, item = r.choice(NAMES), r.choice(["pencils", "stickers", "marbles", "cookies", "cards"])
        a, b = r.randint(3, 19), r.randint(6, 24)
        c = r.randint(1, a * b - 1)
        return (f"{name} buys {a} boxes of {item} with {b} {item} in each box and gives away {c} "
                f"{item}. How many {item} does {name} have left?", a * b - c)

    def teams(r):
        c, k, b = r.randint(2, 9), r.randint(2, 12), r.randint(11, 30)
        a = c * k  # classes: a multiple of the team size, so the split is even
        return (f"A school has {a} classes of {b} students each. All the students are split into teams "
                f"of {c}. How many teams are there?", a * b // c)

    def wages(r):
        name = r.choice(NAMES)
        a, b, c = r.randint(10, 300), r.randint(12, 95), r.randint(3, 14)
        d = r.randint(1, a + b * c - 1)
        return (f"{name} has {a} dollars, earns {b} dollars a day for {c} days, then spends {d} "
                f"dollars. How many dollars does {name} have now?", a + b * c - d)

    def train(r):
        a, b, c, d = r.randint(40, 120), r.randint(2, 9), r.randint(40, 120), r.randint(2, 9)
        return (f"A train travels at {a} km per hour for {b} hours, then at {c} km per hour for {d} "
                f"hours. How many kilometres does it travel in all?", a * b + c * d)

    def baskets(r):
        b, q, c = r.randint(3, 12), r.randint(5, 40), r.randint(2, 15)
        a = b * q
        return (f"{a} apples are shared equally among {b} baskets, and then {c} more apples are put "
                f"in each basket. How many apples are in each basket?", q + c)

    def change(r):
        name = r.choice(NAMES)
        a, b = r.randint(15, 95), r.randint(3, 12)
        c = (a * b // 100 + 1) * 100 + r.choice([0, 100, 500])
        return (f"Pencils cost {a} cents each. {name} buys {b} pencils and pays with {c} cents. How "
                f"many cents of change does {name} get?", c - a * b)

    def orchard(r):
        a, b = r.randint(5, 30), r.randint(6, 25)
        c, d = r.randint(1, a * b // 2), r.randint(1, 60)
        return (f"A farmer has {a} rows of {b} trees. {c} trees die and {d} new trees are planted. "
                f"How many trees does the farmer have now?", a * b - c + d)

    def pages(r):
        name = r.choice(NAMES)
        a, c = r.randint(8, 40), r.randint(3, 12)
        b = a * c + r.randint(1, 400)
        return (f"{name} reads {a} pages every day. The book has {b} pages. How many pages are left "
                f"after {c} days?", b - a * c)

    return [boxes, teams, wages, train, baskets, change, orchard, pages]


WORD_PROBLEMS = _word_templates()


def word_problem(rng: random.Random) -> tuple[str, int]:
    return rng.choice(WORD_PROBLEMS)(rng)


def expression_problem(rng: random.Random) -> tuple[str, int]:
    """'What is (a op b) op c?' with an exact non-negative integer value."""
    a, b = rng.randint(10, 999), rng.randint(2, 99)
    op1 = rng.choice("+-×")
    if op1 == "-" and b > a:
        a, b = b, a
    v = {"+": a + b, "-": a - b, "×": a * b}[op1]
    op2 = rng.choice("+-×÷")
    divisors = [d for d in range(2, 13) if v and v % d == 0]
    if op2 == "÷" and not divisors:
        op2 = "+"
    if op2 == "÷":
        c = rng.choice(divisors)
        return f"What is ({a} {op1} {b}) ÷ {c}?", v // c
    c = rng.randint(2, 99) if op2 != "-" else rng.randint(0, v)
    return f"What is ({a} {op1} {b}) {op2} {c}?", {"+": v + c, "-": v - c, "×": v * c}[op2]


class CalculatorEnv:
    """Arithmetic with four tools; reward 1.0 for the exact '#### <answer>' line."""

    def __init__(self):
        self.answer: int | None = None

    def reset(self, prompt: str, answer) -> str:
        self.answer = int(answer)
        return f"{prompt}\n\n{INSTRUCTIONS}"

    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return _exact(a + b)

    def sub(self, a: float, b: float) -> float:
        """Subtract the second number from the first.

        Args:
            a: The number to subtract from.
            b: The number to subtract.
        """
        return _exact(a - b)

    def mul(self, a: float, b: float) -> float:
        """Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return _exact(a * b)

    def div(self, a: float, b: float) -> float:
        """Divide the first number by the second.

        Args:
            a: The dividend.
            b: The divisor (not zero).
        """
        if isinstance(a, int) and isinstance(b, int) and b and a % b == 0:
            return a // b
        return _exact(a / b)

    def reward(self, completion: str) -> float:
        return check_answer(completion, self.answer) if self.answer is not None else 0.0

    @classmethod
    def rows(cls, size: int, seed: int = 0, word_fraction: float = 0.5) -> list[dict]:
        """`size` problems, a `word_fraction` of them word problems; deterministic in `seed`."""
        rng = random.Random(seed)
        out = []
        for _ in range(size):
            word = rng.random() < word_fraction
            question, answer = word_problem(rng) if word else expression_problem(rng)
            out.append({"prompt": question, "answer": str(answer),
                        "kind": "word" if word else "expression"})
        return out
