"""Failures the CLI reports in one line: a disk that fills mid-run, and an unknown config key.

- A full disk (ENOSPC, a quota, or a file-size limit's EFBIG) while a run writes any of its files
  (metrics.jsonl, samples.jsonl, summary.json, config.yaml, plots, checkpoints, tensorboard) stops
  it with one line naming the run, the file, the cause and the last complete checkpoint; exit code
  1, no traceback. The file being written is left as it was (no partial row, no temporary file), a
  checkpoint cut short is never renamed into place, and resume=true continues from the last
  complete one. The disk is filled here with RLIMIT_FSIZE (`ulimit -f`), lowered once the run's
  first checkpoint is written: every later write past the limit fails with EFBIG, for real.
- An unknown key names its closest keys (dotted section keys included) and `tether <command>
  --help`, in one line, instead of listing every key.
"""

import errno
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.cli import main
from tether.config import ConfigError, load_config
from tether.models import make_tiny_model
from tether.run import disk_full_cause, latest_checkpoint, load_trainer_state
from tether.tasks import arithmetic

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# TensorBoard's writer is checked too where its extra is installed (`.ci/run` installs it); the
# other writers are checked everywhere
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()  # 2 shared cores: small ops stall in 2-thread regions
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_failures")
    make_tiny_model(root / "model", **TINY)
    train, _ = arithmetic.make_splits(200, 10, seed=1)
    (root / "sft.jsonl").write_text("".join(json.dumps(arithmetic.sft_example(p)) + "\n" for p in train))
    return root


def sft_args(root: Path, name: str, *extra: str) -> list[str]:
    return ["sft", f"model={root / 'model'}", f"data={root / 'sft.jsonl'}", f"runs_dir={root / 'runs'}",
            f"name={name}", "batch_size=4", "max_steps=8", "save_every=4", "log_every=1", "lr=1e-3",
            "device=cpu", "progress=false", "num_samples=1", "sample_max_new_tokens=4", *extra]


# Runs the CLI; once the run's first checkpoint is written, no file may grow past its size at that
# moment plus `headroom` bytes (RLIMIT_FSIZE). SIGXFSZ is left alone here: the CLI ignores it, so
# the write fails with EFBIG instead of the signal killing the process.
FILL = r"""
import resource, sys
from tether import run
from tether.cli import main

headroom, filled = int(sys.argv[1]), []
save = run.RunDir.save_checkpoint

def save_then_fill(self, *args, **kwargs):
    out = save(self, *args, **kwargs)
    if not filled:
        filled.append(True)
        size = (self.path / "metrics.jsonl").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + headroom, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return out

run.RunDir.save_checkpoint = save_then_fill
sys.exit(main(sys.argv[2:]))
"""


def fill_run(root: Path, name: str, headroom: int, *extra: str) -> subprocess.CompletedProcess:
    script = root / "fill.py"
    script.write_text(FILL)
    return subprocess.run([sys.executable, str(script), str(headroom), *sft_args(root, name, *extra)],
                          capture_output=True, text=True, env=ENV, timeout=600)


def stopped_line(run: Path, what: str, ckpt: Path) -> str:
    return (f"tether sft: error: run '{run}' stopped: no space left writing {what} (OSError 27: File too "
            f"large); last complete checkpoint: {ckpt} (resume with resume=true)")


