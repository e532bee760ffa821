"""Held-out evaluation in `tether bon`: with rft=true the RFT run (SFT on the kept
completions) evaluates bon's held-out prompts at its eval points exactly as `tether eval` scores the
checkpoints of those steps, keeps the best one (run.keep_best), and bon's summary holds the policy's
numbers before RFT next to the last eval point's; without rft the eval keys are refused in one line."""

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from tether.cli import main
from tether.trainers.best_of_n import BoNConfig, run_bon

# The tiny world of `tether eval`'s tests (a scaled-up random model, the parity verifier).
from queue_support import one_thread_for_the_module  # noqa: E402
from test_evaluation import PROMPTS, REWARD, _model  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    yield from one_thread_for_the_module()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bon_eval")
    (root / "reward.py").write_text(REWARD)
    rows = [{"prompt": p, "answer": str(eval(p[:-1]))} for p in PROMPTS]
    # held-out prompts the policy never samples for RFT (a + b with a in 4..9 or b in 3..9)
    held = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)
            if f"{a}+{b}=" not in PROMPTS]
    return {"root": root, "m": _model(root / "m", 0), "R": f"{root / 'reward.py'}:parity",
            "P": _write(root / "prompts.jsonl", rows), "H": _write(root / "held.jsonl", held)}


def _tether_eval(argv, out):
    assert main(["eval", *argv, f"out={out}", "table=false"]) == 0
    return {k: v for k, v in json.loads((out / "eval.json").read_text())["metrics"].items()
            if k.startswith("greedy/") and not k.endswith(("/prompts", "/completions"))}


def _eval_rows(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "eval/greedy/pass@1" in r]


def test_rft_eval_points_equal_tether_eval_and_keep_best_keeps_the_best(world, tmp_path):
    from safetensors.torch import load_file

    s = run_bon(BoNConfig(model=world["m"], data=world["P"], eval_data=world["H"], reward_funcs=[world["R"]],
                          n=4, max_new_tokens=6, runs_dir=str(tmp_path / "runs"), device="cpu", dtype="fp32",
                          rft=True, rft_lr=1e-2, rft_epochs=2, rft_batch_size=4, eval_every=1, save_every=1,
                          keep_last=0, keep_best="eval/pass@1"))
    bon, rft = tmp_path / "runs" / "bon", tmp_path / "runs" / "bon" / "rft"
    rows = _eval_rows(rft)
    # 12 kept rows / 4 per step x 2 epochs = 6 steps, an eval point after each (the last one once)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]

    def tether_eval(model, out):  # greedy, bon's rollout length, the training reward (no eval_reward_funcs)
        return _tether_eval([f"model={model}", f"data={world['H']}", f"reward_funcs=[{world['R']}]",
                             "decoding=greedy", "max_new_tokens=6"], tmp_path / out)

    for r in rows:
        got = tether_eval(rft / "checkpoints" / f"step-{r['step']}", f"e{r['step']}")
        assert {f"eval/{k}": v for k, v in got.items()} == {k: r[k] for k in r if k.startswith("eval/greedy/")}
    # bon's summary: the policy before RFT (= `tether eval` on model.path) and the last eval point
    before = tether_eval(world["m"], "before")
    assert {k: v for k, v in s["eval"]["before"].items() if k != "eval/seconds"} == \
        {f"eval/{k}": v for k, v in before.items()}
    assert {k: v for k, v in s["eval"]["after"].items() if k != "eval/seconds"} == \
        {k: v for k, v in rows[-1].items() if k.startswith("eval/greedy/")}
    # keep_best: the first step holding the highest logged pass@1, and that step's weights
    values = [r["eval/greedy/pass@1"] for r in rows]
    # not the last step, and tied by later ones (the earlier stays): neither "keep the last" nor
    # "keep ties' latest" passes; if the values were all equal this would check nothing
    assert values.index(max(values)) < len(values) - 1 and values.count(max(values)) > 1, values
    best_step = rows[values.index(max(values))]["step"]
    assert (s["rft"]["best"]["step"], s["rft"]["best"]["value"]) == (best_step, max(values))
    best, same = load_file(str(rft / "checkpoints" / "best" / "model.safetensors")), \
        load_file(str(rft / "checkpoints" / f"step-{best_step}" / "model.safetensors"))
    assert all(torch.equal(best[k], same[k]) for k in same)
    assert json.loads((rft / "checkpoints" / "best" / "best.json").read_text())["step"] == best_step
    assert (rft / "plots" / "eval_greedy_pass_1.png").exists()
    # the eval settings travelled to the RFT run; bon's own metrics stay the best-of-n' curve
    cfg = yaml.safe_load((rft / "config.yaml").read_text())
    assert (cfg["run"]["eval_every"], cfg["run"]["keep_best"]) == (1, "eval/pass@1")
    assert [r["step"] for r in map(json.loads, (bon / "metrics.jsonl").read_text().splitlines())] == [1, 2, 4]


