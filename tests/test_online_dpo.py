"""Online / iterative DPO (`tether odpo`): pairs are the best and the worst of each prompt's k
completions with ties dropped (checked by hand), reference=reset makes each round's first loss
exactly ln 2, the self-judge is the policy's answer-token log-odds, and the reward it is given
moves the policy the right way (and a flipped reward the other way: a trainer that swapped chosen
and rejected fails both)."""

import json
import math

import pytest
import torch

from queue_support import make_world, one_thread_for_the_module
from tether.trainers.preference.online import ODPOConfig, SelfJudge, build_pairs, train_odpo

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    yield from one_thread_for_the_module()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = make_world(tmp_path_factory.mktemp("odpo"))  # the queue tests' tiny model and 64 prompts
    (root / "rewards.py").write_text(REWARDS)
    return root


REWARDS = '''
def digit_frac(prompts, completions, completion_ids, **_):
    """Fraction of the completion's characters that are digits (~10% for the random-init model)."""
    return [sum(c in "0123456789" for c in t) / max(len(t), 1) for t in completions]


def no_digits(prompts, completions, completion_ids, **_):
    return [-r for r in digit_frac(prompts, completions, completion_ids)]


def digit_frac_dies(prompts, completions, completion_ids, **_):
    """digit_frac, but the 5th call raises (a sampler that fails; the count lives in a file)."""
    import os
    path = os.environ["ODPO_CALLS"]
    n = (int(open(path).read()) if os.path.exists(path) else 0) + 1
    open(path, "w").write(str(n))
    if n == 5:
        raise RuntimeError("the sampler's machine went away")
    return digit_frac(prompts, completions, completion_ids)
'''


def _cfg(root, name, **kw):
    base = dict(model=str(root / "model"), data=str(root / "prompts.jsonl"), runs_dir=str(root / "runs"),
                name=name, batch_size=8, num_generations=4, max_new_tokens=8, max_steps=12, lr=1e-2,
                beta=0.1, device="cpu", progress=False, seed=0,
                reward_funcs=[f"{root / 'rewards.py'}:digit_frac"])
    base.update(kw)
    return ODPOConfig(**base)


def _metrics(root, name):
    return [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
            if "reward" in json.loads(line)]


def test_pairs_best_vs_worst_ties_dropped():
    nan = float("nan")
    r = torch.tensor([0.1, 0.9, 0.5, 0.9,    # prompt 0: best = row 1 (the first of the two 0.9), worst = row 0
                      2.0, 2.0, 2.0, 2.0,    # prompt 1: all equal: a tie
                      nan, 3.0, nan, nan,    # prompt 2: one scored completion: no pair
                      nan, -1.0, 4.0, -2.0,  # prompt 3: NaN ignored; best row 14, worst row 15
                      1.0, 1.0, nan, 1.0])   # prompt 4: scored ones tie
    pairs, counts = build_pairs(r, 4)
    assert pairs == [(1, 0), (14, 15)]
    assert counts == {"pairs": 2, "ties": 2, "unscored_prompts": 1, "frac_ties": 0.5}


