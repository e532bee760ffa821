"""RPO's NLL term on the chosen completion (preference.rpo_alpha, Pang et al. 2024) and the chosen
log-prob drift alarm (logps/chosen_drift, preference.chosen_drift_warn): DPO at a high lr can widen
every margin (pair accuracy 1.0) while pushing the chosen completions' likelihood far down."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_offline import TINY, preference_rows, write_jsonl  # noqa: E402

from tether.config import ConfigError, load_config  # noqa: E402
from tether.models import make_tiny_model  # noqa: E402
from tether.objectives import PairLogps, chosen_nll, pairwise_preference_loss  # noqa: E402
from tether.run import read_jsonl  # noqa: E402
from tether.trainers.preference.offline import DPOConfig, KTOConfig, train_offline  # noqa: E402
from tether.trainers.core.setup import Training  # noqa: E402
from tether.trainers.sft import SFTConfig, train_sft  # noqa: E402


# ---- the objective: hand values ------------------------------------------------------------------

def _pair(requires_grad=False):
    # pair 1: log π(y_w) = -6 over 3 tokens, pair 2: -2 over 4 tokens
    chosen = torch.tensor([-6.0, -2.0], dtype=torch.float64, requires_grad=requires_grad)
    return PairLogps(chosen, torch.tensor([-8.0, -1.0], dtype=torch.float64),
                     torch.tensor([-5.0, -2.0], dtype=torch.float64), torch.tensor([-5.0, -2.0], dtype=torch.float64),
                     torch.tensor([3, 4]), torch.tensor([4, 1]))


def _params(**kw):
    return SimpleNamespace(beta=0.5, label_smoothing=0.0, **kw)


def test_chosen_nll_is_per_token_per_pair():
    assert chosen_nll(_pair()).tolist() == [2.0, 0.5]  # 6/3, 2/4


@pytest.mark.parametrize("loss_type, dpo_part", [
    # sigmoid: h = (−6+5) − (−8+5) = 2 and (−2+2) − (−1+2) = −1; −log σ(βh) at β = 0.5
    ("sigmoid", (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2),
    # ipo on length-averaged log-probs: h = (−2+5/3) − (−2+5/4) = 5/12 and (−0.5+0.5) − (−1+2) = −1;
    # (h − 1/(2β))² = (5/12 − 1)² and (−2)²
    ("ipo", ((5 / 12 - 1) ** 2 + 4.0) / 2),
])
def test_rpo_adds_alpha_times_the_mean_per_token_nll_of_the_chosen(loss_type, dpo_part):
    # NLL per pair: 6/3 = 2 and 2/4 = 0.5 -> mean 1.25 (TRL's batch token mean would be 8/7; the
    # NLL of the summed log-probs 4; after ipo's length averaging 0.396: each fails this)
    loss, m = pairwise_preference_loss(_pair(), loss_type, _params(rpo_alpha=0.5))
    assert loss.item() == pytest.approx(dpo_part + 0.5 * 1.25, abs=1e-12)
    assert m["nll_loss"].item() == pytest.approx(1.25, abs=1e-12)


def test_rpo_gradient_on_the_chosen_log_probs():
    x0, x1 = _pair(requires_grad=True), _pair(requires_grad=True)
    pairwise_preference_loss(x0, "sigmoid", _params(rpo_alpha=0.0))[0].backward()
    pairwise_preference_loss(x1, "sigmoid", _params(rpo_alpha=2.0))[0].backward()
    # d/d chosen_i of α·mean_i(−chosen_i/len_i) = −α / (N·len_i)
    extra = (x1.chosen.grad - x0.chosen.grad).tolist()
    assert extra == pytest.approx([-2.0 / (2 * 3), -2.0 / (2 * 4)], abs=1e-12)


def test_alpha_zero_is_bit_identical_to_no_rpo():
    for loss_type in ("sigmoid", "ipo", "dpop", "hinge"):
        without = pairwise_preference_loss(_pair(True), loss_type, _params(dpop_lambda=50.0))
        with_zero = pairwise_preference_loss(_pair(True), loss_type, _params(dpop_lambda=50.0, rpo_alpha=0.0))
        assert torch.equal(without[0], with_zero[0]) and "nll_loss" not in with_zero[1]
        assert without[1].keys() == with_zero[1].keys()


def test_rpo_needs_lengths():
    x = PairLogps(*[torch.zeros(2)] * 4)
    with pytest.raises(ValueError, match="lengths"):
        pairwise_preference_loss(x, "sigmoid", _params(rpo_alpha=1.0))


def test_config_refuses_rpo_outside_dpo_and_negative_numbers():
    assert DPOConfig(rpo_alpha=1.0).preference.rpo_alpha == 1.0
    with pytest.raises(ValueError, match="rpo_alpha"):
        KTOConfig(rpo_alpha=1.0)
    for bad in (["rpo_alpha=-1"], ["chosen_drift_warn=-2"], ["method=simpo", "rpo_alpha=1"]):
        with pytest.raises(ConfigError) as e:
            load_config(DPOConfig, None, bad)
        assert "\n" not in str(e.value) and bad[-1].split("=")[0] in str(e.value)


# ---- the alarm: Training.watch / warn --------------------------------------------------------------

def _bare_training():
    none = dict.fromkeys(["tokenizer", "data", "model", "trainable", "reference", "device", "amp",
                          "optimizer", "scheduler", "order", "ckpt"])
    run = SimpleNamespace(is_main=True, log=lambda *a, **k: None)
    return Training(cfg=SimpleNamespace(run=SimpleNamespace(name="r")), run=run, total_steps=9, **none)


def test_watch_warns_once_on_stderr_when_a_logged_metric_falls_below_its_floor(capfd):
    t = _bare_training()
    t.watch("drift", ("a", "eval/a"), -1.0, "step {step}: {key} = {value:.1f} < {floor:g}")
    t.step = 1
    t.log({"a": -0.5, "other": -9.0})
    t.log({"a": math.nan})
    assert t.warnings == {} and capfd.readouterr().err == ""
    t.step = 2
    t.log({"eval/a": -2.0})
    t.step = 3
    t.log({"a": -3.0})
    assert t.warnings == {"drift": "step 2: eval/a = -2.0 < -1"}
    assert capfd.readouterr().err.splitlines() == ["r: warning: step 2: eval/a = -2.0 < -1"]


# ---- end to end: a DPO run at a high lr ------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """A tiny model fine-tuned on the chosen completions, so DPO starts where they are likely."""
    root = tmp_path_factory.mktemp("rpo")
    make_tiny_model(root / "model", **TINY)
    rows = preference_rows(64)
    write_jsonl(root / "pairs.jsonl", rows)
    write_jsonl(root / "eval.jsonl", preference_rows(16, seed=5))
    write_jsonl(root / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])
    s = train_sft(SFTConfig(model=str(root / "model"), data=str(root / "sft.jsonl"), name="sft",
                            runs_dir=str(root / "runs"), device="cpu", progress=False, batch_size=8,
                            lr=6e-3, max_steps=60, num_samples=0, log_every=10))
    return root, s["checkpoint"]


def _dpo(root, model, name, **kw):
    return train_offline(DPOConfig(model=model, data=str(root / "pairs.jsonl"), eval_data=str(root / "eval.jsonl"),
                                   runs_dir=str(root / "runs"), name=name, device="cpu", progress=False,
                                   batch_size=8, log_every=2, lr=3e-2, beta=0.1, schedule="constant",
                                   warmup_ratio=0.0, max_steps=12, eval_every=6, num_samples=0, **kw))


def test_high_lr_dpo_drifts_warns_once_and_rpo_holds_the_chosen_up(sft_model, capfd):
    root, model = sft_model
    capfd.readouterr()
    plain = _dpo(root, model, "plain")
    err = capfd.readouterr().err
    rows = read_jsonl(root / "runs" / "plain" / "metrics.jsonl")
    drift = [r["logps/chosen_drift"] for r in rows if "logps/chosen_drift" in r]
    eval_drift = [r["eval/logps/chosen_drift"] for r in rows if "eval/logps/chosen_drift" in r]
    assert len(drift) == 6 and len(eval_drift) == 2
    # a healthy-looking run: every pair ordered, the chosen far less likely
    assert plain["eval/rewards/accuracies"] == 1.0 and plain["eval/logps/chosen_drift"] < -4.6
    assert [line for line in err.splitlines() if "warning" in line] == [f"plain: warning: {plain['warnings'][0]}"]
    assert len(plain["warnings"]) == 1 and "logps/chosen_drift" in plain["warnings"][0]
    assert "rpo_alpha" in plain["warnings"][0]  # says what to do about it
    assert json.loads((root / "runs" / "plain" / "summary.json").read_text())["warnings"] == plain["warnings"]
    assert (root / "runs" / "plain" / "plots" / "panel_chosen_drift.png").is_file()

    rpo = _dpo(root, model, "rpo", rpo_alpha=1.0, chosen_drift_warn=0.0)
    assert "warnings" not in rpo  # chosen_drift_warn=0: never
    assert rpo["eval/rewards/accuracies"] == 1.0
    assert rpo["eval/logps/chosen_drift"] > plain["eval/logps/chosen_drift"] + 5.0
    assert "nll_loss" in read_jsonl(root / "runs" / "rpo" / "metrics.jsonl")[0]
