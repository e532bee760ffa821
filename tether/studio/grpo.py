"""Studio page 4, the GRPO explorer: one prompt's group of G completions, their rewards, and the
advantage every critic-free estimator gives each of them, plus PPO's clipped surrogate.

Nothing here recomputes an objective: the advantages are
:data:`tether.objectives.ADVANTAGE_ESTIMATORS` (the registry the online trainer calls), the
surrogate is :data:`tether.objectives.policy.SURROGATES` ``["token"]`` and the group's loss is
:func:`tether.objectives.policy_loss`, so the page shows what training computes, bit for bit.
The page only arranges inputs the way a trainer would: one group (all ``group_ids`` 0), a
completion mask from the completions' token counts, the greedy completion's reward for ReMax.

Completions come from a run's samples.jsonl (grouped by step and prompt, as the online trainer
logs a group's completions together) or live from a checkpoint through the sampler
(:func:`tether.rollout.sample`), scored by a built-in reward function of tether.rewards.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field

from tether.errors import UserError
from tether.objectives import ADVANTAGE_ESTIMATORS, masked_mean, policy_loss
from tether.objectives.policy import SURROGATES
from tether.studio import checkpoints, jobs
from tether.studio.common import get_studio, known_runs, resolve_run, run_file

TITLE = "GRPO explorer"
router = APIRouter(prefix="/api/grpo")

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "remax", "reinforce_pp")
"the estimators the page compares (the registry also has reinforce_pp_baseline)"
GROUP_SIZES = (4, 8, 16, 32)
"group sizes G the page offers"
SCALES = ("group", "batch", "none")
"grpo's `scale` (what the centred rewards are divided by)"


def _mask(lengths, n: int) -> torch.Tensor:
    """[N, T] completion mask from token counts (T = the longest; a length below 1 counts as 1:
    a completion the sampler ended at once still holds its EOS token)."""
    lengths = [1] * n if lengths is None else [max(1, int(x)) for x in lengths]
    if len(lengths) != n:
        raise ValueError(f"lengths has {len(lengths)} entries for {n} rewards")
    t = max(lengths)
    return torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def advantages(rewards, lengths=None, greedy_reward: float = 0.0, scale: str = "group") -> dict:
    """Advantages of one group of completions under each estimator of :data:`ESTIMATORS`.

    ``rewards`` [G] (floats), ``lengths`` [G] completion token counts (REINFORCE++ whitens over
    tokens, so longer completions weigh more; None = all equal), ``greedy_reward`` the reward of
    the prompt's greedy completion (ReMax's baseline), ``scale`` grpo's scale. Returns
    {name: [G] per-completion advantages}; a per-token estimator's value is its masked mean over
    the completion's tokens (with sequence rewards every token of a completion holds the same)."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float32)
    if r.numel() == 0 or not torch.isfinite(r).all():
        raise ValueError("rewards must be a non-empty list of finite numbers")
    mask = _mask(lengths, r.numel())
    out = {}
    for name in ESTIMATORS:
        est = ADVANTAGE_ESTIMATORS[name]
        kwargs = {}
        if est.needs_greedy:
            kwargs["greedy_rewards"] = torch.full_like(r, float(greedy_reward))
        if est.scaled:
            kwargs["scale"] = scale
        adv = est(r, torch.zeros(r.numel(), dtype=torch.long) if est.grouped else None, mask, **kwargs)
        if adv.dim() == 2:
            adv = masked_mean(adv, mask, dim=-1)
        out[name] = [float(a) for a in adv]
    return out


def surrogate(adv: list[float], ratio: float, eps_low: float = 0.2, eps_high: float | None = None,
              lengths=None) -> dict:
    """PPO's clipped surrogate for every completion at one importance ratio r (the same r at
    every token), via SURROGATES["token"]: per completion the per-token loss
    L = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) and where the clip binds; and the group's
    policy_loss (token-mean) with its clip-ratio metrics, as training would log them."""
    if not ratio > 0 or not math.isfinite(ratio):
        raise ValueError(f"ratio must be a positive number, got {ratio}")
    eps_high = eps_low if eps_high is None else eps_high
    a = torch.tensor([float(x) for x in adv], dtype=torch.float32)
    mask = _mask(lengths, a.numel())
    log_ratio = torch.full(mask.shape, math.log(ratio))
    s = SURROGATES["token"](torch.where(mask, log_ratio, 0.0), torch.zeros(mask.shape),
                            torch.where(mask, a.unsqueeze(1), 0.0), mask, eps_low, eps_high)
    loss, metrics = policy_loss(torch.where(mask, log_ratio, 0.0), torch.zeros(mask.shape), a, mask,
                                clip_low=eps_low, clip_high=eps_high, agg="token-mean")
    rows = [{"advantage": float(a[i]), "loss": float(s.loss[i, 0]),
             "clipped_low": bool(s.clipped_low[i, 0]), "clipped_high": bool(s.clipped_high[i, 0])}
            for i in range(a.numel())]
    return {"ratio": ratio, "eps_low": eps_low, "eps_high": eps_high, "rows": rows,
            "policy_loss": float(loss), "clip_ratio": {k.split("/")[1]: float(v) for k, v in metrics.items()
                                                      if k.startswith("clip_ratio/")}}


