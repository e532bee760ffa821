"""bench/prm_real.py: the line truth by hand, and the whole run end to end on a tiny model (its own
sampler runs; the texts the run reads are scripted solutions, some right, some with a false
equation, a slipped answer line or no equation, so selection has something to find)."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import prm_real  # noqa: E402
from prm_real import line_truth, line_verdict, normalize, solution_lines  # noqa: E402

SHAPE = dict(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)


def test_right_chain_every_line_right():
    lines = ["Let's add the tens and the ones.", "30 + 40 = 70", "7 + 8 = 15", "70 + 15 = 85", "#### 85"]
    assert [line_verdict(x) for x in lines] == [None, True, True, True, None]
    assert line_truth(lines, True) == [True] * 5


def test_false_equation_mid_chain_wrongs_every_later_line():
    lines = ["30 + 40 = 70", "7 + 8 = 14", "70 + 14 = 84", "#### 84"]
    assert [line_verdict(x) for x in lines] == [True, False, True, None]  # the third holds on its own
    assert line_truth(lines, False) == [True, False, False, False]
    # a right answer after a false line: the last line is the answer's verdict, the false line stays wrong
    assert line_truth(["7 + 8 = 14", "So 37 + 48 = 85", "#### 85"], True) == [False, False, True]


def test_answer_line_error_only_the_last_line():
    assert line_truth(["37 + 48 = 85", "#### 58"], False) == [True, False]
    assert line_truth(["37 + 48 = 85"], False) == [False]  # one line: the answer's verdict alone


def test_lines_without_equations_keep_the_verdict_before_them():
    assert line_truth(["The answer is 85.", "I am sure."], True) == [True, True]
    assert line_truth(["The answer is 85.", "I am sure."], False) == [True, False]
    assert line_truth(["7 + 8 = 16", "Then I carry the one.", "#### 86"], False) == [False, False, False]


@pytest.mark.parametrize("line, verdict", [
    ("27 * 4 = 108", True), ("27 x 4 = 108", True), ("27 × 4 = 108", True), ("27 \\times 4 = 108", True),
    ("**37 + 48 = 85**", True), ("$37 + 48 = 85$", True), ("40 + 7 + 8 = 55", True),
    ("27 x 4 = 100 + 8 = 108", True), ("Step 2: 12 - 5 = 7.", True), ("1,000 + 234 = 1,234", True),
    ("7 + 8 = 15, write 5 and carry 1", True), ("3 - 5 = -2", True), ("4x3=12", True),
    ("27 * 4 = 98", False), ("30 + 40 = 70 + 15 = 86", False), ("87 - 78=1.", False),
    ("27*4=108 and 3 + 3 = 7", False),
    ("2.5 + 1 = 3.5", None), ("37 + 48 = 85 + 2.5", None), ("So 85 = 85", None), ("2x + 3 = 7", None),
    ("(27 * 4) / 2 = 54", None), ("2023 was a year", None), ("", None)])
def test_line_verdict_forms(line, verdict):
    assert line_verdict(line) is verdict


def test_blank_lines_are_no_steps():
    from tether.data.steps import split_steps
    text = "Add them.\n\n  \n37 + 48 = 85\n\n#### 85\n"
    assert solution_lines(text) == ["Add them.", "37 + 48 = 85", "#### 85"]
    assert split_steps(normalize(text), "\n") == solution_lines(text)
    assert solution_lines("") == [""] and normalize("\n \n") == ""


# -- end to end ----------------------------------------------------------------------------------

def _scripted(tokenizer):
    """A completer writing solutions of a few kinds for a prompt, and for a line prefix the answer
    line its last equation leads to (so Math-Shepherd's rollouts follow a false equation)."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

    def complete(contexts, k, seed):
        out = []
        for j, ids in enumerate(contexts):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            a, op, b = re.search(r"What is (\d+) ([-+*]) (\d+)\?", text).groups()
            ans = ops[op](int(a), int(b))
            prefix = text.split('"#### <number>".', 1)[1]
            rng = random.Random(f"{seed}/{j}/{text}")
            texts = []
            for _ in range(k):
                if prefix.strip():
                    led = re.findall(r"= (-?\d+)", prefix)
                    texts.append(f"#### {led[-1] if led else rng.choice([ans, ans + 1])}")
                    continue
                texts.append(rng.choice([
                    f"{a} {op} {b} = {ans}\n#### {ans}",
                    f"Work it out.\n\n{a} {op} {b} = {ans}\n#### {ans}",
                    f"Work it out.\n{a} {op} {b} = {ans + 10}\n#### {ans + 10}",
                    f"{a} {op} {b} = {ans}\n#### {ans + 1}",
                    f"The answer is {rng.choice([ans, ans + 2])}."]))
            out.append(texts)
        return out
    return complete


def test_main_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    from tether.models import make_tiny_model

    model = tmp_path / "tiny"
    make_tiny_model(model, seed=0, **SHAPE)
    real = prm_real.sampler_completer

    def factory(m, tokenizer, max_new_tokens, temperature, batch_size=256):
        sample, script = real(m, tokenizer, max_new_tokens, temperature, batch_size), _scripted(tokenizer)

        def complete(contexts, k, seed):
            assert all(len(ts) == k for ts in sample(contexts, k, seed))  # the model's own sampler runs
            return script(contexts, k, seed)
        return complete
    monkeypatch.setattr(prm_real, "sampler_completer", factory)

    out = tmp_path / "run"
    s = prm_real.main(["--model", str(model), "--out", str(out), "--device", "cpu", "--n-train", "6",
                       "--samples", "3", "--k", "2", "--n-test", "5", "--max-n", "8", "--seeds", "2",
                       "--subsets", "32", "--max-new-tokens", "8", "--prm-steps", "2", "--batch-size", "4"])

    assert {p.name for p in out.iterdir()} >= {"summary.json", "report.md", "selection.png", "data", "runs"}
    assert json.loads((out / "summary.json").read_text())["ns"] == s["ns"] == [1, 2, 4, 8]
    assert s["rm_seeds"] == [0, 1] and len(s["per_seed"]) == 2
    assert not any((out / "runs").glob("*/checkpoints"))  # removed once scored
    ns, curves, acc = s["ns"], s["selection"], s["test"]["sample_accuracy"]
    selectors = ["prm", "prm_prod", "prm_ms", "prm_ms_prod", "prm_ms_soft", "prm_ms_soft_prod", "orm", "majority"]
    assert set(curves) == set(selectors) | {"random", "oracle"} == set(s["selection_sd"])
    assert 0 < acc < 1
    for name, c in curves.items():
        assert len(c) == len(ns) == len(s["selection_sd"][name]) and all(0 <= x <= 1 for x in c)
    for j in range(len(ns)):
        assert all(curves["oracle"][j] >= curves[k][j] - 1e-12 for k in selectors + ["random"])
        assert abs(curves["random"][j] - acc) < 0.15
    assert curves["random"][-1] == pytest.approx(acc)  # n = max_n: every candidate
    assert len({round(c[0], 12) for c in curves.values()}) == 1  # n = 1: every selector takes the one sample
    assert curves["oracle"] == sorted(curves["oracle"]) and curves["oracle"][-1] > acc

    # the training budget and its labels
    tr = s["train"]
    assert tr["samples"] == 18 and tr["rows"] == 18 and 0 < tr["wrong_steps"] < tr["steps"]
    assert tr["rollouts"] == 2 * sum(len(solution_lines(json.loads(r)["completions"][0])) - 1
                                     for r in (out / "data" / "orm.jsonl").read_text().splitlines())
    rows = [json.loads(r) for r in (out / "data" / "prm_math_shepherd.jsonl").read_text().splitlines()]
    assert all(len(r["labels"]) == len(r["soft_labels"]) == len(r["completions"]) for r in rows)
    assert all(r["soft_labels"][-1] in (0.0, 1.0) for r in rows)
    quality = {(q["k"], q["estimate"]): q for q in s["math_shepherd_quality"]}
    assert set(quality) == {(1, "hard"), (1, "soft"), (2, "hard"), (2, "soft")}
    # a false equation's rollouts carry its value to the answer line: every wrong line is found
    assert all(q["recall_wrong"] == 1.0 for q in quality.values() if q["steps"])

    # step metrics: PRMs against the line truth on every candidate; the ORM only on the outcome
    assert set(s["candidate_metrics"]) == {"prm", "prm_ms", "prm_ms_soft", "orm"}
    assert set(s["candidate_metrics"]["orm"]) == {"outcome_accuracy"}
    for key in ("prm", "prm_ms", "prm_ms_soft"):
        m = s["candidate_metrics"][key]
        assert {"step_accuracy", "error_f1", "first_error_accuracy", "first_error_accuracy_wrong"} <= set(m)
        assert all(0 <= v <= 1 for v in m.values())
    assert all(m["rows"] > 0 for m in s["prm_step_metrics"].values())
    lines = s["line_stats"]["test"]
    assert lines["solutions"] == 40 and lines["lines_with_false_equation"] > 0
    assert lines["accuracy"] == pytest.approx(acc)
    report = (out / "report.md").read_text()
    assert "| 8 |" in report and "PRM MS soft (prod)" in report and "Timings (s)" in report