def test_rft_raises_held_out_pass_at_1_on_a_verifiable_target(tmp_path):
    """Best-of-8 under a verifier keeps completions whose first character has an even code; SFT on
    them teaches that to the policy, which then does it on prompts it never saw: greedy pass@1 on
    disjoint held-out prompts goes from the untrained policy's 0.45 up. (A tiny random model cannot
    learn the sums themselves in seconds: the real arithmetic task is measured in docs/rlhf.md.)"""
    root = tmp_path
    (root / "reward.py").write_text(REWARD)
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    random.Random(0).shuffle(prompts)
    # answer "0" for every row: the verifier passes a completion whose first character's code is even
    held = _write(root / "held.jsonl", [{"prompt": p, "answer": "0"} for p in prompts[:20]])
    train = _write(root / "train.jsonl", [{"prompt": p, "answer": "0"} for p in prompts[20:]])
    s = run_bon(BoNConfig(model=_model(root / "m", 0), data=train, eval_data=held,
                          reward_funcs=[f"{root / 'reward.py'}:parity"], n=8, max_new_tokens=4,
                          runs_dir=str(root / "runs"), device="cpu", dtype="fp32", rft=True, rft_lr=3e-2,
                          rft_epochs=4, rft_batch_size=16))
    before, after = s["eval"]["before"]["eval/greedy/pass@1"], s["eval"]["after"]["eval/greedy/pass@1"]
    assert s["proxy/best_mean"] > s["proxy/mean"]  # the selection kept better rows than it saw
    assert before == 0.45 and after >= before + 0.3, (before, after)


def test_rft_min_reward_trains_only_on_rows_that_reach_it(tmp_path, monkeypatch):
    """bon.rft_min_reward: RFT's SFT data holds the kept rows whose proxy reaches it (a prompt whose n
    samples all failed is left out, not trained on its failing best), the summary counts the others,
    and none left is a one-line error; unset, every kept row is trained on."""
    from tether.config import ConfigError
    from tether.errors import UserError
    from tether.trainers import best_of_n, sft
    seen = []

    def fake_sft(cfg, held_out=None):
        seen.append([json.loads(x)["completion"] for x in Path(cfg.data.path).read_text().splitlines()])
        return {"checkpoint": "ckpt"}
    monkeypatch.setattr(sft, "train_sft", fake_sft)
    kept = [{"prompt": "1+1=", "completion": "2", "reward": 1.0}, {"prompt": "5+7=", "completion": "2", "reward": 0.0},
            {"prompt": "2+2=", "completion": "4", "reward": 1.0}]
    cfg = BoNConfig(model="m", data="d", reward_funcs=["arithmetic"], rft=True, rft_min_reward=1.0)
    out = best_of_n.rejection_sampling_fine_tune(cfg, tmp_path, kept, True, None)
    assert seen[-1] == ["2", "4"] and out["rows"] == 2 and out["below_min_reward"] == 1
    out = best_of_n.rejection_sampling_fine_tune(BoNConfig(model="m", data="d", reward_funcs=["arithmetic"], rft=True),
                                                 tmp_path, kept, True, None)
    assert seen[-1] == ["2", "2", "4"] and out["below_min_reward"] == 0
    with pytest.raises(UserError, match="rft_min_reward=2.0"):
        best_of_n.rejection_sampling_fine_tune(BoNConfig(model="m", data="d", reward_funcs=["arithmetic"], rft=True,
                                                         rft_min_reward=2.0), tmp_path, kept, True, None)
    with pytest.raises(ConfigError, match="'bon.rft_min_reward' needs bon.rft=true"):
        BoNConfig(model="m", data="d", reward_funcs=["arithmetic"], rft_min_reward=1.0)


