"""`guess_number`: find a hidden integer in [1, N] from higher / lower answers (step-based).

The model answers in plain text; the guess is the last integer of its message. The environment
answers 'Higher.' (the number is larger than the guess), 'Lower.' or ends the episode on the
number. A message without an integer, or with one outside [1, N], is answered with a reminder
and costs a guess.

Binary search needs at most B = ceil(log2(N + 1)) guesses, the budget is B + 3 (the row's
`max_guesses` overrides it). Reward, given at the step that ends the episode: 1.0 for finding
the number within B guesses, 1 - (k - B) / (budget - B + 1) for finding it with guess k > B
(N = 100: B = 7, budget 10, guess 8 -> 0.75, guess 10 -> 0.25), 0.0 for not finding it.

Rows (`GuessNumberEnv.rows(size, seed, n=100)`): {"prompt", "target", "n"}.
"""

from __future__ import annotations

import math
import random
import re

__all__ = ["GuessNumberEnv", "optimal_guesses", "guess_reward", "prompt_for"]

_INT = re.compile(r"-?\d+")


def optimal_guesses(n: int) -> int:
    """Guesses binary search needs at most to find any integer of [1, n]."""
    return max(1, math.ceil(math.log2(n + 1)))


def guess_reward(k: int | None, n: int, max_guesses: int) -> float:
    """The reward for finding the number with guess `k` (None: not found)."""
    if k is None:
        return 0.0
    best = optimal_guesses(n)
    if k <= best:
        return 1.0
    return max(0.0, 1.0 - (k - best) / (max_guesses - best + 1))


def prompt_for(n: int, max_guesses: int) -> str:
    return (f"I am thinking of an integer between 1 and {n}. Find it in at most {max_guesses} guesses. "
            "Reply with one integer per message; I will answer 'Higher.' if my number is larger, "
            "'Lower.' if it is smaller.")


class GuessNumberEnv:
    """Higher / lower with a hidden integer; step-based (reset(row), step(text))."""

    def __init__(self):
        self.target = self.n = self.max_guesses = 0
        self.guesses: list[int | None] = []

    def reset(self, row: dict) -> list[dict]:
        self.n = int(row.get("n", 100))
        self.target = int(row["target"])
        if not 1 <= self.target <= self.n:
            raise ValueError(f"target {self.target} is outside [1, {self.n}]")
        self.max_guesses = int(row.get("max_guesses") or optimal_guesses(self.n) + 3)
        self.guesses = []
        prompt = row.get("prompt") or prompt_for(self.n, self.max_guesses)
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def step(self, assistant_text: str) -> tuple[list[dict], float | None, bool]:
        found = _INT.findall(assistant_text or "")
        guess = int(found[-1]) if found else None
        self.guesses.append(guess)
        k, left = len(self.guesses), self.max_guesses - len(self.guesses)
        if guess == self.target:
            return ([{"role": "user", "content": f"Correct! Found in {k} guesses."}],
                    guess_reward(k, self.n, self.max_guesses), True)
        if left <= 0:
            return ([{"role": "user", "content": f"No guesses left; the number was {self.target}."}],
                    0.0, True)
        if guess is None or not 1 <= guess <= self.n:
            text = f"Reply with one integer between 1 and {self.n}."
        else:
            text = "Higher." if self.target > guess else "Lower."
        return [{"role": "user", "content": f"{text} {left} guess{'es' if left > 1 else ''} left."}], 0.0, False

    @classmethod
    def rows(cls, size: int, seed: int = 0, n: int = 100) -> list[dict]:
        """`size` games over [1, n], targets uniform; deterministic in `seed`."""
        rng = random.Random(seed)
        budget = optimal_guesses(n) + 3
        return [{"prompt": prompt_for(n, budget), "target": rng.randint(1, n), "n": n}
                for _ in range(size)]
