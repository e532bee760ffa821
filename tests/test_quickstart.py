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
    assert isinstance(summary["seconds"], float)
    out = capsys.readouterr().out
    assert "held-out pass@1" in out and "What is" in out
    assert (tmp_path / "quickstart" / "sft" / "checkpoints").is_dir()


@pytest.mark.slow
def test_quickstart_default_hits_its_targets(tmp_path):
    """The issues' targets: SFT accuracy in [0.2, 0.7] and above pretraining; RL at least 15 points
    above SFT; about 5 minutes on 2 CPU cores (timing asserted loosely: shared machines vary, and
    the measured totals are 243-288 s in session 6)."""
    summary = run_quickstart(QuickstartConfig(runs_dir=str(tmp_path), progress=False))
    pre, sft, rl = (summary["stages"][k] for k in ("pretrain", "sft", "rl"))
    assert 0.2 <= sft["accuracy"] <= 0.7, sft
    assert sft["accuracy"] > pre["accuracy"]
    assert rl["accuracy"] >= sft["accuracy"] + 0.15, (sft, rl)
    assert summary["seconds"] < 400
