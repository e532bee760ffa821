"""Held-out evaluation inside every trainer (tether/trainers/core/held_out.py) and run.keep_best: the
numbers logged at an eval point are the numbers `tether eval` computes on the checkpoint saved at
that step; keep_best keeps the step whose logged value is best (not the last one, never rotated
away, carried through a resume); what can never work is refused in one line before anything loads."""

import json
import math

import pytest
import torch

from tether.cli import main
from tether.models import make_tiny_model

# The same tiny world as `tether eval`'s tests, so the two compare like with like.
from test_evaluation import PROMPTS, REWARD, SHAPE  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_points")
    model, tok = make_tiny_model(None, seed=0, **SHAPE)
    with torch.no_grad():  # scaled up: greedy completions then depend on the prompt (pass@1 not 0 or 1)
        for p in model.parameters():
            p.mul_(8.0)
    model.save_pretrained(root / "m")
    tok.save_pretrained(root / "m")
    (root / "reward.py").write_text(REWARD)
    answer = {p: str(eval(p[:-1])) for p in PROMPTS}
    files = {"prompts": [{"prompt": p, "answer": answer[p]} for p in PROMPTS],
             "sft": [{"prompt": p, "completion": answer[p], "answer": answer[p]} for p in PROMPTS],
             "pairs": [{"prompt": p, "chosen": answer[p], "rejected": str(int(answer[p]) + 1)} for p in PROMPTS]}
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "m": str(root / "m"), "R": f"{root / 'reward.py'}:parity"}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _common(world, tmp_path, name, **kw):
    return dict(model=world["m"], runs_dir=str(tmp_path / "runs"), name=name, device="cpu", progress=False, **kw)


def _evals(run, key):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def _tether_eval(argv, out):
    assert main(["eval", *argv, f"out={out}", "table=false"]) == 0
    return json.loads((out / "eval.json").read_text())["metrics"]


def _weights(ckpt):
    from safetensors.torch import load_file
    return load_file(str(ckpt / "model.safetensors"))


# -- the eval points equal `tether eval` on the checkpoints of those steps --------------------------

def test_sft_eval_points_equal_tether_eval_on_each_checkpoint(world, tmp_path):
    from tether.trainers.sft import SFTConfig, train_sft

    root = world["root"]
    summary = train_sft(SFTConfig(**_common(world, tmp_path, "s"), data=str(root / "sft.jsonl"),
                                  eval_data=str(root / "sft.jsonl"), eval_reward_funcs=[world["R"]],
                                  sample_max_new_tokens=6, batch_size=4, max_steps=5, eval_every=2,
                                  save_every=2, keep_last=0, lr=1e-2, keep_best="eval/pass@1"))
    run = tmp_path / "runs" / "s"
    logged = _evals(run, "eval/greedy/pass@1")
    assert [s for s, _ in logged] == [2, 4, 5]  # every eval_every steps, and the last step once
    for step, _ in logged:
        ckpt = run / "checkpoints" / f"step-{step}"
        row = next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                   if r["step"] == step and "eval/loss" in r)
        gen = _tether_eval([f"model={ckpt}", f"data={root / 'sft.jsonl'}", "mode=generation",
                            f"reward_funcs=[{world['R']}]", "decoding=greedy", "max_new_tokens=6"],
                           tmp_path / f"g{step}")
        for key in ("pass@1", "reward", "rewards/parity/mean", "completions/mean_length"):
            assert row[f"eval/greedy/{key}"] == gen[f"greedy/{key}"], (step, key)
        ppl = _tether_eval([f"model={ckpt}", f"data={root / 'sft.jsonl'}"], tmp_path / f"p{step}")
        assert row["eval/perplexity"] == pytest.approx(ppl["perplexity"], rel=1e-5)
        assert row["eval/loss"] == pytest.approx(math.log(row["eval/perplexity"]), rel=1e-9)
    # keep_best: the first step holding the highest logged pass@1, and its weights
    best_value = max(v for _, v in logged)
    best_step = next(s for s, v in logged if v == best_value)
    assert summary["best"]["step"] == best_step and summary["best"]["value"] == best_value
    assert summary["best"]["metric"] == "eval/greedy/pass@1" and summary["best"]["mode"] == "max"
    best = _weights(run / "checkpoints" / "best")
    same = _weights(run / "checkpoints" / f"step-{best_step}")
    assert all(torch.equal(best[k], same[k]) for k in same)
    assert json.loads((run / "checkpoints" / "best" / "best.json").read_text())["step"] == best_step
    assert not (run / "checkpoints" / "best" / "optimizer").exists()  # for evaluating, not resuming
    # plotted: one curve per eval metric, and train vs held-out loss on one figure
    assert (run / "plots" / "eval_greedy_pass_1.png").exists() and (run / "plots" / "panel_loss_vs_eval.png").exists()


