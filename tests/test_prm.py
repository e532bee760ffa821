"""Process reward models: the arithmetic step checker, the per-step loss (only at separators),
the PRM reward's aggregates and encoding, Math-Shepherd labels against enumeration, learning."""

from __future__ import annotations

import json
import math
import random
from contextlib import nullcontext

import pytest
import torch

from tether.data import encode_stepwise
from tether.data.steps import encode_steps, split_steps
from tether.models import load_tokenizer, make_tiny_model
from tether.models.heads import ScalarHeadModel
from tether.rewards.process import ProcessReward, aggregate_steps, parse_prm_spec
from tether.rewards.registry import load_reward
from tether.tasks import arithmetic as A
from tether.trainers.prm import IGNORE, batch_loss, process_reward_loss, step_metrics

SHAPE = dict(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)


# -- the step checker ------------------------------------------------------------------------------

def _checks(completion, problem):
    c = A.check_steps(completion, problem)
    return [s.value for s in c], [s.valid for s in c], [s.correct for s in c]


def test_right_solution_every_step_true():
    p = A.Problem(47, "+", 8)
    assert A.split_solution(" 47 + 8 = 40 + 7 + 8 = 40 + 15 = 55\n#### 55") == \
        [" 47 + 8 ", " 40 + 7 + 8 ", " 40 + 15 ", " 55\n#### 55"]
    assert _checks(" 47 + 8 = 40 + 7 + 8 = 40 + 15 = 55\n#### 55", p) == \
        ([55, 55, 55, 55], [True] * 4, [True] * 4)


def test_wrong_link_makes_later_steps_wrong_but_locally_valid():
    p = A.Problem(47, "+", 8)
    # 40 + 5 + 8 = 53: the second link is the error; the chain after it is internally consistent
    assert _checks(" 47 + 8 = 40 + 5 + 8 = 40 + 13 = 53\n#### 53", p) == \
        ([55, 53, 53, 53], [True, False, True, True], [True, False, False, False])
    # an error cancelled by a second one: the chain is back on the answer (on track again)
    assert _checks(" 47 + 8 = 40 + 5 + 8 = 40 + 15 = 55\n#### 55", p)[2] == [True, False, True, True]


def test_slipped_answer_line_and_missing_line():
    p = A.Problem(75, "-", 7)
    sol = " 75 - 7 = 60 + 15 - 7 = 60 + 8 = 68"
    assert _checks(sol + "\n#### 78", p) == ([68] * 4, [True, True, True, False], [True, True, True, False])
    assert _checks(sol, p)[1:] == ([True, True, True, False], [True, True, True, False])  # no answer line


def test_multiplication_and_garbage_steps():
    p = A.Problem(23, "×", 17)
    assert _checks(" 23 × 17 = 23 × 10 + 23 × 7 = 230 + 161 = 391\n#### 391", p)[2] == [True] * 4
    assert _checks(" 23 × 17 = 23 × 10 + 23 × 7 = 230 + 151 = 381\n#### 381", p) == \
        ([391, 391, 381, 381], [True, True, False, True], [True, True, False, False])
    assert _checks(" 23 × = 391\n#### 391", p) == ([None, 391], [False, False], [False, True])
    assert A.evaluate_expression("10 - 2 × 3 + 1") == 5 and A.evaluate_expression("60 + -6") == 54
    assert A.evaluate_expression("4 +") is None and A.evaluate_expression("2 3") is None


def test_generated_solutions_check_true_at_every_level():
    rng = random.Random(1)
    for level in A.LEVELS:
        for _ in range(300):
            p = A.sample_problem(rng, level)
            checks = A.check_steps(f" {p.solution}\n#### {p.answer}", p)
            assert all(c.valid and c.correct for c in checks), (p, p.solution)
            assert len(checks) == p.solution.count("=") + 1


