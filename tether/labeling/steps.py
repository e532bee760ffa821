"""`tether label steps`: Math-Shepherd automatic step labels (Wang et al. 2024).

For each prompt (with its reference answer), sample solutions from a policy; cut each solution
into steps at the separator (tether.data.steps.split_steps, as the PRM reads them). For step i, the
prefix is the prompt + steps 1..i each followed by the separator; K completions of that prefix are
rolled out with the fast sampler (tether.rollout) and checked by a verifier. With c_i of K reaching
the right answer, the step's label is (Wang et al. 2024, eqs. 1-2)

    hard:  y_i = 1[c_i > 0]          (the step can still lead to the answer)
    soft:  y_i = c_i / K             (the estimated probability that it does)

The last step needs no rollout: its prefix is the whole solution, so c_S = K·1[solution correct].
A step's estimate is a property of the *completer* as much as of the step: a weak completer turns
right steps into "wrong" ones (its rollouts fail from a good prefix), which is what the PRM study
measures against the arithmetic task's exact step truth.

Output: TRL's stepwise JSONL (`prompt`, `completions`, `labels`: bools), plus `soft_labels` (c_i/K,
for any estimate), `mc_correct` (c_i), `k` and the input's other columns. With estimate=soft, the
bool `labels` are c_i/K > soft_threshold (TRL's format holds bools; the fractions stay beside them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Literal

from tether.config import ConfigError, check_values
from tether.constraints import PositiveInt, Range, Seed
from tether.errors import UserError

# contexts (token ids: prompt + a step prefix), k, seed -> k continuation texts per context
Completer = Callable[[list, int, int], list]


@dataclass
class LabelStepsConfig:
    policy: str = ""
    "the completer: a causal LM directory (its rollouts decide the labels)"
    data: str = ""
    "prompt rows with the verifier's columns, e.g. `prompt` + `answer` (the arithmetic task's rl.jsonl)"
    out: str = "steps.jsonl"
    "stepwise JSONL to write (prompt, completions, labels, soft_labels, mc_correct, k, + the input's columns)"
    reward: str = "arithmetic"
    "verifier deciding whether a rollout reaches the right answer (> 0.5 counts): built-in name, module:function, file.py:function"
    separator: str = "\n"
    "step separator (the PRM's step_separator; the arithmetic task's is '=')"
    num_solutions: PositiveInt = 4
    "solutions sampled per prompt (each becomes one stepwise row)"
    k: PositiveInt = 8
    "rollouts per step prefix (Math-Shepherd's N)"
    estimate: Literal["hard", "soft"] = "hard"
    "which estimate the bool `labels` carry: hard = some rollout is right; soft = the right fraction > soft_threshold"
    soft_threshold: Annotated[float, Range(ge=0, lt=1)] = 0.5
    "estimate=soft: a step is labelled true when its fraction of right rollouts exceeds this"
    max_new_tokens: PositiveInt = 128
    "most tokens per solution and per rollout"
    temperature: Annotated[float, Range(gt=0)] = 1.0
    "sampling temperature of solutions and rollouts"
    limit: int = 0
    "label the first N prompts only (0 = all)"
    seed: Seed = 0
    "sampling seed"
    device: str = "auto"
    "cuda | cpu | auto"
    batch_size: PositiveInt = 256
    "sequences the sampler decodes at once"

    def __post_init__(self):
        check_values(self)
        if not self.separator:
            raise ConfigError("config key 'separator' must be a non-empty string")


def step_prefix_contexts(tokenizer, prompt: str, steps: list[str], separator: str) -> list[list[int]]:
    """Token ids of prompt + steps[:i+1] (each + separator) for every step but the last: the
    contexts rolled out from (encoded exactly as the PRM reads the same text)."""
    from tether.data.steps import encode_steps
    return [encode_steps(tokenizer, prompt, steps[:i + 1], separator)[0] for i in range(len(steps) - 1)]


def mc_outcomes(rows: list[dict], solutions: list[str], complete: Completer, verify: Callable,
                tokenizer, separator: str, k: int, seed: int = 0) -> list[list[list[bool]]]:
    """For every step of every (row, solution): which of the k rollouts from its prefix reach the
    right answer (the last step: its own verdict, k times). `verify(rows, texts) -> [bool]`.
    The first k' of the k rollouts are a k'-rollout estimate (they are i.i.d.)."""
    from tether.data.steps import split_steps

    steps = [split_steps(s, separator) for s in solutions]
    contexts, owners = [], []  # one context per (solution, non-final step)
    for j, (row, st) in enumerate(zip(rows, steps)):
        for i, ctx in enumerate(step_prefix_contexts(tokenizer, row["prompt"], st, separator)):
            contexts.append(ctx)
            owners.append((j, i))
    rollouts = complete(contexts, k, seed) if contexts else []
    # a rollout's text = the prefix's steps + separators, then what the completer wrote
    texts, text_rows = [], []
    for (j, i), conts in zip(owners, rollouts):
        if len(conts) != k:
            raise ValueError(f"the completer returned {len(conts)} rollouts for a prefix, not k={k}")
        prefix = "".join(s + separator for s in steps[j][:i + 1])
        texts += [prefix + c for c in conts]
        text_rows += [rows[j]] * k
    right = verify(text_rows, texts) if texts else []
    out = [[[] for _ in st] for st in steps]
    for n, (j, i) in enumerate(owners):
        out[j][i] = right[n * k:(n + 1) * k]
    for j, ok in enumerate(verify(rows, solutions)):
        out[j][-1] = [bool(ok)] * k
    return out


def mc_counts(rows: list[dict], solutions: list[str], complete: Completer, verify: Callable,
              tokenizer, separator: str, k: int, seed: int = 0) -> list[list[int]]:
    """c_i for every step of every (row, solution): right rollouts out of k (:func:`mc_outcomes`)."""
    return [[sum(o) for o in sol] for sol in mc_outcomes(rows, solutions, complete, verify, tokenizer,
                                                          separator, k, seed)]


def step_labels(counts: list[int], k: int, estimate: str = "hard", soft_threshold: float = 0.5) -> list[bool]:
    """Math-Shepherd's estimates as bools: hard 1[c > 0], soft c/K > soft_threshold."""
    if estimate == "hard":
        return [c > 0 for c in counts]
    if estimate == "soft":
        return [c / k > soft_threshold for c in counts]
    raise UserError(f"label steps: estimate must be 'hard' or 'soft'; got {estimate!r}")