def test_ppo_eval_points_and_best_checkpoint_equal_tether_eval(world, tmp_path):
    from tether.trainers.ppo import PPOConfig, train_ppo

    root = world["root"]
    summary = train_ppo(PPOConfig(**_common(world, tmp_path, "p"), data=str(root / "prompts.jsonl"),
                                  eval_data=str(root / "prompts.jsonl"), reward_funcs=[world["R"]],
                                  batch_size=4, num_generations=2, max_new_tokens=6, max_steps=3,
                                  num_minibatches=2, ppo_epochs=1, lr=3e-2, eval_every=1, save_every=1,
                                  keep_last=1, keep_best="eval/reward"))
    run = tmp_path / "runs" / "p"
    logged = _evals(run, "eval/greedy/reward")
    assert [s for s, _ in logged] == [1, 2, 3]
    best_step = next(s for s, v in logged if v == max(v for _, v in logged))
    assert (summary["best"]["step"], summary["best"]["value"]) == (best_step, dict(logged)[best_step])
    # keep_last=1 rotated every other step-N away; `tether eval` on best gives the best step's numbers
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "step-3"]
    got = _tether_eval([f"model={run / 'checkpoints' / 'best'}", f"data={root / 'prompts.jsonl'}",
                        f"reward_funcs=[{world['R']}]", "decoding=greedy", "max_new_tokens=6"], tmp_path / "o")
    assert got["greedy/reward"] == summary["best"]["value"]
    last = _tether_eval([f"model={run / 'checkpoints' / 'step-3'}", f"data={root / 'prompts.jsonl'}",
                         f"reward_funcs=[{world['R']}]", "decoding=greedy", "max_new_tokens=6"], tmp_path / "o3")
    assert last["greedy/pass@1"] == dict(_evals(run, "eval/greedy/pass@1"))[3]


def test_dpo_eval_points_equal_tether_eval_policy_ref(world, tmp_path):
    from tether.trainers.preference.offline import DPOConfig, train_offline

    root = world["root"]
    pairs = str(root / "pairs.jsonl")
    summary = train_offline(DPOConfig(**_common(world, tmp_path, "d"), data=pairs, eval_data=pairs, batch_size=4,
                                      max_steps=4, eval_every=2, save_every=2, keep_last=0, lr=1e-2,
                                      keep_best="eval/rewards/margins"))
    run = tmp_path / "runs" / "d"
    logged = _evals(run, "eval/rewards/margins")
    assert [s for s, _ in logged] == [2, 4]
    for step, margin in logged:
        got = _tether_eval([f"policy={run / 'checkpoints' / f'step-{step}'}", f"ref={world['m']}",
                            f"data={pairs}", "beta=0.1"], tmp_path / f"o{step}")
        assert margin == pytest.approx(got["margin"], rel=1e-4, abs=1e-6)
        assert dict(_evals(run, "eval/rewards/accuracies"))[step] == pytest.approx(got["accuracy"])
    assert summary["best"]["step"] == max(logged, key=lambda sv: sv[1])[0]


def test_rm_eval_accuracy_equals_tether_eval_and_keep_best(world, tmp_path):
    from tether.trainers.rm import RMConfig, train_rm

    root = world["root"]
    pairs = str(root / "pairs.jsonl")
    summary = train_rm(RMConfig(**_common(world, tmp_path, "r"), data=pairs, eval_data=pairs, batch_size=4,
                                max_steps=4, eval_every=2, save_every=2, keep_last=0, lr=1e-2, center=False,
                                keep_best="eval/loss"))
    run = tmp_path / "runs" / "r"
    logged = _evals(run, "eval/loss")
    assert [s for s, _ in logged] == [2, 4]
    for step, _ in logged:
        got = _tether_eval([f"model=rm:{run / 'checkpoints' / f'step-{step}'}", f"data={pairs}"], tmp_path / f"o{step}")
        right = round(dict(_evals(run, "eval/accuracy"))[step] * len(PROMPTS))  # a float32 mean
        assert got["accuracy"] == right / len(PROMPTS)
    assert summary["best"]["mode"] == "min"
    assert summary["best"]["step"] == min(logged, key=lambda sv: sv[1])[0]


# -- keep_best on a constructed curve: the best is not the last ----------------------------------

CURVE = {2: 0.2, 4: 0.9, 6: 0.9, 8: 0.1}  # a tie at 4 and 6: the earlier one stays


def _hooked(world, tmp_path, max_steps, snapshots, **kw):
    from tether.trainers.sft import SFTConfig, train_sft

    def hook(model, tokenizer, step):
        snapshots[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"eval/score": CURVE[step]}
    root = world["root"]
    cfg = SFTConfig(**_common(world, tmp_path, "k"), data=str(root / "sft.jsonl"), batch_size=4,
                    max_steps=max_steps, eval_every=2, save_every=2, keep_last=1, lr=1e-2,
                    keep_best="eval/score", **kw)
    return train_sft(cfg, eval_hook=hook)