def surrogate_curve(advantage: float, eps_low: float = 0.2, eps_high: float | None = None,
                    lo: float = 0.0, hi: float = 2.0, points: int = 81) -> dict:
    """−L(r) = min(r·A, clip(r)·A) over a grid of ratios for one advantage (SURROGATES["token"]),
    with the ratios where the clip binds (no gradient there): the picture of PPO's trust region."""
    eps_high = eps_low if eps_high is None else eps_high
    rs = torch.linspace(max(lo, 1e-4), hi, points)
    mask = torch.ones(points, 1, dtype=torch.bool)
    s = SURROGATES["token"](rs.log().unsqueeze(1), torch.zeros(points, 1),
                            torch.full((points, 1), float(advantage)), mask, eps_low, eps_high)
    return {"advantage": float(advantage), "ratio": [float(r) for r in rs],
            "objective": [float(-x) for x in s.loss[:, 0]],
            "clipped": [bool(lo_ or hi_) for lo_, hi_ in zip(s.clipped_low[:, 0], s.clipped_high[:, 0])]}


# ---- where completions come from ---------------------------------------------------------------

def sample_groups(samples_path: Path, limit: int = 200) -> list[dict]:
    """A run's samples.jsonl as groups: rows of the same step and prompt, in file order (the
    online trainer logs a prompt's completions together). Rows without a numeric reward
    ("reward" for the GRPO family, "score" for PPO) are left out. At most `limit` groups, newest last."""
    from tether.run import read_jsonl

    groups: dict[tuple, dict] = {}
    for row in read_jsonl(samples_path):
        reward = row.get("reward", row.get("score"))
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            continue
        prompt = row.get("prompt")
        key = (row.get("step"), prompt if isinstance(prompt, str) else repr(prompt))
        g = groups.setdefault(key, {"step": row.get("step"), "prompt": key[1], "completions": [], "rewards": []})
        g["completions"].append(str(row.get("completion", "")))
        g["rewards"].append(float(reward))
    return list(groups.values())[-limit:]


def token_lengths(tokenizer, completions: list[str]) -> list[int]:
    """Token counts of completion texts (for REINFORCE++'s token weighting of logged samples)."""
    return [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions]


def live_group(model, tokenizer, prompt: str, rewards: list[str], columns: dict, n: int, seed: int = 0,
               temperature: float = 1.0, max_new_tokens: int = 64) -> dict:
    """Sample n completions of `prompt` with the sampler (and its greedy completion, ReMax's
    baseline) and score them with tether.rewards.RewardSet(`rewards`): built-in names, `columns`
    the prompt row's extra columns (e.g. the arithmetic reward's `answer`)."""
    from tether.rewards import RewardSet
    from tether.rewards.registry import as_completions
    from tether.rollout import sample

    ro = sample(model, tokenizer, [prompt], n=n, seed=seed, temperature=temperature,
                max_new_tokens=max_new_tokens)
    greedy = sample(model, tokenizer, [prompt], n=1, seed=seed, temperature=0.0, max_new_tokens=max_new_tokens)
    texts = list(ro.texts) + list(greedy.texts)
    ids = ro.completion_lists()[:n] + greedy.completion_lists()[:1]
    prompts = [prompt] * (n + 1)
    scored = RewardSet(list(rewards)).score(prompts, as_completions(prompts, texts), ids,
                                            {k: [v] * (n + 1) for k, v in columns.items()})
    return {"prompt": prompt, "completions": texts[:n], "rewards": scored.total[:n],
            "lengths": ro.completion_mask.sum(-1).tolist(), "greedy_completion": texts[n],
            "greedy_reward": scored.total[n]}


# ---- the page's API --------------------------------------------------------------------------------

