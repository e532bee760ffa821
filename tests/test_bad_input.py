"""Hostile inputs across every command: each is refused with exit code != 0 and exactly one line on
stderr that names the culprit (the config key, the file:line, the reward function), no traceback,
and — where a run would be created — nothing written. `--debug` / TETHER_DEBUG=1 bring the
traceback back."""

import json
import math
import subprocess
import sys

import pytest
import torch

from tether.cli import COMMANDS, main


@pytest.fixture(autouse=True)
def quiet_libraries(monkeypatch):
    # Hugging Face's own loading bars ("Loading weights") are not ours to count as error lines.
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    monkeypatch.delenv("TETHER_DEBUG", raising=False)
    yield
    if was:
        hf_logging.enable_progress_bar()


def _refused(capsys, argv, needle, code=None):
    """Run the CLI in-process; assert the one-line refusal naming `needle`, and return it."""
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0, f"{argv} was accepted; stdout: {out[-300:]}"
    if code is not None:
        assert rc == code, (rc, err)
    assert len(lines) == 1, f"{argv}: expected one stderr line, got:\n{err}"
    assert "Traceback" not in err and lines[0].startswith("tether")
    assert needle in lines[0], f"{argv}: {needle!r} not in {lines[0]!r}"
    return lines[0]


# ---- config values: range and finiteness, declared once per field ---------------------------------