@pytest.mark.parametrize("mode, step", [("max", 4), ("min", 8)])
def test_keep_best_keeps_the_best_step_and_rotation_never_deletes_it(world, tmp_path, mode, step):
    snapshots = {}
    summary = _hooked(world, tmp_path, 8, snapshots, keep_best_mode=mode)
    assert summary["best"] == {"metric": "eval/score", "mode": mode, "step": step, "value": CURVE[step],
                               "checkpoint": str(tmp_path / "runs" / "k" / "checkpoints" / "best")}
    ckpts = tmp_path / "runs" / "k" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["best", "step-8"]  # keep_last=1 spared best
    best = _weights(ckpts / "best")
    assert all(torch.equal(best[k], snapshots[step][k]) for k in best)
    assert json.loads((ckpts / "best" / "best.json").read_text())["value"] == CURVE[step]


def test_keep_best_survives_a_resume(world, tmp_path):
    # the first run ends at step 4 (best 0.9 at 4); the resumed one logs 0.9 at 6 (a tie) and 0.1
    # at 8: the best stays step 4, which a resumed run that forgot the race would replace
    _hooked(world, tmp_path, 4, {}, keep_best_mode="max")
    summary = _hooked(world, tmp_path, 8, {}, keep_best_mode="max", resume=True)
    assert (summary["best"]["step"], summary["best"]["value"]) == (4, 0.9)


# -- refusals: one line, exit code 2, before any model loads ---------------------------------------

@pytest.mark.parametrize("command, args, needle", [
    ("sft", ["data=SFT", "keep_best=eval/loss"], "eval/loss is never logged: this run has no held-out data"),
    ("sft", ["data=SFT", "eval_data=SFT", "keep_best=eval/pass@1"],
     "eval/pass@1 is never logged by this run; its eval metrics are eval/loss, eval/perplexity"),
    ("sft", ["data=SFT", "eval_reward_funcs=[R]"], "'sft.eval_reward_funcs' needs held-out rows"),
    ("grpo", ["data=P", "reward_funcs=[R]", "keep_best=eval/pass@1"], "this run has no held-out data"),
    ("ppo", ["data=P", "reward_funcs=[R]", "eval_every=2"], "'run.eval_every' needs held-out prompts"),
    ("dpo", ["data=PAIRS", "eval_data=PAIRS", "keep_best=eval/rewards/chosen"], "set run.keep_best_mode=max or min"),
    ("dpo", ["data=PAIRS", "eval_fraction=0.25", "keep_best=eval/accuracy"],
     "eval/accuracy is never logged by this run; its eval metrics are eval/logps/chosen"),
    ("rm", ["data=PAIRS", "eval_fraction=0", "keep_best=eval/accuracy"], "this run has no held-out data"),
    ("bon", ["data=P", "reward_funcs=[R]", "keep_best=eval/reward"], "config key 'run.keep_best' needs bon.rft=true"),
])
def test_what_can_never_work_is_refused_in_one_line(world, tmp_path, capsys, command, args, needle):
    root = world["root"]
    subst = {"SFT": root / "sft.jsonl", "P": root / "prompts.jsonl", "PAIRS": root / "pairs.jsonl",
             "[R]": f"[{world['R']}]"}
    argv = [f"{k}={subst.get(v, v)}" for k, v in (a.split("=", 1) for a in args)]
    rc = main([command, f"model={world['m']}", f"runs_dir={tmp_path / 'runs'}", "progress=false", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "runs").exists()  # refused before the run directory


def test_the_progress_bar_shows_the_last_eval_number(world, tmp_path, capsys):
    from tether.trainers.sft import SFTConfig, train_sft

    root = world["root"]
    cfg = SFTConfig(**{**_common(world, tmp_path, "bar"), "progress": True}, data=str(root / "sft.jsonl"),
                    eval_data=str(root / "sft.jsonl"), batch_size=4, max_steps=4, eval_every=2, lr=1e-2)
    train_sft(cfg)
    err = capsys.readouterr().err
    logged = dict(_evals(tmp_path / "runs" / "bar", "eval/loss"))
    assert f"eval_loss={logged[2]:.4g}" in err  # the postfix after step 2's eval point


@pytest.mark.parametrize("metric, mode", [
    ("eval/greedy/pass@1", "max"), ("eval/pass@4", "max"), ("eval/greedy/reward", "max"),
    ("eval/greedy/rewards/parity/mean", "max"), ("eval/rewards/accuracies", "max"),
    ("eval/rewards/margins", "max"), ("eval/accuracy", "max"), ("eval/gold_agreement", "max"),
    ("eval/loss", "min"), ("eval/nll_loss", "min"), ("eval/perplexity", "min"), ("eval/kl", "min"),
])
def test_the_direction_follows_the_name(metric, mode):
    from tether.config import ConfigError
    from tether.trainers.core.held_out import best_mode

    assert best_mode(metric) == mode and best_mode(metric, "min") == "min"
    for unclear in ("eval/rewards/chosen", "eval/greedy/completions/mean_length", "eval/score"):
        with pytest.raises(ConfigError, match="keep_best_mode"):
            best_mode(unclear)
