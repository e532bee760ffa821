"""Pairwise AI judges: which of two responses better follows written principles, as a probability,
with the position bias averaged out (docs/ai-feedback.md).

    presentation   (x, y₁ shown as A, y₂ shown as B, principles)  ->  P_J(A | x, y₁, y₂)
    swapped        (x, y₂ shown as A, y₁ shown as B, principles)  ->  P_J(A | x, y₂, y₁)
    debiased       P̂(y₁ ≻ y₂) = ½ [P_J(A | x, y₁, y₂) + 1 − P_J(A | x, y₂, y₁)]     (swap_debiased)
    label          chosen = y₁ if P̂ ≥ ½ (or a draw from P̂), the judge's P̂ kept in the row

A judge is any callable `p_first(presentations) -> [P(A)]`: the LM judge below (answer-token
probabilities of an instruct model), or a synthetic judge with known biases (tether/studies/judges.py).
An unbiased judge has E[P(A)] = ½ over presentations of both orders; the raw position bias reported
is that mean before debiasing. After debiasing it is ½ exactly, by construction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from tether.feedback.lm import answer_contexts, answer_logprobs, chat_text, generate

ANSWERS = ("A", "B")

INSTRUCTION = ("Compare two assistant responses to the conversation below and decide which one "
               "better follows the principles.")
ASK_DIRECT = "Which response follows the principles better? Answer with a single letter: A or B."
ASK_COT = ("Which response follows the principles better? Explain your reasoning in two or three "
           "sentences, then finish with 'Answer: A' or 'Answer: B'.")
# appended after the rationale; the answer token is read right after it (answer_contexts finds the
# token boundary, so a BPE that writes " A" as one token is read as such)
COT_CUE = "\nAnswer: "


def as_text(value) -> str:
    """A prompt or response as plain text: strings as they are, a conversation as `Role: text` lines."""
    if isinstance(value, str):
        return value.strip()
    return "\n".join(f"{m.get('role', '').capitalize()}: {str(m.get('content', '')).strip()}"
                     for m in value)


def judge_message(prompt, first, second, principles: list[str], cot: bool = False,
                  max_chars: int = 0) -> str:
    """The user message a judge reads for one presentation (first shown as A)."""
    def cut(s: str) -> str:  # long conversations: keep their end, where the compared turn is
        return s if not max_chars or len(s) <= max_chars else "…" + s[-max_chars:]
    rules = "\n".join(f"- {p}" for p in principles)
    return (f"{INSTRUCTION}\n\nPrinciples:\n{rules}\n\nConversation:\n{cut(as_text(prompt))}\n\n"
            f"Response A:\n{cut(as_text(first))}\n\nResponse B:\n{cut(as_text(second))}\n\n"
            f"{ASK_COT if cot else ASK_DIRECT}")


def swap_debiased(p_ab, p_ba):
    """Position-debiased preference from both presentation orders (Lee et al. 2023, RLAIF §2.1.2;
    Wang et al. 2023, "Large language models are not fair evaluators", balanced position calibration):

        P̂(y₁ ≻ y₂) = ½ [P_J(A | y₁, y₂) + (1 − P_J(A | y₂, y₁))]

    For a judge that prefers the first shown, P_J(A | u, v) = w + (1 − w)·P(u ≻ v), this is
    ½ + (1 − w)(P(y₁ ≻ y₂) − ½): unbiased in position (P̂(y₁ ≻ y₂) + P̂(y₂ ≻ y₁) = 1, ties -> ½)
    but shrunk towards ½ by the share w of judgments position decided. A bias that does not depend
    on order (e.g. for the longer response) passes through unchanged."""
    return 0.5 * (p_ab + (1.0 - p_ba))


@dataclass
class Judgments:
    """Both orders of N pairs: `p_ab[i]` = P(A) with y₁ first, `p_ba[i]` with y₂ first, `p` debiased."""
    p_ab: np.ndarray
    p_ba: np.ndarray
    p: np.ndarray = field(init=False)

    def __post_init__(self):
        self.p = swap_debiased(self.p_ab, self.p_ba)

    def stats(self) -> dict:
        """position_bias: mean P(A) over all 2N presentations before debiasing (½ = none);
        first_choice_rate: share of presentations whose argmax is A; order_consistency: share of
        pairs whose argmax verdict survives the swap; debiased_position_bias: the same mean of the
        debiased probabilities of the shown-first response (½ by construction)."""
        both = np.concatenate([self.p_ab, self.p_ba])
        deb = np.concatenate([self.p, 1.0 - self.p])
        return {"pairs": int(len(self.p)), "position_bias": float(both.mean()),
                "first_choice_rate": float((both > 0.5).mean()),
                "order_consistency": float(((self.p_ab > 0.5) == (self.p_ba < 0.5)).mean()),
                "debiased_position_bias": float(deb.mean()),
                "mean_confidence": float(np.abs(self.p - 0.5).mean() + 0.5)}


def judge_pairs(p_first, prompts, first, second, principles: list[list[str]]) -> Judgments:
    """Ask `p_first` about every pair in both orders (one call: 2N presentations, so an LM judge
    batches them all). principles[i]: the principles of pair i, the same in both orders."""
    n = len(prompts)
    if not n == len(first) == len(second) == len(principles):
        raise ValueError("judge_pairs: prompts, responses and principles differ in length")
    shown = ([(x, a, b, pr) for x, a, b, pr in zip(prompts, first, second, principles)]
             + [(x, b, a, pr) for x, a, b, pr in zip(prompts, first, second, principles)])
    probs = np.asarray(p_first(shown), dtype=np.float64)
    if probs.shape != (2 * n,):
        raise ValueError(f"judge returned {probs.shape} probabilities for {2 * n} presentations")
    return Judgments(probs[:n], probs[n:])


def choose(p: np.ndarray, rule: str = "argmax", seed: int = 0) -> np.ndarray:
    """True where y₁ is chosen. `argmax`: P̂ > ½ (exact ties broken by a seeded coin); `sample`:
    a Bernoulli(P̂) draw per pair, the i-th with the i-th uniform of Random(seed) — the same
    uniforms the gold Bradley–Terry labeller draws (tether.tasks.preference_world.label_pairs)."""
    rng = random.Random(seed)
    u = np.array([rng.random() for _ in range(len(p))])
    if rule == "sample":
        return u < p
    if rule == "argmax":
        return np.where(p == 0.5, u < 0.5, p > 0.5)
    raise ValueError(f"label rule must be 'argmax' or 'sample'; got {rule!r}")


def preference_rows(prompts, first, second, judgments: Judgments, picks: np.ndarray,
                    principles: list[list[str]] | None = None, extra: list[dict] | None = None) -> list[dict]:
    """TRL preference rows (prompt, chosen, rejected) + the judge's numbers: `judge_prob` =
    P̂(chosen ≻ rejected), `judge_p_first` / `judge_p_second` = raw P(A) with chosen / rejected
    shown first."""
    rows = []
    for i, (x, a, b) in enumerate(zip(prompts, first, second)):
        keep = bool(picks[i])
        p, pab, pba = float(judgments.p[i]), float(judgments.p_ab[i]), float(judgments.p_ba[i])
        row = {"prompt": x, "chosen": a if keep else b, "rejected": b if keep else a,
               "judge_prob": p if keep else 1.0 - p,
               "judge_p_first": pab if keep else pba, "judge_p_second": pba if keep else pab}
        if principles is not None and len(principles[i]) == 1:
            row["principle"] = principles[i][0]
        row.update(extra[i] if extra else {})
        rows.append(row)
    return rows


class LMJudge:
    """An instruct model as judge: P(A) = softmax over the log-probs of the answer tokens A and B
    read after the judge prompt in its chat template (one forward per batch). With `cot`, a short
    rationale is first sampled with the fast sampler and the answer read after it."""

    def __init__(self, model, tokenizer, *, cot: bool = False, cot_max_new_tokens: int = 96,
                 cot_temperature: float = 0.7, seed: int = 0, batch_size: int = 8,
                 max_chars: int = 1500):
        self.model, self.tokenizer, self.cot = model, tokenizer, cot
        self.cot_max_new_tokens, self.cot_temperature = cot_max_new_tokens, cot_temperature
        self.seed, self.batch_size, self.max_chars = seed, batch_size, max_chars
        self.rationales: list[str] = []

    def texts(self, presentations) -> tuple[list[str], tuple[str, ...]]:
        """The text each answer token follows, and the answer strings."""
        convs = [[{"role": "user", "content": judge_message(x, a, b, pr, self.cot, self.max_chars)}]
                 for x, a, b, pr in presentations]
        prompts = [chat_text(self.tokenizer, c) for c in convs]
        if not self.cot:
            self.rationales = []
            return prompts, ANSWERS
        out = generate(self.model, self.tokenizer, convs, max_new_tokens=self.cot_max_new_tokens,
                       temperature=self.cot_temperature, seed=self.seed, batch_size=self.batch_size * 4)
        # the verdict is read by us at the cue, so whatever answer the rationale wrote is cut off
        self.rationales = [r.split("Answer:")[0].rstrip() for r in out]
        return [p + r + COT_CUE for p, r in zip(prompts, self.rationales)], ANSWERS

    def __call__(self, presentations) -> list[float]:
        texts, answers = self.texts(presentations)
        contexts, ids = answer_contexts(self.tokenizer, texts, answers)
        lp = answer_logprobs(self.model, contexts, ids, self.batch_size,
                             pad_id=self.tokenizer.pad_token_id or 0)
        return torch.softmax(lp, -1)[:, 0].tolist()  # renormalized over the two answers
