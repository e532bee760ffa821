"""The Episodes page's API: a run's multi-turn samples by step, each episode arranged by turn
(tether.studio.episodes.episode_view) — on a fabricated run whose every field is known, and on a
real GRPO run over an environment (tether.trainers.grpo with env=...)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("httpx", reason="httpx not installed (fastapi's TestClient; pip install -e '.[test]')")

from studio_support import client, make_app  # noqa: E402

PROMPT = ("What is 17 × 23?\n\nUse the tools add, sub, mul and div for the arithmetic. When you know the "
          "answer, write it on the last line of your reply as '#### <number>', for example '#### 42'.")
CALL = '<tool_call>\n{"name": "mul", "arguments": {"a": 17, "b": 23}}\n</tool_call>'
BAD_CALL = '<tool_call>{"name": "mul", "arguments": {"a": 17}}</tool_call>'
ANSWER = "17 × 23 = 391.\n#### 391"
MISSING = "error: tool 'mul' is missing argument 'b' (arguments: a: number, b: number)"
# the environment's replies as a ChatML template (SmolLM2's) renders a tool message
REPLY = "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
ERROR_REPLY = f"\n<|im_start|>tool\n{MISSING}<|im_end|>\n<|im_start|>assistant\n"

# Two calculator episodes of step 3 and one of step 1, as the GRPO trainer logs episodes (the
# keys of its episode sample), with segments and rewards chosen to tell every case apart.
SOLVED = {  # a tool call, its result, the answer; the environment rewarded both turns
    "step": 3, "prompt": PROMPT, "completion": CALL + ANSWER, "reward": 1.0,
    "rewards/env_reward": 1.0, "advantage": 0.8660254, "turns": 2, "tool_calls": 1, "tool_errors": 0,
    "messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": CALL},
                 {"role": "tool", "name": "mul", "content": "391"}, {"role": "assistant", "content": ANSWER}],
    "turn_rewards": [0.0, 1.0], "env_reward": 1.0, "finish_reason": "done",
    "segments": [["model", CALL + "<|im_end|>"], ["env", REPLY], ["model", ANSWER + "<|im_end|>"]],
}
CUT = {  # a call missing an argument, the tool's error, then a turn cut by the token budget
    "step": 3, "prompt": PROMPT, "completion": BAD_CALL + "Let me think about 17", "reward": 0.0,
    "rewards/env_reward": 0.0, "advantage": -0.8660254, "turns": 1, "tool_calls": 1, "tool_errors": 1,
    "messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": BAD_CALL},
                 {"role": "tool", "name": "mul", "content": MISSING}],
    "turn_rewards": [], "env_reward": 0.0, "finish_reason": "length",
    "segments": [["model", BAD_CALL + "<|im_end|>"], ["env", ERROR_REPLY], ["model", "Let me think about 17"]],
}
GUESS = {  # a step-based environment rewarding only its last turn: which turn is not logged
    "step": 1, "prompt": "go", "completion": "ba", "reward": 0.2, "rewards/env_reward": 0.2, "advantage": 0.5,
    "turns": 2, "tool_calls": 0, "tool_errors": 0,
    "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "a"}, {"role": "assistant", "content": "a"}],
    "turn_rewards": [0.2], "env_reward": 0.2, "finish_reason": "done",
    "segments": [["model", "b<|end|>"], ["env", "<|user|>a<|end|><|assistant|>"], ["model", "a<|end|>"]],
}


def write_episode_run(runs, name: str = "calc", rows=(GUESS, SOLVED, CUT), tool_format: str = "hermes"):
    """A run directory whose samples.jsonl holds `rows` (and a run of single-turn samples beside it)."""
    d = runs / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"env:\n  env: calculator\n  tool_format: {tool_format}\n  max_turns: 4\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3)))
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = runs / "single-turn"
    if not plain.exists():
        plain.mkdir()
        (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.1}) + "\n")
        (plain / "samples.jsonl").write_text(json.dumps({"step": 1, "prompt": "p", "completion": "c", "reward": 0.1}) + "\n")
    return d


def test_episodes_by_step_and_by_turn(tmp_path):
    runs = tmp_path / "runs"
    d = write_episode_run(runs)
    c = client(make_app(runs))
    listed = c.get("/api/episodes/runs").json()
    assert listed["runs"] == ["calc"]  # the single-turn run logs no episodes
    assert set(listed["finish_reasons"]) == {"done", "length", "turns", "eos", "env_error"}

    r = c.get("/api/episodes/samples", params={"run": "calc"}).json()
    assert r["steps"] == [1, 3] and r["step"] == 3 and r["tool_format"] == "hermes"  # the newest step first
    solved, cut = r["episodes"]
    assert [solved["index"], cut["index"]] == [0, 1]
    for view, row in ((solved, SOLVED), (cut, CUT)):
        assert view["segments"] == row["segments"] and view["finish_reason"] == row["finish_reason"]
        assert (view["reward"], view["advantage"], view["env_reward"]) == (row["reward"], row["advantage"], row["env_reward"])
        assert view["rewards"] == {"env_reward": row["rewards/env_reward"]}
        assert (view["turns"], view["tool_calls"], view["tool_errors"]) == (row["turns"], row["tool_calls"], row["tool_errors"])
        assert view["context"] == [{"role": "user", "content": PROMPT}]

    # every turn rewarded: each turn carries its reward
    assert solved["turn_rewards"] == [0.0, 1.0] and solved["turn_rewards_by_turn"]
    t1, t2 = solved["by_turn"]
    assert (t1["turn"], t1["assistant"], t1["model"], t1["env"], t1["reward"]) == (1, CALL, CALL + "<|im_end|>", REPLY, 0.0)
    assert t1["replies"] == [{"role": "tool", "name": "mul", "content": "391"}]
    assert t1["calls"] == [{"name": "mul", "arguments": {"a": 17, "b": 23}, "positional": [], "error": None, "text": CALL}]
    assert (t2["assistant"], t2["model"], t2["env"], t2["reward"], t2["calls"]) == (
        ANSWER, ANSWER + "<|im_end|>", None, 1.0, [])

    # the cut turn has its trained tokens and no message; the failed call is read as the episode read it
    c1, c2 = cut["by_turn"]
    # (the call reads fine: the missing argument is the tool's error, in the reply)
    assert c1["calls"][0]["name"] == "mul" and c1["calls"][0]["error"] is None and c1["env"] == ERROR_REPLY
    assert (c2["turn"], c2["assistant"], c2["model"], c2["env"], c2["replies"]) == (2, None, "Let me think about 17", None, [])
    assert cut["turn_rewards"] == [] and c1["reward"] is None

    # step 1: one reward over two turns is not placed on a turn
    g = c.get("/api/episodes/samples", params={"run": "calc", "step": 1}).json()
    assert g["step"] == 1 and len(g["episodes"]) == 1
    (guess,) = g["episodes"]
    assert guess["turn_rewards"] == [0.2] and not guess["turn_rewards_by_turn"]
    assert [t["reward"] for t in guess["by_turn"]] == [None, None]
    assert [(t["assistant"], t["model"], t["env"]) for t in guess["by_turn"]] == [
        ("b", "b<|end|>", "<|user|>a<|end|><|assistant|>"), ("a", "a<|end|>", None)]
    assert [t["replies"] for t in guess["by_turn"]] == [[{"role": "user", "content": "a"}], []]

    # a step without episodes, an unknown run: 404; the single-turn run: no steps
    assert c.get("/api/episodes/samples", params={"run": "calc", "step": 2}).status_code == 404
    assert c.get("/api/episodes/samples", params={"run": "nope"}).status_code == 404
    assert c.get("/api/episodes/samples", params={"run": "single-turn"}).json() == {
        "run": "single-turn", "steps": [], "step": None, "tool_format": "auto", "episodes": []}

    # a run being written: the next step's episodes appear on the next request
    with open(d / "samples.jsonl", "a") as f:
        f.write(json.dumps({**SOLVED, "step": 4}) + "\n")
    r = c.get("/api/episodes/samples", params={"run": "calc"}).json()
    assert r["steps"] == [1, 3, 4] and r["step"] == 4 and r["episodes"][0]["segments"] == SOLVED["segments"]
    assert c.get("/episodes").status_code == 200


def test_a_ppo_episode_names_its_reward_score():
    from tether.studio.episodes import episode_view

    row = {k: v for k, v in SOLVED.items() if k not in ("reward", "advantage", "rewards/env_reward")}
    view = episode_view({**row, "score": 0.75}, 0, "hermes")
    assert (view["reward"], view["reward_name"], view["advantage"], view["rewards"]) == (0.75, "score", None, {})
    assert view["by_turn"] == episode_view(SOLVED, 0, "hermes")["by_turn"]
    assert episode_view(SOLVED, 0)["reward_name"] == "reward"


def test_tool_calls_are_read_in_the_runs_format():
    from tether.studio.episodes import tool_calls

    assert [c["name"] for c in tool_calls(CALL, "auto")] == ["mul"]
    assert tool_calls(CALL, "plain") == []  # a plain run never read a <tool_call> block
    (call,) = tool_calls("I will compute.\nCALL add(a=2, b=3)", "auto")
    assert (call["name"], call["arguments"], call["text"]) == ("add", {"a": 2, "b": 3}, "CALL add(a=2, b=3)")
    (bad,) = tool_calls("<tool_call>{not json</tool_call>", "hermes")
    assert bad["name"] is None and bad["error"].startswith("malformed tool call")


class TwoTurns:
    """Turn 1: anything; the environment answers 'x'; turn 2: reward 1 if the reply starts with x."""

    def reset(self, row):
        self.k = 0
        return row["prompt"]

    def step(self, text):
        self.k += 1
        if self.k == 1:
            return [{"role": "user", "content": "x"}], None, False
        return [], float(text[:1] == "x"), True

    @classmethod
    def rows(cls, size, seed=0):
        return [{"prompt": "go"} for _ in range(size)]


def test_a_real_grpo_run_over_an_environment(tmp_path, monkeypatch):
    """One GRPO step of a tiny model on TwoTurns: every logged episode comes back arranged by
    turn, its model and env segments alternating, each env segment holding the environment's reply."""
    import torch

    # the run's closing plots (27 PNGs, ~5 s of matplotlib) are not what this test reads
    monkeypatch.setattr("tether.trainers.core.setup.plot_metrics", lambda path: None)

    from tether.models import make_tiny_model
    from tether.studio.episodes import FINISH_REASONS
    from tether.trainers.grpo import GRPOConfig, train_grpo

    model, tok = make_tiny_model(tmp_path / "model", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=32, chars="abcxyz")
    with torch.no_grad():  # turns that end, so that the environment gets to answer
        model.get_output_embeddings().weight[tok.convert_tokens_to_ids("<|end|>")] *= 8.0
    model.save_pretrained(tmp_path / "model")
    train_grpo(GRPOConfig(model=str(tmp_path / "model"), data="env", env="test_studio_episodes:TwoTurns", train_rows=8,
                          runs_dir=str(tmp_path / "runs"), name="two-turns", batch_size=2, num_generations=4,
                          max_new_tokens=12, max_steps=1, log_every=1, num_samples=8, device="cpu", progress=False,
                          seed=0))
    logged = [json.loads(line) for line in (tmp_path / "runs" / "two-turns" / "samples.jsonl").read_text().splitlines()]
    c = client(make_app(tmp_path / "runs"))
    assert c.get("/api/episodes/runs").json()["runs"] == ["two-turns"]
    r = c.get("/api/episodes/samples", params={"run": "two-turns"}).json()
    assert r["steps"] == [1] and len(r["episodes"]) == len(logged) == 8
    fed_back = 0
    for view, row in zip(r["episodes"], logged):
        assert view["segments"] == row["segments"] and view["reward"] == row["reward"]
        assert view["finish_reason"] in FINISH_REASONS and view["turns"] == row["turns"]
        kinds = [k for k, _ in view["segments"]]
        assert kinds[0] == "model" and all(a != b for a, b in zip(kinds, kinds[1:]))  # model, env, model, ...
        assert [t["model"] for t in view["by_turn"]] == [s for k, s in view["segments"] if k == "model"]
        assert [t["env"] for t in view["by_turn"] if t["env"] is not None] == [s for k, s in view["segments"] if k == "env"]
        assert [t["assistant"] for t in view["by_turn"] if t["assistant"] is not None] == [
            m["content"] for m in row["messages"] if m["role"] == "assistant"]
        for t in view["by_turn"]:
            if t["env"] is not None:
                fed_back += 1
                assert t["replies"] == [{"role": "user", "content": "x"}] and "x" in t["env"]
    assert fed_back > 0  # some episode got its second turn
