"""Studio page 8, Episodes: the multi-turn samples of a run trained on an environment (`env=...`),
turn by turn, with the tokens the loss was computed on told apart from the masked ones.

What a GRPO run over an environment writes per logged episode, in samples.jsonl beside `step`,
`prompt`, `completion`, `reward`, `rewards/<fn>` and `advantage` (the trainer's episode sample):

    messages        the transcript: the environment's first messages (the prompt), then per
                    turn the assistant's message and the environment's reply (user / tool)
    segments        the completion as trained, in order: [kind, text] with kind 'model' (sampled
                    tokens, loss mask 1) or 'env' (the environment's tokens, loss mask 0),
                    decoded with special tokens kept
    turns, tool_calls, tool_errors, turn_rewards, env_reward, finish_reason

Nothing is recomputed: :func:`episode_view` only arranges a row by turn. Model segment k is the
k-th model turn (a turn is sampled up to its end-of-turn token, so a model segment never splits)
and the env segment after it the environment's reply; assistant message k of the transcript is
the same turn as the environment read it (special tokens and the stop token stripped). A turn cut
by the token budget has a model segment and no assistant message; the reply to a last turn that
was not fed back (max_turns reached) has messages and no env segment. The tool calls of an
assistant message are read with the run's tool format (tether.envs.formats), the way the episode
read them.
"""

from __future__ import annotations

import math

import yaml
from fastapi import APIRouter, HTTPException, Query, Request

from tether.studio.common import JsonlTail, get_studio, known_runs, last_rows, resolve_run, run_file, tail_of

TITLE = "Episodes"
router = APIRouter(prefix="/api/episodes")

FINISH_REASONS = {
    "done": "the environment ended the episode",
    "length": "the token budget (max_new_tokens) ran out mid-turn",
    "turns": "max_turns model turns were taken",
    "eos": "the model ended with its end-of-sequence token instead of ending its turn",
    "env_error": "the environment raised; the episode ended there",
}
"each finish reason of an episode, in words (the page's legend)"

EPISODE_KEYS = ("messages", "segments")
"a samples.jsonl row is an episode when it holds these"

PROBE_BYTES = 1 << 20
"the last bytes of a samples file read to tell whether a run logs episodes"


def is_episode(row: dict) -> bool:
    return isinstance(row.get("segments"), list) and isinstance(row.get("messages"), list)


class EpisodeTail(JsonlTail):
    """A samples.jsonl read incrementally into its episode rows by step (file order within a step)."""

    def reset(self) -> None:
        self.rows: dict[int, list[dict]] = {}
        self.bad = 0

    def add(self, row: dict) -> None:
        step = row.get("step")
        if is_episode(row) and isinstance(step, int) and not isinstance(step, bool):
            self.rows.setdefault(step, []).append(row)


def has_episodes(run_dir) -> bool:
    """Whether a run's samples.jsonl holds episodes (judged from its last lines)."""
    path = run_file(run_dir, "samples.jsonl")
    return path is not None and any(is_episode(r) for r in last_rows(path, PROBE_BYTES))


def _tool_format(run_dir) -> str:
    """The run's env.tool_format from its config.yaml ('auto' when absent or unreadable)."""
    path = run_file(run_dir, "config.yaml")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, yaml.YAMLError):
        cfg = None
    env = cfg.get("env") if isinstance(cfg, dict) else None
    fmt = env.get("tool_format") if isinstance(env, dict) else None
    return fmt if isinstance(fmt, str) else "auto"


def tool_calls(text: str, tool_format: str) -> list[dict]:
    """The tool calls of an assistant message as the episode read them: {name, arguments,
    positional, error, text (the call as written)}. `tool_format` 'auto' (the tokenizer that
    decided is not at hand): the first of hermes, gemma, plain that reads any call."""
    from tether.envs.formats import FORMATS

    names = list(FORMATS) if tool_format not in FORMATS else [tool_format]
    for name in names:
        calls = FORMATS[name]().parse(text)
        if calls:
            return [{"name": c.name, "arguments": c.arguments, "positional": c.positional, "error": c.error,
                     "text": c.text} for c in calls]
    return []


