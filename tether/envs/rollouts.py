"""The episode loop: multi-turn, tool-using rollouts of an environment (docs/environments.md).

One sampling call runs a batch of episodes, token-in/token-out:

    prompt ids     the environment's first messages through the generation prompt (prompt_ids)
    model turn     sampled ids, kept exactly as sampled, up to its end-of-turn token  (loss mask 1)
    reply          the environment's messages as the delta the chat template adds after that
                   token, through the next generation prompt (observation_ids)           (mask 0)
    model turn ... until the environment is done, `max_turns` model turns, or the token budget

The engine (`Sampler.sample(episodes=...)`) feeds each reply into the same KV cache as forced
tokens, so nothing is re-prefilled and rows with different turn counts stay in one batch; this
module is its host side (:class:`EpisodeBatch`): one :class:`tether.envs.Episode` per sequence,
the assistant text of each turn handed to the environment, the reply rendered to ids, the
transcript and the counts recorded. A tool call that fails in any way is an error message the
model sees (the environment adapter's job); an environment whose `reset` raises skips its row
(counted); one whose `step` raises ends that episode (counted) — never the step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tether import distributed
from tether.config import ConfigError
from tether.constraints import NonNegativeInt, PositiveInt
from tether.envs.episode import Episode, EnvError, EnvResetError, env_rows
from tether.envs.render import end_of_turn_ids, observation_ids, prompt_ids
from tether.rollout import Rollout, Sampler
from tether.rollout.engine import Episodes


@dataclass
class EnvSection:
    env: str = ""
    "environment: a built-in (calculator, python, wordle, guess_number), 'module:Class' or './file.py:Class'; empty = single-turn prompts"
    train_rows: PositiveInt = 2000
    "data=env: rows drawn from the environment's own rows(size, seed) for training (seed: run.seed)"
    eval_rows: PositiveInt = 200
    "data.eval_data=env: held-out rows drawn likewise with another seed (rows equal to a training row left out), played greedily at eval points (eval/env/...)"
    max_turns: PositiveInt = 8
    "most model turns per episode (its last turn's tool calls, if any, are not run)"
    tool_format: str = "auto"
    "how the model writes tool calls: auto (from the chat template), hermes, gemma or plain (docs/environments.md)"
    tool_timeout_s: float = 10.0
    "each tool call's deadline; past it the model sees an error"
    max_tool_calls: NonNegativeInt = 8
    "tool calls run per model message; further ones are answered with an error"

    def __post_init__(self):
        if self.tool_timeout_s <= 0:
            raise ConfigError(f"env.tool_timeout_s must be > 0, got {self.tool_timeout_s}")


class EpisodeBatch(Episodes):
    """The host side of one multi-turn sampling call: sequence i (prompt-major) is `episodes[i]`."""

    def __init__(self, episodes: list[Episode], tokenizer, max_turns: int):
        self.episodes, self.tok, self.max_turns = episodes, tokenizer, max_turns
        n = len(episodes)
        self.turns = [0] * n
        self.tool_calls = [0] * n
        self.tool_errors = [0] * n
        self.env_errors = [0] * n
        self.turn_rewards: list[list[float]] = [[] for _ in range(n)]
        self.reasons: list[Optional[str]] = [None] * n
        self.stop = end_of_turn_ids(tokenizer, episodes[0].tools if episodes else None).stop if episodes else []

    def _text(self, ids: list[int]) -> str:
        k = len(self.stop)
        if k and ids[-k:] == self.stop:
            ids = ids[:-k]
        return self.tok.decode(ids, skip_special_tokens=True)

    def turn_ended(self, seq: int, ids: list[int]) -> list[int] | None:
        ep = self.episodes[seq]
        self.turns[seq] += 1
        if ids[-len(self.stop):] != self.stop:  # ended on another end token (e.g. the base EOS)
            ep.messages.append({"role": "assistant", "content": self._text(ids)})
            self.reasons[seq] = "eos"
            return None
        try:
            turn = ep.respond(self._text(ids))
        except EnvError:
            self.env_errors[seq] += 1
            self.reasons[seq] = "env_error"
            return None
        self.tool_calls[seq] += turn.tool_calls
        self.tool_errors[seq] += turn.tool_errors
        if turn.reward is not None:
            self.turn_rewards[seq].append(turn.reward)
        if turn.done or not turn.messages:
            self.reasons[seq] = "done"
            return None
        if self.turns[seq] >= self.max_turns:
            self.reasons[seq] = "turns"
            return None
        return observation_ids(self.tok, turn.messages, ep.tools)

    def truncated(self, seq: int) -> None:
        self.reasons[seq] = "length"

    def cut_off(self, seq: int, ids: list[int]) -> None:
        """The model's turn ran out of tokens before its end token: the part it wrote is the
        transcript's last assistant message (what the reward reads), and the turn counts."""
        self.turns[seq] += 1
        self.episodes[seq].messages.append({"role": "assistant", "content": self._text(ids)})
        self.reasons[seq] = "length"

    def finish_reason(self, seq: int) -> str:
        return self.reasons[seq] or "length"

    def record(self, seq: int) -> dict:
        """What the episode leaves for rewards, metrics and samples."""
        ep = self.episodes[seq]
        try:
            reward = ep.final_reward()
        except EnvError:
            reward, self.env_errors[seq] = None, self.env_errors[seq] + 1
        if reward is None and ep.step_based and self.reasons[seq] != "done":
            reward = 0.0  # a step-based episode that never reached its end earned nothing (not: skipped)
        return {"messages": copy.deepcopy(ep.messages), "turns": self.turns[seq],
                "tool_calls": self.tool_calls[seq], "tool_errors": self.tool_errors[seq],
                "env_errors": self.env_errors[seq], "turn_rewards": list(self.turn_rewards[seq]),
                "env_reward": reward}


