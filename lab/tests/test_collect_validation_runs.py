"""lab/collect_validation_runs.py: two real validation runs on the committed sample are recorded with what each did
differently from the recipe and their validation accuracy, and never with a test accuracy."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "cifar10-mini.safetensors"  # the committed real-data sample

spec = importlib.util.spec_from_file_location("collect_validation_runs", ROOT / "lab" / "collect_validation_runs.py")
collect = importlib.util.module_from_spec(spec)
spec.loader.exec_module(collect)

TINY = ["--subset", "400", "--epochs", "1", "--batch-size", "100", "--set", "data.val_split=100",
        "--set", "train.tta=false"]


def _train(out: Path, *extra: str, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "cifarkit", "train", *TINY, *extra, "--out", str(out)], env=env, check=True,
                   capture_output=True)


def test_runs_are_recorded_by_their_overrides_and_validation_accuracy(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(FIXTURE, home / "cifar10.safetensors")
    env = {**os.environ, "CIFARKIT_HOME": str(home)}
    env.pop("CIFARKIT_DATA", None)
    _train(tmp_path / "base", env=env)
    _train(tmp_path / "smooth", "--set", "train.label_smoothing=0.2", env=env)
    target = tmp_path / "validation.json"
    collect.main([str(tmp_path / "base"), str(tmp_path / "smooth"), "--recipe", "fast", "--json", str(target)])
    result = json.loads(target.read_text())
    base, smooth = result["runs"]
    assert set(smooth["overrides"]) - set(base["overrides"]) == {"train.label_smoothing=0.2"}
    assert "train.tta=false" in base["overrides"] and "data.val_split=100" in base["overrides"]
    assert 0.0 <= base["val_acc"] <= 1.0 and list(base["val_acc_by_epoch"]) == ["1"]
    assert "test_acc" not in json.dumps(result)

    (tmp_path / "smooth" / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train_acc": 0.5}) + "\n")
    with pytest.raises(SystemExit, match="no validation accuracy"):
        collect.main([str(tmp_path / "smooth"), "--recipe", "fast", "--json", str(tmp_path / "other.json")])
    assert not (tmp_path / "other.json").exists()
