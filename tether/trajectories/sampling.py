"""A step's scored rollouts: prompts in the data order -> G completions of each -> rewards, with
DAPO dynamic sampling (Yu et al. 2025, §3.2). `GroupSampler` is the producer the trajectory
queue's sources call (`produce(step, sampler)`), built by a trainer from its pieces:

- `PromptStream`: the prompts' order (the run's resumable EpochSampler) and, under torchrun, the
  rank's share of each global batch;
- `Scoring`: the reward functions and weights (tether.rewards.scoring.score_rollout) with DAPO's
  overlong shaping; a scoring that reads the sampling policy (online DPO's self-judge) binds it
  per sampler (`for_sampler`);
- the rollout config (completions per prompt, the sampler's settings) and the run's seed.

Without dynamic sampling a step is one round: `batch_size` prompts × G completions, scored.
With it, a group whose scored rewards are all equal (zero variance: every completion right, or
every one wrong) has all-zero advantages and only dilutes the batch, so it is dropped, and further
rounds of `batch_size` new prompts are sampled until `batch_size` groups with signal are in hand
or `max_sampling_rounds` rounds were drawn (then the step trains on fewer groups; if none had
signal, on the last round's groups, whose advantages are all 0). Extra kept groups are cut.

The seed of round k of step s is a function of (seed, s, k), and prompts come from the resumable
EpochSampler, so a resumed run samples exactly what an uninterrupted one did.

Under torchrun each rank collects its share (`batch_size` is then the rank's part of the global
batch, and each round draws the rank's part of the next global batch of prompts), and every rank
draws as many rounds as the rank that needs the most (`every_rank`): the data order stays the same
on all, and so do the collective forwards that follow. One round (all groups kept, or
`max_sampling_rounds=1`) keeps exactly the groups one process keeps. When a step needs more rounds
it does not: one process fills the batch with the first groups with signal of the next global
batch, each rank with the first of its own part, so the kept groups (and the step) differ.

With an environment (`env=`), each completion is an episode (tether/envs/rollouts.py: the
policy's turns and the environment's replies in one transcript, one engine call for the batch)
and the StepBatch is the same, so every source, the queue and the trainers take it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from tether import distributed
from tether.objectives import group_stats
from tether.rewards.scoring import score_rollout
from tether.rollout import Rollout, Sampler
from tether.envs import load_env
from tether.envs.rollouts import EnvSection, episode_columns, sample_episodes


def _pad_to(x: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value) if x.shape[1] < width else x


def select_groups(ro: Rollout, groups: list[int], G: int) -> Rollout:
    """The sequences of prompt-groups `groups` (G each, prompt-major), renumbered 0..len-1."""
    idx = [g * G + j for g in groups for j in range(G)]
    t = torch.tensor(idx, dtype=torch.long)
    return Rollout(prompt_ids=[ro.prompt_ids[i] for i in idx], completion_ids=ro.completion_ids[t],
                   completion_mask=ro.completion_mask[t], logprobs=ro.logprobs[t],
                   texts=[ro.texts[i] for i in idx], finish_reasons=[ro.finish_reasons[i] for i in idx],
                   group=torch.arange(len(groups)).repeat_interleave(G),
                   logprob_temperature=ro.logprob_temperature, pad_token_id=ro.pad_token_id,
                   stats=dict(ro.stats),
                   observation_mask=None if ro.observation_mask is None else ro.observation_mask[t],
                   episodes=None if ro.episodes is None else [ro.episodes[i] for i in idx])


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Rollouts one after the other (completions re-padded to the longest; group ids offset)."""
    if len(parts) == 1:
        return parts[0]
    T = max(p.completion_ids.shape[1] for p in parts)
    groups, offset = [], 0
    for p in parts:
        groups.append(p.group + offset)
        offset += int(p.group.max()) + 1 if len(p) else 0
    first = parts[0]
    episodes = first.episodes is not None
    return Rollout(prompt_ids=[ids for p in parts for ids in p.prompt_ids],
                   completion_ids=torch.cat([_pad_to(p.completion_ids, T, first.pad_token_id) for p in parts]),
                   completion_mask=torch.cat([_pad_to(p.completion_mask, T, False) for p in parts]),
                   logprobs=torch.cat([_pad_to(p.logprobs, T, 0.0) for p in parts]),
                   texts=[s for p in parts for s in p.texts],
                   finish_reasons=[f for p in parts for f in p.finish_reasons], group=torch.cat(groups),
                   logprob_temperature=first.logprob_temperature, pad_token_id=first.pad_token_id,
                   stats=sum_stats([p.stats for p in parts]),
                   observation_mask=torch.cat([_pad_to(p.observation_mask, T, False) for p in parts])
                   if episodes else None,
                   episodes=[e for p in parts for e in p.episodes] if episodes else None)