def episode_columns(record: dict) -> dict:
    """What a reward function gets of an episode besides the row's columns: `messages` (the
    transcript) and `env_reward` (the environment's own reward, None where it gives none)."""
    return {"messages": record["messages"], "env_reward": record["env_reward"]}


def env_reward(prompts, completions, completion_ids, env_reward=None, **_) -> list:
    """The environment's reward of each episode (:meth:`tether.envs.Episode.final_reward`): the
    first reward of every run with an environment; `reward_funcs` add to it, weighted."""
    return list(env_reward) if env_reward is not None else [None] * len(completions)


def start_episodes(factory: Callable[[], Any], tokenizer, rows: list[dict], n: int, section: EnvSection,
                   only: Optional[list[int]] = None):
    """Reset n environments per row (of `only`'s rows; one per other row, for its prompt only).

    Returns (prompt ids per row — None for a row whose reset raised —, the episodes of the
    sampled rows' sequences, prompt-major, and the rows skipped). All n episodes of a row must
    start from the same prompt: a group shares its prompt."""
    chosen = set(range(len(rows)) if only is None else only)
    prompts: list[Optional[list[int]]] = []
    episodes: dict[int, list[Episode]] = {}
    skipped = []
    for i, row in enumerate(rows):
        group = []
        ids = None
        try:
            for _ in range(n if i in chosen else 1):
                ep = Episode(factory(), tokenizer, tool_format=section.tool_format,
                             tool_timeout_s=section.tool_timeout_s, max_tool_calls=section.max_tool_calls)
                mine = prompt_ids(tokenizer, ep.start(row), ep.tools)
                if ids is not None and mine != ids:
                    raise EnvResetError(f"environment {ep.name}: reset gives different prompts for one row "
                                        "(the n episodes of a group share their prompt)")
                ids = mine
                group.append(ep)
        except EnvResetError:
            ids = None
            skipped.append(i)
        prompts.append(ids)
        if i in chosen and ids is not None:
            episodes[i] = group
    return prompts, episodes, skipped


def sample_episodes(sampler: Sampler, tokenizer, factory: Callable[[], Any], rows: list[dict], n: int,
                    section: EnvSection, seed: Optional[int] = None, only: Optional[list[int]] = None,
                    **overrides) -> tuple[Rollout, list[int]]:
    """Run n episodes of each row (of `only`'s rows) in one batched multi-turn sampling call.

    Returns (the rollout, the indices — into `rows` — of the rows it holds, in order). The rollout
    is the engine's multi-turn rollout (`completion_mask`: the model's tokens, `observation_mask`:
    the environment's) with `episodes[i]` = :meth:`EpisodeBatch.record` of sequence i. A row whose
    reset raised is left out (`rollout.stats['env/reset_errors']` counts them)."""
    prompts, episodes, skipped = start_episodes(factory, tokenizer, rows, n, section, only)
    order = [i for i in (range(len(rows)) if only is None else only) if episodes.get(i)]
    stop = []
    flat = [ep for i in order for ep in episodes[i]]
    if flat:
        stop = end_of_turn_ids(tokenizer, flat[0].tools).stop[-1:]
    batch = EpisodeBatch(flat, tokenizer, section.max_turns)
    # a row whose reset raised still holds its place in the random streams' keys (a stand-in prompt)
    keyed = [p if p is not None else [0] for p in prompts]
    stop_ids = sorted(set(overrides.pop("stop_token_ids", sampler.config.stop_token_ids)) | set(stop))
    if not order:
        raise EnvError(f"every row's environment reset raised ({len(skipped)} rows)")
    ro = sampler.sample(keyed, n=n, seed=seed, only=order, episodes=batch, stop_token_ids=stop_ids, **overrides)
    for i in range(len(flat)):
        if batch.reasons[i] is None:  # its last turn ran out of tokens mid-turn
            batch.cut_off(i, last_model_turn(ro, i))
    ro.episodes = [{**batch.record(i), "segments": segments(ro, i, tokenizer)} for i in range(len(flat))]
    ro.stats["env/reset_errors"] = len([i for i in skipped if only is None or i in set(only)])
    return ro, order


