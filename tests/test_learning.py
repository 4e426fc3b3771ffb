"""Does training actually learn? Real images, real recipe, judged on held-out real test images."""
import json
import os
import subprocess
import sys

import pytest

from cifarkit import train
from cifarkit.config import load_recipe
from conftest import FLOORS


def test_cifar10net_learns_on_real_images(cifar_home, tmp_path):
    check = FLOORS["training"]["cifar10net-4-epochs-sample"]
    summary = train.run(load_recipe(check["recipe"], check["overrides"]), out=tmp_path / "run")
    assert summary["test_acc"] >= check["floor"]


@pytest.mark.realdata
@pytest.mark.skipif(not os.environ.get("CIFARKIT_DATA"), reason="CIFARKIT_DATA is not set (CI sets it)")
def test_real_archive_import_and_short_training(tmp_path, monkeypatch):
    """The real 50,000/10,000 set: import it, train cifar10net on 5,000 images for 2 epochs, test on all 10,000 (once,
    at the end)."""
    home = tmp_path / "home"
    env = {**os.environ, "CIFARKIT_HOME": str(home)}
    cli = [sys.executable, "-m", "cifarkit"]
    subprocess.run(cli + ["data", "import", os.environ["CIFARKIT_DATA"]], env=env, check=True)
    info = json.loads(subprocess.run(cli + ["data", "info", "--json"], env=env, check=True, capture_output=True,
                                     text=True).stdout)
    assert info["splits"]["train"]["images"] == 50_000 and info["splits"]["test"]["images"] == 10_000
    out = tmp_path / "run"
    check = FLOORS["training"]["cifar10net-2-epochs-real-5000"]
    overrides = [arg for override in check["overrides"] for arg in ("--set", override)]
    subprocess.run(cli + ["train", "--recipe", check["recipe"], *overrides, "--out", str(out)], env=env, check=True,
                   cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_acc"] >= check["floor"]
    assert summary["dataset_sha256"] == info["sha256"]
