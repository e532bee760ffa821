"""The quickstart end to end. The full default run takes minutes, so it is behind `-m slow`; a
shrunken run checks the wiring (stages, summary keys, table) in the default suite."""

import json

import pytest

from tether.quickstart import QuickstartConfig, run_quickstart


def test_quickstart_wiring_small(tmp_path, capsys):
    cfg = QuickstartConfig(runs_dir=str(tmp_path), n_train=300, n_test=20, hidden_size=32,
                           num_layers=1, pretrain_steps=4, sft_steps=4, batch_size=8,
                           rl=True, rl_steps=2, rl_batch_size=2, rl_generations=2, rl_prompts=20,
                           progress=False)
    summary = run_quickstart(cfg)
    on_disk = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert on_disk == summary
    assert set(summary["stages"]) == {"pretrain", "sft", "rl"}
    for stage in ("pretrain", "sft", "rl"):
        s = summary["stages"][stage]
        assert 0.0 <= s["accuracy"] <= 1.0 and s["seconds"] >= 0
        assert round(s["accuracy"] * 20) + sum(s["misses"].values()) == 20  # every miss has a kind
    assert isinstance(summary["seconds"], float)
    out = capsys.readouterr().out
    assert "held-out pass@1" in out and "What is" in out
    assert (tmp_path / "quickstart" / "sft" / "checkpoints").is_dir()
    # The demonstrations carry the annotator's slip on sft_slip (0.75) of the carry/borrow rows, and
    # only there: the worked solution above each answer line stays right.
    from tether.tasks import arithmetic as A
    rows = [json.loads(l) for l in open(tmp_path / "quickstart" / "data" / "sft.jsonl")]
    train, _ = A.make_splits(300, 20, cfg.level, cfg.seed)
    kinds = [A.diagnose(r["completion"], p) for r, p in zip(rows, train)]
    carries = [k for k, p in zip(kinds, train) if A.slipped_answer(p) is not None]
    assert all(k == "correct" for k, p in zip(kinds, train) if A.slipped_answer(p) is None)
    assert set(carries) == {"correct", "slipped"} and abs(carries.count("slipped") / len(carries) - 0.75) < 0.12


@pytest.mark.slow
def test_quickstart_default_hits_its_targets(tmp_path):
    """The quickstart's targets: SFT accuracy in [0.3, 0.7] and above pretraining; RL at least 15 points
    above SFT (docs/quickstart.md has the 12-run spread over seeds, threads and fused AdamW)."""
    summary = run_quickstart(QuickstartConfig(runs_dir=str(tmp_path), progress=False))
    pre, sft, rl = (summary["stages"][k] for k in ("pretrain", "sft", "rl"))
    assert 0.3 <= sft["accuracy"] <= 0.7, sft
    assert sft["accuracy"] > pre["accuracy"]
    assert rl["accuracy"] >= sft["accuracy"] + 0.15, (sft, rl)
