"""`cifarkit release`: versioned, self-describing model folders, measured on this machine.

A release is `<root>/version_<name>/`:
    model.safetensors   weights (metadata: model name, mean, std)
    config.yaml         model, training and data sections
    preprocess.py       standalone (numpy + Pillow) image -> normalized 3 x 32 x 32 input, with this release's mean/std
    metrics.json        every number below, measured by this command on this machine, and the sha256 of every
                        other file (`files`), which `Classifier` and `cifarkit release --check` verify
    MODEL_CARD.md       the same, for people
It is assembled in a hidden temporary folder and swapped into place in one step, so a crash or a kill leaves the old
release or the new one, whole, never a mix. No file in it holds a path of this machine.
"""
from __future__ import annotations

import ctypes
import errno
import inspect
import json
import logging
import os
import re
import shutil
import sys
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import yaml

from cifarkit import models
from cifarkit.artifacts import preprocess, weights
from cifarkit.artifacts.releases import (
    METRICS_NAME,
    NAME_PATTERN,
    ONNX_NAME,
    WEIGHTS_NAME,
    replaced_path,
    restore_replaced,
)
from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import (
    FOLDER_MODE,
    file_digest,
    fsync_folder,
    fsync_tree,
    portable,
    remove_stale_temps,
    temp_name,
    write_json,
    write_text,
)
from cifarkit.data import cifar10
from cifarkit.inference import backends
from cifarkit.inference.backends import BACKENDS
from cifarkit.inference.classifier import Classifier
from cifarkit.release import export
from cifarkit.release.card import model_card
from cifarkit.tools import benchmark
from cifarkit.tools.speedrun import SPEED_RUN_SETTINGS
from cifarkit.training.config import flatten, load_recipe, parse_override, recipe_from_dict, to_dict
from cifarkit.training.engine import evaluate, per_class_accuracy

log = logging.getLogger(__name__)
INFERENCE_ROUNDS = 5  # interleaved rounds per backend and batch size; the median is kept
SECONDS_PER_SAMPLE = 0.5  # several batches of 256 per sample even on 2 cores, so one slow batch is averaged out
# renameat2(2) from <linux/fs.h> and <fcntl.h>: swap two paths in one step
RENAME_EXCHANGE = 2
AT_FDCWD = -100
# Differ between a speedrun's runs, by design, or between them and a `cifarkit train` of the same recipe: a speedrun
# sets SPEED_RUN_SETTINGS on each of its runs, which are released from the speedrun's own folder as often as not.
SET_PER_SPEEDRUN_RUN = ("train.seed", "train.eval_every",
                        *(parse_override(setting)[0] for setting in SPEED_RUN_SETTINGS))


def make_release(run_dir: Path, name: str, root: Path, force: bool = False, weights_dtype: str = "fp32",
                 speedrun: Path | None = None, keep_onnx: bool = False) -> Path:
    run_dir, root = Path(run_dir), Path(root)
    if not NAME_PATTERN.fullmatch(name):
        raise CifarkitError(f"release name {name!r} is not usable in a folder name; use letters, digits, . _ -")
    for needed in ("summary.json", "config.yaml", "model.safetensors"):
        if not (run_dir / needed).is_file():
            raise CifarkitError(f"{run_dir} has no {needed}: give the folder of a finished `cifarkit train` run")
    run_config = yaml.safe_load((run_dir / "config.yaml").read_text())
    spread = speedrun_figures(speedrun, run_config) if speedrun else None  # before anything is measured or written
    target = root / f"version_{name}"
    restore_replaced(target)
    if target.exists() and not force:
        raise CifarkitError(f"{target} already exists; pass --force to replace it, or choose another --name")
    new_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    # What killed releases left: staging folders, and a parked old release whose replacement did finish.
    remove_stale_temps(root, target.name)
    shutil.rmtree(replaced_path(target), ignore_errors=True)
    tmp = root / temp_name(target.name)
    tmp.mkdir()
    try:
        _assemble(tmp, run_dir, run_config, name, weights_dtype, spread, keep_onnx)
        os.chmod(tmp, FOLDER_MODE)
        fsync_tree(tmp)
        swap_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if new_root and not target.exists():  # a failed first release leaves no empty folder behind
            with suppress(OSError):
                root.rmdir()
    return target


def swap_into_place(new: Path, target: Path) -> None:
    """Put the staged release `new` at `target`; the release it replaces, if any, is then at `new`.

    On Linux the two folders trade places in one atomic step, so `target` always holds a whole release. Elsewhere
    two renames do it, the old release parked beside the target between them; a kill there leaves no release at
    `target` but the parked one, which the next release or load moves back (inference.restore_replaced).
    """
    if not os.path.lexists(target):
        os.rename(new, target)
    elif not exchange_paths(new, target):
        parked = replaced_path(target)
        os.rename(target, parked)
        os.rename(new, target)
        os.rename(parked, new)
    fsync_folder(target.parent)


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL):  # a kernel before 3.15, or a file system without the exchange
        return False
    raise OSError(code, os.strerror(code), str(b))