def test_stepwise_row_and_first_error():
    p = A.Problem(47, "+", 8)
    row = A.stepwise_example(p, " 47 + 8 = 40 + 5 + 8 = 40 + 13 = 53\n#### 53")
    assert row == {"prompt": "What is 47 + 8?", "completions": [" 47 + 8 ", " 40 + 5 + 8 ", " 40 + 13 ", " 53\n#### 53"],
                   "labels": [True, False, False, False]}
    assert A.first_error(row["labels"]) == 1 and A.first_error([True, True]) is None
    assert split_steps("a=b=", "=") == ["a", "b"] and split_steps("ab", "=") == ["ab"]


# -- the per-step loss -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("prm") / "tiny"
    make_tiny_model(path, seed=3, **SHAPE)
    return str(path)


def _bce(s, y):
    p = 1 / (1 + math.exp(-s))
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


def test_loss_only_at_separators_matches_hand_bce(tiny):
    tok = load_tokenizer(tiny)
    torch.manual_seed(0)
    model = ScalarHeadModel.from_pretrained(tiny).eval()
    with torch.no_grad():  # a head big enough that positions give clearly different logits
        model.head.weight.normal_(0, 1.0)
    rows = [{"prompt": "What is 47 + 8?", "completions": [" 47 + 8 ", " 40 + 5 + 8 ", " 53\n#### 53"],
             "labels": [True, False, False]},
            {"prompt": "What is 9 - 3?", "completions": [" 9 - 3 ", " 6\n#### 6"], "labels": [True, True]}]
    examples, _ = encode_stepwise(rows, tok, step_separator="=")
    loss, stats = batch_loss(model, examples, tok.pad_token_id, torch.device("cpu"), nullcontext())
    # by hand: each row alone (no padding), the head's scalar at every '=' token (the separators:
    # no step holds an '=' of its own), BCE against the row's labels, mean over all 5 steps
    eq = tok.convert_tokens_to_ids("=")
    hand, shifted = [], []
    with torch.no_grad():
        for ex, row in zip(examples, rows):
            ids = torch.tensor([ex["input_ids"]])
            s = model(ids)[0].tolist()
            pos = [t for t, i in enumerate(ex["input_ids"]) if i == eq]
            assert len(pos) == len(row["labels"]) and pos[-1] == len(ex["input_ids"]) - 1
            hand += [_bce(s[t], float(y)) for t, y in zip(pos, row["labels"])]
            shifted += [_bce(s[t - 1], float(y)) for t, y in zip(pos, row["labels"])]
    assert stats["steps"] == 5
    assert float(loss.detach()) == pytest.approx(sum(hand) / len(hand), rel=1e-5)
    # a mask shifted by one token gives another number: the test above would catch it
    assert abs(sum(shifted) / len(shifted) - sum(hand) / len(hand)) > 1e-2


def test_process_reward_loss_ignores_unlabelled_positions():
    logits = torch.tensor([[0.3, -1.2, 2.0, 5.0], [1.5, 0.0, -0.7, -9.0]])
    labels = torch.tensor([[IGNORE, 0, IGNORE, 1], [1, IGNORE, 0, IGNORE]])
    loss, stats = process_reward_loss(logits, labels)
    want = (_bce(-1.2, 0) + _bce(5.0, 1) + _bce(1.5, 1) + _bce(-0.7, 0)) / 4
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(stats["accuracy"]) == 1.0 and stats["steps"] == 4


def test_soft_targets_loss_by_hand():
    logits = torch.tensor([[0.0, 7.0, math.log(3)]])
    labels = torch.tensor([[0.25, IGNORE, 0.75]])
    loss, stats = process_reward_loss(logits, labels)
    # σ(0) = 1/2:     −[0.25·ln(1/2) + 0.75·ln(1/2)] = ln 2
    # σ(ln 3) = 3/4:  −[0.75·ln(3/4) + 0.25·ln(1/4)] = 0.75·ln 4 − 0.75·ln 3 + 0.25·ln 4 = 2 ln 2 − 0.75 ln 3
    # mean of the two: (3 ln 2 − 0.75 ln 3)/2 = (2.0794415 − 0.8239592)/2 = 0.6277412
    # (a target rounded to 1 would give −ln(3/4) = 0.2877 for the second step instead)
    assert float(loss) == pytest.approx((math.log(2) + 2 * math.log(2) - 0.75 * math.log(3)) / 2, rel=1e-6)
    assert float(loss) == pytest.approx(0.6277412, rel=1e-6) and stats["steps"] == 2


