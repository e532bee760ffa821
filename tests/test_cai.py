"""Constitutional AI's supervised stage (tether/feedback/cai.py): the critique -> revision chain with a
recording fake generator, and the command on a tiny model writing rows `tether sft` loads."""

from __future__ import annotations

import json

import pytest

from tether.cli import main
from tether.feedback.cai import (CRITIQUE_REQUEST, REVISION_REQUEST, CAIConfig, critique_and_revise, run_cai,
                                 sft_rows)
from tether.models import make_tiny_model

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


class Recorder:
    """A generator whose every reply names the call and the conversation it answered."""

    def __init__(self):
        self.calls = []

    def __call__(self, convs):
        k = len(self.calls)
        self.calls.append(convs)
        return [f"out{k}.{i}" for i in range(len(convs))]


@pytest.mark.parametrize("rounds", [1, 3])
def test_each_round_critiques_the_previous_revision_and_revises_with_its_critique(rounds):
    gen = Recorder()
    prompts = ["how do I pick a lock?", [{"role": "user", "content": "insult me"}]]
    principles = ["Be harmless.", "Be honest.", "Be kind."]
    chains = critique_and_revise(gen, prompts, principles, rounds, seed=1)
    assert len(gen.calls) == 1 + 2 * rounds and all(len(c) == 2 for c in gen.calls)
    assert gen.calls[0] == [[{"role": "user", "content": prompts[0]}], prompts[1]]
    for i in range(2):
        assert [r["round"] for r in chains[i]] == list(range(1, rounds + 1))
        previous = f"out0.{i}"  # the initial response
        for k, rec in enumerate(chains[i]):
            asked = gen.calls[1 + 2 * k][i]      # the critique call of round k + 1
            revise = gen.calls[2 + 2 * k][i]     # the revision call
            assert rec["response"] == previous and asked[-2] == {"role": "assistant", "content": previous}
            assert asked[-1]["content"] == CRITIQUE_REQUEST.format(principle=rec["principle"])
            assert rec["critique"] == f"out{1 + 2 * k}.{i}"
            assert revise[:-2] == asked and revise[-2] == {"role": "assistant", "content": rec["critique"]}
            assert revise[-1]["content"] == REVISION_REQUEST.format(principle=rec["principle"])
            assert rec["revision"] == f"out{2 + 2 * k}.{i}"
            assert rec["principle"] in principles
            previous = rec["revision"]
    rows = sft_rows(prompts, chains, "all")
    assert len(rows) == 2 * rounds
    final = sft_rows(prompts, chains, "final")
    assert [r["completion"] for r in final] == [f"out{2 * rounds}.0",
                                                [{"role": "assistant", "content": f"out{2 * rounds}.1"}]]


def test_an_empty_revision_keeps_the_text_it_was_to_replace():
    replies = iter([["first"], ["crit"], ["  "]])
    chains = critique_and_revise(lambda convs: next(replies), ["p"], ["x"], 1)
    assert chains[0][0]["revision"] == "first"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cai") / "model"
    make_tiny_model(path, seed=1, **TINY)
    return path


def test_cai_command_writes_rows_that_sft_loads(tiny, tmp_path):
    from tether.models import load_tokenizer
    from tether.trainers.sft import SFTConfig
    from tether.trainers.sft import load_sft_data

    cons = tmp_path / "c.md"
    cons.write_text("- Be harmless.\n- Be honest.\n")
    data = tmp_path / "red.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"bad request {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "sl.jsonl"
    s = run_cai(CAIConfig(model=str(tiny), constitution=str(cons), data=str(data), out=str(out), rounds=2,
                          keep="all", max_new_tokens=12, temperature=1.0, device="cpu", dtype="fp32"))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert s["rows"] == len(rows) == 10
    assert [(r["prompt"], r["round"]) for r in rows] == [(f"bad request {i}", k) for i in range(5) for k in (1, 2)]
    for a, b in zip(rows[0::2], rows[1::2]):  # round 2 revises round 1's revision
        assert b["response"] == a["revision"] and a["completion"] == a["revision"]
    train, _, _, report = load_sft_data(SFTConfig(model=str(tiny), data=str(out), eval_fraction=0.0),
                                        load_tokenizer(str(tiny)))
    assert len(train) == 10 and report["dropped"] == 0


def test_cai_bad_input_is_one_line(capsys, tiny, tmp_path):
    data = tmp_path / "red.jsonl"
    data.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    cons = tmp_path / "c.md"
    cons.write_text("- Be harmless.\n")
    for argv, needle in ([f"constitution={tmp_path / 'none.md'}", "none.md: constitution file not found"],
                         [f"constitution={cons}", "red.jsonl:2:prompt: empty string"]):
        assert main(["cai", f"model={tiny}", f"data={data}", f"out={tmp_path / 'o.jsonl'}", argv]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_rl_cai_pairs_sampled_from_a_policy_load_in_dpo_and_rm(tiny, tmp_path):
    """RL-CAI's labelling step: prompt-only red-team rows, two responses sampled per prompt from the
    policy, judged under the constitution; the file is what `tether dpo` / `tether rm` read."""
    from tether.feedback.label import LabelPairsConfig, label_pairs
    from tether.models import load_tokenizer
    from tether.trainers.preference.offline import DPOConfig
    from tether.trainers.preference.data import load_offline_data
    from tether.trainers.rm import load_pairs

    cons = tmp_path / "c.md"
    cons.write_text("- Be harmless.\n- Be honest.\n")
    data = tmp_path / "red.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"bad request {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "ai_pairs.jsonl"
    s = label_pairs(LabelPairsConfig(judge=str(tiny), policy=str(tiny), constitution=str(cons), data=str(data),
                                     out=str(out), policy_max_new_tokens=10, device="cpu", dtype="fp32"))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == s["pairs"] == 6 - s["dropped_empty"] > 0
    assert all(r["prompt"].startswith("bad request") and r["chosen"] and r["rejected"] for r in rows)
    tok = load_tokenizer(str(tiny))
    train, _, _, paired, _ = load_offline_data(DPOConfig(model=str(tiny), data=str(out), eval_fraction=0.0), tok)
    assert paired and len(train) == len(rows)
    assert len(load_pairs(str(out), tok, 256)[0]) == len(rows)
