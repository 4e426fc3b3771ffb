"""`cifarkit eval`: test accuracy, per-class accuracy and a confusion matrix for a run folder or a weights file."""
from __future__ import annotations

from pathlib import Path

import torch

from cifarkit import checkpoint, data, plots
from cifarkit.device import pick_device, pick_precision
from cifarkit.engine import confusion_matrix, evaluate, per_class_accuracy


def evaluate_weights(target: Path, tta: bool = False, device: str = "auto", precision: str = "auto",
                     figure: Path | None = None) -> dict:
    target = Path(target)
    model, meta = checkpoint.load_weights(target)
    dev = pick_device(device)
    prec = pick_precision(precision, dev)
    model = model.to(dev).to(memory_format=torch.channels_last)
    dataset = data.load()
    result = evaluate(model, dataset.test_x, dataset.test_y, meta["mean"], meta["std"], dev, prec, tta=tta)
    predictions = result["predictions"]
    matrix = confusion_matrix(predictions, dataset.test_y)
    figure = figure or (target if target.is_dir() else target.parent) / "confusion.png"
    plots.confusion(matrix, data.CLASSES, figure, f"{meta['model']}: test accuracy {100 * result['acc']:.2f}%")
    return {
        "weights": str(target), "model": meta["model"], "tta": tta, "device": str(dev), "precision": prec.name,
        "test_acc": result["acc"], "test_loss": result["loss"], "test_images": len(predictions),
        "per_class_acc": dict(zip(data.CLASSES, per_class_accuracy(predictions, dataset.test_y))),
        "confusion_matrix": matrix.tolist(), "confusion_png": str(figure),
    }