def test_soft_targets_sit_where_the_bool_labels_do(tiny):
    tok = load_tokenizer(tiny)
    row = {"prompt": "What is 9 - 3?", "completions": [" 9 - 3 ", " 6\n#### 6"], "labels": [True, False],
           "soft_labels": [0.625, 0.25]}
    (hard,), _ = encode_stepwise([row], tok, step_separator="=")
    (soft,), _ = encode_stepwise([row], tok, step_separator="=", soft=True)
    # one token per character: BOS + the prompt's 14 + ' 9 - 3 =' puts step 0's '=' at 1 + 14 + 8 − 1 = 22
    ends = [22, len(hard["input_ids"]) - 1]
    assert soft["input_ids"] == hard["input_ids"]
    assert [(t, y) for t, y in enumerate(hard["step_labels"]) if y != IGNORE] == list(zip(ends, [1, 0]))
    assert [(t, y) for t, y in enumerate(soft["step_labels"]) if y != IGNORE] == list(zip(ends, [0.625, 0.25]))


SOFT = {"a": 0.1, "b": 0.3, "c": 0.7, "d": 0.9}  # each step's soft label is a function of its text


def _soft_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        steps = [rng.choice("abcd") for _ in range(rng.randint(2, 5))]
        rows.append({"prompt": "Q", "completions": steps, "labels": [SOFT[c] > 0.5 for c in steps],
                     "soft_labels": [SOFT[c] for c in steps]})
    return rows


def _soft_error(model, tok, rows) -> float:
    """mean over all steps of |σ(s_i) − y_soft,i|, each row scored as `prm:` reads it."""
    errors = []
    with torch.no_grad():
        for r in rows:
            ids, pos = encode_steps(tok, r["prompt"], r["completions"], "|")
            p = torch.sigmoid(model.eval()(torch.tensor([ids]))[0, pos].float())
            errors += (p - torch.tensor(r["soft_labels"])).abs().tolist()
    return sum(errors) / len(errors)


