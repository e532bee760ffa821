"""Experiment trackers (run.log_with: wandb, trackio, mlflow; tether/trackers.py): each one, run for
real in its local / offline mode through a tiny SFT run, holds what metrics.jsonl, config.yaml and
samples.jsonl hold, read back with the tracker's own reader or files; a resumed run continues the
same tracker runs; a tracker that fails is said once and left out while training finishes; a
tracker that is not installed is one line naming its extra before anything loads."""

from __future__ import annotations

import errno
import json
import random
import struct
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from extras import needs
from tether.config import ConfigError, load_config
from tether.errors import UserError
from tether.models import make_tiny_model
from tether.run import RunDir
from tether.trackers import mlflow_name, read_links
from tether.trainers.sft import SFTConfig, train_sft

TIMING = ("time", "step_time", "tokens_per_second")  # differ between two runs of the same numbers


@pytest.fixture(scope="module", autouse=True)
def local_trackers(tmp_path_factory):
    """Every tracker local: wandb offline with its settings and caches in a temporary directory,
    trackio's database there (it reads TRACKIO_DIR once, when first imported: this module is its
    first importer in the suite), mlflow on its default store in the run directory."""
    home = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "TRACKIO_DIR"):
            mp.setenv(var, str(home / var.lower()))
        for var in ("WANDB_API_KEY", "WANDB_PROJECT", "TRACKIO_PROJECT", "MLFLOW_TRACKING_URI",
                    "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracked")
    make_tiny_model(root / "model", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    rng = random.Random(0)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(200):
            digits = "".join(rng.choice("0123456789") for _ in range(3))
            f.write(json.dumps({"prompt": f"Copy {digits}:", "completion": f" {digits}"}) + "\n")
    return root


def _cfg(tiny, runs, **kw):
    base = dict(model=str(tiny / "model"), data=str(tiny / "train.jsonl"), runs_dir=str(runs), name="r",
                batch_size=8, lr=3e-3, log_every=1, device="cpu", progress=False, num_samples=2,
                sample_max_new_tokens=4, max_steps=3, eval_fraction=0.1, eval_every=2,
                tracker_project=f"t{uuid.uuid4().hex[:8]}")  # a trackio project of the test's own
    base.update(kw)
    return SFTConfig(**base)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _metric_rows(run: Path) -> list[dict]:
    """metrics.jsonl as a tracker gets it: the step and the metrics, no wall-clock time, no nulls."""
    return [{k: v for k, v in r.items() if k != "time" and v is not None} for r in _jsonl(run / "metrics.jsonl")]


def _samples_by_step(run: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in _jsonl(run / "samples.jsonl"):
        out.setdefault(r["step"], []).append(r)
    return out


def _table_rows(table: dict) -> list[dict]:
    """W&B's and MLflow's table JSON ({"columns", "data"}) as one dict a row."""
    return [dict(zip(table["columns"], row)) for row in table["data"]]


# -- wandb's offline run: its transaction log (<run>/wandb/offline-run-*/run-<id>.wandb) ----------------

def _wandb_records(path: Path):
    """The records of a .wandb file, decoded with wandb's own protobuf schema. The file is a LevelDB
    log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte
    header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_run(offline_dir: Path) -> dict:
    """{"run": the run record, "config": {key: value}, "history": [{key: value}] in log order}.
    The run's file is written by wandb's service process, which can still hold part of it after
    `finish()` returns (seen on a machine's first wandb run); `wandb.teardown()` waits for the
    service to write everything and stop, as the end of a process does."""
    import wandb
    wandb.teardown()
    (log,) = offline_dir.glob("run-*.wandb")
    out = {"run": None, "config": {}, "history": []}
    for r in _wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            out["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in r.history.item})
    out["config"].pop("_wandb", None)
    return out


@needs("wandb")
def test_wandb_offline_run_holds_the_metrics_config_and_samples(tiny, tmp_path):
    train_sft(_cfg(tiny, tmp_path, log_with="wandb"))
    run = tmp_path / "r"
    record = json.loads((run / "trackers.json").read_text())["wandb"]
    offline = Path(record["link"])
    assert record["mode"] == "offline" and offline.parent == run / "wandb" and offline.is_dir()
    assert offline.name.startswith("offline-run-") and offline.name.endswith(record["id"])  # `wandb sync` it
    assert read_links(run) == {"wandb": str(offline)}  # what a model card cites
    w = _wandb_run(offline)
    assert w["run"].run_id == record["id"] and w["run"].display_name == "r"
    assert w["config"] == yaml.safe_load((run / "config.yaml").read_text())
    history = [{k: v for k, v in h.items() if not k.startswith(("_", "samples/"))} for h in w["history"]]
    assert [h for h in history if len(h) > 1] == _metric_rows(run)  # every row, in order, same values
    tables = {h["step"]: json.loads((offline / "files" / h["samples/path"]).read_text())
              for h in w["history"] if "samples/path" in h}
    assert {step: _table_rows(t) for step, t in tables.items()} == _samples_by_step(run)


@needs("trackio")
def test_trackio_run_holds_the_metrics_config_and_samples(tiny, tmp_path):
    from trackio import SQLiteStorage

    cfg = _cfg(tiny, tmp_path, log_with="trackio")
    train_sft(cfg)
    run, project = tmp_path / "r", cfg.run.tracker_project
    record = json.loads((run / "trackers.json").read_text())["trackio"]
    assert record["project"] == project and record["name"] == "r"
    assert Path(record["link"]) == SQLiteStorage.get_project_db_path(project) and Path(record["link"]).is_file()
    config = SQLiteStorage.get_run_config(project, "r")
    assert {k: v for k, v in config.items() if not k.startswith("_")} == yaml.safe_load((run / "config.yaml").read_text())
    logs = SQLiteStorage.get_logs(project, "r")
    metrics = [{k: v for k, v in r.items() if k != "timestamp"} for r in logs if "samples" not in r]
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(metrics, key=key) == sorted(_metric_rows(run), key=key)
    tables = {r["step"]: r["samples"]["_value"] for r in logs if "samples" in r}
    assert tables == _samples_by_step(run)


@needs("mlflow", "sqlalchemy", "alembic")
def test_mlflow_run_holds_the_metrics_config_and_samples(tiny, tmp_path):
    from mlflow import MlflowClient

    train_sft(_cfg(tiny, tmp_path, log_with="mlflow"))
    run = tmp_path / "r"
    record = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert record["tracking_uri"] == f"sqlite:///{run.resolve() / 'mlflow.db'}"
    assert record["link"].startswith(record["tracking_uri"] + "#/experiments/") and record["link"].endswith(record["id"])
    client = MlflowClient(record["tracking_uri"])
    info = client.get_run(record["id"])
    assert info.info.status == "FINISHED" and info.info.run_name == "r"
    assert info.info.artifact_uri.startswith((run / "mlruns").resolve().as_uri())
    rows = _metric_rows(run)
    for key in {k for r in rows for k in r if k != "step"}:
        history = sorted((m.step, m.value) for m in client.get_metric_history(record["id"], mlflow_name(key)))
        assert history == [(r["step"], r[key]) for r in rows if key in r], key
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert yaml.safe_load(Path(client.download_artifacts(record["id"], "config.yaml")).read_text()) == config
    assert info.data.params["model.path"] == config["model"]["path"] and info.data.params["optim.lr"] == "0.003"
    tables = {step: _table_rows(json.loads(Path(client.download_artifacts(record["id"], f"samples/step-{step}.json")).read_text()))
              for step in _samples_by_step(run)}
    assert tables == _samples_by_step(run)


def test_mlflow_names_spell_what_mlflow_refuses():
    assert mlflow_name("eval/greedy/pass@1") == "eval/greedy/pass_at_1"
    assert mlflow_name("clip_ratio/low_mean") == "clip_ratio/low_mean"
    assert mlflow_name("rewards/exact(answer)") == "rewards/exact_answer_"


@needs("wandb", "trackio", "mlflow", "sqlalchemy")
def test_a_resumed_run_continues_the_same_tracker_runs(tiny, tmp_path):
    from mlflow import MlflowClient
    from trackio import SQLiteStorage

    cfg = _cfg(tiny, tmp_path, log_with=["wandb", "trackio", "mlflow"], max_steps=2, save_every=2,
               eval_every=0, num_samples=0)
    train_sft(cfg)
    run = tmp_path / "r"
    first = json.loads((run / "trackers.json").read_text())
    train_sft(_cfg(tiny, tmp_path, log_with="wandb,trackio,mlflow", max_steps=4, save_every=2, eval_every=0,
                   num_samples=0, resume=True, tracker_project=cfg.run.tracker_project))
    again = json.loads((run / "trackers.json").read_text())
    assert {k: r["id"] for k, r in again.items()} == {k: r["id"] for k, r in first.items()}
    losses = [(r["step"], r["loss"]) for r in _jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    # wandb: a second offline directory of the same run id (`wandb sync` puts both in one run)
    resumed = Path(again["wandb"]["link"])
    assert resumed != Path(first["wandb"]["link"]) and _wandb_run(resumed)["run"].run_id == first["wandb"]["id"]
    assert [(h["step"], h["loss"]) for h in _wandb_run(resumed)["history"] if "loss" in h] == losses[2:]
    # mlflow: the same run holds all four steps
    client = MlflowClient(again["mlflow"]["tracking_uri"])
    assert sorted((m.step, m.value) for m in client.get_metric_history(first["mlflow"]["id"], "loss")) == losses
    # trackio: the same run (its id) holds all four steps
    logs = SQLiteStorage.get_logs(cfg.run.tracker_project, "r", run_id=first["trackio"]["id"])
    assert [(r["step"], r["loss"]) for r in logs if "loss" in r] == losses


@needs("wandb")
def test_a_tracker_that_fails_mid_run_is_said_once_and_training_finishes(tiny, tmp_path, monkeypatch, capsys):
    import wandb.sdk.wandb_run

    train_sft(_cfg(tiny, tmp_path / "plain"))
    calls = []

    def full_disk(self, *args, **kwargs):  # the real run object's log, on a full disk
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", full_disk)
    summary = train_sft(_cfg(tiny, tmp_path / "tracked", log_with="wandb"))
    said = "run.log_with=wandb: log failed (OSError: [Errno 28] No space left on device); wandb is left out"
    assert len(calls) == 1 and [w for w in summary["warnings"] if "log_with" in w] == [
        said + " for the rest of the run (metrics.jsonl has every row)"]
    assert capsys.readouterr().err.count(said) == 1
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(_jsonl(tmp_path / "tracked" / "r" / "metrics.jsonl")) == strip(_jsonl(tmp_path / "plain" / "r" / "metrics.jsonl"))
    assert (tmp_path / "tracked" / "r" / "checkpoints" / "step-3").is_dir()


@needs("mlflow", "sqlalchemy")
def test_a_tracker_that_cannot_start_is_said_once_and_training_finishes(tiny, tmp_path, monkeypatch):
    # a tracking server that is not there (loopback, nothing listening): the real client's own error
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    summary = train_sft(_cfg(tiny, tmp_path, log_with="mlflow", mlflow_uri="http://127.0.0.1:9"))
    (said,) = [w for w in summary["warnings"] if "log_with" in w]
    assert said.startswith("run.log_with=mlflow: start failed (MlflowException: ") and "left out" in said
    assert summary["steps"] == 3 and len([r for r in _jsonl(tmp_path / "r" / "metrics.jsonl") if "loss" in r]) == 3
    assert json.loads((tmp_path / "r" / "trackers.json").read_text()) == {}


@needs("trackio")
def test_a_run_directory_alone_warns_once_with_python_warnings(tmp_path, monkeypatch):
    import trackio.run

    monkeypatch.setattr(trackio.run.Run, "log", lambda self, *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    project = f"t{uuid.uuid4().hex[:8]}"
    run = RunDir(tmp_path / "alone", log_with="trackio", tracker_project=project)
    with pytest.warns(UserWarning) as caught:
        for step in (1, 2, 3):
            run.log(step, {"loss": 1.0 / step})
    run.close()
    from trackio import SQLiteStorage
    assert run.tracker_links() == {"trackio": str(SQLiteStorage.get_project_db_path(project))}
    assert [str(w.message) for w in caught if "log_with" in str(w.message)] == [
        "alone: run.log_with=trackio: log failed (OSError: disk gone); trackio is left out for the rest of "
        "the run (metrics.jsonl has every row)"]
    assert [r["loss"] for r in _jsonl(tmp_path / "alone" / "metrics.jsonl")] == [1.0, 0.5, 1.0 / 3]


@pytest.mark.parametrize("tracker,module", [("wandb", "wandb"), ("trackio", "trackio"), ("mlflow", "mlflow"),
                                            ("mlflow", "sqlalchemy")])
def test_a_tracker_that_is_not_installed_is_one_line_before_anything_loads(tiny, tmp_path, monkeypatch,
                                                                           tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import` fails, as where it is not installed
    with pytest.raises(UserError) as e:
        train_sft(_cfg(tiny, tmp_path, log_with=["tensorboard", tracker]))
    assert str(e.value) == f"run.log_with={tracker} needs the {module} package: pip install 'tether[{tracker}]'"
    assert not (tmp_path / "r").exists()


def test_log_with_takes_a_list_one_name_the_comma_form_or_none(tmp_path):
    def log_with(*overrides):
        return load_config(SFTConfig, overrides=list(overrides)).run.log_with

    assert log_with() == []
    assert log_with("log_with=wandb,tensorboard") == ["wandb", "tensorboard"]
    assert log_with("run.log_with=[trackio, mlflow]") == ["trackio", "mlflow"]
    assert log_with("log_with=none") == [] and log_with("log_with=[]") == []
    assert SFTConfig(log_with="mlflow").run.log_with == ["mlflow"]
    assert SFTConfig(log_with="wandb, trackio,wandb").run.log_with == ["wandb", "trackio"]
    old = tmp_path / "old.yaml"  # a config.yaml written when log_with was one name
    old.write_text("run:\n  log_with: tensorboard\n")
    assert load_config(SFTConfig, str(old)).run.log_with == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"^config key 'run.log_with' must be one of 'none', 'tensorboard', "
                                          r"'wandb', 'trackio', 'mlflow'; got 'comet'$"):
        log_with("log_with=wandb,comet")
    with pytest.raises(ConfigError, match=r"log_with: 'none' cannot be combined with wandb$"):
        log_with("log_with=none,wandb")
    with pytest.raises(UserError, match=r"^run.log_with: unknown tracker 'comet'; choose from tensorboard, "
                                        r"wandb, trackio, mlflow \(or none\)$"):
        RunDir(tmp_path / "x", log_with="comet")
