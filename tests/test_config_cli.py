"""Config loading and the CLI: docs per field, strict keys and types, one-line errors."""

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from tether.cli import COMMANDS, main
from tether.config import ConfigError, field_docs, format_help, load_config


@dataclass
class Inner:
    dtype: str = "fp32"
    "weight dtype"


@dataclass
class Cfg:
    lr: float = 1e-3
    "peak learning rate"
    steps: int = 10
    "optimizer steps"
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    "which loss"
    tag: Optional[str] = None
    "an optional tag"
    flag: bool = False
    "a switch"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    "two numbers"
    inner: Inner = field(default_factory=Inner)
    "nested section"


def test_field_docs_are_read_from_the_source():
    docs = field_docs(Cfg)
    assert docs["lr"] == "peak learning rate" and docs["loss"] == "which loss"
    text = format_help(Cfg)
    assert "inner.dtype" in text and "weight dtype" in text and "default: 0.001" in text


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 3e-4\nsteps: 5\ninner:\n  dtype: bf16\n")
    cfg = load_config(Cfg, str(f), ["steps=7", "flag=true", "betas=0.8,0.9", "tag=x"])
    assert cfg.lr == pytest.approx(3e-4) and cfg.steps == 7 and cfg.flag is True
    assert cfg.betas == [0.8, 0.9] and cfg.inner.dtype == "bf16" and cfg.tag == "x"
    assert load_config(Cfg, None, ["inner.dtype=fp16"]).inner.dtype == "fp16"


def test_on_and_off_mean_the_words_where_the_choices_are_words():
    # YAML 1.1 reads `on` as True: read as YAML alone, `optim.fused_adamw=on` is refused ("got True")
    @dataclass
    class Switch:
        mode: Literal["auto", "on", "off"] = "auto"
        "a three-way switch"
    assert [load_config(Switch, None, [f"mode={v}"]).mode for v in ("on", "off", "auto")] == ["on", "off", "auto"]
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(Cfg, None, ["loss=on"])  # no such word among the choices: still refused


@pytest.mark.parametrize("args, needle", [
    (["lrr=1"], "unknown key 'lrr' for Cfg; did you mean 'lr'?"),
    (["steps=abc"], "config key 'steps' expects int"),
    (["steps=1.5"], "config key 'steps' expects int"),
    (["flag=maybe"], "config key 'flag' expects bool"),
    (["loss=dpo"], "config key 'loss' must be one of 'sigmoid', 'ipo'"),
    (["inner.nope=1"], "unknown key 'inner.nope' for Cfg"),
    (["novalue"], "is not key=value"),
])
def test_bad_keys_and_types_are_one_line(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, None, args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_key_names_the_closest_keys_and_where_all_are_listed():
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, None, ["inner.dtpye=bf16"])
    assert str(e.value) == ("unknown key 'inner.dtpye' for Cfg; did you mean 'inner.dtype'? "
                            "(tether.config.format_help(Cfg) lists every key)")
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, None, ["zzzz=1"], command="sft")
    assert str(e.value) == "unknown key 'zzzz' for tether sft (tether sft --help lists every key)"


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(Cfg, str(f))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, str(tmp_path / "missing.yaml"))


