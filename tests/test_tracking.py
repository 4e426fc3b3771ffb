"""MLflow tracking for real: a SQLite store in a temporary folder, read back through MlflowClient."""
import json
import logging
import socket
import time

import pytest
from mlflow.tracking import MlflowClient

from cifarkit.cli import main
from cifarkit.training import train
from cifarkit.training.config import load_recipe
from conftest import interrupt_as_epoch_starts

QUICK = ["train.epochs=3", "train.batch_size=100", "data.subset=300", "train.track=mlflow"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # MLflow keeps a SQLite store's artifacts beside the working folder
    return MlflowClient(uri)


def mlflow_run(store, run_folder):
    return store.get_run(json.loads((run_folder / "tracking.json").read_text())["mlflow"]["run_id"])


def test_a_tracked_run_sends_params_metrics_tags_and_files(cifar_home, store, tmp_path):
    started_ms = 1000 * time.time()
    summary = train.run(load_recipe("cifar10net", QUICK), out=tmp_path / "run")
    run = mlflow_run(store, tmp_path / "run")
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.epochs"] == "3" and run.data.params["model.name"] == "cifar10net"
    assert run.data.params["data.mean"] == "[0.4914, 0.4822, 0.4465]"
    tags = run.data.tags
    assert (tags["device"], tags["precision"], tags["dataset_sha256"]) == \
        (summary["device"], summary["precision"], summary["dataset_sha256"])
    assert tags["torch"] == summary["torch"] and len(tags.get("git_commit", "0" * 40)) == 40
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("train_loss", "test_acc", "lr", "images_per_s"):
        history = store.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r[key])) for r in records], key
        assert all(m.timestamp >= started_ms - 1000 for m in history)  # wall-clock times, when the epoch ended
    assert run.data.metrics["final_test_acc"] == pytest.approx(summary["test_acc"])
    files = {a.path for a in store.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "summary.json", "curves.png", "model.safetensors", "train.log"} <= files


def test_a_resumed_run_continues_the_same_mlflow_run(cifar_home, store, tmp_path, monkeypatch):
    real_epoch = interrupt_as_epoch_starts(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train.run(load_recipe("cifar10net", QUICK), out=tmp_path / "run")
    first = mlflow_run(store, tmp_path / "run")
    assert first.info.status == "KILLED"
    assert [m.step for m in store.get_metric_history(first.info.run_id, "train_loss")] == [1, 2]
    monkeypatch.setattr(train, "train_one_epoch", real_epoch)
    train.run(resume=tmp_path / "run")
    resumed = mlflow_run(store, tmp_path / "run")
    assert resumed.info.run_id == first.info.run_id and resumed.info.status == "FINISHED"
    assert [m.step for m in store.get_metric_history(first.info.run_id, "train_loss")] == [1, 2, 3]
    assert len(store.search_runs([first.info.experiment_id])) == 1


def test_an_unreachable_store_warns_once_and_training_goes_on(cifar_home, tmp_path, monkeypatch, caplog):
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with caplog.at_level(logging.WARNING, logger="cifarkit"):
        summary = train.run(load_recipe("cifar10net", QUICK), out=tmp_path / "run")
    assert summary["epochs"] == 3 and (tmp_path / "run" / "model.safetensors").is_file()
    warnings = [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("MLflow tracking failed to start the run")
    assert warnings[0].endswith("training goes on without tracking")


def test_release_registers_a_version_with_an_alias(store, capsys):
    assert main(["release", "--check", "B", "--register", "cifar10-fast", "--alias", "champion"]) == 0
    assert "as version 1 of MLflow model 'cifar10-fast', alias 'champion'" in capsys.readouterr().out
    assert main(["release", "--check", "A", "--register", "cifar10-fast", "--alias", "champion"]) == 0
    version = store.get_model_version_by_alias("cifar10-fast", "champion")
    assert int(version.version) == 2 and version.tags["release"] == "A"
    files = {a.path for a in store.list_artifacts(version.run_id, "release")}
    assert {"release/model.safetensors", "release/metrics.json", "release/MODEL_CARD.md"} <= files


def test_an_alias_needs_a_registered_model(capsys):
    assert main(["release", "--check", "A", "--alias", "champion"]) == 2
    assert "--alias names an alias of the registered model: give --register MODEL too" in capsys.readouterr().err
