"""Does training actually learn? Real images, real recipe, judged on held-out real test images."""
import json
import os

import pytest

from cifarkit.cli import main
from cifarkit.training import train
from cifarkit.training.config import load_recipe
from conftest import FLOORS

pytestmark = pytest.mark.e2e


# Where the real archive is given (CI on the project's machines), the real-data check below judges learning on 2,500
# real training images and all 10,000 test images, a stronger check of the same loop; this one then adds only time.
@pytest.mark.skipif(bool(os.environ.get("CIFARKIT_DATA")), reason="the real-data check judges learning instead")
def test_cifar10net_learns_on_real_images(cifar_home, tmp_path):
    check = FLOORS["training"]["cifar10net-4-epochs-sample"]
    summary = train.run(load_recipe(check["recipe"], check["overrides"]), out=tmp_path / "run")
    assert summary["test_acc"] >= check["floor"]


@pytest.mark.realdata
@pytest.mark.skipif(not os.environ.get("CIFARKIT_DATA"), reason="CIFARKIT_DATA is not set (CI sets it)")
def test_real_archive_import_and_short_training(tmp_path, monkeypatch, capsys):
    """The real 50,000/10,000 set: import it, train cifar10net on 2,500 images for 2 epochs, test on all 10,000 (once,
    at the end). The commands run in this process: a child's start would cost more than the checks here."""
    monkeypatch.setenv("CIFARKIT_HOME", str(tmp_path / "home"))
    assert main(["data", "import", os.environ["CIFARKIT_DATA"]]) == 0
    capsys.readouterr()
    assert main(["data", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["splits"]["train"]["images"] == 50_000 and info["splits"]["test"]["images"] == 10_000
    out = tmp_path / "run"
    check = FLOORS["training"]["cifar10net-2-epochs-real-2500"]
    overrides = [arg for override in check["overrides"] for arg in ("--set", override)]
    assert main(["train", "--recipe", check["recipe"], *overrides, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_acc"] >= check["floor"]
    assert summary["dataset_sha256"] == info["sha256"]
