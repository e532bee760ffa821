"""Experiment trackers beside the run directory's own files (`run.log_with`): Weights & Biases,
trackio and MLflow, one small adapter each with the same four methods — `start(config, resume)`,
`log(step, metrics)`, `log_samples(step, rows)`, `finish()` — and a `link` (where the tracker's
run is: a URL, or a local path / store URI). `run.RunDir` drives them on rank 0.

Each tracker's run gets the metrics under the names metrics.jsonl has (MLflow, whose names allow
no `@`, gets `pass_at_1` for `pass@1`), the resolved config (the dict config.yaml holds) as its
config, and the samples as a table. Its run id and link go to `<run>/trackers.json`, so a resumed
run (`resume=true`) continues the same tracker run, and a model card can cite it (`read_links`).

Where each one writes, with nothing configured:
- wandb: `<run>/wandb/`; offline (as `WANDB_MODE=offline`: `wandb sync <run>/wandb/offline-run-*`
  uploads it later) unless an API key is set (`WANDB_API_KEY` or `wandb login`'s netrc entry) or
  `WANDB_MODE` says otherwise. An online start that fails (no network) falls back to offline.
- trackio: its own local database, `$TRACKIO_DIR/<project>.db` (default
  ~/.cache/huggingface/trackio; trackio reads TRACKIO_DIR once, when it is imported, so a run
  cannot move it); `trackio show --project <project>` shows it.
- mlflow: `run.mlflow_uri`, else `$MLFLOW_TRACKING_URI`, else a SQLite store in the run directory
  (`sqlite:///<run>/mlflow.db`, artifacts in `<run>/mlruns/`; MLflow 3 refuses the plain-file
  store unless told to): `mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db` shows it.

A tracker that is not installed is one line naming its extra before the run starts
(`check_installed`); one that fails later is RunDir's to drop (a tracker never stops training).
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse

from tether.errors import UserError

RECORDS = "trackers.json"  # <run>/trackers.json: {tracker: {"id": ..., "link": ..., ...}}


def _cell(value):
    """A table cell: numbers, strings, booleans and None as they are, anything else as JSON."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _columns(rows: list[dict]) -> list[str]:
    """"step", then every key of `rows` in first-seen order."""
    return ["step", *dict.fromkeys(k for r in rows for k in r if k != "step")]


class WandbTracker:
    """Weights & Biases (`wandb.init(dir=<run>)`); metrics are plotted against tether's `step`
    (`define_metric`), so the steps a resume logs again never clash with W&B's own counter."""

    def __init__(self, run_dir: Path, name: str, project: str | None = None, **_):
        self.run_dir, self.name, self.project = run_dir, name, project
        self.run, self.mode = None, None

    def start(self, config: dict, resume: dict | None) -> dict:
        import wandb
        key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has(
            urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname)
        mode = os.environ.get("WANDB_MODE") or ("online" if key else "offline")
        kwargs = dict(project=self.project or os.environ.get("WANDB_PROJECT") or "tether", name=self.name,
                      dir=str(self.run_dir), config=config, reinit="create_new",
                      **({"id": resume["id"], "resume": "allow"} if resume else {}))
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception:
            if mode != "online" or os.environ.get("WANDB_MODE"):
                raise
            mode = "offline"  # a key but no network: the run is kept for `wandb sync`
            self.run = wandb.init(mode=mode, **kwargs)
        self.mode = mode
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        return {"id": self.run.id, "link": self.link, "mode": mode}

    @property
    def link(self) -> str | None:
        if self.run is None:
            return None
        return self.run.url if self.mode == "online" else str(self.run.settings.sync_dir)

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({**metrics, "step": step})

    def log_samples(self, step: int, rows: list[dict]) -> None:
        import wandb
        columns = _columns(rows)
        data = [[step, *(_cell(r.get(c)) for c in columns[1:])] for r in rows]
        self.run.log({"samples": wandb.Table(columns=columns, data=data), "step": step})

    def finish(self) -> None:
        self.run.finish()


class TrackioTracker:
    """trackio (Hugging Face's local-first tracker): one run named as the run directory in the
    project `run.tracker_project` ($TRACKIO_PROJECT, else "tether"). trackio resumes by name: the
    latest run of that name in the project."""

    def __init__(self, run_dir: Path, name: str, project: str | None = None, **_):
        self.name, self.project = name, project or os.environ.get("TRACKIO_PROJECT") or "tether"
        self.run = None

    def start(self, config: dict, resume: dict | None) -> dict:
        import trackio
        self.run = trackio.init(project=self.project, name=self.name, config=config, embed=False,
                                resume="allow" if resume else "never")
        return {"id": self.run.id, "name": self.run.name, "project": self.project, "link": self.link}

    @property
    def link(self) -> str | None:
        if self.run is None:
            return None
        if self.run.url:  # logging to a Space or a trackio server
            return str(self.run.url)
        from trackio import SQLiteStorage
        return str(SQLiteStorage.get_project_db_path(self.project))

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        import trackio
        columns = _columns(rows)
        table = [{c: _cell(step if c == "step" else r.get(c)) for c in columns} for r in rows]
        self.run.log({"samples": trackio.Table(data=table)}, step=step)

    def finish(self) -> None:
        self.run.finish()


_MLFLOW_NAME = re.compile(r"[^/\w.\- :]")  # what MLflow allows in a metric or param name


