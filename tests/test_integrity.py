"""Release integrity: changed files are refused or reported, an unwritable cache costs no prediction, and a killed
release never leaves a broken one behind."""
import errno
import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from cifarkit import CIFAR10Classifier, Classifier, models
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.cli import main
from cifarkit.core.errors import CifarkitError
from cifarkit.data import cifar10
from cifarkit.inference import classifier
from cifarkit.release import build, export


def copy_release(released: Path, tmp_path: Path) -> Path:
    target = tmp_path / "models" / "version_T"
    shutil.copytree(released, target)
    return target


def zero_bytes(path: Path, count: int = 1000) -> None:
    """Zero `count` bytes in the middle of the file: inside the tensor data of a weights file."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + count] = bytes(count)
    path.write_bytes(bytes(raw))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def pixels(cifar_home):
    """16 real test images, N x 32 x 32 x 3 uint8."""
    return cifar10.load().test_x[:16].permute(0, 2, 3, 1).numpy()


@pytest.fixture
def image_file(pixels, tmp_path):
    path = tmp_path / "image.png"
    Image.fromarray(pixels[0]).save(path)
    return path


def test_changed_weights_are_refused_before_loading(released, tmp_path, pixels, monkeypatch):
    target = copy_release(released, tmp_path)
    zero_bytes(target / "model.safetensors")
    loaded = []
    monkeypatch.setattr(classifier, "load_weights", lambda path: loaded.append(path))
    with pytest.raises(CifarkitError) as refused:
        Classifier.load(target)
    message = str(refused.value)
    assert "\n" not in message and str(target / "model.safetensors") in message
    assert sha256(target / "model.safetensors") in message and sha256(released / "model.safetensors") in message
    assert "verify=False" in message and not loaded
    monkeypatch.undo()
    with pytest.raises(CifarkitError, match="records"):  # nor is it exported, and so blessed
        export.export(target, "onnx")
    assert not (target / "model.onnx").exists()
    with pytest.raises(CifarkitError, match="records"):
        CIFAR10Classifier(version="T", root=target.parent)
    # Unverified, the damaged weights load, and answer differently: what the check is there to prevent.
    damaged = Classifier.load(target, backend="torch-fp32", verify=False)
    intact = Classifier.load(released, backend="torch-fp32")
    assert not torch.equal(damaged.logits(pixels), intact.logits(pixels))
    seed_style = CIFAR10Classifier(version="T", root=target.parent, backend="torch-fp32", verify=False)
    assert torch.equal(seed_style.logits(pixels), damaged.logits(pixels))


def test_predict_refuses_changed_weights_unless_told_not_to_verify(released, tmp_path, image_file, capsys):
    target = copy_release(released, tmp_path)
    zero_bytes(target / "model.safetensors")
    assert main(["predict", "--model", str(target), str(image_file)]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert captured.out == "" and len(error.splitlines()) == 1 and error.startswith("cifarkit: error: ")
    assert sha256(target / "model.safetensors") in error and sha256(released / "model.safetensors") in error
    assert "--no-verify" in error
    assert main(["predict", "--model", str(target), "--no-verify", str(image_file)]) == 0
    assert capsys.readouterr().out.startswith(f"{image_file}: ")


@pytest.mark.parametrize("kind", ["release without metrics.json", "run folder", "bare weights file"])
def test_weights_without_metrics_load_unverified_with_a_warning_and_fp32(released, tmp_path, caplog, kind):
    target = copy_release(released, tmp_path)
    (target / "metrics.json").unlink()
    path = {"release without metrics.json": target, "run folder": released.parent.parent / "run",
            "bare weights file": released.parent.parent / "run" / "model.safetensors"}[kind]
    with caplog.at_level(logging.WARNING, logger="cifarkit"):
        classifier = Classifier.load(path)
    assert classifier.backend == "torch-fp32"
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("cifarkit")]
    assert len(warnings) == 1 and "is not verified" in warnings[0] and "model.safetensors" in warnings[0]


def test_check_passes_a_good_release(released, capsys):
    assert main(["release", "--check", str(released)]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = {"metrics.json", "model.safetensors", "config.yaml", "preprocess.py", "MODEL_CARD.md"}
    assert sorted(lines) == sorted(f"ok      {name}" for name in names)


def _replace_model_name(folder: Path) -> None:
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["model"]["name"] = "resnet18"
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


DAMAGE = {
    "weights changed": ("model.safetensors", "changed: sha256",
                        lambda folder: zero_bytes(folder / "model.safetensors")),
    "file missing": ("MODEL_CARD.md", "missing", lambda folder: (folder / "MODEL_CARD.md").unlink()),
    "bytes changed": ("preprocess.py", "changed: sha256",
                      lambda folder: (folder / "preprocess.py").write_text("MEAN = (0.5, 0.5, 0.5)\n")),
    "config names another model": ("config.yaml", "names model 'resnet18', the weights hold 'simplecnn'",
                                   _replace_model_name),
    "metrics unreadable": ("metrics.json", "is unreadable", lambda folder: (folder / "metrics.json").write_text("{")),
    "recorded export missing": ("model.torchscript.pt", "missing", lambda folder: _record_missing_export(folder)),
}


def _record_missing_export(folder: Path) -> None:
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["exports"] = {"torchscript": {"format": "torchscript", "file": "model.torchscript.pt", "sha256": "0" * 64,
                                          "weights_sha256": metrics["weights_sha256"]}}
    (folder / "metrics.json").write_text(json.dumps(metrics))


@pytest.mark.parametrize("damage", DAMAGE)
def test_check_names_each_damaged_file(released, tmp_path, capsys, damage):
    name, problem, harm = DAMAGE[damage]
    target = copy_release(released, tmp_path)
    harm(target)
    assert main(["release", "--check", str(target)]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.out.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error   {name}: ") and problem in errors[0]
    assert len(captured.err.strip().splitlines()) == 1 and "failed the check" in captured.err


def test_check_warns_of_unrecorded_files_without_failing(released, tmp_path, capsys):
    target = copy_release(released, tmp_path)
    (target / "notes.txt").write_text("mine")
    assert main(["release", "--check", str(target)]) == 0
    assert "warning notes.txt: not recorded in metrics.json" in capsys.readouterr().out.splitlines()


def test_check_of_a_release_without_a_manifest_reports_it(released, tmp_path, capsys):
    target = copy_release(released, tmp_path)
    metrics = json.loads((target / "metrics.json").read_text())
    del metrics["files"]
    (target / "metrics.json").write_text(json.dumps(metrics))
    assert main(["release", "--check", str(target)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("error   metrics.json: records no sha256 of the other files")
    assert "ok      model.safetensors" in out and "warning preprocess.py: not recorded in metrics.json" in out
    Classifier.load(target, backend="torch-fp32")  # the weights are still verified, and load


def test_release_command_needs_a_run_and_name_or_check(released, capsys):
    assert main(["release", "--name", "X"]) == 2
    assert "or --check RELEASE" in capsys.readouterr().err
    assert main(["release", str(released), "--check", str(released)]) == 2
    assert "drop RUN_DIR and --name" in capsys.readouterr().err


def test_a_release_onnx_made_from_other_weights_is_refused(released, tmp_path, cifar_home, pixels, capsys):
    target = copy_release(released, tmp_path)
    export.export(target, "onnx")
    fp32 = Classifier.load(target, backend="torch-fp32").logits(pixels)
    recorded = Classifier.load(target, backend="onnxruntime")
    assert (recorded.logits(pixels) - fp32).abs().max().item() < 1e-3
    assert not (cifar_home / "onnx").exists()  # the release's own export ran, not a cached one
    export.write_onnx(models.create("simplecnn").eval(), target / "model.onnx")  # another model's export
    with pytest.raises(CifarkitError) as refused:
        Classifier.load(target, backend="onnxruntime")
    message = str(refused.value)
    assert "\n" not in message and str(target / "model.onnx") in message
    assert f"cifarkit export {target} --format onnx" in message and "delete it" in message
    swapped = Classifier.load(target, backend="onnxruntime", verify=False)
    assert (swapped.logits(pixels) - fp32).abs().max().item() > 1e-2
    assert main(["release", "--check", str(target)]) == 2
    assert "error   model.onnx: changed: sha256" in capsys.readouterr().out


@pytest.fixture
def onnx_reference(released, tmp_path_factory, pixels, monkeypatch):
    """Logits of the onnxruntime backend with a writable cache of its own, to compare the other ways against."""
    with monkeypatch.context() as patch:
        patch.setenv("CIFARKIT_HOME", str(tmp_path_factory.mktemp("writable-home")))
        patch.delenv("CIFARKIT_DATA", raising=False)  # this home's cache, not the real archive
        return Classifier.load(released, backend="onnxruntime").logits(pixels)


def test_a_home_that_cannot_be_created_runs_onnx_from_memory(released, tmp_path, pixels, onnx_reference,
                                                             image_file, caplog, capsys, monkeypatch):
    (tmp_path / "file").write_text("a file where the home's parent folder should be")
    monkeypatch.setenv("CIFARKIT_HOME", str(tmp_path / "file" / "home"))
    monkeypatch.delenv("CIFARKIT_DATA", raising=False)  # this home's cache, not the real archive
    with caplog.at_level(logging.WARNING, logger="cifarkit"):
        classifier = Classifier.load(released, backend="onnxruntime")
    assert any("running it from memory" in r.getMessage() for r in caplog.records)
    assert torch.equal(classifier.logits(pixels), onnx_reference)
    assert main(["predict", "--model", str(released), "--backend", "onnxruntime", "--json", str(image_file)]) == 0
    label = json.loads(capsys.readouterr().out)[0]["label"]
    assert label == classifier.predict_label(image_file)


def test_a_full_disk_runs_onnx_from_memory(released, cifar_home, pixels, onnx_reference, caplog, monkeypatch):
    def full_disk(path, _):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(classifier, "write_bytes", full_disk)
    with caplog.at_level(logging.WARNING, logger="cifarkit"):
        loaded = Classifier.load(released, backend="onnxruntime")
    assert any("No space left on device" in r.getMessage() for r in caplog.records)
    assert torch.equal(loaded.logits(pixels), onnx_reference)
    assert not list((cifar_home / "onnx").glob("*"))


@pytest.mark.parametrize("harm", ["zeroed bytes", "truncated", "unreadable"])
def test_a_damaged_cached_onnx_is_exported_again(released, cifar_home, pixels, caplog, harm):
    first = Classifier.load(released, backend="onnxruntime").logits(pixels)
    [cached] = (cifar_home / "onnx").glob("*.onnx")
    intact = cached.read_bytes()
    if harm == "zeroed bytes":
        zero_bytes(cached)
    elif harm == "truncated":
        cached.write_bytes(intact[:100])
    else:
        cached.unlink()
        cached.mkdir()  # reading it fails with IsADirectoryError
    with caplog.at_level(logging.WARNING, logger="cifarkit"):
        again = Classifier.load(released, backend="onnxruntime").logits(pixels)
    assert any("damaged or unreadable; exporting it again" in r.getMessage() for r in caplog.records)
    assert torch.equal(again, first)
    if harm != "unreadable":  # a folder in the way is not the cache's to delete: that load ran from memory
        assert cached.read_bytes() == intact


# Run in a child process that is killed (os._exit) between the two renames of the fallback replacement, as on a
# system without renameat2: argv is the releases' root and the release to stage in.
KILLED_BETWEEN_RENAMES = """
import os, shutil, sys
from pathlib import Path
from cifarkit.core import files
from cifarkit.release import build