def sum_stats(stats: list[dict]) -> dict:
    """Sampler timings and token counts of several calls, added up (tokens/s recomputed)."""
    out: dict = {}
    for st in stats:
        for k in ("prefill_s", "decode_s", "capture_s", "total_s", "tokens", "decode_steps"):
            out[k] = out.get(k, 0) + st.get(k, 0)
    out["tokens_per_s"] = out["tokens"] / max(out["prefill_s"] + out["decode_s"], 1e-9)
    return out


@dataclass
class StepBatch:
    rollout: Rollout
    "the sequences to train on (kept groups, prompt-major)"
    prompt_rows: list[dict]
    "one data row per kept group"
    per_fn: torch.Tensor
    "[N, F] per-function rewards of the kept sequences (NaN = not scored)"
    rewards: torch.Tensor
    "[N] total reward of the kept sequences (NaN = skipped)"
    sampled_rewards: torch.Tensor
    "[M] rewards of everything sampled this step (M ≥ N with dynamic sampling): the policy's score"
    sampled_per_fn: torch.Tensor
    "[M, F]"
    sampled_groups: torch.Tensor
    "[M] group id of each sampled sequence (unique across rounds)"
    sampled_tokens: int = 0
    "completion tokens generated this step, dropped groups included"
    metrics: dict = field(default_factory=dict)
    "num_sampling_rounds, dynamic_sampling/{kept,dropped}_groups"
    filler: Optional[Rollout] = None
    "under torchrun, when this rank keeps no sequence: sampled ones to run forwards that count for nothing"
    epoch: float = 0.0
    "the data order's epoch once these prompts were drawn (logged: a queue's producer draws ahead)"

    @property
    def seq_rows(self) -> list[dict]:
        G = len(self.rollout) // max(len(self.prompt_rows), 1)
        return [self.prompt_rows[i // G] for i in range(len(self.rollout))]


def has_signal(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """[num_groups] bool: the group's scored (non-NaN) rewards are not all equal (needs ≥ 2 scored)."""
    valid = ~rewards.isnan()
    groups = torch.arange(len(rewards)) // G
    out = torch.zeros(len(rewards) // G, dtype=torch.bool)
    if valid.any():
        s = group_stats(rewards[valid], groups[valid])
        out[groups[valid]] = ~s["constant"]
    return out


def one_process(flag: bool) -> bool:
    """`every_rank` of one process: the flag itself."""
    return flag


def collect(sample, next_prompts, score, batch_size: int, G: int, seed: int,
            dynamic: bool = False, max_rounds: int = 1,
            every_rank: Callable[[bool], bool] = one_process) -> StepBatch:
    """`next_prompts() -> (rows, mine)`: a batch's rows and the indices of this rank's share
    (None: all of them); `sample(rows, seed, mine) -> (Rollout, rows sampled)`: G completions of
    each of `mine`'s prompts, keyed as in the whole batch (Sampler.sample's `only`), and the rows
    they belong to (an environment whose reset raised leaves its row out);
    `score(seq_rows, rollout) -> (per_fn [N, F], rewards [N])`; see the module doc.
    `every_rank(flag)`: whether `flag` holds on every rank (under torchrun; `batch_size` is then
    this rank's share)."""
    kept: list[tuple] = []  # (rollout, prompt rows, per_fn, rewards) of kept groups per round
    all_r, all_f, all_g, stats, n_kept, n_signal, rounds = [], [], [], [], 0, 0, 0
    while True:
        batch, mine = next_prompts()
        ro, rows = sample(batch, seed + rounds * (1 << 32), mine)
        per_fn, rewards = score([rows[i // G] for i in range(len(ro))], ro)
        all_r.append(rewards), all_f.append(per_fn), all_g.append(torch.arange(len(ro)) // G + rounds * len(rows))
        stats.append({**ro.stats, "tokens": int(ro.lengths.sum())})
        rounds += 1
        if not dynamic:
            kept.append((ro, rows, per_fn, rewards))
            break
        signal = has_signal(rewards, G).nonzero().flatten().tolist()
        n_signal += len(signal)
        signal = signal[:batch_size - n_kept]
        if signal:
            idx = torch.tensor([g * G + j for g in signal for j in range(G)])
            kept.append((select_groups(ro, signal, G), [rows[g] for g in signal], per_fn[idx], rewards[idx]))
            n_kept += len(signal)
        if rounds >= max_rounds or every_rank(n_kept >= batch_size):
            break
    filler = None
    if every_rank(not kept):  # no group had signal within the cap: train on the last round (all advantages 0)
        kept.append((ro, rows, per_fn, rewards))
    elif not kept:  # only other ranks kept groups: one process would train on theirs alone, so
        kept.append((select_groups(ro, [], G), [], per_fn[:0], rewards[:0]))  # this rank on none
        filler = ro
    rollout = cat_rollouts([k[0] for k in kept])
    rollout.stats = sum_stats(stats)  # the sampling cost of the step, dropped rounds included
    metrics = {"num_sampling_rounds": rounds}
    if dynamic:
        n_groups = sum(len(g) for g in all_g) // G
        metrics.update({"dynamic_sampling/sampled_groups": n_groups,
                        "dynamic_sampling/dropped_groups": n_groups - n_signal,
                        "dynamic_sampling/kept_groups": n_kept})
    return StepBatch(rollout, [r for k in kept for r in k[1]], torch.cat([k[2] for k in kept]),
                     torch.cat([k[3] for k in kept]), torch.cat(all_r), torch.cat(all_f), torch.cat(all_g),
                     rollout.stats["tokens"], metrics, filler)


# ---- the producer ------------------------------------------------------------------------------

class PromptStream:
    """The prompts in the run's data order: each call draws the next global batch of `rows`
    (`order`: the resumable EpochSampler, its position checkpointed) and, under torchrun, the
    indices of this rank's share of it (None: all of them)."""

    def __init__(self, rows: list[dict], order):
        self.rows, self.order = rows, order

    def __call__(self) -> tuple[list[dict], Optional[list[int]]]:
        batch = [self.rows[i] for i in self.order.global_batch_at(self.order.position)]
        self.order.next()
        mine = self.order.part(list(range(len(batch))), distributed.rank()) if distributed.active() else None
        return batch, mine

    def epoch(self) -> float:
        """The data order's epoch after the prompts drawn so far."""
        return self.order.epoch


@dataclass
class Scoring:
    """Reward functions -> per-function rewards [N, F] and total reward [N] of a rollout
    (rewards.scoring.score_rollout: weighted sum, None = not scored), + DAPO's overlong shaping
    over the last `overlong_buffer` tokens before `max_new_tokens` (0 = off)."""
    funcs: Sequence
    weights: Sequence[float]
    max_new_tokens: int
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __call__(self, seq_rows: list[dict], rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        if rollout.episodes is not None:  # multi-turn: each function also gets the episode's transcript
            seq_rows = [{**row, **episode_columns(ep)} for row, ep in zip(seq_rows, rollout.episodes)]
        return score_rollout(self.funcs, self.weights, seq_rows, rollout, max_new_tokens=self.max_new_tokens,
                             buffer=self.overlong_buffer, coef=self.overlong_penalty)

    def for_sampler(self, sampler: Sampler) -> "Scoring":
        """The scoring of completions `sampler` drew: this one (a reward that reads the sampling
        policy returns itself bound to `sampler.model`)."""
        return self


class GroupSampler:
    """The producer of the GRPO family and online DPO: step j's batch is `per_rank` prompts of the
    stream (this rank's share) × `rollout.num_generations` completions, sampled with the seed of
    (seed, j), scored, with dynamic sampling's extra rounds when `dynamic` (module doc).

    `rollout`: the rollout config section (num_generations, sampling()); `refresh()`: brings the
    weights the trainer's sampler reads up to date (Training.rollout_model: the replica after an
    update, or after its memory was lent), before ReMax's greedy baseline."""

    def __init__(self, prompts: PromptStream, scoring: Scoring, rollout, tokenizer, seed: int, per_rank: int,
                 dynamic: bool = False, max_rounds: int = 1, every_rank: Callable[[bool], bool] = one_process,
                 refresh: Callable[[], object] = lambda: None, env: Optional[EnvSection] = None):
        self.prompts, self.scoring, self.rollout, self.tokenizer = prompts, scoring, rollout, tokenizer
        # multi-turn: each completion is an episode of this environment (envs/rollouts.py), else one turn
        self.env = env if env is not None and env.env else None
        self.env_factory = load_env(self.env.env) if self.env else None
        self.seed, self.per_rank, self.G = seed, per_rank, rollout.num_generations
        self.dynamic, self.max_rounds, self.every_rank, self.refresh = dynamic, max_rounds, every_rank, refresh

    def make_sampler(self, model) -> Sampler:
        """A sampler of `model` with the rollout's settings (the trainer's, or a sampler thread's
        on its own copy of the policy)."""
        return Sampler(model, self.tokenizer, self.rollout.sampling())

    def __call__(self, step: int, sampler: Sampler) -> StepBatch:
        """Step `step`'s scored groups, sampled with `sampler` (its weights: the version the source's
        schedule gives the step). The seed is a function of (seed, step): a resumed run draws the
        same completions."""
        def sample(rows, seed, mine):
            if self.env is not None:
                ro, kept = sample_episodes(sampler, self.tokenizer, self.env_factory, rows, self.G, self.env,
                                           seed=seed, only=mine)
                return ro, [rows[i] for i in kept]
            ro = sampler.sample([r["prompt_ids"] for r in rows], n=self.G, seed=seed, only=mine)
            return ro, rows if mine is None else [rows[i] for i in mine]
        collected = collect(sample, self.prompts, self.scoring.for_sampler(sampler), self.per_rank, self.G,
                            seed=self.seed * 1_000_003 + step, dynamic=self.dynamic, max_rounds=self.max_rounds,
                            every_rank=self.every_rank)
        collected.epoch = self.prompts.epoch()
        return collected

    def greedy_scores(self, sampler: Sampler, prompt_rows: list[dict]) -> torch.Tensor:
        """[prompts] the score of each prompt's greedy completion, no KL term (ReMax's baseline),
        sampled with the trainer's `sampler` once its weights are back (`refresh`)."""
        self.refresh()
        if self.env is not None:  # the greedy episode of each prompt
            greedy, kept = sample_episodes(sampler, self.tokenizer, self.env_factory, prompt_rows, 1, self.env,
                                           temperature=0.0)
            scores = torch.zeros(len(prompt_rows))
            scores[kept] = torch.nan_to_num(self.scoring.for_sampler(sampler)([prompt_rows[i] for i in kept], greedy)[1])
            return scores
        greedy = sampler.sample([p["prompt_ids"] for p in prompt_rows], n=1, temperature=0.0)
        return torch.nan_to_num(self.scoring.for_sampler(sampler)(prompt_rows, greedy)[1])
