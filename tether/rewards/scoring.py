"""Scoring for the online trainers: reward functions -> one scalar per completion (+ DAPO overlong shaping).

    per_fn, rewards = score(funcs, weights, rows, texts, completion_ids)      # [N, F], [N]; NaN = skipped
    rewards += overlong_penalty(lengths, max_new_tokens, buffer, coef)        # DAPO eq. 13, ≤ 0

Used by GRPO and PPO (tether.trainers.grpo.loop, .ppo); it lives here, below them, because it is
about rewards, not about training. Imports torch, so tether.rewards' __init__ leaves it out.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tether import distributed
from tether.errors import UserError
from tether.rewards.registry import validate_reward_output, as_completions, load_reward

RewardFn = Callable[..., list]


def resolve_reward_funcs(specs: Sequence) -> list[RewardFn]:
    """Callables pass through; strings are built-in names ('math', 'arithmetic', 'format',
    'length_penalty', 'code') or 'module:function' (tether.rewards.load_reward)."""
    return [load_reward(s) for s in specs]


def fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def score(funcs: list[RewardFn], weights: list[float], rows: list[dict], texts: list[str],
          completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every function on every completion → (per-function rewards [N, F] with NaN for None,
    weighted reward [N] = Σ_f w_f r_f over the functions that scored it; NaN if none did)."""
    prompts = [r["prompt"] for r in rows]
    completions = as_completions(prompts, texts)  # chat prompts: message lists, as TRL passes them
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "prompt_ids")}
    per_fn = torch.full((len(rows), len(funcs)), float("nan"))
    for j, fn in enumerate(funcs):
        try:
            out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise UserError(f"reward function {fn_name(fn)!r} failed: {type(e).__name__}: {first}") from e
        # The same checks as best-of-n's (RewardSet): a list of numbers or None, one per completion;
        # NaN / inf are errors naming the function (they would silently zero a group's advantages).
        vals = validate_reward_output(fn_name(fn), out, len(rows))
        per_fn[:, j] = torch.tensor([float("nan") if v is None else v for v in vals])
    w = torch.tensor(weights, dtype=per_fn.dtype)
    scored = ~per_fn.isnan()
    total = torch.where(scored, per_fn * w, 0.0).sum(1)
    return per_fn, torch.where(scored.any(1), total, float("nan"))


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, coef: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `coef`:

        R_len(y) = 0                              if |y| ≤ L − B
                 = coef · ((L − B) − |y|) / B     if L − B < |y| ≤ L
    with L = max_new_tokens and B = buffer: 0 up to the buffer, then linearly down to −coef at L
    (a completion cannot exceed L here, so the paper's −1 branch is the end point of the ramp).
    Shapes: lengths [N] → [N] float32. buffer = 0 gives zeros.
    """
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    expected = max_new_tokens - buffer
    return coef * ((expected - lengths) / buffer).clamp(max=0.0)


def score_rollout(funcs, weights, seq_rows: list[dict], rollout, *, max_new_tokens: int, buffer: int = 0,
                  coef: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Score a Rollout and add the overlong shaping (:func:`overlong_penalty` with `max_new_tokens`,
    `buffer`, `coef`; to scored completions only: a skipped one stays NaN). Returns (per-function
    rewards [N, F], total reward [N]); with shaping on (buffer > 0), the penalty is per_fn's last
    column (logged as `rewards/overlong_penalty/mean`)."""
    comp_ids = rollout.completion_lists()
    try:
        per_fn, rewards = score(funcs, weights, seq_rows, rollout.texts, comp_ids)
    except UserError as e:  # under torchrun: about this rank's completions, the others may not fail
        raise distributed.rank_local(e)
    if buffer > 0:
        pen = overlong_penalty(rollout.lengths.cpu(), max_new_tokens, buffer, coef)
        rewards = rewards + pen
        per_fn = torch.cat([per_fn, pen.unsqueeze(1)], 1)
    return per_fn, rewards