def env_data(section: EnvSection, seed: int, held_out: bool = False) -> list[dict]:
    """data=env: the training rows from the environment's rows(size, seed); `held_out`
    (data.eval_data=env): rows of another seed, with any row equal to a training row left out."""
    train = env_rows(section.env, section.train_rows, seed=seed)
    if not held_out:
        return train
    seen = {repr(sorted(r.items())) for r in train}
    return [r for r in env_rows(section.env, section.eval_rows, seed=seed + 1_000_003)
            if repr(sorted(r.items())) not in seen]


def last_model_turn(ro: Rollout, i: int) -> list[int]:
    """Sequence i's sampled ids after the last environment token (its last model turn)."""
    ids, model, real = (x[i].tolist() for x in (ro.completion_ids, ro.completion_mask, ro.token_mask))
    out: list[int] = []
    for t, m, r in zip(ids, model, real):
        if r and m:
            out.append(t)
        elif r:
            out = []
    return out


def segments(ro: Rollout, i: int, tokenizer) -> list[list]:
    """Sequence i's completion as it was trained: [[kind, text], ...] in order, kind 'model' (the
    sampled tokens, loss on) or 'env' (the environment's, masked), decoded with special tokens."""
    ids, model, real = (x[i].tolist() for x in (ro.completion_ids, ro.completion_mask, ro.token_mask))
    runs: list[list] = []
    for t, m, r in zip(ids, model, real):
        if not r:
            continue
        kind = "model" if m else "env"
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(t)
        else:
            runs.append([kind, [t]])
    return [[k, tokenizer.decode(v, skip_special_tokens=False)] for k, v in runs]


def episode_metrics(ro: Rollout) -> dict[str, float]:
    """`env/turns`, `env/tool_calls`, `env/tool_errors`, `env/episode_tokens` (means per episode),
    `env/reset_errors` (rows skipped) and, where the environment gives per-turn rewards,
    `env/turn_reward` (their mean)."""
    eps = ro.episodes or []
    if not eps:
        return {}
    n = len(eps)
    out = {"env/turns": sum(e["turns"] for e in eps) / n,
           "env/tool_calls": sum(e["tool_calls"] for e in eps) / n,
           "env/tool_errors": sum(e["tool_errors"] for e in eps) / n,
           "env/env_errors": sum(e["env_errors"] for e in eps) / n,
           "env/episode_tokens": float(ro.token_mask.sum(-1).float().mean()),
           "env/reset_errors": float(ro.stats.get("env/reset_errors", 0))}
    turn = [r for e in eps for r in e["turn_rewards"]]
    if turn:
        out["env/turn_reward"] = sum(turn) / len(turn)
    return out


def episode_metrics_over_ranks(rollout) -> dict[str, float]:
    """The env/* metrics (tether.envs.rollouts.episode_metrics) of every rank's episodes together:
    each rank's means weighted by its episodes (env/turn_reward by its per-turn rewards),
    env/reset_errors summed; episode_metrics itself in one process (collective under torchrun)."""
    own = episode_metrics(rollout) if rollout is not None else {}
    if not distributed.active():
        return own
    records = rollout.episodes if own else []
    parts = distributed.all_gather_object((own, len(records), sum(len(e["turn_rewards"]) for e in records)))
    total: dict[str, float] = {}
    for metrics, episodes, turn_rewards in parts:
        for key, value in metrics.items():
            weight = 1 if key == "env/reset_errors" else turn_rewards if key == "env/turn_reward" else episodes
            total[key] = total.get(key, 0.0) + value * weight
    episodes, turn_rewards = sum(p[1] for p in parts), sum(p[2] for p in parts)
    return {k: v if k == "env/reset_errors" else v / max(turn_rewards if k == "env/turn_reward" else episodes, 1)
            for k, v in total.items()}
