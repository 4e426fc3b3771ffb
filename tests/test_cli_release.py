"""The release side of the `cifarkit` command as a newcomer meets it: one way to name a release in every command and
in the API, a status line before every long step, errors that point the right way, and releases that describe what
was actually done."""
import json
import logging
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import yaml
from PIL import Image

from cifarkit import CIFAR10Classifier, Classifier
from cifarkit.cli import main
from cifarkit.data import cifar10
from cifarkit.release import build
from cifarkit.release.card import model_card


@pytest.fixture
def workdir(released, cifar_home, tmp_path, monkeypatch):
    """A working folder whose ./cifar10_models holds a copy of the session's release T, as `cifarkit release RUN
    --name T` would have left it."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(released, tmp_path / "cifar10_models" / "version_T")
    return tmp_path


@pytest.fixture
def image(cifar_home, tmp_path):
    path = tmp_path / "image.png"
    Image.fromarray(cifar10.load().test_x[0].permute(1, 2, 0).numpy()).save(path)
    return path


@pytest.fixture
def run_dir(released):
    return released.parent.parent / "run"


def error_line(capsys) -> str:
    """The command's one stderr line, without its `cifarkit: error: ` prefix."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cifarkit: error: "), err
    return err[0].removeprefix("cifarkit: error: ")


def speedrun_report(path, overrides):
    """A speedrun.json as `cifarkit speedrun` writes it (the fields a release reads), of the simplecnn recipe."""
    path.write_text(json.dumps({"recipe": "simplecnn", "overrides": overrides,
                                "accuracy": {"n": 2, "mean": 0.31, "std": 0.01, "ci95": [0.22, 0.40]},
                                "wall_time_s": {"mean": 5.0, "max": 5.5, "min": 4.5}}))
    return path


def test_a_version_name_means_the_same_release_everywhere(workdir, image, capsys, caplog):
    caplog.set_level(logging.INFO, logger="cifarkit")
    assert main(["predict", "--model", "T", str(image)]) == 0
    assert capsys.readouterr().out.startswith(f"{image}: ")
    assert main(["release", "--check", "T"]) == 0
    capsys.readouterr()
    assert Classifier.load("T", backend="torch-fp32").info["release"] == "T"
    assert CIFAR10Classifier(version="T", backend="torch-fp32").info["release"] == "T"
    # The seed's call from the README, on a ./cifar10_models without its version: the shipped one, said so.
    assert CIFAR10Classifier(version="A", root="cifar10_models", backend="torch-fp32").info["release"] == "A"
    assert "version A: the shipped release" in caplog.messages
    assert main(["compare", "--figure", "cmp.png"]) == 0
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows == ["| version", "| A", "| B", "| T", "| seed A", "| seed B"]
    assert main(["compare", "T", "A"]) == 0  # by name, in the order named
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows == ["| version", "| T", "| A", "| seed A", "| seed B"]
    # A release of the user's under a shipped name is the one every command then uses.
    shutil.copytree(workdir / "cifar10_models" / "version_T", workdir / "cifar10_models" / "version_A")
    assert Classifier.load("A", backend="torch-fp32").info["model"] == "simplecnn"
    assert "version A: cifar10_models/version_A" in caplog.messages


@pytest.mark.parametrize("command", [
    ["predict", "--model", "nope", "image.png"], ["eval", "nope"], ["export", "nope", "--format", "onnx"],
    ["release", "--check", "nope"]])
def test_an_unknown_name_says_where_it_looked_and_what_exists(workdir, capsys, command):
    assert main(command) == 2
    message = error_line(capsys)
    assert message.startswith("no weights at nope, cifar10_models/version_nope or the shipped version_nope; give a "
                              "version name (found: T (in cifar10_models); A, B (shipped)) or a release folder")
    # Only the commands that take bare weights suggest them.
    assert (".safetensors" in message) == (command[0] in ("predict", "eval"))


@pytest.mark.parametrize("weights", [True, False], ids=["weights file", "run folder"])
def test_export_takes_only_a_release(run_dir, capsys, weights):
    target = run_dir / "model.safetensors" if weights else run_dir
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["export", str(target), "--format", "onnx"]) == 2
    assert error_line(capsys) == (f"{target} is not a release folder (no metrics.json); make one with `cifarkit "
                                  f"release RUN_DIR --name NAME` and export that")
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_torchscript_export_is_announced_and_its_deprecation_said_once(workdir, capsys, caplog):
    caplog.set_level(logging.INFO, logger="cifarkit")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["export", "T", "--format", "torchscript"]) == 0
    assert capsys.readouterr().out.startswith("wrote cifar10_models/version_T/model.torchscript.pt ")
    assert not [w for w in seen if "torch.jit" in str(w.message)]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"TorchScript is deprecated in the installed torch {torch.__version__}; prefer --format exported "
        f"(torch.export)"]
    assert "exporting cifar10_models/version_T as torchscript and checking it against PyTorch on 500 test " \
           "images..." in caplog.messages