def _number(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def episode_view(row: dict, index: int, tool_format: str = "auto") -> dict:
    """One logged episode arranged by turn.

    Returns the row's numbers (reward — PPO logs it as `score`, named by `reward_name` —,
    advantage, rewards/<fn>, env_reward, turn_rewards, counts, finish_reason), `context` (the messages before the first assistant message: the prompt),
    `segments` as logged and `by_turn`: per turn {turn (from 1), assistant (message text or None),
    calls (its tool calls), replies (the environment's messages after it), model (its trained
    segment's text or None), env (the masked segment after it, or None), reward}. A turn's reward
    is set only when the environment rewarded every turn (len(turn_rewards) == turns): otherwise
    which turns the rewards belong to is not logged, and `turn_rewards` stays a list."""
    messages = [m for m in row.get("messages") or [] if isinstance(m, dict)]
    segments = [s for s in row.get("segments") or []
                if isinstance(s, (list, tuple)) and len(s) == 2 and s[0] in ("model", "env")]
    context, said = [], []  # said: [assistant message, replies after it]
    for m in messages:
        if m.get("role") == "assistant":
            said.append([m, []])
        elif said:
            said[-1][1].append(m)
        else:
            context.append(m)
    tokens: list[list] = []  # [model text, env text]
    for kind, text in segments:
        if kind == "model" or not tokens:
            tokens.append([None, None])
        tokens[-1][0 if kind == "model" else 1] = str(text)
    turn_rewards = [r for r in (_number(x) for x in row.get("turn_rewards") or []) if r is not None]
    turns = row.get("turns") if isinstance(row.get("turns"), int) else len(said)
    aligned = bool(turn_rewards) and len(turn_rewards) == turns
    by_turn = []
    for k in range(max(len(said), len(tokens))):
        msg, replies = said[k] if k < len(said) else (None, [])
        model, env = tokens[k] if k < len(tokens) else (None, None)
        text = None if msg is None else str(msg.get("content") or "")
        calls = tool_calls(text, tool_format) if text and row.get("tool_calls") else []
        by_turn.append({"turn": k + 1, "assistant": text, "calls": calls, "replies": replies, "model": model,
                        "env": env, "reward": turn_rewards[k] if aligned and k < len(turn_rewards) else None})
    prompt = row.get("prompt")
    return {"index": index, "step": row.get("step"), "prompt": prompt if isinstance(prompt, str) else repr(prompt),
            "completion": row.get("completion"), "reward": _number(row.get("reward", row.get("score"))),
            "reward_name": "reward" if "reward" in row or "score" not in row else "score",
            "advantage": _number(row.get("advantage")), "env_reward": _number(row.get("env_reward")),
            "rewards": {k.split("/", 1)[1]: _number(v) for k, v in row.items() if k.startswith("rewards/")},
            "finish_reason": row.get("finish_reason"), "turns": turns,
            "tool_calls": row.get("tool_calls"), "tool_errors": row.get("tool_errors"),
            "turn_rewards": turn_rewards, "turn_rewards_by_turn": aligned,
            "context": context, "segments": [[k, str(t)] for k, t in segments], "by_turn": by_turn}


@router.get("/runs")
def runs(request: Request):
    """The runs whose samples are episodes, and the finish reasons in words."""
    studio = get_studio(request)
    return {"runs": [rid for rid, path in known_runs(studio).items() if has_episodes(path)],
            "finish_reasons": FINISH_REASONS}


@router.get("/samples")
def samples(request: Request, run: str, step: int | None = Query(None)):
    """A run's episodes of one step (paged by step: the newest logged step when none is given):
    {run, steps (every step with episodes), step, episodes: [episode_view]}. 404 for a step
    without episodes."""
    studio = get_studio(request)
    run_dir = resolve_run(request, run)
    path = run_file(run_dir, "samples.jsonl")
    by_step = tail_of(studio, path, EpisodeTail).read() if path is not None else {}
    steps = sorted(by_step)
    if step is None:
        step = steps[-1] if steps else None
    elif step not in by_step:
        raise HTTPException(404, f"run {run!r} has no episodes at step {step}")
    fmt = _tool_format(run_dir)
    rows = by_step.get(step, []) if step is not None else []
    return {"run": run, "steps": steps, "step": step, "tool_format": fmt,
            "episodes": [episode_view(r, i, fmt) for i, r in enumerate(rows)]}