# (command, key=value, what the line must name). Every command's sections are covered.
CONFIG_CASES = [
    ("sft", "lr=0", "'optim.lr' must be > 0"),
    ("sft", "lr=-1e-4", "'optim.lr' must be > 0"),
    ("sft", "lr=nan", "'optim.lr' must be > 0 and finite; got nan"),
    ("sft", "lr=.inf", "'optim.lr' must be > 0 and finite; got inf"),
    ("sft", "max_length=0", "'data.max_length' must be >= 1"),
    ("sft", "max_length=-3", "'data.max_length' must be >= 1"),
    ("sft", "log_every=0", "'run.log_every' must be >= 1"),
    ("sft", "epochs=nan", "'optim.epochs' must be > 0 and finite"),
    ("sft", "epochs=0", "'optim.epochs' must be > 0"),
    ("sft", "batch_size=0", "'data.batch_size' must be >= 1"),
    ("sft", "grad_accum=0", "'data.grad_accum' must be >= 1"),
    ("sft", "eval_fraction=1", "'data.eval_fraction' must be in [0, 1)"),
    ("sft", "warmup_ratio=2", "'optim.warmup_ratio' must be in [0, 1]"),
    ("sft", "warmup_steps=-1", "'optim.warmup_steps' must be >= 0"),
    ("sft", "min_lr_ratio=nan", "'optim.min_lr_ratio'"),
    ("sft", "weight_decay=-0.1", "'optim.weight_decay' must be >= 0"),
    ("sft", "max_grad_norm=-1", "'optim.max_grad_norm' must be >= 0"),
    ("sft", "max_grad_norm=inf", "'optim.max_grad_norm' must be >= 0 and finite"),
    ("sft", "adam_betas=0.9,1.0", "'optim.adam_betas' must be in [0, 1)"),
    ("sft", "adam_betas=nan,0.9", "'optim.adam_betas'"),
    ("sft", "seed=-1", "'run.seed' must be in [0, 4294967296)"),
    ("sft", "keep_last=-1", "'run.keep_last' must be >= 0"),
    ("sft", "save_every=-5", "'run.save_every' must be >= 0"),
    ("sft", "eval_every=-1", "'run.eval_every' must be >= 0"),
    ("sft", "num_samples=-1", "'run.num_samples' must be >= 0"),
    ("sft", "lora_r=-1", "'model.lora_r' must be >= 0"),
    ("sft", "lora_alpha=0", "'model.lora_alpha' must be >= 1"),
    ("sft", "lora_dropout=1", "'model.lora_dropout' must be in [0, 1)"),
    ("sft", "sample_max_new_tokens=0", "'sft.sample_max_new_tokens' must be >= 1"),
    ("sft", "log_every=1.5", "'run.log_every' expects int"),
    ("grpo", "temperature=nan", "'rollout.temperature' must be > 0 and finite"),
    ("grpo", "temperature=0", "'rollout.temperature' must be > 0"),
    ("grpo", "top_p=0", "'rollout.top_p' must be in (0, 1]"),
    ("grpo", "top_p=1.5", "'rollout.top_p' must be in (0, 1]"),
    ("grpo", "top_k=-1", "'rollout.top_k' must be >= 0"),
    ("grpo", "num_generations=0", "'rollout.num_generations' must be >= 1"),
    ("grpo", "num_generations=1", "'rollout.num_generations' must be >= 2 for advantage='grpo'"),
    ("grpo", "max_new_tokens=0", "'rollout.max_new_tokens' must be >= 1"),
    ("grpo", "beta=-0.1", "'grpo.beta' must be >= 0"),
    ("grpo", "beta=nan", "'grpo.beta' must be >= 0 and finite"),
    ("grpo", "clip_low=0", "'grpo.clip_low' must be > 0"),
    ("grpo", "clip_high=-0.2", "'grpo.clip_high' must be > 0"),
    ("grpo", "num_iterations=0", "'grpo.num_iterations' must be >= 1"),
    ("grpo", "overlong_penalty=-1", "'grpo.overlong_penalty' must be >= 0"),
    ("grpo", "max_sampling_rounds=0", "'grpo.max_sampling_rounds' must be >= 1"),
    ("grpo", "reward_weights=1,nan", "'reward.reward_weights' must be finite"),
    ("grpo", "max_prompt_length=0", "'data.max_prompt_length' must be >= 1"),
    ("rloo", "num_generations=1", "'rollout.num_generations' must be >= 2 for advantage='rloo'"),
    ("remax", "temperature=-1", "'rollout.temperature' must be > 0"),
    ("dpo", "beta=nan", "'preference.beta' must be > 0 and finite"),
    ("dpo", "beta=-0.1", "'preference.beta' must be > 0"),
    ("dpo", "beta=0", "'preference.beta' must be > 0"),
    ("dpo", "label_smoothing=0.5", "'preference.label_smoothing' must be in [0, 0.5)"),
    ("dpo", "dpop_lambda=-1", "'preference.dpop_lambda' must be >= 0"),
    ("dpo", "max_prompt_length=0", "'data.max_prompt_length' must be >= 1"),
    ("kto", "desirable_weight=0", "'preference.desirable_weight' must be > 0"),
    ("odpo", "num_generations=1", "'rollout.num_generations' must be >= 2 for odpo"),
    ("odpo", "method=kto", "'preference.method': odpo trains pairs"),
    ("odpo", "reference=latest", "'odpo.reference'"),
    ("odpo", "dpo_epochs=0", "'odpo.dpo_epochs' must be >= 1"),
    ("simpo", "gamma_beta_ratio=-1", "'preference.gamma_beta_ratio' must be >= 0"),
    ("orpo", "beta=inf", "'preference.beta' must be > 0 and finite"),
    ("rm", "center_rewards_coefficient=-1", "'rm.center_rewards_coefficient' must be >= 0"),
    ("rm", "eval_seed=-1", "'rm.eval_seed'"),
    ("rm", "lr=nan", "'optim.lr' must be > 0 and finite"),
    ("ppo", "kl_coef=-0.1", "'ppo.kl_coef' must be >= 0"),
    ("ppo", "kl_coef=nan", "'ppo.kl_coef' must be >= 0 and finite"),
    ("ppo", "gamma=1.5", "'ppo.gamma' must be in [0, 1]"),
    ("ppo", "lam=-0.1", "'ppo.lam' must be in [0, 1]"),
    ("ppo", "cliprange=0", "'ppo.cliprange' must be > 0"),
    ("ppo", "vf_coef=-1", "'ppo.vf_coef' must be >= 0"),
    ("ppo", "ppo_epochs=0", "'ppo.ppo_epochs' must be >= 1"),
    ("ppo", "num_minibatches=0", "'ppo.num_minibatches' must be >= 1"),
    ("ppo", "kl_target=0", "'ppo.kl_target' must be > 0"),
    ("bon", "n=0", "'bon.n' must be >= 1"),
    ("bon", "rft_lr=0", "'bon.rft_lr' must be > 0"),
    ("bon", "rft_epochs=nan", "'bon.rft_epochs' must be > 0 and finite"),
    ("bon", "max_prompts=-1", "'bon.max_prompts' must be >= 0"),
    ("bon", "batch_size=0", "'data.batch_size' must be >= 1"),
    ("memory", "batch_size=0", "'batch_size' must be >= 1"),
    ("memory", "seq_len=-1", "'seq_len' must be >= 1"),
    ("memory", "beta=nan", "'beta' must be >= 0 and finite"),
    ("memory", "lora_rank=0", "'lora_rank' must be >= 1"),
    ("quickstart", "level=99", "'level' must be one of 1, 2, 3, 4, 5; got 99"),
    ("quickstart", "hidden_size=0", "'hidden_size' must be >= 1"),
    ("quickstart", "hidden_size=100", "'hidden_size' must be 32 or a multiple of 64"),
    ("quickstart", "n_test=1000000", "'n_test' must be at most 900 at level 2"),
    ("quickstart", "rl_temperature=nan", "'rl_temperature' must be > 0 and finite"),
    ("quickstart", "pretrain_lr=0", "'pretrain_lr' must be > 0"),
    ("quickstart", "rl_generations=1", "'rl_generations' must be >= 2"),
    ("quickstart", "sft_steps=0", "'sft_steps' must be >= 1"),
    ("study frontier", "methods=FOO", "'methods' must be one of 'DPO'"),
    ("study frontier", "methods=DPO,foo", "got 'foo'"),
    ("study frontier", "betas=-1", "'betas'"),
    ("study frontier", "lr=nan", "'lr' must be > 0 and finite"),
    ("study frontier", "methods=", "'methods' must name at least one method"),
    ("study frontier", "orpo_lambdas=", "'orpo_lambdas' is empty, but method ORPO sweeps it"),
    ("study overoptimization", "betas=-0.1", "'betas' must be >= 0"),
    ("study overoptimization", "rm_lr=0", "'rm_lr' must be > 0"),
    ("study overoptimization", "label_temperature=nan", "'label_temperature' must be > 0 and finite"),
    ("study overoptimization", "betas=", "'betas' must list at least one"),
    ("eval", "n=0", "'generation.n' must be >= 1"),
    ("eval", "k=[1,9]", "'generation.k' must be <= generation.n"),
    ("eval", "top_p=0", "'generation.top_p' must be in (0, 1]"),
    ("chat", "top_p=0", "'top_p' must be in (0, 1]"),
    ("chat", "temperature=-1", "'temperature' must be >= 0"),
    ("init-model", "hidden_size=0", "hidden_size must be >= 1"),
    ("init-model", "heads=3", "hidden_size 128 is not a multiple of heads 3"),
    ("convert", "overwrite=maybe", "config key 'overwrite' expects bool, got 'maybe'"),
    ("label pairs", "batch_size=0", "'batch_size' must be >= 1"),
    ("label pairs", "principles=some", "'principles' must be one of 'sample', 'all'; got 'some'"),
    ("cai", "rounds=0", "'rounds' must be >= 1"),
    ("cai", "keep=some", "'keep' must be one of 'final', 'all'"),
    ("study judges", "position_p=0.2", "'position_p' must be in [0.5, 1]"),
    ("prm", "lr=0", "'optim.lr' must be > 0"),
    ("prm", "threshold=2", "'prm.threshold' must be in (0, 1)"),
    ("prm", "targets=both", "'prm.targets' must be one of 'hard', 'soft'"),
    ("label steps", "k=0", "'k' must be >= 1"),
    ("label steps", "estimate=x", "'estimate' must be one of 'hard', 'soft'"),
    ("study prm", "max_n=0", "'max_n' must be >= 1"),
    ("study judges", "ppo_seeds=", "'ppo_seeds' must list at least one seed"),
    ("study judges", "hh_judge=m", "'hh_judge' and 'hh_data' go together"),
    ("studio", "port=70000", "'port' must be in [0, 65535]"),
    ("serve", "port=70000", "'port' must be in [0, 65535]"),
    ("serve", "max_tokens=0", "'max_tokens' must be >= 1"),
]


