"""`cifarkit eval`: test accuracy, per-class accuracy and a confusion matrix for a release, a run folder or a weights
file.

It measures in fp32 by default, as `cifarkit release` records the accuracy and `Classifier.predict` computes it, so
the same weights give the same number everywhere; another precision is asked for by name and printed with it.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from cifarkit.artifacts import weights
from cifarkit.artifacts.releases import METRICS_NAME, release_dir
from cifarkit.core.device import pick_device, pick_precision
from cifarkit.data import cifar10
from cifarkit.training import plots
from cifarkit.training.engine import confusion_matrix, evaluate, per_class_accuracy

log = logging.getLogger(__name__)


def evaluate_weights(target: str | Path, tta: bool = False, device: str = "auto", precision: str = "fp32",
                     figure: Path | None = None) -> dict:
    """`target`: a version name, a release folder, a run folder or a .safetensors file (see inference.release_dir)."""
    target = release_dir(target)
    model, meta = weights.load_weights(target)
    dev = pick_device(device)
    prec = pick_precision(precision, dev)
    model = model.to(dev).to(memory_format=torch.channels_last)
    dataset = cifar10.load()
    log.info("measuring test accuracy (%s images, %s, %s, %s)...", f"{len(dataset.test_y):,}", dev, prec.name,
             "with mirror + 1-pixel-shift TTA" if tta else "single view")
    result = evaluate(model, dataset.test_x, dataset.test_y, meta["mean"], meta["std"], dev, prec, tta=tta)
    predictions = result["predictions"]
    matrix = confusion_matrix(predictions, dataset.test_y)
    figure = figure or _default_figure(target)
    plots.confusion(matrix, cifar10.CLASSES, figure, f"{meta['model']}: test accuracy {100 * result['acc']:.2f}%")
    return {
        "weights": str(target), "model": meta["model"], "tta": tta, "device": str(dev), "precision": prec.name,
        "test_acc": result["acc"], "test_loss": result["loss"], "test_images": len(predictions),
        "per_class_acc": dict(zip(cifar10.CLASSES, per_class_accuracy(predictions, dataset.test_y))),
        "confusion_matrix": matrix.tolist(), "confusion_png": str(figure),
    }


def _default_figure(target: Path) -> Path:
    """confusion.png beside the weights of a run, but never inside a release: every file there is recorded (and a
    shipped one lies inside the package), so it goes to the working folder, named after the release."""
    folder = target if target.is_dir() else target.parent
    if (folder / METRICS_NAME).is_file():
        return Path(f"confusion_{folder.name}.png")
    return folder / "confusion.png"