rename = os.rename
def rename_then_die(source, destination):
    rename(source, destination)
    if Path(destination).name.endswith(".replaced"):
        os._exit(9)
os.rename = rename_then_die
build.exchange_paths = lambda a, b: False
root = Path(sys.argv[1])
staged = root / files.temp_name("version_T")
shutil.copytree(sys.argv[2], staged)
build.swap_into_place(staged, root / "version_T")
"""


def test_a_release_killed_between_its_two_renames_is_restored(released, tmp_path, monkeypatch):
    root = tmp_path / "models"
    shutil.copytree(released.parent, root)
    killed = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(root), str(released)])
    assert killed.returncode == 9
    assert not (root / "version_T").exists() and (root / ".version_T.replaced").is_dir()
    assert len(list(root.glob(".version_T.*.tmp"))) == 1  # the staged release of the killed process

    # A load puts the parked release back.
    loaded_root = tmp_path / "loaded"
    shutil.copytree(root, loaded_root)
    Classifier.load(loaded_root / "version_T", backend="torch-fp32")
    loaded = (loaded_root / "version_T" / "model.safetensors").read_bytes()
    assert loaded == (released / "model.safetensors").read_bytes()

    # So does the next release, which then clears the killed one's leftovers and replaces it through the fallback.
    monkeypatch.setenv("CIFARKIT_HOME", str(released.parent.parent / "home"))
    monkeypatch.delenv("CIFARKIT_DATA", raising=False)  # this home's cache, not the real archive
    monkeypatch.setattr(build, "INFERENCE_ROUNDS", 1)
    monkeypatch.setattr(build, "SECONDS_PER_SAMPLE", 0.02)
    monkeypatch.setattr(build, "exchange_paths", lambda a, b: False)
    run = released.parent.parent / "run"
    with pytest.raises(CifarkitError, match="already exists"):
        build.make_release(run, "T", root)
    target = build.make_release(run, "T", root, force=True, keep_onnx=True)
    assert sorted(p.name for p in root.iterdir()) == ["version_T"]
    # Two releases of one run: the same weights file, byte for byte.
    assert (target / "model.safetensors").read_bytes() == (released / "model.safetensors").read_bytes()
    metrics = json.loads((target / "metrics.json").read_text())
    onnx = metrics["exports"]["onnx"]
    assert onnx["sha256"] == sha256(target / "model.onnx") == metrics["files"]["model.onnx"]
    assert onnx["weights_sha256"] == metrics["weights_sha256"]
    assert main(["release", "--check", str(target)]) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "which").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "which").write_text("b")
    assert build.exchange_paths(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "which").read_text() == "b" and (tmp_path / "b" / "which").read_text() == "a"


def test_the_seeds_interface_works_out_of_the_box(cifar_home, pixels):
    folder = SHIPPED / "version_A"
    config = yaml.safe_load((folder / "config.yaml").read_text())
    # The same numbers by another road: the raw tensors into a fresh model, normalization written out in torch. An
    # int8 file holds each filter as int8 with its per-output-channel scales beside it, multiplied back here.
    raw = load_file(folder / "model.safetensors")
    scales = {name.removesuffix(".int8_scale"): raw.pop(name) for name in list(raw) if name.endswith(".int8_scale")}
    assert bool(scales) == (json.loads((folder / "metrics.json").read_text())["weights_dtype"] == "int8")
    for name, scale in scales.items():
        raw[name] = raw[name].float() * scale.reshape(-1, *[1] * (raw[name].ndim - 1))
    model = models.create(config["model"]["name"]).eval()
    model.load_state_dict(raw)
    mean = torch.tensor(config["data"]["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(config["data"]["std"]).view(1, 3, 1, 1)
    x = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 - mean) / std
    with torch.no_grad():
        expected = model(x).softmax(1).numpy()
    seed_style = CIFAR10Classifier()
    assert seed_style.info["release"] == "A"
    # Out of the box it runs the release's default backend, which may compute in bf16 (the release measured its
    # top-1 agreement with fp32 on the test set); through fp32 it must give the other road's numbers.
    exact = CIFAR10Classifier(backend="torch-fp32")
    assert [exact.predict(image) for image in pixels] == expected.argmax(1).tolist()
    np.testing.assert_allclose(exact.predict_proba_batch(pixels), expected, atol=1e-4)
    np.testing.assert_allclose(seed_style.predict_proba_batch(pixels), expected, atol=0.02)


def test_inference_does_not_import_the_training_side():
    # Measured beyond what `import torch` loads: torch.hub itself imports tqdm.
    code = ("import sys, torch; before = set(sys.modules); import cifarkit.inference.classifier; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    added = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert "cifarkit.inference.classifier" in added
    training = {"cifarkit.training", "cifarkit.data", "cifarkit.release", "cifarkit.tools", "tqdm", "tensorboard",
                "torch.utils.tensorboard", "onnxruntime"}
    assert not training & added