@pytest.mark.parametrize("command, arg, needle", CONFIG_CASES, ids=[f"{c}:{a}" for c, a, _ in CONFIG_CASES])
def test_bad_config_value_is_one_line_and_writes_nothing(capsys, tmp_path, command, arg, needle):
    runs = tmp_path / "runs"  # where the command would write
    base = {"memory": [], "init-model": [f"out={runs}"], "convert": ["model=m.gguf", f"out={runs}"], "chat": ["model=m"], "serve": ["model=m"], "label pairs": [f"out={runs}/p.jsonl"], "cai": [f"out={runs}/c.jsonl"],
            "quickstart": [f"runs_dir={runs}"], "studio": [f"runs_dir={runs}"],
            "study frontier": [f"runs_dir={runs}"], "study judges": [f"runs_dir={runs}"], "study overoptimization": [f"runs_dir={runs}"],
            "study prm": [f"runs_dir={runs}"], "label steps": ["policy=m", "data=d.jsonl", f"out={runs}/s.jsonl"]}
    argv = command.split() + base.get(command, ["model=m", "data=d.jsonl", f"runs_dir={runs}"]) + [arg]
    _refused(capsys, argv, needle, code=2)
    assert not runs.exists()


def test_every_command_has_a_case():
    assert {c for c, _, _ in CONFIG_CASES} == set(COMMANDS)