def sampler_completer(model, tokenizer, max_new_tokens: int, temperature: float,
                      batch_size: int = 256) -> Completer:
    """The fast sampler (tether.rollout.Sampler) as a Completer."""
    from tether.rollout import Sampler

    sampler = Sampler(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature,
                      max_batch_size=batch_size)

    def complete(contexts: list, k: int, seed: int) -> list:
        texts = sampler.sample(contexts, n=k, seed=seed).texts
        return [texts[i * k:(i + 1) * k] for i in range(len(contexts))]
    return complete


def verifier(spec: str) -> Callable:
    """`verify(rows, texts) -> [bool]` from a reward spec: right when the reward is > 0.5."""
    from tether.rewards.registry import load_reward
    from tether.rewards.scoring import score

    fn = load_reward(spec)

    def verify(rows: list[dict], texts: list[str]) -> list[bool]:
        _, total = score([fn], [1.0], rows, texts, [None] * len(texts))
        return [bool(v > 0.5) for v in total.tolist()]  # NaN (not scored) is not right
    return verify


def label_steps(cfg: LabelStepsConfig) -> dict:
    """Sample cfg.num_solutions solutions per prompt, label their steps by MC rollouts, write
    cfg.out; returns the summary (also printed)."""
    import torch

    from tether.data import load_data
    from tether.data.steps import encode_steps, split_steps
    from tether.models import load_model, load_tokenizer

    if not cfg.policy or not cfg.data:
        raise UserError("label steps: policy=<model dir> and data=<prompt rows> are required")
    rows = load_data(cfg.data, expect="prompt-only")
    rows = [dict(r) for r in rows][:cfg.limit or None]
    if any(not isinstance(r["prompt"], str) for r in rows):
        raise UserError(f"{cfg.data}: label steps needs standard (string) prompts")
    verify = verifier(cfg.reward)  # a bad spec fails before the model loads
    if rows:  # and so does data the verifier cannot read (e.g. no `answer` column for 'arithmetic')
        try:
            verify(rows[:1], [""])
        except UserError as e:
            raise UserError(f"{cfg.data}:1: the verifier {cfg.reward!r} cannot score this row: {e}") from None
    t0 = time.time()
    tokenizer = load_tokenizer(cfg.policy)
    model = load_model(cfg.policy, device=cfg.device).eval()
    complete = sampler_completer(model, tokenizer, cfg.max_new_tokens, cfg.temperature, cfg.batch_size)
    with torch.no_grad():
        prompts = [encode_steps(tokenizer, r["prompt"], [], cfg.separator)[0] for r in rows]
        sols = complete(prompts, cfg.num_solutions, cfg.seed)
        sol_rows = [r for r, s in zip(rows, sols) for _ in s]
        solutions = [t for s in sols for t in s]
        counts = mc_counts(sol_rows, solutions, complete, verify, tokenizer, cfg.separator, cfg.k, cfg.seed + 1)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(out, "w", encoding="utf-8") as f:
        for row, sol, c in zip(sol_rows, solutions, counts):
            steps = split_steps(sol, cfg.separator)
            if any(not s for s in steps):  # an empty step ('==') is no row of the stepwise format
                continue
            f.write(json.dumps({**row, "completions": steps,
                                "labels": step_labels(c, cfg.k, cfg.estimate, cfg.soft_threshold),
                                "soft_labels": [x / cfg.k for x in c], "mc_correct": c, "k": cfg.k}) + "\n")
            written += 1
    summary = {"rows": written, "prompts": len(rows), "solutions": len(solutions),
               "rollouts": sum(len(c) - 1 for c in counts) * cfg.k, "seconds": round(time.time() - t0, 1),
               "out": str(out)}
    print(json.dumps(summary))
    return summary
