"""Experiment tracking: a training run's params, per-epoch metrics, tags and files, sent to MLflow (`train.track:
mlflow`, or `cifarkit train --track mlflow`; install with `pip install "cifarkit[mlflow]"`).

The store is MLflow's own choice: MLFLOW_TRACKING_URI if set, else MLflow's default, `sqlite:///mlflow.db` in the
working folder (its artifacts under ./mlartifacts or ./mlruns, as the MLflow version decides). The experiment is
MLFLOW_EXPERIMENT_NAME, else "cifarkit". The run folder's `tracking.json` names the MLflow run, so `--resume`
continues that run, and the epochs logged so far, so none is logged twice or lost.

Tracking never stops or changes training: the first call that fails (a store that cannot be reached, a full disk)
logs one warning, and the run goes on untracked. HTTP stores get at most 2 retries of 10 s unless the environment
says otherwise, instead of MLflow's several minutes of backoff.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from cifarkit.core.errors import CifarkitError, first_line
from cifarkit.core.files import write_json

log = logging.getLogger("cifarkit")

STATE_NAME = "tracking.json"
ARTIFACTS = ("config.yaml", "summary.json", "curves.png", "model.safetensors", "train.log")
DEFAULT_EXPERIMENT = "cifarkit"


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"epochs": 8}} -> {"train.epochs": "8"}: a recipe as MLflow params."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return flat


def git_source() -> dict | None:
    """The commit of the cifarkit source that runs, and whether the package's files differ from it, when it is a git
    checkout (an installed wheel is not: None)."""
    package = Path(__file__).resolve().parent.parent
    try:
        commit, status = (subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=10)
                          for args in (["rev-parse", "HEAD"], ["status", "--porcelain", "--", "."]))
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode or status.returncode:
        return None
    return {"commit": commit.stdout.strip(), "modified": bool(status.stdout.strip())}


def stamp() -> dict:
    """When a measurement was written, and the cifarkit commit that made it (None outside a git checkout): what
    results/README.md shows beside every file."""
    return {"measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "source": git_source()}


def absolute_uri(uri: str) -> str:
    """A local store's URI with an absolute path, so that `--resume` from another folder finds the same store."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    if "://" not in uri and not uri.startswith("file:"):
        return Path(uri).resolve().as_uri()
    return uri


def require_mlflow(wanted_by: str = "train.track is mlflow"):
    """(the mlflow module, its MlflowClient class), or the one-line error that says how to install them."""
    try:
        import mlflow
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise CifarkitError(f'{wanted_by}, but MLflow is not installed; pip install "cifarkit[mlflow]" '
                            "(or pip install mlflow)") from None
    return mlflow, MlflowClient