def test_ranges_are_shown_in_help(capsys):
    assert main(["sft", "--help"]) == 0
    text = capsys.readouterr().out
    assert "[float > 0; default: 2e-05]" in text            # optim.lr
    assert "[int >= 1; default: 10]" in text                # run.log_every
    assert "[float in [0, 1); default: 0.0]" in text        # data.eval_fraction
    assert "[list[float in [0, 1)]; default: [0.9, 0.999]]" in text  # optim.adam_betas


def test_python_callers_get_the_same_checks():
    from tether.config import ConfigError
    from tether.quickstart import QuickstartConfig
    from tether.studies.frontier import FrontierConfig
    from tether.trainers.preference.offline import DPOConfig
    from tether.trainers.grpo import GRPOConfig
    with pytest.raises(ConfigError, match="'optim.lr' must be > 0 and finite; got nan"):
        GRPOConfig(model="m", data="d", lr=math.nan)
    with pytest.raises(ConfigError, match="'preference.beta' must be > 0 and finite"):
        DPOConfig(model="m", data="d", beta=math.nan)
    with pytest.raises(ConfigError, match="'level' must be one of"):
        QuickstartConfig(level=99)
    with pytest.raises(ConfigError, match="unknown method 'FOO'"):
        FrontierConfig(methods=["FOO"])
    # estimators that need no group take one sample per prompt
    assert GRPOConfig(model="m", data="d", num_generations=1, advantage="reinforce_pp").rollout.num_generations == 1


def test_runs_dir_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    for command in ("sft", "dpo", "quickstart"):
        extra = ["model=m", "data=d"] if command != "quickstart" else []
        _refused(capsys, [command, *extra, f"runs_dir={f}"], "'run.runs_dir' must be a directory"
                 if command != "quickstart" else "'runs_dir' must be a directory", code=2)
        _refused(capsys, [command, *extra, f"runs_dir={f}/sub"], f"'{f}' is a file", code=2)
    assert f.read_text() == "x"


# ---- config files and the command line ----------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("lr: 1e-4\nbatch_size: 2\nlr: 3e-4\n", "key 'lr' given twice (lines 1 and 3)"),
    ("optim:\n  lr: 1e-4\n  lr: 2e-4\n", "key 'lr' given twice (lines 2 and 3)"),
    ("lr: 1e-4\noptim: {lr: 2e-4}\n", "'optim.lr' is given twice"),
    ("lr: [1, 2\n", "invalid YAML"),
    ("- lr\n- 1\n", "top level must be a mapping"),
    ("lr: .nan\n", "'optim.lr' must be > 0 and finite"),
    ("optim: 3\n", "config key 'optim' expects OptimSection"),
], ids=["dup-top", "dup-nested", "dup-flat-and-full", "syntax", "list", "nan", "section-scalar"])
def test_bad_config_file(capsys, tmp_path, text, needle):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    line = _refused(capsys, ["sft", "--config", str(f), "model=m", "data=d", f"runs_dir={tmp_path / 'runs'}"],
                    needle, code=2)
    assert "c.yaml" in line or "config key" in line
    assert not (tmp_path / "runs").exists()


def test_config_file_unreadable_or_missing(capsys, tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"lr: \xff\xfe\n")
    _refused(capsys, ["sft", "--config", str(tmp_path / "bin.yaml")], "bin.yaml", code=2)
    _refused(capsys, ["sft", "--config", str(tmp_path)], "does not exist", code=2)
    _refused(capsys, ["sft", "--config", str(tmp_path / "nope.yaml")], "does not exist", code=2)
    _refused(capsys, ["sft", "--config"], "--config needs a file path", code=2)


@pytest.mark.parametrize("argv, needle", [
    (["nope"], "unknown command 'nope'"),
    (["study", "nope"], "studies: overoptimization, frontier"),
    (["study"], "name one of the studies: overoptimization, frontier"),
    (["sft", "lr"], "'lr' is not key=value"),
    (["sft", "lr=1e-4", "optim.lr=2e-4"], "'optim.lr' is given twice"),
    (["sft", "x=1"], "unknown key 'x' for tether sft"),
])
def test_bad_command_line(capsys, argv, needle):
    _refused(capsys, argv, needle, code=2)