MAX_G = max(GROUP_SIZES)
LIVE_REWARDS = ("arithmetic", "math", "format", "length_penalty")
"built-in rewards the live mode offers (tether.rewards; `code` needs tests and a sandbox)"


class GroupIn(BaseModel):
    rewards: list[float] = Field(min_length=1, max_length=MAX_G)
    lengths: list[int] | None = None
    "completion token counts (REINFORCE++ weighs tokens); none = equal"
    greedy_reward: float = 0.0
    "ReMax's baseline: the reward of the prompt's greedy completion"
    scale: str = "group"


class SurrogateIn(BaseModel):
    advantages: list[float] = Field(min_length=1, max_length=MAX_G)
    lengths: list[int] | None = None
    ratio: float = Field(1.0, gt=0, le=100)
    eps_low: float = Field(0.2, ge=0, lt=1)
    eps_high: float | None = Field(None, ge=0, le=10)
    curve_advantage: float | None = None
    "also the surrogate over ratios 0..2 for this advantage (the chart)"


class SampleIn(BaseModel):
    checkpoint: str
    prompt: str = Field(min_length=1, max_length=4000)
    answer: str | None = None
    "the row's `answer` column (arithmetic and math rewards compare against it)"
    reward: str = "arithmetic"
    n: int = Field(8, ge=2, le=MAX_G)
    temperature: float = Field(1.0, ge=0, le=5)
    max_new_tokens: int = Field(64, ge=1, le=512)
    seed: int = 0


@router.get("/sources")
def sources(request: Request):
    """Runs with samples to explore, checkpoints to sample from, and the page's fixed choices."""
    studio = get_studio(request)
    runs = [rid for rid, path in known_runs(studio).items() if run_file(path, "samples.jsonl")]
    return {"runs": runs, "checkpoints": sorted(checkpoints.known_checkpoints(studio)),
            "rewards": list(LIVE_REWARDS), "group_sizes": list(GROUP_SIZES), "estimators": list(ESTIMATORS),
            "scales": list(SCALES)}


@router.get("/groups")
def groups(run: str, request: Request):
    """A run's logged completions as groups (step, prompt); token counts from the run's newest
    checkpoint's tokenizer when it has one (else none: equal lengths)."""
    path = resolve_run(request, run)
    out = sample_groups(run_file(path, "samples.jsonl")) if run_file(path, "samples.jsonl") else []
    ckpt = checkpoints.latest_of(path)
    if ckpt is not None and out:
        from tether.models import load_tokenizer

        tok = load_tokenizer(str(ckpt))  # the tokenizer alone: no model weights to read
        for g in out:
            g["lengths"] = token_lengths(tok, g["completions"])
    return {"run": run, "groups": out, "lengths_from": str(ckpt.name) if ckpt is not None else None}


@router.post("/advantages")
def advantages_route(body: GroupIn):
    try:
        return {"advantages": advantages(body.rewards, body.lengths, body.greedy_reward, body.scale)}
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


@router.post("/surrogate")
def surrogate_route(body: SurrogateIn):
    try:
        out = surrogate(body.advantages, body.ratio, body.eps_low, body.eps_high, body.lengths)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    if body.curve_advantage is not None:
        out["curve"] = surrogate_curve(body.curve_advantage, body.eps_low, body.eps_high)
    return out


@router.post("/sample")
def sample_route(body: SampleIn, request: Request):
    """Start sampling a live group (a job; GET /api/grpo/job/<id>)."""
    studio = get_studio(request)
    path = checkpoints.resolve_checkpoint(studio, body.checkpoint)
    if body.reward not in LIVE_REWARDS:
        raise HTTPException(400, f"reward {body.reward!r}: expected one of {', '.join(LIVE_REWARDS)}")
    columns = {"answer": body.answer} if body.answer not in (None, "") else {}
    if body.reward in ("arithmetic", "math") and not columns:
        raise HTTPException(400, f"the {body.reward} reward needs the prompt's answer")

    def work(job):
        job.message = f"sampling {body.n} completions from {body.checkpoint}"
        model, tok = checkpoints.load(path)
        try:
            return live_group(model, tok, body.prompt, [body.reward], columns, body.n, body.seed,
                              body.temperature, body.max_new_tokens)
        except ValueError as e:  # e.g. a prompt longer than the model's context
            raise UserError(str(e).splitlines()[0]) from None

    return jobs.start(studio, "grpo", work).view()


@router.get("/job/{job_id}")
def job_route(job_id: str, request: Request):
    return jobs.get(get_studio(request), "grpo", job_id)