def resume_finishes(root: Path, name: str, capsys) -> list[dict]:
    """resume=true without the limit: the run finishes at step 8; its metrics rows, one per step."""
    assert main(sft_args(root, name, "resume=true")) == 0, capsys.readouterr().err
    run = root / "runs" / name
    assert json.loads((run / "summary.json").read_text())["steps"] == 8
    assert load_trainer_state(latest_checkpoint(run))["step"] == 8
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_disk_filling_mid_run_stops_with_one_line_and_resumes_from_the_last_checkpoint(root, capsys):
    # 300 bytes: one ~220-byte metrics row after the step-4 checkpoint fits, the next one does not
    r = fill_run(root, "metrics", 300)
    run = root / "runs" / "metrics"
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == stopped_line(run, "metrics.jsonl", run / "checkpoints" / "step-4")
    text = (run / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]  # every line whole: the cut row was removed
    assert text.endswith("\n") and [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert latest_checkpoint(run) == run / "checkpoints" / "step-4"
    assert load_trainer_state(run / "checkpoints" / "step-4")["step"] == 4

    resumed = resume_finishes(root, "metrics", capsys)
    assert [row["step"] for row in resumed] == list(range(1, 9))
    # resumed from step 4: its rows up to the checkpoint are the first run's, byte for byte
    assert (run / "metrics.jsonl").read_text().splitlines()[:4] == text.splitlines()[:4]


def test_a_disk_filling_during_a_checkpoint_write_leaves_no_checkpoint_a_resume_would_pick(root, capsys):
    # 5000 bytes: the metrics rows of steps 5-8 fit; the step-8 checkpoint's files (optimizer state
    # 300 kB, weights 90 kB) do not. TensorBoard writes too: its thread's error prints no traceback.
    r = fill_run(root, "checkpoint", 5000, *(["log_with=tensorboard"] if HAS_TENSORBOARD else []))
    run = root / "runs" / "checkpoint"
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr
    step4 = run / "checkpoints" / "step-4"
    assert r.stderr.strip().splitlines()[-1] == stopped_line(run, "checkpoints/step-8", step4)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]  # no step-8, no step-8.tmp
    assert not (run / "summary.json").exists()
    assert latest_checkpoint(run) == step4 and load_trainer_state(step4)["step"] == 4

    resumed = resume_finishes(root, "checkpoint", capsys)
    assert [row["step"] for row in resumed] == list(range(1, 9))
    assert (run / "checkpoints" / "step-8").is_dir()


# Every writer of a run directory, each under a file-size limit it crosses: the one line, and the
# files as they were (tensorboard: its own event file is the one cut off; metrics.jsonl has the row).
WRITERS = r"""
import dataclasses, importlib.util, json, resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from tether.errors import DiskFullError
from tether.plots import plot_metrics
from tether.run import RunDir, disk_full_cause

@dataclasses.dataclass
class Cfg:
    lr: float = 0.1

root, hard = Path(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]

def files(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != ".lock"}

def limited(limit, write):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        write()
    except BaseException as e:
        return e
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))

def size(run, name):
    return next(run.path.glob(name)).stat().st_size

def plots(run):
    with run.writing("plots"):
        plot_metrics(run.path)

CASES = {
    "metrics.jsonl": (lambda run: size(run, "metrics.jsonl") + 10, lambda run: run.log(3, {"loss": 0.3})),
    "samples.jsonl": (lambda run: size(run, "samples.jsonl") + 10,
                      lambda run: run.add_samples(3, [{"prompt": "p", "completion": "c" * 40}])),
    "summary.json": (lambda run: 10, lambda run: run.write_summary({"steps": 3, "loss": 0.3})),
    "config.yaml": (lambda run: 4, lambda run: run.write_config(Cfg(lr=0.2))),  # 8 bytes
    "plots": (lambda run: 100, plots),
    "truncate": (lambda run: 10, lambda run: run.truncate_after(1)),
    "tensorboard": (lambda run: size(run, "tensorboard/events.*") + 10,
                    lambda run: run.log(3, {"loss": 0.3, "lr": 0.1, "grad_norm": 1.0})),
}
if importlib.util.find_spec("tensorboard") is None:  # its extra is not installed
    del CASES["tensorboard"]
for case, (limit, write) in CASES.items():
    run = RunDir(root / case.replace(".", "_"), log_with="tensorboard" if case == "tensorboard" else "none")
    run.write_config(Cfg())
    for step in (1, 2):
        run.log(step, {"loss": 1.0 / step})
        run.add_samples(step, [{"prompt": "p", "completion": "c"}])
    run.write_summary({"steps": 2})
    plot_metrics(run.path)
    before = files(run.path)
    error = limited(limit(run), lambda: write(run))
    after = files(run.path)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    print(json.dumps({"case": case, "run": str(run.path), "error": type(error).__name__,
                      "message": str(error), "changed": changed}))

# The errors of the writers a checkpoint uses (Rust, torch.save into a file, DCP) keep the errno
errors = {
    "safetensors": limited(1000, lambda: save_file({"x": torch.zeros(10000)}, str(root / "x.safetensors"))),
    "torch.save": limited(1000, lambda: torch.save(torch.zeros(10000), open(root / "x.pt", "wb"))),
    "dcp": limited(1000, lambda: dcp.save({"x": torch.zeros(10000)}, checkpoint_id=str(root / "dcp"))),
}
print(json.dumps({"causes": {k: disk_full_cause(e) for k, e in errors.items()}}))
"""