def test_self_judge_is_the_policys_answer_log_odds(setup):
    from transformers import AutoModelForCausalLM

    from tether.models import load_tokenizer
    model = AutoModelForCausalLM.from_pretrained(setup / "model").eval()
    tok = load_tokenizer(str(setup / "model"))
    judge = SelfJudge(model, tok, "{prompt}{completion} ok?", ["Y", "N"])
    got = judge(["Say 1:", "Say 22:"], ["12", "abc"])
    for prompt, completion, value in zip(["Say 1:", "Say 22:"], ["12", "abc"], got):
        # the tiny tokenizer has a chat template: the judge text is a user turn, then the assistant's
        ids = tok(f"<|user|>{prompt}{completion} ok?<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        y, n = tok.convert_tokens_to_ids("Y"), tok.convert_tokens_to_ids("N")
        assert value == pytest.approx(float(lp[y] - lp[n]), abs=1e-5)


def test_reset_reference_makes_each_round_start_at_ln2(setup):
    """reference=reset: at a round's start the reference *is* the policy, so the sigmoid loss of
    the first update is −log σ(0) = ln 2 exactly, every round; with the reference fixed it is ln 2
    only in round 1 (the policy has moved since)."""
    reset = train_odpo(_cfg(setup, "reset", reference="reset", max_steps=3, dpo_epochs=2))
    fixed = train_odpo(_cfg(setup, "fixed", reference="fixed", max_steps=3, dpo_epochs=2))
    rows_reset, rows_fixed = _metrics(setup, "reset"), _metrics(setup, "fixed")
    ln2 = float(-torch.nn.functional.logsigmoid(torch.tensor(0.0)))  # ln 2 in float32, as the loss is
    assert ln2 == pytest.approx(math.log(2), abs=1e-7)
    assert [r["loss/round_start"] for r in rows_reset] == [ln2] * 3
    assert rows_fixed[0]["loss/round_start"] == ln2
    assert all(abs(r["loss/round_start"] - ln2) > 1e-4 for r in rows_fixed[1:])
    assert reset["reference"] == "reset" and fixed["reference"] == "fixed"
    for r in rows_reset:
        assert r["pairs"] + r["ties"] + r["unscored_prompts"] == 8
        assert r["updates"] == 2  # all pairs in one step, two epochs


@pytest.mark.parametrize("reference", ["fixed", "reset"])
def test_reward_moves_the_policy_the_right_way(setup, reference):
    """The digit fraction of the sampled completions (the truth: the reward function itself) rises
    when it is the reward and falls when its negation is. Chosen/rejected swapped, both would flip."""
    up = train_odpo(_cfg(setup, f"up-{reference}", reference=reference, dpo_epochs=2))
    down = train_odpo(_cfg(setup, f"down-{reference}", reference=reference, dpo_epochs=2,
                           reward_funcs=[f"{setup / 'rewards.py'}:no_digits"]))
    del up, down
    def start_end(name, sign):
        vals = [sign * r["reward"] for r in _metrics(setup, name)]
        return sum(vals[:3]) / 3, sum(vals[-3:]) / 3
    s_up, e_up = start_end(f"up-{reference}", 1.0)
    s_down, e_down = start_end(f"down-{reference}", -1.0)
    assert e_up > s_up + 0.15, (s_up, e_up)
    assert e_down < s_down - 0.03, (s_down, e_down)


def test_resume_matches_uninterrupted(setup):
    """A run stopped after round 2 and resumed ends as one that never stopped (rounds are steps)."""
    kw = dict(reference="reset", dpo_epochs=2)
    train_odpo(_cfg(setup, "whole", max_steps=4, **kw))
    train_odpo(_cfg(setup, "halves", max_steps=2, **kw))
    train_odpo(_cfg(setup, "halves", max_steps=4, resume=True, **kw))
    keys = ("loss", "reward", "kl", "rewards/margins", "pairs")
    whole, halves = _metrics(setup, "whole"), _metrics(setup, "halves")
    assert [[r[k] for k in keys] for r in whole] == [[r[k] for k in keys] for r in halves]


def test_resume_after_a_crash_under_the_queue_is_exact(setup, monkeypatch):
    """queue.max_staleness=1 (rounds sampled one ahead by the sampler thread): a run whose reward
    fails while scoring round 4 (rounds 0-3 trained, the step-2 checkpoint written with the round
    sampled ahead in it), resumed, logs what the uninterrupted run logs."""
    kw = dict(max_staleness=1, max_steps=5, save_every=2, keep_last=0, dpo_epochs=2,
              reward_funcs=[f"{setup / 'rewards.py'}:digit_frac_dies"])
    (setup / "never.txt").write_text("100")  # the uninterrupted run's count never reaches 5
    monkeypatch.setenv("ODPO_CALLS", str(setup / "never.txt"))
    train_odpo(_cfg(setup, "qwhole", **kw))
    monkeypatch.setenv("ODPO_CALLS", str(setup / "calls.txt"))
    with pytest.raises(RuntimeError, match="went away"):
        train_odpo(_cfg(setup, "qcut", **kw))
    assert (setup / "runs" / "qcut" / "checkpoints" / "step-2" / "queue.pt").exists()
    train_odpo(_cfg(setup, "qcut", resume=True, **kw))  # calls 6, 7, ...: no failure
    keys = ("loss", "reward", "kl", "rewards/margins", "pairs", "queue/staleness")
    assert [[r[k] for k in keys] for r in _metrics(setup, "qwhole")] == \
        [[r[k] for k in keys] for r in _metrics(setup, "qcut")]


def test_sampler_thread_trains_on_batches_one_round_stale(setup):
    """queue.max_staleness=1: round j is sampled with the weights of round j − 1 (round 0 with the
    initial ones) by the trajectory queue's sampler thread, while the trainer updates."""
    train_odpo(_cfg(setup, "stale", max_steps=4, max_staleness=1))
    assert [r["queue/staleness"] for r in _metrics(setup, "stale")] == [0, 1, 1, 1]


def test_torchrun_is_refused_before_anything_loads(setup, monkeypatch):
    """Under torchrun (WORLD_SIZE > 1) odpo says it runs in one process — before the process group is
    joined or a model loads (distributed.active() is still False then: the check reads WORLD_SIZE)."""
    from tether.errors import UserError
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="one process"):
        train_odpo(_cfg(setup, "torchrun", max_steps=1))
    assert not (setup / "runs" / "torchrun").exists()
