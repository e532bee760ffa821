"""`wordle`: find a hidden 5-letter word in at most 6 guesses, with per-letter feedback.

Tool: guess(word) -> e.g. 'SPEED --Y-Y (5 guesses left)'. Feedback per letter: G the letter is
in that place; Y the word holds the letter elsewhere; - it does not (or holds no further copy of
it). Repeated letters are scored as the game scores them: greens first, then yellows left to
right while the answer still has unmatched copies of the letter, so 'speed' against 'abide' is
'--Y-Y' (one E of the answer: the first E of the guess takes it, the second gets '-').

A guess is any five letters a-z (not only words of the list); anything else is an error
observation and costs no guess. The episode ends when the word is found or the guesses run out.
Reward: (7 - k) / 6 for finding the word with guess k (1.0 with the first, 1/6 with the sixth),
0.0 if not found.

Rows (`WordleEnv.rows(size, seed)`): {"prompt", "answer"}, answers drawn from
tether.envs.wordle_words.WORDS (795 common words written for tether).
"""

from __future__ import annotations

import random
from collections import Counter

from tether.envs.wordle_words import WORDS

__all__ = ["WordleEnv", "feedback", "PROMPT"]

MAX_GUESSES = 6

PROMPT = ("Let's play Wordle. Find the hidden 5-letter English word in at most 6 guesses. Call the "
          "guess tool with a 5-letter word; it answers with one mark per letter: G = right letter in "
          "the right place, Y = the letter is in the word but elsewhere, - = not in the word.")


def feedback(guess: str, answer: str) -> str:
    """Wordle's marks for `guess` against `answer`, e.g. feedback('speed', 'abide') == '--Y-Y'."""
    guess, answer = guess.lower(), answer.lower()
    marks = ["-"] * len(guess)
    left = Counter(a for g, a in zip(guess, answer) if g != a)  # answer letters not matched in place
    for i, (g, a) in enumerate(zip(guess, answer)):
        if g == a:
            marks[i] = "G"
    for i, g in enumerate(guess):
        if marks[i] != "G" and left[g] > 0:
            marks[i] = "Y"
            left[g] -= 1
    return "".join(marks)


class WordleEnv:
    """Wordle with a guess tool; reward (7 - guesses) / 6 when solved."""

    def __init__(self):
        self.answer = ""
        self.guesses: list[str] = []
        self.solved = False
        self.done = False

    def reset(self, answer: str, prompt: str | None = None) -> str:
        self.answer = str(answer).strip().lower()
        if len(self.answer) != 5 or not self.answer.isalpha():
            raise ValueError(f"answer {answer!r} is not a 5-letter word")
        self.guesses, self.solved, self.done = [], False, False
        return prompt or PROMPT

    def guess(self, word: str) -> str:
        """Guess the hidden word.

        Args:
            word: A 5-letter English word.
        """
        if self.done:
            return "The game is over."
        w = word.strip().lower()
        if len(w) != 5 or not w.isascii() or not w.isalpha():
            raise ValueError(f"{word!r} is not five letters a-z")
        self.guesses.append(w)
        marks = feedback(w, self.answer)
        self.solved = w == self.answer
        left = MAX_GUESSES - len(self.guesses)
        self.done = self.solved or left == 0
        if self.solved:
            return f"{w.upper()} {marks}: solved in {len(self.guesses)} guesses."
        if left == 0:
            return f"{w.upper()} {marks}: no guesses left; the word was {self.answer.upper()}."
        return f"{w.upper()} {marks} ({left} guess{'es' if left > 1 else ''} left)"

    def reward(self) -> float:
        return (MAX_GUESSES + 1 - len(self.guesses)) / MAX_GUESSES if self.solved else 0.0

    @classmethod
    def rows(cls, size: int, seed: int = 0) -> list[dict]:
        """`size` games, answers drawn with replacement from WORDS; deterministic in `seed`."""
        rng = random.Random(seed)
        return [{"prompt": PROMPT, "answer": rng.choice(WORDS)} for _ in range(size)]
