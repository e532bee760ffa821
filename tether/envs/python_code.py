"""`python`: problems whose answers must be computed, with a tool that runs Python in the sandbox.

Tool: run_python(code) runs the model's program in tether's hardened sandbox
(tether.rewards.sandbox.run_python: own namespaces, uids, seccomp, no network, memory / process /
output / wall-clock limits; docs/rewards.md) and returns what it printed; a program that fails or
runs out of time returns its error text and status, as any program's output (a tool error is only
a call that could not run: see tether.envs.tools). The sandbox kills the program at its own
deadline, so the tool's thread is never left running.

The final answer is the last message's line '#### <integer>'; reward 1.0 when it equals the row's
`answer` exactly, else 0.0.

Rows (`PythonEnv.rows(size, seed)`): {"prompt", "answer", "kind"}; each answer is computed here by
a plain reference implementation from the numbers in the question.
"""

from __future__ import annotations

import math
import random

from tether.rewards.sandbox import SandboxLimits, SandboxResult, run_python
from tether.tasks.arithmetic import check_answer

__all__ = ["PythonEnv", "INSTRUCTIONS", "PROBLEMS", "primes_below", "fibonacci_number", "collatz_steps",
           "divisor_count"]

INSTRUCTIONS = ("Compute the answer with the run_python tool: it runs a Python program and returns "
                "what the program prints. When you know the answer, write it on the last line of your "
                "reply as '#### <number>', for example '#### 42'.")


def primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * n
    sieve[0:2] = b"\x00\x00"
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
    return [i for i in range(n) if sieve[i]]


def fibonacci_number(k: int) -> int:
    a, b = 0, 1
    for _ in range(k):
        a, b = b, a + b
    return a


def collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def divisor_count(n: int) -> int:
    return sum(2 if d * d != n else 1 for d in range(1, math.isqrt(n) + 1) if n % d == 0)


def _problems():
    """Each maker: rng -> (kind, question, answer)."""

    def prime_sum(r):
        n = r.randint(1000, 20000)
        return "prime_sum", f"What is the sum of all prime numbers below {n}?", sum(primes_below(n))

    def fibonacci(r):
        k = r.randint(30, 90)
        return ("fibonacci", f"What is the {k}th Fibonacci number, counting F(1) = 1 and F(2) = 1?",
                fibonacci_number(k))

    def digit_sum(r):
        a, b = r.randint(2, 9), r.randint(50, 200)
        return "digit_sum", f"What is the sum of the decimal digits of {a}^{b}?", sum(map(int, str(a ** b)))

    def multiples(r):
        n = r.randint(10_000, 1_000_000)
        p, q = r.sample([3, 4, 5, 6, 7, 11, 13], 2)
        count = n // p + n // q - n // (p * q // math.gcd(p, q))
        return "multiples", f"How many integers from 1 to {n} are divisible by {p} or by {q}?", count

    def collatz(r):
        n = r.randint(1000, 100_000)
        return ("collatz", f"Starting from {n}, repeatedly halve the number if it is even, else "
                           "replace it by 3 times it plus 1. How many steps does it take to reach 1?",
                collatz_steps(n))

    def power_mod(r):
        a, b, m = r.randint(2, 999), r.randint(10 ** 5, 10 ** 9), r.randint(1000, 99_999)
        return "power_mod", f"What is the remainder of {a}^{b} divided by {m}?", pow(a, b, m)

    def divisors(r):
        n = r.randint(2, 50) * r.randint(2, 50) * r.randint(2, 500)
        return "divisors", f"How many positive divisors does {n} have?", divisor_count(n)

    return [prime_sum, fibonacci, digit_sum, multiples, collatz, power_mod, divisors]


PROBLEMS = _problems()


class PythonEnv:
    """Computed problems with a sandboxed Python tool; reward 1.0 for the exact '#### <answer>'."""

    limits = SandboxLimits(timeout_s=5.0, memory_mb=256)
    # the tool's deadline: the sandbox's own limit plus its start-up and clean-up
    tool_timeout_s = 30.0
    max_output_chars = 2000

    def __init__(self):
        self.answer: int | None = None
        self.results: list[SandboxResult] = []   # every run of the episode, with its isolation report

    def reset(self, prompt: str, answer) -> str:
        self.answer = int(answer)
        self.results = []
        return f"{prompt}\n\n{INSTRUCTIONS}"

    def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: The complete Python program; print the values you need.
        """
        res = run_python(code, self.limits)
        self.results.append(res)
        out = res.stdout
        if len(out) > self.max_output_chars:
            out = out[:self.max_output_chars] + f"\n[... {len(out) - self.max_output_chars} more characters cut]"
        if res.passed:
            return out if out.strip() else "(the program printed nothing)"
        err = res.stderr.strip()
        err = err[-self.max_output_chars:] if err else ""
        parts = [out.rstrip()] if out.strip() else []
        parts.append(f"[program failed: {res.reason}]")
        if err and err not in res.reason:
            parts.append(err)
        return "\n".join(parts)

    def reward(self, completion: str) -> float:
        return check_answer(completion, self.answer) if self.answer is not None else 0.0

    @classmethod
    def rows(cls, size: int, seed: int = 0) -> list[dict]:
        """`size` problems, kinds drawn uniformly; deterministic in `seed`."""
        rng = random.Random(seed)
        out = []
        for _ in range(size):
            kind, question, answer = rng.choice(PROBLEMS)(rng)
            out.append({"prompt": question, "answer": str(answer), "kind": kind})
        return out