def test_eval_reports_the_number_the_release_records_in_fp32(workdir, capsys, caplog):
    caplog.set_level(logging.INFO, logger="cifarkit")
    recorded = json.loads((workdir / "cifar10_models" / "version_T" / "metrics.json").read_text())["test_acc"]
    assert main(["eval", "T", "--device", "cpu"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("simplecnn on 500 test images (cpu, fp32): ")
    assert f"accuracy {100 * recorded:.2f}%" in line
    # The confusion matrix stays out of the release, whose every file is recorded.
    assert (workdir / "confusion_version_T.png").is_file()
    assert main(["release", "--check", "T"]) == 0
    capsys.readouterr()
    # TTA and another precision are said in both lines. Apart: on a CPU without native bf16 (AVX2) six views in
    # emulated bf16 would cost this test most of its time.
    assert main(["eval", "T", "--device", "cpu", "--tta"]) == 0
    assert capsys.readouterr().out.startswith("simplecnn on 500 test images (cpu, fp32, TTA): ")
    assert "measuring test accuracy (500 images, cpu, fp32, with mirror + 1-pixel-shift TTA)..." in caplog.messages
    assert main(["eval", "T", "--device", "cpu", "--precision", "bf16"]) == 0
    assert capsys.readouterr().out.startswith("simplecnn on 500 test images (cpu, bf16): ")
    assert "measuring test accuracy (500 images, cpu, bf16, single view)..." in caplog.messages


def test_a_speedrun_of_other_settings_is_refused_before_anything_is_measured(run_dir, tmp_path, monkeypatch,
                                                                               capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(build.cifar10, "load", lambda: pytest.fail("measuring began"))
    other = speedrun_report(tmp_path / "speedrun.json", ["train.epochs=2", "data.subset=500"])
    assert main(["release", str(run_dir), "--name", "C", "--speedrun", str(other)]) == 2
    assert error_line(capsys) == (f"{other} is a speedrun of another recipe than this run's (train.epochs 2 there, "
                                  f"1 in the run); give the speedrun of the run's recipe and overrides, or drop "
                                  f"--speedrun")
    other.write_text("{not json")
    assert main(["release", str(run_dir), "--name", "C", "--speedrun", str(other)]) == 2
    assert error_line(capsys).startswith(f"{other} is not a usable speedrun report (JSONDecodeError: ")
    assert not (tmp_path / "cifar10_models").exists()


def test_a_release_that_fails_leaves_no_folder(run_dir, empty_home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CIFARKIT_DATA", str(tmp_path / "missing.tar.gz"))
    assert main(["release", str(run_dir), "--name", "C", "--out", str(tmp_path / "models")]) == 2
    assert "CIFARKIT_DATA" in error_line(capsys)
    assert not (tmp_path / "models").exists()


def test_a_release_card_says_what_the_run_and_its_speedrun_did(released, run_dir, tmp_path):
    train_images = yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["train_images"]
    card = (released / "MODEL_CARD.md").read_text()
    assert f"Data: {train_images:,} images (a class-balanced subset) of the CIFAR-10 training set" in card
    metrics = json.loads((released / "metrics.json").read_text())
    config = yaml.safe_load((released / "config.yaml").read_text())
    run_config = yaml.safe_load((run_dir / "config.yaml").read_text())
    # A speedrun gives each of its runs its own seed and evaluation interval, and no checkpoints: those may differ
    # from the run's, whether it is one of the speedrun's runs (no checkpoints) or a `cifarkit train` of its recipe.
    overrides = ["train.epochs=1", "data.subset=500", "train.seed=4", "train.eval_every=2"]
    run_config["train"]["checkpoints"] = False
    for tta, evaluation in ((False, "single view, no TTA"),
                            (True, "with mirror + 1-pixel-shift TTA, as the recipe evaluates")):
        run_config["train"]["tta"] = tta
        report = speedrun_report(tmp_path / "speedrun.json", overrides + [f"train.tta={tta}"])
        spread = build.speedrun_figures(report, run_config)
        card = model_card({**metrics, "speedrun": spread}, config)
        assert f"Over 2 seeds of the same recipe ({evaluation}): mean 31.00%, std 1.00." in card


def test_status_lines_go_to_stderr(released, cifar_home, tmp_path):
    # A process of its own: in-process, pytest's log capture stands where the command's stderr handler would be.
    done = subprocess.run([sys.executable, "-m", "cifarkit", "eval", str(released), "--tta", "--device", "cpu"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    status = " INFO measuring test accuracy (500 images, cpu, fp32, with mirror + 1-pixel-shift TTA)..."
    assert [line for line in done.stderr.splitlines() if line.endswith(status)], done.stderr
    assert done.stdout.startswith("simplecnn on 500 test images (cpu, fp32, TTA): accuracy ")