def test_prm_with_soft_targets_learns_the_soft_labels(tiny, tmp_path):
    """Steps a, b, c, d carry soft labels 0.1, 0.3, 0.7, 0.9 (bool labels: > 0.5). Trained toward
    the soft labels, σ(s) moves onto them; trained on the bool labels it would head for 0 and 1,
    where the mean error over the four kinds of step is at least 0.1."""
    from tether.trainers.prm import PRMConfig, train_prm

    for name, rows in (("train", _soft_rows(400, 0)), ("eval", _soft_rows(100, 1))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok, held = load_tokenizer(tiny), _soft_rows(100, 1)
    torch.manual_seed(0)
    start = _soft_error(ScalarHeadModel.from_pretrained(tiny), tok, held)
    s = train_prm(PRMConfig(model=tiny, data=str(tmp_path / "train.jsonl"), eval_data=str(tmp_path / "eval.jsonl"),
                            step_separator="|", targets="soft", runs_dir=str(tmp_path), name="prm", max_steps=60,
                            lr=5e-3, batch_size=32, device="cpu", progress=False, log_every=40))
    end = _soft_error(ScalarHeadModel.from_pretrained(s["checkpoint"]), tok, held)
    print(f"mean |σ(s) − y_soft|: {start:.4f} -> {end:.4f}; eval {s['eval/step_accuracy']=}, {s['eval/loss']=}")
    assert start > 0.25 and end < 0.05
    assert s["eval/step_accuracy"] > 0.95  # the metrics read the bool labels (the soft ones thresholded here)


def test_step_metrics_by_hand():
    probs = [torch.tensor([0.9, 0.2, 0.4]), torch.tensor([0.8, 0.7]), torch.tensor([0.6, 0.3])]
    labels = [[True, False, False], [True, True], [True, True]]
    m = step_metrics(probs, labels)
    # predictions [T F F] [T T] [T F]: 6 of 7 right; correct: tp 4, fp 0, fn 1; wrong: tn 2, fn 0, fp 1
    assert m["step_accuracy"] == pytest.approx(6 / 7)
    assert m["step_f1"] == pytest.approx(8 / 9) and m["error_f1"] == pytest.approx(4 / 5)
    assert m["first_error_accuracy"] == pytest.approx(2 / 3)  # rows 1, 2 right; row 3 predicts step 1


# -- the PRM as a reward ---------------------------------------------------------------------------

def test_aggregates_by_hand():
    p = torch.tensor([0.9, 0.2, 0.6])
    assert aggregate_steps(p, "min") == pytest.approx(0.2)
    assert aggregate_steps(p, "last") == pytest.approx(0.6)
    assert aggregate_steps(p, "prod") == pytest.approx(0.108)
    assert aggregate_steps(p, "mean") == pytest.approx(1.7 / 3)
    with pytest.raises(Exception, match="aggregate"):
        aggregate_steps(p, "max")
    assert parse_prm_spec("prm:runs/x?aggregate=prod&batch_size=8") == ("runs/x", {"aggregate": "prod", "batch_size": 8})


def test_prm_reward_scores_each_step_at_its_separator(tiny, tmp_path):
    torch.manual_seed(1)
    model = ScalarHeadModel.from_pretrained(tiny)
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
    model.save_pretrained(tmp_path / "prm", load_tokenizer(tiny))
    (tmp_path / "prm" / "prm.json").write_text(json.dumps({"separator": "="}))
    tok = load_tokenizer(tiny)
    prompt, completion = "What is 47 + 8?", " 47 + 8 = 40 + 7 + 8 = 55\n#### 55"
    # by hand: BOS + prompt + completion + the '=' closing the last step, one char per token
    ids = [tok.bos_token_id] + tok(prompt + completion + "=", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        s = model.eval()(torch.tensor([ids]))[0]
    pos = [t for t, c in enumerate(ids) if c == tok.convert_tokens_to_ids("=")]
    want = torch.sigmoid(s[pos])
    assert encode_steps(tok, prompt, split_steps(completion, "="), "=") == (ids, pos)
    for agg, value in (("min", want.min()), ("last", want[-1]), ("prod", want.prod()), ("mean", want.mean())):
        r = load_reward(f"prm:{tmp_path / 'prm'}?aggregate={agg}&device=cpu")
        got = r([prompt, prompt], [completion, completion])
        assert got[0] == pytest.approx(float(value), rel=1e-5) and got[1] == pytest.approx(got[0], rel=1e-6)
    probs = ProcessReward(tmp_path / "prm", device="cpu").step_probabilities([prompt], [completion])[0]
    assert torch.allclose(probs, want, rtol=1e-5)
    # the training encoding of the same steps is the scoring encoding
    ex, _ = encode_stepwise([{"prompt": prompt, "completions": split_steps(completion, "="),
                              "labels": [True] * 3}], tok, step_separator="=")
    assert ex[0]["input_ids"] == ids and [t for t, y in enumerate(ex[0]["step_labels"]) if y != IGNORE] == pos


# -- dense per-step rewards for PPO ----------------------------------------------------------------

def test_ppo_process_rewards_land_on_completion_tokens_of_the_padded_batch(tiny, tmp_path, monkeypatch):
    """In a PPO run with process_reward=true the PRM's dense rewards reach GAE inside the completion
    mask of the (width-padded) training batch, one on each completion's last token — a reward
    placed on prompt or padding columns would be dropped by the mask without a sound."""
    from tether.trainers.ppo import loop as ppo_mod

    torch.manual_seed(2)
    tok = load_tokenizer(tiny)
    prm_model = ScalarHeadModel.from_pretrained(tiny)
    prm_model.save_pretrained(tmp_path / "prm", tok)
    (tmp_path / "prm" / "prm.json").write_text(json.dumps({"separator": "="}))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"What is {a} + 1?"}) + "\n" for a in range(8)))
    seen = []
    real = ppo_mod.ppo_advantages

    def spy(*a, **k):
        dense = k.get("dense", a[10] if len(a) > 10 else None)
        seen.append((a[4].clone(), None if dense is None else dense.clone()))
        return real(*a, **k)
    monkeypatch.setattr(ppo_mod, "ppo_advantages", spy)
    ppo_mod.train_ppo(ppo_mod.PPOConfig(model=tiny, data=str(tmp_path / "p.jsonl"), runs_dir=str(tmp_path / "runs"),
                                        name="prm", batch_size=8, num_generations=1, max_new_tokens=12, max_steps=1,
                                        device="cpu", progress=False, seed=0, value_model="policy",
                                        process_reward=True, kl_coef=0.0),
                      reward_funcs=[f"prm:{tmp_path / 'prm'}?device=cpu"])
    (mask, dense), = seen
    assert dense is not None and mask.shape[1] % 16 == 0  # the padded width
    assert not dense[~mask.bool()].any()  # nothing outside the completions
    rows = mask.any(1)
    last = mask.shape[1] - 1 - mask.flip(1).float().argmax(1)
    assert (dense[torch.arange(len(mask)), last][rows] > 0).all()  # the last step ends on the last token