def test_study_help_lists_the_studies(capsys):
    assert main(["study", "--help"]) == 0
    out = capsys.readouterr().out
    assert "overoptimization" in out and "frontier" in out and "unknown" not in out


# ---- runtime: data, model, reward functions ------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tether.models import make_tiny_model
    root = tmp_path_factory.mktemp("bad_input")
    make_tiny_model(root / "model", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Say {i}:"}) + "\n")
    (root / "rewards_mod.py").write_text(
        "import math\n"
        "def strings(completions, **_): return ['1.0' if i else 'x' for i, _ in enumerate(completions)]\n"
        "def bare(completions, **_): return 1.0\n"
        "def nan(completions, **_): return [math.nan] * len(completions)\n"
        "def inf(completions, **_): return [math.inf] * len(completions)\n"
        "def short(completions, **_): return [1.0]\n"
        "def boom(completions, **_): raise KeyError('answer')\n"
        "def skip(completions, **_): return [None] * len(completions)\n")
    return root


def _rl_args(world, tmp_path, command="grpo"):
    return [command, f"model={world / 'model'}", f"data={world / 'prompts.jsonl'}",
            f"runs_dir={tmp_path / 'runs'}", "max_steps=1", "batch_size=2", "max_new_tokens=4",
            "device=cpu", "progress=false"] + (["num_generations=2"] if command == "grpo" else
                                                ["num_minibatches=1"])


@pytest.mark.parametrize("command", ["grpo", "ppo"])
@pytest.mark.parametrize("fn, needle", [
    ("strings", "reward function 'strings' returned 'x' at row 0, not a number or None"),
    ("bare", "reward function 'bare' returned float, expected a list"),
    ("nan", "reward function 'nan' returned NaN at row 0"),
    ("inf", "reward function 'inf' returned inf at row 0"),
    ("short", "reward function 'short' returned 1 values"),
    ("boom", "reward function 'boom' failed: KeyError"),
])
def test_bad_reward_function_is_named(capsys, monkeypatch, world, tmp_path, command, fn, needle):
    monkeypatch.syspath_prepend(str(world))
    torch.set_num_threads(1)
    _refused(capsys, _rl_args(world, tmp_path, command) + [f"reward_funcs=rewards_mod:{fn}"], needle, code=1)


def test_bon_nan_reward_is_named_too(capsys, monkeypatch, world, tmp_path):
    monkeypatch.syspath_prepend(str(world))
    _refused(capsys, ["bon", f"model={world / 'model'}", f"data={world / 'prompts.jsonl'}",
                      f"runs_dir={tmp_path / 'runs'}", "n=2", "max_new_tokens=4", "device=cpu",
                      "reward_funcs=rewards_mod:nan"], "reward function 'nan' returned NaN", code=1)


def test_odpo_unknown_reward_is_named_before_anything_loads(capsys, world, tmp_path):
    _refused(capsys, ["odpo", f"model={world / 'model'}", f"data={world / 'prompts.jsonl'}",
                      f"runs_dir={tmp_path / 'runs'}", "device=cpu", "reward_funcs=no_such_reward"],
             "reward 'no_such_reward' is neither a built-in", code=1)
    _refused(capsys, ["odpo", f"model={world / 'model'}", f"data={world / 'prompts.jsonl'}",
                      f"runs_dir={tmp_path / 'runs'}", "device=cpu"], "'reward.reward_funcs' must name", code=2)
    assert not (tmp_path / "runs").exists()


def test_a_reward_function_returning_none_skips_the_rows(capsys, monkeypatch, world, tmp_path):
    monkeypatch.syspath_prepend(str(world))
    assert main(_rl_args(world, tmp_path) + ["reward_funcs=rewards_mod:skip"]) == 0


@pytest.mark.parametrize("rows, needle", [
    ([{"prompt": "p", "chosen": "a", "rejected": "b", "margin": float("nan")}], "pairs.jsonl:1:margin: must be a finite number"),
    ([{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}], "pairs.jsonl:1:margin"),
    ([{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a"}], "pairs.jsonl:2:rejected: missing column"),
    ([{"prompt": "p", "chosen": 3, "rejected": "b"}], "pairs.jsonl:1:chosen"),
])
def test_bad_preference_rows(capsys, world, tmp_path, rows, needle):
    data = tmp_path / "pairs.jsonl"
    # json.dumps writes NaN as the bare token NaN, as pandas and many writers do
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for command in ("rm", "dpo"):
        _refused(capsys, [command, f"model={world / 'model'}", f"data={data}", f"runs_dir={tmp_path / 'runs'}",
                          "device=cpu", "progress=false"], needle, code=1)
    assert not (tmp_path / "runs").exists()


_STEPS = {"prompt": "p", "completions": ["a", "b"], "labels": [True, False], "soft_labels": [0.75, 0.25]}


@pytest.mark.parametrize("rows, needle", [
    ([_STEPS, {k: v for k, v in _STEPS.items() if k != "soft_labels"}], "steps.jsonl:2:soft_labels: missing"),
    ([{**_STEPS, "soft_labels": [0.75, 1.5]}], "steps.jsonl:1:soft_labels[1]: expected a number in [0, 1], got 1.5"),
    ([{**_STEPS, "soft_labels": [-0.25, 0.0]}], "steps.jsonl:1:soft_labels[0]: expected a number in [0, 1]"),
    ([{**_STEPS, "soft_labels": [float("nan"), 0.0]}], "steps.jsonl:1:soft_labels[0]: expected a number in [0, 1], got nan"),
    ([{**_STEPS, "soft_labels": [0.75, True]}], "steps.jsonl:1:soft_labels[1]"),
    ([{**_STEPS, "soft_labels": 0.5}], "steps.jsonl:1:soft_labels: expected a list of numbers"),
    ([_STEPS, {**_STEPS, "soft_labels": [0.75]}], "steps.jsonl:2:soft_labels: 1 values for 2 completions"),
])
def test_bad_soft_labels_with_soft_targets(capsys, world, tmp_path, rows, needle):
    data = tmp_path / "steps.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _refused(capsys, ["prm", f"model={world / 'model'}", f"data={data}", f"runs_dir={tmp_path / 'runs'}",
                      "targets=soft", "device=cpu", "progress=false"], needle, code=1)
    assert not (tmp_path / "runs").exists()


def test_identical_pairs_are_counted_in_a_warning(caplog, tmp_path):
    from tether.data import load_data
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": "p", "chosen": c, "rejected": r}) + "\n"
                            for c, r in [("a", "a"), ("a", "b"), ("c", "c")]))
    with caplog.at_level("WARNING"):
        load_data(str(data), expect="preference")
    assert "2 of 3 pairs have chosen identical to rejected" in caplog.text