def mlflow_name(key: str) -> str:
    """A metric name as MLflow allows it: `@` spelt `_at_` (`eval/greedy/pass_at_1`), any other
    character outside letters, digits, `_ - . / : space` as `_`."""
    return _MLFLOW_NAME.sub("_", key.replace("@", "_at_"))


def _flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class MlflowTracker:
    """MLflow through `MlflowClient` (no global active run): metrics by step, the config as params
    (`section.key`) and as the artifact config.yaml, the samples as a table a step
    (samples/step-<N>.json, MLflow's table format: {"columns", "data"}). Experiment: `run.tracker_project` ($MLFLOW_EXPERIMENT_NAME, else
    "tether")."""

    def __init__(self, run_dir: Path, name: str, project: str | None = None, uri: str | None = None, **_):
        self.run_dir, self.name = run_dir, name
        self.experiment = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tether"
        self.local = not (uri or os.environ.get("MLFLOW_TRACKING_URI"))
        self.uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client, self.run_id, self.experiment_id = None, None, None

    def start(self, config: dict, resume: dict | None) -> dict:
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        self.client = MlflowClient(tracking_uri=self.uri)
        logged = {}
        if resume and resume.get("tracking_uri") == self.uri:
            run = self.client.get_run(resume["id"])
            self.client.update_run(run.info.run_id, status="RUNNING")
            logged = run.data.params
        else:
            experiment = self.client.get_experiment_by_name(self.experiment)
            artifacts = {"artifact_location": (self.run_dir / "mlruns").resolve().as_uri()} if self.local else {}
            experiment_id = experiment.experiment_id if experiment else \
                self.client.create_experiment(self.experiment, **artifacts)
            run = self.client.create_run(experiment_id, run_name=self.name)
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        # a param keeps its first value (MLflow refuses a change): a resume's changed RESUMABLE
        # fields are in the config.yaml artifact, which it writes again
        params = [Param(mlflow_name(k), str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in _flatten(config).items()
                  if mlflow_name(k) not in logged]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        self.client.log_dict(self.run_id, config, "config.yaml")
        return {"id": self.run_id, "link": self.link, "tracking_uri": self.uri}

    @property
    def link(self) -> str | None:
        """The run's page in the MLflow UI of its tracking URI (for a local store: what
        `mlflow ui --backend-store-uri <uri>` shows at that address)."""
        if self.run_id is None:
            return None
        page = f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"{self.uri.rstrip('/')}/{page}" if self.uri.startswith(("http://", "https://")) else f"{self.uri}{page}"

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), float(v), now, step)
                                                    for k, v in metrics.items()])

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)
        table = {c: [_cell(step if c == "step" else r.get(c)) for r in rows] for c in columns}
        self.client.log_table(self.run_id, data=table, artifact_file=f"samples/step-{step}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
        if self.local:  # let go of the SQLite file (MLflow keeps an engine per URI for the process):
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # a later run may replace it
            engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(self.uri, None)
            if engine is not None:
                engine.dispose()


# name -> (adapter, the modules it imports: a missing one is `check_installed`'s error)
TRACKERS = {
    "wandb": (WandbTracker, ("wandb",)),
    "trackio": (TrackioTracker, ("trackio",)),
    "mlflow": (MlflowTracker, ("mlflow", "sqlalchemy", "alembic")),  # the SQLite store needs the last two
}
LOG_WITH = ("tensorboard", *TRACKERS)  # what run.log_with takes (TensorBoard is RunDir's own writer)


def log_targets(log_with) -> list[str]:
    """`run.log_with` as a list of names, from a list, one name, the comma form `wandb,tensorboard`,
    or "none" / [] / None (nothing). An unknown name, or "none" beside a tracker, is a ValueError."""
    if log_with is None:
        return []
    items = log_with.split(",") if isinstance(log_with, str) else list(log_with)
    names = list(dict.fromkeys(str(n).strip() for n in items if str(n).strip()))
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"log_with: 'none' cannot be combined with {', '.join(n for n in names if n != 'none')}")
        return []
    for n in names:
        if n not in LOG_WITH:
            raise ValueError(f"log_with: unknown tracker {n!r}; choose from {', '.join(LOG_WITH)} (or none)")
    return names


def check_installed(names: list[str]) -> None:
    """One line naming the extra for the first tracker of `names` whose package is missing (found,
    not imported: every rank checks, before anything is loaded or written)."""
    for name in names:
        for module in TRACKERS[name][1] if name in TRACKERS else ():
            if importlib.util.find_spec(module) is None:
                raise UserError(f"run.log_with={name} needs the {module} package: pip install 'tether[{name}]'")


def make_tracker(name: str, run_dir: Path, run_name: str, project: str | None = None,
                 mlflow_uri: str | None = None):
    return TRACKERS[name][0](run_dir, run_name, project=project, uri=mlflow_uri)


def read_records(run_dir: str | Path) -> dict:
    """<run>/trackers.json: {tracker: {"id", "link", ...}} ({} when the run has none)."""
    path = Path(run_dir) / RECORDS
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def read_links(run_dir: str | Path) -> dict:
    """{tracker: link} of the trackers a run logged to (a URL, or a local path / store URI)."""
    return {name: r["link"] for name, r in read_records(run_dir).items() if r.get("link")}


def _netrc_has(host: str | None) -> bool:
    """Whether the netrc file (`wandb login` writes ~/.netrc) holds credentials for `host`."""
    if not host:
        return False
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