def test_ppo_dense_rewards_at_each_steps_last_token(tiny, tmp_path):
    from types import SimpleNamespace

    from tether.trainers.ppo.loop import ppo_advantages
    from tether.trainers.ppo.process import dense_process_rewards, step_end_tokens

    tok = load_tokenizer(tiny)
    torch.manual_seed(2)
    model = ScalarHeadModel.from_pretrained(tiny)
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
    model.save_pretrained(tmp_path / "prm", tok)
    (tmp_path / "prm" / "prm.json").write_text(json.dumps({"separator": "="}))
    prm = ProcessReward(tmp_path / "prm", device="cpu")
    texts = [" 5 = 4\n#### 4", " 7"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(map(len, ids))
    # " 5 =" ends at character 4: token 3 (the '='); the last step at the last token
    assert step_end_tokens(tok, ids[0], [" 5 ", " 4\n#### 4"], "=") == [3, len(ids[0]) - 1]
    rollout = SimpleNamespace(texts=texts, prompt_width=4,
                              completion_ids=torch.tensor([i + [0] * (T - len(i)) for i in ids]),
                              completion_mask=torch.tensor([[1] * len(i) + [0] * (T - len(i)) for i in ids]).bool())
    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": "What is 3 + 4?"}]
    dense = dense_process_rewards(prm, 0.5, rows, rollout, T + 4, tok)  # 4 columns of prompt
    p = prm.step_probabilities([r["prompt"] for r in rows], texts)
    want = torch.zeros(2, T + 4)
    want[0, 4 + 3], want[0, 4 + len(ids[0]) - 1], want[1, 4 + len(ids[1]) - 1] = 0.5 * p[0][0], 0.5 * p[0][1], 0.5 * p[1][0]
    assert torch.allclose(dense, want)
    # PPO's training batch is width-padded on the right (training_batch(SEQ_MULTIPLE)): the same
    # columns, then zeros
    padded = dense_process_rewards(prm, 0.5, rows, rollout, T + 4 + 5, tok)
    assert torch.allclose(padded[:, :T + 4], want) and not padded[:, T + 4:].any()
    # in PPO's per-token reward (β = 0): the dense rewards plus the other rewards' score at the end
    mask = torch.zeros(2, T + 4, dtype=torch.bool)
    mask[0, 4:4 + len(ids[0])], mask[1, 4:4 + len(ids[1])] = True, True
    zeros = torch.zeros(2, T + 4)
    r, _, _ = ppo_advantages(torch.tensor([1.0, 2.0]), zeros, zeros, zeros, mask, 0.0, whiten=False, dense=dense)
    want[0, 4 + len(ids[0]) - 1] += 1.0
    want[1, 4 + len(ids[1]) - 1] += 2.0
    assert torch.allclose(r, want)