def _experiment(client) -> tuple[str, str]:
    """(name, id) of the experiment runs go to: MLFLOW_EXPERIMENT_NAME, else "cifarkit", created if need be."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
    experiment = client.get_experiment_by_name(name)
    return name, experiment.experiment_id if experiment else client.create_experiment(name)


class NoTracker:
    def log_epoch(self, record: dict) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass

    def stop(self, status: str) -> None:
        pass


class MlflowTracker(NoTracker):
    """One MLflow run per cifarkit run folder. Every MLflow call goes through `_safely`."""

    def __init__(self, out: Path, recipe: dict, run_info: dict):
        mlflow, client_class = require_mlflow()
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.out, self.active = out, True
        state_path = out / STATE_NAME
        state = json.loads(state_path.read_text())["mlflow"] if state_path.is_file() else None
        uri = state["tracking_uri"] if state else absolute_uri(mlflow.get_tracking_uri())
        self.client = client_class(tracking_uri=uri)
        self.state = state or {"tracking_uri": uri, "run_id": None, "logged_epochs": 0}
        self._safely("start the run", self._start, recipe, run_info)

    def _start(self, recipe: dict, run_info: dict) -> None:
        if self.state["run_id"] is not None:  # --resume: the same MLflow run goes on
            self.client.update_run(self.state["run_id"], status="RUNNING")
            log.info("MLflow: continuing run %s at %s", self.state["run_id"], self.state["tracking_uri"])
            return
        name, experiment_id = _experiment(self.client)
        tags = {"device": run_info["device"], "precision": run_info["precision"],
                "torch": run_info["versions"]["torch"], "cifarkit": run_info["versions"]["cifarkit"],
                "dataset_sha256": run_info["dataset_sha256"], "run_folder": self.out.name}
        if run_info.get("source"):
            tags["git_commit"] = run_info["source"]["commit"]
        run = self.client.create_run(experiment_id, run_name=self.out.name, tags=tags)
        self.state["run_id"] = run.info.run_id
        from mlflow.entities import Param
        params = [Param(key, value) for key, value in flatten(recipe).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run.info.run_id, params=params[start:start + 100])
        self._save_state()
        log.info("MLflow: run %s in experiment %r at %s", run.info.run_id, name, self.state["tracking_uri"])

    def _save_state(self) -> None:
        write_json(self.out / STATE_NAME, {"mlflow": self.state})

    def _safely(self, what: str, action, *args) -> None:
        if not self.active:
            return
        try:
            action(*args)
        except Exception as e:  # any failure of the store: training matters more than its record
            self.active = False
            log.warning("MLflow tracking failed to %s (%s); training goes on without tracking", what,
                        first_line(e)[:300])

    def log_epoch(self, record: dict) -> None:
        self._safely(f"log epoch {record['epoch']}", self._log_epoch, record)

    def _log_epoch(self, record: dict) -> None:
        from mlflow.entities import Metric
        epoch = record["epoch"]
        if epoch <= self.state["logged_epochs"]:
            return  # logged before the run was stopped and resumed
        stamp = int(1000 * time.time())  # MLflow's timestamps are wall-clock milliseconds
        metrics = [Metric(key, float(value), stamp, epoch) for key, value in record.items()
                   if key != "epoch" and isinstance(value, (int, float))]
        self.client.log_batch(self.state["run_id"], metrics=metrics)
        self.state["logged_epochs"] = epoch
        self._save_state()

    def finish(self, summary: dict) -> None:
        self._safely("log the final results", self._finish, summary)

    def _finish(self, summary: dict) -> None:
        from mlflow.entities import Metric
        run_id = self.state["run_id"]
        finals = {f"final_{key}": summary[key] for key in ("test_acc", "test_loss", "wall_time_s", "train_time_s")}
        stamp = int(1000 * time.time())
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), stamp, summary["epochs"])
                                               for k, v in finals.items()])
        for name in ARTIFACTS:
            if (self.out / name).is_file():
                self.client.log_artifact(run_id, str(self.out / name))
        self.client.set_terminated(run_id, status="FINISHED")

    def stop(self, status: str) -> None:
        """An interrupted (KILLED) or diverged (FAILED) run; `--resume` sets it running again."""
        self._safely("mark the run " + status, lambda: self.client.set_terminated(self.state["run_id"], status=status))


def open_tracker(kind: str | None, out: Path, recipe: dict, run_info: dict) -> NoTracker:
    return MlflowTracker(out, recipe, run_info) if kind == "mlflow" else NoTracker()


def register_release(folder: Path, model_name: str, alias: str | None) -> dict:
    """Log a release folder as the artifacts of an MLflow run and register them as a new version of `model_name`,
    with `alias` pointing at it (MLflow's aliases replace its deprecated stages). Errors are CifarkitErrors."""
    mlflow, client_class = require_mlflow("--register needs MLflow")
    metrics = json.loads((folder / "metrics.json").read_text())
    client = client_class()
    try:
        _, experiment_id = _experiment(client)
        tags = {"release": metrics["release"], "model": metrics["model"], "weights_sha256": metrics["weights_sha256"]}
        run = client.create_run(experiment_id, run_name=f"release {metrics['release']}", tags=tags)
        client.log_artifacts(run.info.run_id, str(folder), artifact_path="release")
        client.set_terminated(run.info.run_id, status="FINISHED")
        if not client.search_registered_models(filter_string=f"name = '{model_name}'"):
            client.create_registered_model(model_name)
        version = client.create_model_version(model_name, f"{run.info.artifact_uri}/release", run_id=run.info.run_id,
                                              tags=tags)
        if alias:
            client.set_registered_model_alias(model_name, alias, version.version)
    except Exception as e:  # the store's own errors, and a store that cannot be reached
        raise CifarkitError(f"the release in {folder} is complete, but registering it in MLflow failed: "
                            f"{first_line(e)}; check MLFLOW_TRACKING_URI, then "
                            f"`cifarkit release --check {folder} --register {model_name}`") from None
    return {"model": model_name, "version": version.version, "alias": alias, "run_id": run.info.run_id,
            "tracking_uri": mlflow.get_tracking_uri()}
