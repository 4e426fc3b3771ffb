import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
import yaml
from PIL import Image

from cifarkit import models
from cifarkit.artifacts import weights
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.cli import main
from cifarkit.core.errors import CifarkitError
from cifarkit.data import cifar10
from cifarkit.inference import backends
from cifarkit.inference.backends import BACKENDS
from cifarkit.inference.classifier import Classifier
from cifarkit.release import build, export
from fake_tensorrt import FakeTensorRT


def test_release_folder_holds_what_a_user_needs(released):
    for name in ("model.safetensors", "config.yaml", "preprocess.py", "metrics.json", "MODEL_CARD.md"):
        assert (released / name).is_file(), name
    metrics = json.loads((released / "metrics.json").read_text())
    assert metrics["model"] == "simplecnn" and metrics["params"] == 113_738 and metrics["macs"] > 0
    assert set(metrics["test_acc_per_class"]) == set(cifar10.CLASSES)
    assert metrics["weights_sha256"] == hashlib.sha256((released / "model.safetensors").read_bytes()).hexdigest()
    for key in ("wall_time_s", "device", "seed"):
        assert metrics["training"][key] is not None, key
    # What one run cost, and where: the card says it, with no teacher sentence for a run that had none.
    assert (metrics["training"]["cpu_kind"], metrics["training"]["threads"]) == (backends.cpu_kind(),
                                                                               torch.get_num_threads())
    card = (released / "MODEL_CARD.md").read_text()
    assert f"{torch.get_num_threads()} threads of an {backends.cpu_kind()} CPU" in card
    assert "Distilled" not in card
    inference = metrics["inference"]
    assert {(r["backend"], r["batch_size"]) for r in inference["throughput"]} == {
        (b, bs) for b in ("torch-fp32", "torch-bf16", "onnxruntime") for bs in (1, 256)}
    assert inference["top1_agreement_with_fp32"]["torch-fp32"] == 1.0
    assert set(inference["test_acc_by_backend"]) == set(inference["top1_agreement_with_fp32"]) == set(BACKENDS)
    assert inference["test_acc_by_backend"]["torch-fp32"] == pytest.approx(metrics["test_acc"],
                                                                            abs=2 / metrics["test_images"])
    # the default is what `auto` picks on the machine that made the release, and it says why
    choice = backends.choose(metrics)
    assert (inference["default_backend"], inference["default_backend_reason"]) == (choice.backend, choice.reason)
    assert inference["cpu_kind"] == backends.cpu_kind()
    assert not (released / "model.onnx").exists()  # measured, then dropped: `cifarkit export` writes artifacts
    config = yaml.safe_load((released / "config.yaml").read_text())
    assert {"model", "training", "data"} <= set(config)
    assert config["training"]["recipe"] == "simplecnn" and config["model"]["classes"] == list(cifar10.CLASSES)
    assert not list(released.parent.glob(".version_*"))  # no temporary folder left behind
    shipped = {"model.safetensors", "config.yaml", "preprocess.py", "MODEL_CARD.md"}
    assert metrics["files"] == {name: hashlib.sha256((released / name).read_bytes()).hexdigest() for name in shipped}


def test_release_files_hold_no_path_of_this_machine(released):
    metrics = json.loads((released / "metrics.json").read_text())
    source = Path(metrics["source_run"])
    assert not source.is_absolute() and source.name == "run"
    machine = str(released.parent.parent)
    for name in ("metrics.json", "config.yaml", "MODEL_CARD.md"):
        assert machine not in (released / name).read_text(), name


def test_recorded_accuracy_is_what_the_classifier_scores(released, cifar_home):
    metrics = json.loads((released / "metrics.json").read_text())
    dataset = cifar10.load()
    classifier = Classifier.load(released, backend="torch-fp32")
    predictions = classifier.logits(dataset.test_x.permute(0, 2, 3, 1).numpy()).argmax(1)
    assert (predictions == dataset.test_y).float().mean().item() == pytest.approx(metrics["test_acc"], abs=1e-6)


