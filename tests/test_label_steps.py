"""Math-Shepherd step labels (`tether label steps`): the Monte-Carlo counts equal an exhaustive
enumeration of the completer's outputs; a PRM learns true step labels and not shuffled ones."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tether.labeling.steps import LabelStepsConfig, label_steps, mc_counts, sampler_completer, step_labels
from tether.models import load_model, load_tokenizer, make_tiny_model
from tether.rollout.hf import generate
from tether.tasks import arithmetic as A

SHAPE = dict(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)


def _verify(rows, texts):
    return [A.check_answer(t, r["answer"]) > 0 for r, t in zip(rows, texts)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ms") / "tiny"
    make_tiny_model(path, seed=5, **SHAPE)
    return str(path)


def test_counts_equal_enumeration_of_a_finite_completer(tiny):
    """A completer whose outputs from each prefix are a known finite set, returned whole (K = the
    set's size): c_i must be the number of right members, for the prefix of exactly steps ≤ i."""
    tok = load_tokenizer(tiny)
    # every continuation the completer can write after each prefix (prefix text -> outputs)
    support = {
        " 47 + 8 =": [" 40 + 7 + 8 = 55\n#### 55", " 50\n#### 50", " 55\n#### 45", " 55\n#### 55"],
        " 47 + 8 = 40 + 7 + 8 =": [" 40 + 15 = 55\n#### 55", " 40 + 15 = 55\n#### 55", " 54\n#### 54", " 55\n#### 55"],
        " 47 + 8 = 40 + 7 + 8 = 40 + 15 =": [" 55\n#### 45"] * 4,
        " 47 + 8 = 41 + 7 + 8 =": [" 56\n#### 56", " 55\n#### 55", " 56\n#### 56", " 57\n#### 57"],
    }
    seen = []

    def complete(contexts, k, seed):
        out = []
        for ids in contexts:
            text = tok.decode(ids, skip_special_tokens=True)
            assert ids[0] == tok.bos_token_id and text.startswith("What is 47 + 8?")
            prefix = text[len("What is 47 + 8?"):]
            seen.append(prefix)
            assert len(support[prefix]) == k
            out.append(support[prefix])
        return out

    rows = [{"prompt": "What is 47 + 8?", "answer": "55"}] * 2
    solutions = [" 47 + 8 = 40 + 7 + 8 = 40 + 15 = 55\n#### 45", " 47 + 8 = 41 + 7 + 8 = 55\n#### 55"]
    counts = mc_counts(rows, solutions, complete, _verify, tok, "=", 4)
    # by hand: right continuations per prefix; the last step is the solution's own verdict (x K)
    assert counts == [[2, 3, 0, 0], [2, 1, 4]]
    assert seen == [" 47 + 8 =", " 47 + 8 = 40 + 7 + 8 =", " 47 + 8 = 40 + 7 + 8 = 40 + 15 =",
                    " 47 + 8 =", " 47 + 8 = 41 + 7 + 8 ="]
    assert step_labels(counts[0], 4, "hard") == [True, True, False, False]
    assert step_labels(counts[0], 4, "soft") == [False, True, False, False]  # 2/4 is not > 0.5
    assert step_labels(counts[1], 4, "soft", soft_threshold=0.2) == [True, True, True]


def test_greedy_completer_matches_enumerated_greedy_continuations(tiny):
    """At temperature 0 the policy has one output per prefix: every one of K rollouts is it, so
    c_i = K·1[prefix + greedy continuation is right], enumerated here with the text generator."""
    model, tok = load_model(tiny, device="cpu"), load_tokenizer(tiny)
    complete = sampler_completer(model, tok, max_new_tokens=6, temperature=0.0)
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 9 - 4?", "answer": "5"}]
    solutions = [" 2 + 3 = 5\n#### 5", " 9 - 4 = 6 = 5\n#### 5"]
    # a verifier of the rollout's whole text (right iff its character sum is even): any fixed
    # function of the text works; this one splits the random model's continuations both ways
    verify = lambda rows, texts: [sum(map(ord, t)) % 2 == 0 for t in texts]  # noqa: E731
    counts = mc_counts(rows, solutions, complete, verify, tok, "=", 3)
    want = []
    for row, sol in zip(rows, solutions):
        steps = sol.split("=")
        prefixes = ["=".join(steps[:i + 1]) + "=" for i in range(len(steps) - 1)]
        greedy = generate(model, tok, [row["prompt"] + p for p in prefixes], max_new_tokens=6)
        want.append([3 * verify(None, [p + g])[0] for p, g in zip(prefixes, greedy)] + [3 * verify(None, [sol])[0]])
    assert counts == want
    assert any(0 < sum(c) < 3 * len(c) for c in want)  # the check is not vacuous: both outcomes occur


def test_label_steps_command_writes_stepwise_rows(tiny, tmp_path):
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps(A.rl_example(p)) + "\n" for p in
                            [A.Problem(47, "+", 8), A.Problem(75, "-", 7)]))
    out = tmp_path / "steps.jsonl"
    s = label_steps(LabelStepsConfig(policy=tiny, data=str(data), out=str(out), separator="=",
                                     num_solutions=3, k=4, max_new_tokens=12, device="cpu"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert s["solutions"] == 6 and len(rows) == s["rows"] > 0
    for r in rows:
        assert len(r["completions"]) == len(r["labels"]) == len(r["mc_correct"]) == len(r["soft_labels"])
        assert r["labels"] == [c > 0 for c in r["mc_correct"]] and r["k"] == 4 and "answer" in r


def _synthetic_rows(n: int, seed: int, shuffle: bool = False) -> list[dict]:
    """Steps are single characters; a step is right iff it is a digit (a rule a 1-layer model
    learns in seconds). `shuffle`: the same steps with the labels permuted over the whole set
    (the wrong-label control: same label frequencies, no relation to the steps)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        steps = [rng.choice("abcdefgh01234567") for _ in range(rng.randint(2, 5))]
        rows.append({"prompt": "Q", "completions": steps, "labels": [c.isdigit() for c in steps]})
    if shuffle:
        flat = [y for r in rows for y in r["labels"]]
        rng.shuffle(flat)
        it = iter(flat)
        rows = [{**r, "labels": [next(it) for _ in r["labels"]]} for r in rows]
    return rows


@pytest.mark.parametrize("shuffle", [False, True])
def test_prm_learns_true_step_labels_not_shuffled_ones(tiny, tmp_path, shuffle):
    from tether.trainers.prm import PRMConfig, train_prm

    for name, rows in (("train", _synthetic_rows(800, 0, shuffle)), ("eval", _synthetic_rows(200, 1))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    s = train_prm(PRMConfig(model=tiny, data=str(tmp_path / "train.jsonl"), eval_data=str(tmp_path / "eval.jsonl"),
                            step_separator="|", runs_dir=str(tmp_path), name="prm", max_steps=60, lr=5e-3,
                            batch_size=32, device="cpu", progress=False, log_every=40))
    if shuffle:
        assert s["eval/step_accuracy"] < 0.7  # held-out truth: about the base rate (~0.5)
    else:
        assert s["eval/step_accuracy"] > 0.95 and s["eval/first_error_accuracy"] > 0.9