def test_every_writer_of_a_run_stops_with_one_line_and_leaves_its_files_as_they_were(tmp_path):
    script = tmp_path / "writers.py"
    script.write_text(WRITERS)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                       env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, r.stderr[-3000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    cases = {res["case"]: res for res in results if "case" in res}
    assert set(cases) == {"metrics.jsonl", "samples.jsonl", "summary.json", "config.yaml", "plots",
                          "truncate", *(["tensorboard"] if HAS_TENSORBOARD else [])}
    for case, res in cases.items():
        what = {"truncate": "metrics.jsonl"}.get(case, case)
        assert res["error"] == "DiskFullError", res
        assert res["message"] == (f"run '{res['run']}' stopped: no space left writing {what} "
                                  "(OSError 27: File too large); no complete checkpoint yet")
        # nothing half-written: the file as it was, no temporary file left (tensorboard: the row went
        # to metrics.jsonl before the event file filled; a resume drops rows after its checkpoint)
        if case == "tensorboard":
            assert len(res["changed"]) == 2 and res["changed"][0] == "metrics.jsonl"
            assert res["changed"][1].startswith("tensorboard/events.out.tfevents.")
        else:
            assert res["changed"] == [], res
    causes = next(res["causes"] for res in results if "causes" in res)
    assert causes == {k: [errno.EFBIG, "File too large"] for k in ("safetensors", "torch.save", "dcp")}


def test_disk_full_cause_tells_a_full_disk_from_other_errors():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full_cause(full) == (errno.ENOSPC, "No space left on device")
    assert disk_full_cause(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full_cause(ValueError("bad row")) is None
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598")  # torch's writer, its OSError as the context
    except RuntimeError as e:
        assert disk_full_cause(e) == (errno.EDQUOT, "Disk quota exceeded")
    assert disk_full_cause(RuntimeError("I/O error: No space left on device (os error 28)")) == \
        (errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---- unknown keys ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, near", [
    (["grpo", "grpo.bta=0.1"], "'grpo.beta'"),
    (["grpo", "bta=0.1"], "'beta'"),
    (["grpo", "optim.beta=0.1"], "'grpo.beta'"),  # the key's last name, in the section that has it
    (["grpo", "grpo.lr=1e-5"], "'optim.lr'"),
    (["sft", "lrr=1e-5"], "'lr'"),
    (["dpo", "modl=x"], "'model'"),
    (["study", "frontier", "seeed=1"], "'seed'"),
])
def test_an_unknown_key_names_its_closest_keys_in_one_short_line(capsys, argv, near):
    command = " ".join(a for a in argv if "=" not in a)
    key = next(a for a in argv if "=" in a).split("=")[0]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 200, err
    assert err.strip() == (f"tether {command}: error: unknown key '{key}' for tether {command}; "
                           f"did you mean {near}? (tether {command} --help lists every key)")


def test_an_unknown_key_with_no_close_match_still_points_to_help(capsys, tmp_path):
    assert main(["grpo", "zzzzqq=1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("tether grpo: error: unknown key 'zzzzqq' for tether grpo "
                           "(tether grpo --help lists every key)")
    config = tmp_path / "c.yaml"  # a YAML file's keys too, a section's included
    config.write_text("grpo:\n  bta: 0.1\n")
    assert main(["grpo", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'grpo.bta'" in err and "did you mean 'grpo.beta'?" in err
    assert "(tether grpo --help lists every key)" in err


def test_python_callers_get_the_closest_keys_and_the_class_name():
    from tether.trainers.grpo import GRPOConfig
    with pytest.raises(ConfigError) as e:
        GRPOConfig(model="m", data="d", bta=0.1)
    assert str(e.value) == ("unknown key 'bta' for GRPOConfig; did you mean 'beta'? "
                            "(tether.config.format_help(GRPOConfig) lists every key)")
    with pytest.raises(ConfigError, match=r"unknown key 'grpo\.bta' for GRPOConfig; did you mean 'grpo\.beta'\?"):
        load_config(GRPOConfig, None, ["grpo.bta=0.1"])