def test_every_command_documents_every_option(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"tether {name}:" in out
    for name in COMMANDS:
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        for line in text.splitlines():
            if line.startswith("  ") and "[" in line:  # an option line: doc then [type; default]
                key, rest = line.strip().split("  ", 1)
                assert rest.strip() and not rest.strip().startswith("["), f"{name}.{key} has no doc"


def test_cli_errors_are_one_line():
    r = subprocess.run([sys.executable, "-m", "tether", "sft", "lrr=1"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == ("tether sft: error: unknown key 'lrr' for tether sft; did you mean 'lr'? "
                                "(tether sft --help lists every key)")
    r = subprocess.run([sys.executable, "-m", "tether", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command 'nope'" in r.stderr


# ---- sections: flat names, per-trainer defaults, old flat files ---------------------------------

from tether.config import flat_init, save_config  # noqa: E402


@dataclass
class _A:
    x: int = 1
    "x of a"
    only_a: int = 2
    "only in a"


@dataclass
class _B:
    PRIMARY = "path"  # a plain class attribute works as well as a ClassVar
    path: str = ""
    "the b path"
    x: int = 3
    "x of b"


@flat_init
@dataclass
class _Sectioned:
    a: _A = field(default_factory=lambda: _A(only_a=20))
    "section a"
    b: _B = field(default_factory=_B)
    "section b"


def test_flat_names_route_to_their_section_on_top_of_the_trainers_defaults():
    cfg = load_config(_Sectioned, None, ["only_a=5", "b=some/dir"])
    assert cfg.a.only_a == 5 and cfg.b.path == "some/dir" and cfg.a.x == 1
    cfg = load_config(_Sectioned, None, ["a.x=7"])
    assert cfg.a.x == 7 and cfg.a.only_a == 20  # a partial section keeps the trainer's defaults


def test_ambiguous_flat_name_is_one_line_listing_the_full_names():
    with pytest.raises(ConfigError) as e:
        load_config(_Sectioned, None, ["x=1"])
    assert "ambiguous" in str(e.value) and "a.x" in str(e.value) and "b.x" in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_flat_name_suggests_the_near_one():
    with pytest.raises(ConfigError, match="did you mean 'only_a'"):
        load_config(_Sectioned, None, ["only_b=1"])


def test_python_flat_kwargs_and_replace():
    import dataclasses
    cfg = _Sectioned(only_a=9, b="p")
    assert cfg.a == _A(x=1, only_a=9) and cfg.b.path == "p"
    again = dataclasses.replace(cfg, path="q")  # replace passes the sections too: flat keys win
    assert again.b.path == "q" and again.a.only_a == 9
    assert _Sectioned(a=_A(x=4), only_a=6).a == _A(x=4, only_a=6)


def test_old_flat_yaml_equals_nested_yaml_and_the_saved_config_reloads(tmp_path):
    from tether.trainers.sft import SFTConfig
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("model: m\ndata: d.jsonl\nlr: 3.0e-4\nname: x\nbatch_size: 4\ncompletion_only: false\n")
    nested.write_text("model: {path: m}\ndata: {path: d.jsonl, batch_size: 4}\noptim: {lr: 3.0e-4}\n"
                      "run: {name: x}\nsft: {completion_only: false}\n")
    a, b = load_config(SFTConfig, str(flat)), load_config(SFTConfig, str(nested))
    assert a == b and a.optim.lr == 3e-4 and a.optim.warmup_ratio == 0.03 and a.run.log_every == 10
    save_config(a, tmp_path / "saved.yaml")
    assert load_config(SFTConfig, str(tmp_path / "saved.yaml")) == a
    assert SFTConfig(model="m", data="d.jsonl", lr=3e-4, name="x", batch_size=4, completion_only=False) == a


def test_help_is_grouped_by_section(capsys):
    assert main(["sft", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for section in ("model", "optim", "run", "data"):
        header = next(i for i, line in enumerate(lines) if line.startswith(f"{section}:"))
        assert lines[header + 1].strip().startswith(f"{section}.")


def test_a_shared_key_a_trainer_does_not_use_is_hidden_and_refused(capsys):
    from tether.trainers.best_of_n import BoNConfig
    assert main(["bon", "--help"]) == 0
    bon_help = capsys.readouterr().out
    assert main(["grpo", "--help"]) == 0
    assert "rollout.num_generations" in capsys.readouterr().out and "rollout.num_generations" not in bon_help
    with pytest.raises(ConfigError, match="rollout.num_generations is not used here") as e:
        load_config(BoNConfig, None, ["num_generations=2"])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not used here"):
        BoNConfig(model="m", data="d", num_generations=2)
    assert BoNConfig(model="m", data="d", num_generations=1).rollout.num_generations == 1  # the default is fine
    # grpo and ppo evaluate held-out prompts (data.eval_data); without them eval_every is refused, saying so
    from tether.trainers.grpo import GRPOConfig
    from tether.trainers.ppo import PPOConfig
    for config in (GRPOConfig, PPOConfig):
        with pytest.raises(ConfigError, match="'run.eval_every' needs held-out prompts: data.eval_data"):
            load_config(config, None, ["eval_every=2"])