def test_missing_model_and_data_are_named(capsys, world, tmp_path):
    runs = tmp_path / "runs"
    _refused(capsys, ["sft", f"model={world / 'model'}", f"data={tmp_path / 'missing.jsonl'}",
                      f"runs_dir={runs}"], "missing.jsonl", code=1)
    _refused(capsys, ["sft", f"model={world / 'model'}", f"runs_dir={runs}"], "`data` is required", code=1)
    _refused(capsys, ["grpo", f"model={world / 'model'}", f"data={world / 'prompts.jsonl'}", f"runs_dir={runs}"],
             "at least one reward function is required", code=1)
    assert not runs.exists()


# ---- an unexpected exception: one line naming its type and place; --debug for the traceback -----

def _crash(cfg):
    raise RuntimeError("shapes do not match\nsecond line")


def test_unexpected_exception_names_type_and_place(capsys, monkeypatch):
    import tether.memory
    monkeypatch.setattr(tether.memory, "run_memory", _crash)
    line = _refused(capsys, ["memory"], "RuntimeError at test_bad_input.py:", code=1)
    assert "in _crash(): shapes do not match second line" in line and "--debug" in line
    assert main(["memory", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("tether memory: error: RuntimeError")
    monkeypatch.setenv("TETHER_DEBUG", "1")
    assert main(["memory"]) == 1 and "Traceback" in capsys.readouterr().err


def test_subprocess_exit_codes_and_debug(tmp_path):
    """The real entry point: exit status and stderr as a shell sees them."""
    run = lambda *a, **env: subprocess.run([sys.executable, "-m", "tether", *a], capture_output=True,  # noqa: E731
                                           text=True, env={**__import__("os").environ, **env})
    r = run("sft", "model=m", "data=d", "lr=nan", f"runs_dir={tmp_path}/r")
    assert r.returncode == 2 and r.stderr.strip() == \
        "tether sft: error: config key 'optim.lr' must be > 0 and finite; got nan"
    r = run("sft", f"model={tmp_path}/none", f"data={tmp_path}/none.jsonl", f"runs_dir={tmp_path}/r")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()