def test_shipped_preprocess_runs_without_torch_or_cifarkit(released, tmp_path):
    script = (released / "preprocess.py").read_text()
    assert "import torch" not in script and "cifarkit" not in script.split('"""', 2)[2]
    image = tmp_path / "big.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (97, 61, 3), dtype=np.uint8)).save(image)
    # torch is made unimportable: the script must get by with numpy and Pillow.
    code = ("import sys; sys.modules['torch'] = None; from preprocess import preprocess; "
            f"x = preprocess({str(image)!r}); print(x.shape, x.dtype)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=released, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "(3, 32, 32) float32"


def test_an_existing_release_is_kept_unless_forced(released, tmp_path):
    run_dir = released.parent.parent / "run"
    before = (released / "metrics.json").read_bytes()
    with pytest.raises(CifarkitError, match="already exists; pass --force"):
        build.make_release(run_dir, "T", released.parent)
    assert (released / "metrics.json").read_bytes() == before


@pytest.mark.parametrize("weights_dtype, size_ratio", [("fp16", 0.6), ("int8", 0.3)])
def test_force_replaces_a_release_atomically_saying_what_it_measures(released, tmp_path, monkeypatch, capsys,
                                                                     caplog, weights_dtype, size_ratio):
    root = tmp_path / "cifar10_models"
    shutil.copytree(released.parent, root)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CIFARKIT_HOME", str(released.parent.parent / "home"))
    monkeypatch.delenv("CIFARKIT_DATA", raising=False)  # the sample's 500 test images, as the messages say
    monkeypatch.setattr(build, "INFERENCE_ROUNDS", 1)
    monkeypatch.setattr(build, "SECONDS_PER_SAMPLE", 0.02)
    caplog.set_level(logging.INFO, logger="cifarkit")
    exchanges = []
    exchange = build.exchange_paths

    def counted_exchange(a, b):
        exchanges.append(exchange(a, b))
        return exchanges[-1]

    monkeypatch.setattr(build, "exchange_paths", counted_exchange)
    run_dir = released.parent.parent / "run"
    assert main(["release", str(run_dir), "--name", "T", "--force", "--weights-dtype", weights_dtype]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("released cifar10_models/version_T: test accuracy ")
    assert out[1] == ("use it as `cifarkit predict --model T IMAGE`, `cifarkit export T --format onnx` or "
                      "`Classifier.load('T')`")
    assert caplog.messages == [
        "measuring test accuracy (500 images, fp32, single view and with TTA)...",
        "exporting the ONNX model for the onnxruntime measurement...",
        "measuring each backend's test accuracy and top-1 agreement with fp32 (500 images) and inference speed "
        "(3 backends x 2 batch sizes; the median over rounds: 1, of 0.02 s each)..."]
    metrics = json.loads((root / "version_T" / "metrics.json").read_text())
    assert metrics["weights_dtype"] == weights_dtype
    assert metrics["weights_bytes"] < json.loads((released / "metrics.json").read_text())["weights_bytes"] * size_ratio
    assert sorted(p.name for p in root.iterdir()) == ["version_T"]
    assert exchanges == [sys.platform.startswith("linux")]  # one atomic swap where the system has one


def test_int8_weights_round_each_filter_channel_within_half_its_step(released, tmp_path):
    model, meta = weights.load_weights(released)
    path = tmp_path / "int8.safetensors"
    weights.save_weights(path, model, meta["model"], meta["mean"], meta["std"], weights_dtype="int8")
    restored, restored_meta = weights.load_weights(path)
    assert restored_meta["quantized"].startswith("int8")
    original = model.state_dict()
    for name, value in restored.state_dict().items():
        want = original[name]
        assert value.dtype == want.dtype, name
        if want.is_floating_point() and want.ndim >= 2:
            step = want.abs().amax(dim=tuple(range(1, want.ndim)), keepdim=True) / 127
            assert ((value - want).abs() <= step * (0.5 + 1e-4)).all(), name  # half a step, and fp32 rounding
            assert not torch.equal(value, want), name  # really rounded, not stored as it was
        else:  # BatchNorm statistics and shifts, biases, the batch counter: exact
            assert torch.equal(value, want), name
    images = torch.randn(256, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        agreement = (restored(images).argmax(1) == model(images).argmax(1)).float().mean().item()
    assert agreement >= 0.97


def test_release_needs_a_finished_run(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["release", str(tmp_path / "run"), "--name", "X", "--out", str(tmp_path / "models")]) == 2
    assert "has no summary.json" in capsys.readouterr().err
    assert not (tmp_path / "models" / "version_X").exists()
    assert main(["release", str(tmp_path / "run"), "--name", "../evil", "--out", str(tmp_path)]) == 2


def test_compare_prints_a_table_and_draws_a_chart(released, tmp_path, capsys):
    figure = tmp_path / "cmp.png"
    assert main(["compare", str(released.parent), "--figure", str(figure)]) == 0
    out = capsys.readouterr().out
    assert "| T | `simplecnn` | `simplecnn` | 113,738 |" in out
    assert figure.stat().st_size > 0
    # The seed's two releases under it, its claims marked as such, the architecture's size counted.
    resnet18 = models.create("resnet18")
    assert (f"| seed A | `resnet18-sgd` | `resnet18` | {models.count_params(resnet18):,} | "
            f"{models.count_macs(resnet18):,} | 95.2% | not stated |") in out
    assert "| seed B | `resnet18-adamw` |" in out and "| 2,150 | RTX 3090 |" in out
    assert "not measured here" in out
    assert main(["compare", str(tmp_path)]) == 2
    assert "no releases (version_*/metrics.json) under" in capsys.readouterr().err
    assert main(["compare", str(released), "nope"]) == 2
    assert "no weights at nope" in capsys.readouterr().err


def test_compare_says_which_evaluation_each_spread_over_seeds_took(tmp_path, capsys):
    # A's recipe evaluates with TTA and B's with one view: each spread is labelled with its own, from its config.
    assert main(["compare", "A", "B", "--figure", str(tmp_path / "cmp.png")]) == 0
    cells = {line.split(" | ")[0]: line.split(" | ")[7] for line in capsys.readouterr().out.splitlines()
             if line.startswith("| A |") or line.startswith("| B |")}
    for version, label in (("A", "TTA"), ("B", "single view")):
        folder = SHIPPED / f"version_{version}"
        tta = yaml.safe_load((folder / "config.yaml").read_text())["training"]["train"]["tta"]
        assert tta == (label == "TTA")
        spread = json.loads((folder / "metrics.json").read_text())["speedrun"]
        assert cells[f"| {version}"] == (f"n = {spread['n']}: {100 * spread['mean']:.2f}% +- "
                                         f"{100 * spread['std']:.2f}, {label}")


def test_compare_times_releases_side_by_side_where_one_command_timed_them_all(tmp_path, capsys):
    # Each release's own img/s were taken when it was made, on a machine whose speed drifts: where one command timed
    # every release on a CPU kind, those figures are the columns; where one release lacks that kind, its own stand.
    for version in ("A", "B"):
        shutil.copytree(SHIPPED / f"version_{version}", tmp_path / f"version_{version}")
    def speeds(version, batch_1, batch_256, kinds):
        path = tmp_path / f"version_{version}" / "metrics.json"
        metrics = json.loads(path.read_text())
        taken = {"measured_on": {"threads": 2, "cpu_features": ["avx2"]}, "measured": "2026-12-08T00:38:00+00:00",
                 "throughput": [{"backend": "onnxruntime", "batch_size": 1, "images_per_s": batch_1},
                                {"backend": "onnxruntime", "batch_size": 256, "images_per_s": batch_256},
                                {"backend": "torch-fp32", "batch_size": 1, "images_per_s": batch_1 / 2},
                                {"backend": "torch-fp32", "batch_size": 256, "images_per_s": batch_256 / 2}]}
        metrics["inference"]["speed_by_cpu_kind"] = {kind: taken for kind in kinds}
        path.write_text(json.dumps(metrics))
        return metrics["inference"]
    speeds("A", 111.0, 222.0, ["avx2"])
    own_b = speeds("B", 333.0, 444.0, ["avx2"])
    def rows():
        assert main(["compare", str(tmp_path), "--figure", str(tmp_path / "cmp.png")]) == 0
        out = capsys.readouterr().out
        return {line.split(" | ")[0][2:]: line.split(" | ")[9:12] for line in out.splitlines()
                if line.startswith(("| A |", "| B |"))}, out
    cells, out = rows()
    assert cells == {"A": ["111", "222", "avx2 CPU, 2 threads, onnxruntime"],
                     "B": ["333", "444", "avx2 CPU, 2 threads, onnxruntime"]}
    assert "timed on one CPU kind by one command" in out
    speeds("B", 333.0, 444.0, ["avx512_bf16"])
    cells, out = rows()
    assert cells["B"][:2] == [f"{own_b['images_per_s_batch1']:,.0f}", f"{own_b['images_per_s_batch256']:,.0f}"]
    assert "timed as each release was made" in out


@pytest.mark.parametrize("fmt", ["onnx", "exported", "torchscript"])
def test_export_matches_pytorch(released, cifar_home, tmp_path, fmt):
    target = tmp_path / "version_T"
    shutil.copytree(released, target)
    report = export.export(target, fmt)
    artifact = target / export.FILES[fmt]
    assert artifact.is_file()
    assert report["max_abs_logit_diff"] <= 1e-3 and report["top1_agreement"] >= 0.999
    assert report["images"] == 500  # the fixture's whole test split (fewer than 512)
    metrics = json.loads((target / "metrics.json").read_text())
    sha = hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert metrics["exports"][fmt]["file"] == export.FILES[fmt] and metrics["exports"][fmt]["sha256"] == sha
    assert metrics["exports"][fmt]["weights_sha256"] == metrics["weights_sha256"]
    assert metrics["files"][export.FILES[fmt]] == sha
    assert main(["release", "--check", str(target)]) == 0


def test_export_with_out_leaves_the_release_as_it_was(released, cifar_home, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in released.iterdir() if p.is_file()}
    assert main(["export", str(released), "--format", "onnx", "--out", str(tmp_path / "exports")]) == 0
    artifact = tmp_path / "exports" / "model.onnx"
    assert f"wrote {artifact} " in capsys.readouterr().out
    record = json.loads((tmp_path / "exports" / "model.onnx.json").read_text())
    assert record["release"] == "T" and record["sha256"] == hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert record["weights_sha256"] == json.loads(before["metrics.json"])["weights_sha256"]
    assert {p.name: p.read_bytes() for p in released.iterdir() if p.is_file()} == before


@pytest.fixture
def read_only_package():
    """The shipped releases' folder really read-only, through a read-only bind mount over it (an installed package
    owned by another user is so; root is refused only by a read-only mount)."""
    from cifarkit.artifacts.releases import SHIPPED
    mounted = subprocess.run(["mount", "--bind", str(SHIPPED), str(SHIPPED)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root): {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(SHIPPED)], check=True, capture_output=True)
        with pytest.raises(OSError):  # the mount takes effect, or the test proves nothing
            (SHIPPED / "probe").write_bytes(b"")
        yield SHIPPED
    finally:
        subprocess.run(["umount", "-l", str(SHIPPED)], check=False)


def test_a_shipped_release_exports_into_the_current_folder_and_never_into_the_package(read_only_package, cifar_home,
                                                                                      tmp_path, monkeypatch, capsys):
    shipped = read_only_package / "version_B"
    before = {p.name: p.read_bytes() for p in shipped.iterdir() if p.is_file()}
    monkeypatch.chdir(tmp_path)
    assert main(["export", "B", "--format", "onnx"]) == 0
    assert "wrote model.onnx " in capsys.readouterr().out
    record = json.loads((tmp_path / "model.onnx.json").read_text())
    assert record["release"] == "B" and record["weights_sha256"] == json.loads(before["metrics.json"])["weights_sha256"]
    assert record["sha256"] == hashlib.sha256((tmp_path / "model.onnx").read_bytes()).hexdigest()
    assert {p.name: p.read_bytes() for p in shipped.iterdir() if p.is_file()} == before


def test_export_that_fails_parity_writes_nothing(released, cifar_home, tmp_path, monkeypatch, capsys):
    target = tmp_path / "version_T"
    shutil.copytree(released, target)
    monkeypatch.setattr(export, "MAX_ABS_DIFF", -1.0)
    assert main(["export", str(target), "--format", "torchscript"]) == 2
    assert "failed its parity check" in capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in released.iterdir())
    # Into a folder of its own: the folders it would have made are not left behind either.
    assert main(["export", str(target), "--format", "torchscript", "--out", str(tmp_path / "new" / "nested")]) == 2
    assert "failed its parity check" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.fixture
def fake_gpu_with_tensorrt(monkeypatch):
    """A fake `tensorrt` (tests/fake_tensorrt.py: no GPU here, nor TensorRT), whose engine runs on the CPU: the
    export's GPU is the CPU, where the fake reads and writes the buffers it is given."""
    fake = FakeTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(export, "_gpu", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return fake


def test_a_tensorrt_export_is_a_strongly_typed_fp16_engine_checked_like_the_others(released, cifar_home, tmp_path,
                                                                                   fake_gpu_with_tensorrt, capsys):
    target = tmp_path / "version_T"
    shutil.copytree(released, target)
    assert main(["export", str(target), "--format", "tensorrt"]) == 0
    assert "an fp16 engine for the Fake GPU, TensorRT 10.0.0 (fake)" in capsys.readouterr().out
    report = json.loads((target / "metrics.json").read_text())["exports"]["tensorrt"]
    assert report["file"] == "model.plan" and report["batch_size"] == export.TENSORRT_BATCH == 256
    assert report["gpu"] == "Fake GPU" and report["precision"] == "fp16"
    assert 0 < report["max_abs_logit_diff"] <= report["limits"]["max_abs_logit_diff"]
    rule = backends.ACCURACY_RULE["min_top1_agreement"]  # the agreement that admits a half-precision backend
    assert report["top1_agreement"] >= report["limits"]["top1_agreement"] == rule
    calls = fake_gpu_with_tensorrt.calls
    assert ("create_network", 1 << 5) in calls  # strongly typed: the engine computes in the graph's own types
    (built,) = [model for name, model in calls if name == "build"]
    graph = onnx.load_from_string(built).graph  # weights in fp16, fp32 in and out, batch 256
    weights = {t.data_type for t in graph.initializer} - {onnx.TensorProto.INT64}  # less the shapes' constants
    assert weights == {onnx.TensorProto.FLOAT16}
    for tensor, shape in ((graph.input[0], [256, 3, 32, 32]), (graph.output[0], [256, 10])):
        assert tensor.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert [d.dim_value for d in tensor.type.tensor_type.shape.dim] == shape
    assert [size for name, size in calls if name == "execute"] == [256, 256]  # 500 images: the second batch padded
    assert main(["release", "--check", str(target)]) == 0


def test_a_tensorrt_export_needs_a_gpu_and_tensorrt_and_says_so_before_any_work(released, cifar_home, monkeypatch,
                                                                                capsys):
    before = sorted(p.name for p in released.iterdir())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["export", str(released), "--format", "tensorrt"]) == 2
    assert "torch sees no CUDA GPU here; export it on that machine" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, faked, and no TensorRT
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # what an import of a package that is not installed meets
    assert main(["export", str(released), "--format", "tensorrt"]) == 2
    assert capsys.readouterr().err.strip().endswith("pip install tensorrt (on a machine with a CUDA GPU)")
    assert sorted(p.name for p in released.iterdir()) == before


def test_onnx_backend_agrees_with_fp32(released, cifar_home, tmp_path):
    target = tmp_path / "version_T"
    shutil.copytree(released, target)
    export.export(target, "onnx")
    pixels = cifar10.load().test_x[:64].permute(0, 2, 3, 1).numpy()
    fp32 = Classifier.load(target, backend="torch-fp32").logits(pixels)
    onnx = Classifier.load(target, backend="onnxruntime").logits(pixels)
    assert (fp32 - onnx).abs().max().item() < 1e-3


def test_onnxruntime_without_an_exported_file_exports_once_into_the_cache(released, cifar_home, caplog):
    assert not (released / "model.onnx").exists()
    pixels = cifar10.load().test_x[:16].permute(0, 2, 3, 1).numpy()
    caplog.set_level(logging.INFO, logger="cifarkit")
    onnx = Classifier.load(released, backend="onnxruntime").logits(pixels)
    cached = list((cifar_home / "onnx").glob("*.onnx"))
    assert len(cached) == 1
    exporting = f"exporting the ONNX model once into the cache {cifar_home / 'onnx'} (later loads reuse it)..."
    assert caplog.messages == [exporting]  # said while the user waits, and only then
    again = Classifier.load(released, backend="onnxruntime")
    assert caplog.messages == [exporting]
    assert list((cifar_home / "onnx").glob("*.onnx")) == cached
    assert (again.logits(pixels) - onnx).abs().max().item() == 0
    fp32 = Classifier.load(released, backend="torch-fp32").logits(pixels)
    assert (fp32 - onnx).abs().max().item() < 1e-3