@pytest.mark.slow
def test_rft_on_the_quickstart_arithmetic_task_raises_held_out_pass_at_1(tmp_path):
    """The real task: the quickstart's SFT model (level 2; it imitates demonstrations that forget the
    carry) best-of-8 on 256 training problems under the exact-match verifier, RFT on the kept
    answers that pass it (rft_min_reward=1: a prompt whose 8 samples all fail teaches nothing but
    the slip), greedy pass@1 on the 200 held-out problems. About 5 minutes on 2 CPU cores, 4.5 of
    them the quickstart's pretrain + SFT; measured 0.535 -> 0.74 (docs/rlhf.md)."""
    from tether.quickstart import QuickstartConfig, run_quickstart

    q = run_quickstart(QuickstartConfig(runs_dir=str(tmp_path), rl=False, threads=1, progress=False))
    data = tmp_path / "quickstart" / "data"
    s = run_bon(BoNConfig(model=q["stages"]["sft"]["model"], data=str(data / "rl.jsonl"),
                          eval_data=str(data / "test.jsonl"), reward_funcs=["arithmetic"], n=8, max_prompts=256,
                          max_new_tokens=64, device="cpu", rft=True, rft_lr=2e-4, rft_epochs=4, rft_batch_size=32,
                          rft_min_reward=1.0, eval_every=4, runs_dir=str(tmp_path / "runs")))
    before, after = s["eval"]["before"]["eval/greedy/pass@1"], s["eval"]["after"]["eval/greedy/pass@1"]
    # the same 200 problems scored by the quickstart's own greedy generate + exact match: the same count
    assert before == pytest.approx(q["stages"]["sft"]["accuracy"], abs=1e-3)
    assert after >= before + 0.1, (before, after)


# -- refusals: one line, exit code 2, before any model loads ---------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["eval_data=H"], "config key 'data.eval_data' needs bon.rft=true"),
    (["eval_every=2"], "config key 'run.eval_every' needs bon.rft=true"),
    (["eval_reward_funcs=[R]"], "config key 'reward.eval_reward_funcs' needs bon.rft=true"),
    (["keep_best=eval/pass@1"], "config key 'run.keep_best' needs bon.rft=true"),
    (["rft=true", "eval_every=2"], "config key 'run.eval_every' needs held-out prompts: data.eval_data=<file>"),
    (["rft=true", "eval_reward_funcs=[R]"], "'reward.eval_reward_funcs' needs held-out prompts"),
    (["rft=true", "keep_best=eval/pass@1"], "eval/pass@1 is never logged: this run has no held-out data"),
    (["rft=true", "eval_data=H", "keep_best=eval/loss"],
     "eval/loss is never logged by this run; its eval metrics are eval/greedy/completions/clipped_ratio"),
    (["rft=true", "eval_data=H", "eval_reward_funcs=[R]", "keep_best=eval/greedy/rewards/other/mean"],
     "its eval metrics are eval/greedy/completions/clipped_ratio, eval/greedy/completions/mean_length, "
     "eval/greedy/frac_unscored, eval/greedy/pass@1, eval/greedy/reward, eval/greedy/rewards/parity/mean"),
    (["rft=true", "eval_data=BAD"], "bad.jsonl:2:prompt: missing column (row has: question)"),
])
def test_what_can_never_work_is_refused_in_one_line(world, tmp_path, capsys, args, needle):
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"question": "2+2="}])
    subst = {"H": world["H"], "BAD": bad, "[R]": f"[{world['R']}]"}
    argv = [f"{k}={subst.get(v, v)}" for k, v in (a.split("=", 1) for a in args)]
    rc = main(["bon", f"model={world['m']}", f"data={world['P']}", f"reward_funcs=[{world['R']}]",
               f"runs_dir={tmp_path / 'runs'}", "device=cpu", *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc in (1, 2) and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "runs").exists()  # refused before the run directory