def _assemble(folder: Path, run_dir: Path, run_config: dict, name: str, weights_dtype: str,
              spread: dict | None, keep_onnx: bool) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    model, meta = weights.load_weights(run_dir)
    mean, std = meta["mean"], meta["std"]
    weights_path = folder / WEIGHTS_NAME
    weights.save_weights(weights_path, model, meta["model"], mean, std, weights_dtype=weights_dtype,
                            release=name, recipe=summary["recipe"])
    model, _ = weights.load_weights(weights_path)  # measure what ships: an fp32 model with the stored values
    write_text(folder / "preprocess.py", _standalone_preprocess(mean, std))
    dataset = cifar10.load()
    cpu = torch.device("cpu")
    log.info("measuring test accuracy (%s images, fp32, single view and with TTA)...", f"{len(dataset.test_y):,}")
    plain = evaluate(model, dataset.test_x, dataset.test_y, mean, std, cpu, device.PRECISIONS["fp32"])
    tta = evaluate(model, dataset.test_x, dataset.test_y, mean, std, cpu, device.PRECISIONS["fp32"], tta=True)
    onnx_path = folder / ONNX_NAME
    log.info("exporting the ONNX model for the onnxruntime measurement...")
    export.write_onnx(model, onnx_path)
    inference = _measure_inference(model, mean, std, onnx_path, dataset, plain["predictions"])
    weights_sha = file_digest(weights_path, "sha256")
    metrics = {
        "release": name, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source_run": portable(run_dir), "recipe": summary["recipe"], "model": meta["model"],
        "test_acc": plain["acc"],
        "test_acc_per_class": dict(zip(cifar10.CLASSES, per_class_accuracy(plain["predictions"], dataset.test_y))),
        "test_images": len(dataset.test_y),
        "test_acc_evaluation": "single view, fp32, no TTA: exactly what Classifier.predict computes",
        "test_acc_tta": tta["acc"],
        "speedrun": spread,
        "training": {**{k: summary.get(k) for k in ("wall_time_s", "train_time_s", "device", "precision", "epochs",
                                                     "seed", "test_acc")},
                     **_trained_on(run_config["run"])},
        "params": models.count_params(model), "macs": models.count_macs(model),
        "weights_dtype": weights_dtype, "weights_bytes": weights_path.stat().st_size,
        "inference": inference,
        "torch": str(torch.__version__), "dataset_sha256": dataset.sha256,
        "weights_sha256": weights_sha,
    }
    if keep_onnx:
        metrics["exports"] = {"onnx": export.record("onnx", onnx_path, weights_sha)}
    else:
        onnx_path.unlink()
    config = {
        "model": {"name": meta["model"], "params": metrics["params"], "macs": metrics["macs"],
                  "input": [3, preprocess.SIZE, preprocess.SIZE], "classes": list(cifar10.CLASSES)},
        "training": {"recipe": summary["recipe"], "optim": run_config["optim"], "schedule": run_config["schedule"],
                     "train": run_config["train"], "run": _portable_run(run_config.get("run", {})),
                     **({"distill": run_config["distill"]} if run_config.get("run", {}).get("teacher") else {})},
        "data": {**run_config["data"], "dataset_sha256": dataset.sha256},
    }
    write_text(folder / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    write_text(folder / "MODEL_CARD.md", model_card(metrics, config))
    write_manifest(folder, metrics)


def _trained_on(run: dict) -> dict:
    """The training images, and on a CPU its kind and threads: what the wall time cost, and where."""
    where = {"train_images": run["train_images"]}
    if run.get("device") == "cpu" and "cpu_features" in run:
        where |= {"cpu_kind": device.cpu_kind(run["cpu_features"]), "threads": run["threads"]}
    return where


def _portable_run(run: dict) -> dict:
    """A run's `run` block with its teacher (a release folder, when the run was distilled) as a portable path."""
    teacher = run.get("teacher")
    return {**run, "teacher": {**teacher, "release": portable(teacher["release"])}} if teacher else run


def write_manifest(folder: Path, metrics: dict) -> None:
    """Write `metrics` as the release's metrics.json, with the sha256 of every other file of the release."""
    folder = Path(folder)
    metrics["files"] = {path.name: file_digest(path, "sha256") for path in sorted(folder.iterdir())
                        if path.is_file() and path.name != METRICS_NAME and not path.name.startswith(".")}
    write_json(folder / METRICS_NAME, metrics)


def _standalone_preprocess(mean, std) -> str:
    source = inspect.getsource(preprocess)
    source = re.sub(r"^MEAN = .*$", f"MEAN = {tuple(mean)!r}", source, count=1, flags=re.M)
    return re.sub(r"^STD = .*$", f"STD = {tuple(std)!r}", source, count=1, flags=re.M)


def speedrun_figures(path: Path, run_config: dict) -> dict:
    """n, mean and std across seeds from the speedrun report at `path`, refused unless its runs trained this run's
    resolved recipe: the same recipe and overrides, up to the settings a speedrun gives each of its runs."""
    try:
        report = json.loads(Path(path).read_text())
        theirs = flatten(to_dict(load_recipe(report["recipe"], report.get("overrides", []))))
        acc = report["accuracy"]
        stats = {"n": acc["n"], "mean": acc["mean"], "std": acc["std"], "ci95": acc["ci95"],
                 "wall_time_s_mean": report["wall_time_s"]["mean"]}
    except (ValueError, KeyError, TypeError, CifarkitError) as e:
        raise CifarkitError(f"{path} is not a usable speedrun report ({type(e).__name__}: {e}); give the "
                            f"speedrun.json `cifarkit speedrun` wrote") from None
    ours = flatten(to_dict(recipe_from_dict({k: v for k, v in run_config.items() if k != "run"})))
    differences = [f"{key} {theirs.get(key)!r} there, {ours.get(key)!r} in the run"
                   for key in sorted(theirs.keys() | ours.keys())
                   if key not in SET_PER_SPEEDRUN_RUN and theirs.get(key) != ours.get(key)]
    if differences:
        raise CifarkitError(f"{path} is a speedrun of another recipe than this run's ({'; '.join(differences)}); "
                            f"give the speedrun of the run's recipe and overrides, or drop --speedrun")
    tta = run_config["train"]["tta"]
    return {**stats, "evaluation": "with mirror + 1-pixel-shift TTA, as the recipe evaluates" if tta else
            "single view, no TTA", "file": portable(path)}


def _measure_inference(model, mean, std, onnx_path: Path, dataset, fp32_predictions) -> dict:
    # On the CPU whatever else the machine has: the figures are kept by CPU kind (backends.speed_tables).
    classifiers = {backend: Classifier(model, mean, std, backend=backend, device="cpu", onnx=onnx_path)
                   for backend in BACKENDS}
    pixels = dataset.test_x.permute(0, 2, 3, 1).numpy()
    labels = dataset.test_y.numpy()
    log.info("measuring each backend's test accuracy and top-1 agreement with fp32 (%s images) and inference speed "
             "(%d backends x 2 batch sizes; the median over rounds: %d, of %g s each)...", f"{len(pixels):,}",
             len(classifiers), INFERENCE_ROUNDS, SECONDS_PER_SAMPLE)
    accuracy, agreement = backend_accuracies(classifiers, pixels, labels, fp32_predictions.numpy())
    rows = throughput_rows(classifiers, pixels)
    speed = {(r["backend"], r["batch_size"]): r["images_per_s"] for r in rows}
    inference = {
        "measured_on": device.report(torch.device("cpu")),
        "cpu_kind": backends.cpu_kind(),
        "what": "img/s of Classifier.logits: 32x32 uint8 pixels -> normalization -> logits, median of "
                f"{INFERENCE_ROUNDS} rounds",
        "throughput": rows,
        "top1_agreement_with_fp32": agreement,
        "test_acc_by_backend": accuracy,
        "accuracy_rule": backends.ACCURACY_RULE,
    }
    # What `auto` means on the machine that made the release; every other machine decides for itself.
    choice = backends.choose({"inference": inference})
    return {**inference, "default_backend": choice.backend, "default_backend_reason": choice.reason,
            "images_per_s_batch1": speed[(choice.backend, 1)],
            "images_per_s_batch256": speed[(choice.backend, 256)]}


def backend_accuracies(classifiers: dict, pixels: np.ndarray, labels: np.ndarray,
                       fp32_predictions: np.ndarray | None = None) -> tuple[dict, dict]:
    """(backend -> test accuracy, backend -> top-1 agreement with fp32) over every image; fp32's predictions are
    `fp32_predictions`, or those of the classifiers' torch-fp32 backend."""
    predictions = {backend: np.concatenate([classifier.logits(pixels[i:i + 1000]).argmax(1).numpy()
                                            for i in range(0, len(pixels), 1000)])
                   for backend, classifier in classifiers.items()}
    reference = predictions[backends.REFERENCE] if fp32_predictions is None else fp32_predictions
    return ({b: float((p == labels).mean()) for b, p in predictions.items()},
            {b: float((p == reference).mean()) for b, p in predictions.items()})


def throughput_rows(classifiers: dict, pixels: np.ndarray) -> list[dict]:
    """Each backend's img/s at batch 1 and 256, as a release records them (without the per-round samples)."""
    rows = benchmark.inference_throughput(classifiers, pixels[:256], rounds=INFERENCE_ROUNDS,
                                          seconds_per_sample=SECONDS_PER_SAMPLE)
    return [{k: v for k, v in r.items() if k != "samples"} for r in rows]
