"""AI judges (tether/feedback): swap debiasing against exact expected values, answer-token
log-probs from one batched forward against token-by-token decoding, the labelled rows against the
trainers' own data loaders, and bad input as one line."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from tether.cli import main
from tether.feedback.constitution import load_constitution, parse_principles, pick_principles
from tether.feedback.judge import (LMJudge, choose, judge_pairs, preference_rows, swap_debiased)
from tether.feedback.label import LabelPairsConfig, label_pairs
from tether.feedback.lm import answer_contexts, answer_logprobs, chat_text
from tether.models import make_tiny_model
from tether.tasks.preference_world import PreferenceWorld, label_pairs as bt_labels

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


def sigmoid(z):
    return 1 / (1 + math.exp(-z))


# -- swap debiasing ----------------------------------------------------------------------------------

def _pairs(n=40, seed=0):
    """n pairs of responses with known rewards r (a response is 'x' * length; r is given per text)."""
    rng = random.Random(seed)
    a = ["a" * rng.randint(1, 9) + str(i) for i in range(n)]
    b = ["b" * rng.randint(1, 9) + str(i) for i in range(n)]
    r = {t: rng.choice([-1.0, 0.0, 0.5, 2.0]) for t in a + b}
    return a, b, r


@pytest.mark.parametrize("w", [0.0, 0.3, 0.8, 1.0])
def test_swap_debiasing_makes_a_position_biased_judge_unbiased(w):
    a, b, r = _pairs()
    truth = np.array([sigmoid(r[x] - r[y]) for x, y in zip(a, b)])

    def judge(shown):  # prefers whatever is shown first with weight w, else the BT truth
        return [w + (1 - w) * sigmoid(r[u] - r[v]) for _, u, v, _ in shown]

    j = judge_pairs(judge, ["p"] * len(a), a, b, [["be good"]] * len(a))
    # exact expectation: P̂ = ½ + (1 − w)(P − ½)
    np.testing.assert_allclose(j.p, 0.5 + (1 - w) * (truth - 0.5), atol=1e-12)
    # asked the other way round, the debiased judge says exactly the complement
    jr = judge_pairs(judge, ["p"] * len(a), b, a, [["be good"]] * len(a))
    np.testing.assert_allclose(jr.p, 1 - j.p, atol=1e-12)
    s = j.stats()
    assert s["position_bias"] == pytest.approx(w + (1 - w) / 2, abs=1e-12)  # = p, the raw P(A)
    assert s["debiased_position_bias"] == pytest.approx(0.5, abs=1e-12)
    # ties in the truth are exactly ½ after debiasing, whatever w
    tie = truth == 0.5
    assert tie.any() and np.all(j.p[tie] == 0.5)


def test_swap_debiasing_cannot_remove_an_order_free_bias():
    """A judge preferring the longer response with probability q: both orders carry the same bias,
    so the debiased probability is the biased one, exactly."""
    a, b, r = _pairs(seed=1)
    q = 0.6

    def longer(u, v):
        return 0.5 if len(u) == len(v) else float(len(u) > len(v))

    def judge(shown):
        return [q * longer(u, v) + (1 - q) * sigmoid(r[u] - r[v]) for _, u, v, _ in shown]

    j = judge_pairs(judge, ["p"] * len(a), a, b, [[]] * len(a))
    expected = [q * longer(x, y) + (1 - q) * sigmoid(r[x] - r[y]) for x, y in zip(a, b)]
    np.testing.assert_allclose(j.p, expected, atol=1e-12)
    np.testing.assert_allclose(j.p_ab, expected, atol=1e-12)
    assert j.stats()["position_bias"] == pytest.approx(0.5, abs=1e-12)  # no position bias to see


def test_swap_debiased_is_the_two_order_average():
    assert swap_debiased(0.9, 0.7) == pytest.approx(0.6)
    assert swap_debiased(np.array([1.0, 0.2]), np.array([1.0, 0.8])).tolist() == pytest.approx([0.5, 0.2])


def test_sampled_labels_reproduce_the_gold_bradley_terry_labeller():
    """choose('sample') draws with the same uniforms as preference_world.label_pairs: a judge that
    returns the gold BT probability labels exactly as the gold labeller does."""
    world = PreferenceWorld()
    rng = random.Random(3)
    prompts = world.prompts(50, seed=1)
    a = [world.write(p, rng) or "the" for p in prompts]
    b = [world.write(p, rng) or "a" for p in prompts]
    gold = bt_labels(world, prompts, a, b, seed=11)
    p = np.array([sigmoid(x - y) for x, y in zip(world.gold_reward(prompts, a), world.gold_reward(prompts, b))])
    picks = choose(p, "sample", seed=11)
    assert [r["chosen"] for r in gold] == [x if k else y for x, y, k in zip(a, b, picks)]
    # argmax: the more probable side, ties by a coin
    assert choose(np.array([0.7, 0.3]), "argmax").tolist() == [True, False]


# -- the LM judge ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge") / "model"
    model, tok = make_tiny_model(path, seed=3, **TINY)
    return path, model.eval(), tok


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_answer_logprobs_of_one_batched_forward_equal_token_by_token_decoding(tiny):
    _, model, tok = tiny
    texts = [chat_text(tok, [{"role": "user", "content": c}]) for c in ("Which? A or B", "x" * 37, "hi")]
    contexts, ids = answer_contexts(tok, texts, ("A", "B"))
    assert [i for i, _ in ids] == [tok.convert_tokens_to_ids("A")] * 3
    batched = answer_logprobs(model, contexts, ids, batch_size=3, pad_id=tok.pad_token_id)
    for ctx, (ia, ib), row in zip(contexts, ids, batched):
        past, logits = None, None
        with torch.no_grad():
            for t in ctx:  # one token at a time through the KV cache
                o = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past, logits = o.past_key_values, o.logits[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        torch.testing.assert_close(row, torch.stack([lp[ia], lp[ib]]), atol=1e-5, rtol=1e-5)


def test_lm_judge_probability_is_the_softmax_over_the_two_answers(tiny):
    _, model, tok = tiny
    judge = LMJudge(model, tok, batch_size=2)
    shown = [("q?", "yes", "no", ["be kind"]), ("q2", "a long answer", "b", ["p1", "p2"])]
    probs = judge(shown)
    texts, answers = judge.texts(shown)
    assert "- p1\n- p2" in texts[1] and "Response A:\na long answer" in texts[1]
    contexts, ids = answer_contexts(tok, texts, answers)
    lp = answer_logprobs(model, contexts, ids, batch_size=1)
    expected = (lp[:, 0].exp() / lp.exp().sum(1)).tolist()
    assert probs == pytest.approx(expected, abs=1e-6)


def test_lm_judge_with_chain_of_thought_reads_the_answer_after_the_rationale(tiny):
    _, model, tok = tiny
    judge = LMJudge(model, tok, cot=True, cot_max_new_tokens=8, cot_temperature=1.0, seed=5)
    shown = [("q?", "yes", "no", ["be kind"])]
    probs = judge(shown)
    texts, answers = judge.texts(shown)  # same seed: the same rationale again
    assert answers == ("A", "B") and texts[0].endswith(judge.rationales[0] + "\nAnswer: ")
    assert "Explain your reasoning" in texts[0] and 0 < probs[0] < 1


# -- the command: rows the trainers accept; bad input -------------------------------------------------

@pytest.fixture()
def files(tmp_path):
    cons = tmp_path / "principles.md"
    cons.write_text("# Constitution\n\n- Be helpful.\n- Be harmless,\n  and honest.\n")
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"question {i}?", "completions": [f"answer {i}", f"reply {i} more"]} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path, cons, data


def test_label_pairs_writes_rows_that_dpo_and_rm_load(tiny, files):
    from tether.trainers.preference.offline import DPOConfig
    from tether.trainers.preference.data import load_offline_data
    from tether.trainers.rm import load_pairs

    path, _, tok = tiny
    tmp, cons, data = files
    out = tmp / "judged.jsonl"
    s = label_pairs(LabelPairsConfig(judge=str(path), constitution=str(cons), data=str(data), out=str(out),
                                     device="cpu", dtype="fp32", batch_size=4))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and s["pairs"] == 6
    for i, r in enumerate(rows):
        assert {r["chosen"], r["rejected"]} == {f"answer {i}", f"reply {i} more"}
        assert r["judge_prob"] >= 0.5
        assert r["judge_prob"] == pytest.approx(0.5 * (r["judge_p_first"] + 1 - r["judge_p_second"]))
        assert r["principle"] in ("Be helpful.", "Be harmless, and honest.")
    train, _, _, paired, _ = load_offline_data(DPOConfig(model=str(path), data=str(out), eval_fraction=0.0), tok)
    assert paired and len(train) == 6
    examples, report = load_pairs(str(out), tok, 256)
    assert len(examples) == 6 and report["dropped"] == 0
    summary = json.loads((tmp / "judged.summary.json").read_text())
    assert summary["position_bias"] == pytest.approx(
        np.mean([r["judge_p_first"] for r in rows] + [r["judge_p_second"] for r in rows]))


def test_label_pairs_relabels_preference_data_and_reports_agreement(tiny, files):
    path, _, _ = tiny
    tmp, cons, _ = files
    data = tmp / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "good", "rejected": f"bad {i}"}) + "\n"
                            for i in range(4)))
    s = label_pairs(LabelPairsConfig(judge=str(path), constitution=str(cons), data=str(data),
                                     out=str(tmp / "re.jsonl"), principles="all", device="cpu", dtype="fp32"))
    rows = [json.loads(x) for x in (tmp / "re.jsonl").read_text().splitlines()]
    agree = np.mean([r["chosen"] == "good" for r in rows])
    assert s["agreement_debiased"] == pytest.approx(agree)
    assert "principle" not in rows[0]  # all principles shown: none singled out


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def test_bad_input_is_one_line_naming_file_row_field(capsys, tiny, files):
    path, _, _ = tiny
    tmp, cons, data = files
    base = ["label", "pairs", f"judge={path}", f"out={tmp / 'o.jsonl'}"]
    _one_line_error(capsys, base + [f"constitution={tmp / 'nope.md'}", f"data={data}"],
                    "nope.md: constitution file not found")
    empty = tmp / "empty.md"
    empty.write_text("# Title only\n\n<!-- nothing -->\n")
    _one_line_error(capsys, base + [f"constitution={empty}", f"data={data}"], "empty.md: no principles found")
    bad = tmp / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "completions": ["a", "b"]}) + "\n"
                   + json.dumps({"prompt": "q", "completions": ["only one"]}) + "\n")
    _one_line_error(capsys, base + [f"constitution={cons}", f"data={bad}"], "bad.jsonl:2:completions",
                    "exactly two")
    bad.write_text(json.dumps({"prompt": "q", "completions": ["a", ""]}) + "\n")
    _one_line_error(capsys, base + [f"constitution={cons}", f"data={bad}"], "bad.jsonl:1:completions[1]")
    bad.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": 3}) + "\n")
    _one_line_error(capsys, base + [f"constitution={cons}", f"data={bad}"], "bad.jsonl:1:rejected")
    bad.write_text(json.dumps({"prompt": "q"}) + "\n")
    _one_line_error(capsys, base + [f"constitution={cons}", f"data={bad}"], "bad.jsonl", "policy=")
    assert not (tmp / "o.jsonl").exists()


# -- constitutions ------------------------------------------------------------------------------------

def test_constitution_items_continuations_and_paragraphs(tmp_path):
    text = "# C\n<!-- note -->\n1. First rule\n   continues here.\n2) Second\n\n* Third\n"
    assert parse_principles(text) == ["First rule continues here.", "Second", "Third"]
    assert parse_principles("Be kind.\nAlways.\n\n## h\nBe brief.\n") == ["Be kind. Always.", "Be brief."]
    draws = pick_principles(["a", "b", "c"], 300, "sample", seed=4)
    assert all(len(d) == 1 for d in draws) and {d[0] for d in draws} == {"a", "b", "c"}
    assert pick_principles(["a", "b", "c"], 300, "sample", seed=4)[:10] == draws[:10]
    assert pick_principles(["a", "b"], 2, "all", 0) == [["a", "b"], ["a", "b"]]
    (tmp_path / "c.md").write_text("- x\n")
    assert load_constitution(str(tmp_path / "c.md")) == ["x"]


def test_preference_rows_keep_the_judges_probability_of_the_chosen():
    from tether.feedback.judge import Judgments
    j = Judgments(np.array([0.9, 0.2]), np.array([0.3, 0.6]))  # P̂ = 0.8, 0.3
    rows = preference_rows(["p", "q"], ["a", "c"], ["b", "d"], j, np.array([True, False]))
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("a", "b"), ("d", "c")]
    assert [r["judge_prob"] for r in rows] == pytest.approx([0.8, 0.7])
    assert (rows[1]["judge_p_first"], rows[1]["judge_p_second"]) == (0.6, 0.2)
