"""Figures: training curves, a labelled sample grid, a confusion matrix. Files are written atomically."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window: runs happen on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from cifarkit.files import atomic_path  # noqa: E402


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def curves(records: list[dict], path: Path) -> None:
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split in ("train", "val", "test"):
        points = [(r["epoch"], r[f"{split}_loss"], r[f"{split}_acc"]) for r in records
                  if r.get(f"{split}_loss") is not None]
        if points:
            epochs, losses, accs = zip(*points)
            ax_loss.plot(epochs, losses, marker=".", label=split)
            ax_acc.plot(epochs, [100 * a for a in accs], marker=".", label=split)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="Loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="Accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)


def sample_grid(images: torch.Tensor, labels: torch.Tensor, classes, path: Path, columns: int = 8) -> None:
    """images: N x 3 x 32 x 32 uint8."""
    rows = (len(images) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 1.3, rows * 1.45))
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label in zip(axes.flat, images, labels):
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(classes[int(label)], fontsize=8)
    _save(fig, path)


def confusion(matrix: torch.Tensor, classes, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 6))
    ax.imshow(matrix.numpy(), cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set(xlabel="predicted", ylabel="true", title=title)
    peak = matrix.max().item()
    for i in range(len(classes)):
        for j in range(len(classes)):
            value = matrix[i, j].item()
            ax.text(j, i, value, ha="center", va="center", fontsize=7, color="white" if value > peak / 2 else "black")
    _save(fig, path)


def accuracy_vs_time(runs: list[dict], target: float, path: Path, title: str) -> None:
    """Test accuracy after each epoch against wall-clock minutes, one line per seed; the final (TTA) score is a dot."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        line, = ax.plot([p["elapsed_s"] / 60 for p in run["curve"]], [100 * p["test_acc"] for p in run["curve"]],
                        marker=".", alpha=0.7, label=f"seed {run['seed']}")
        ax.plot(run["wall_time_s"] / 60, 100 * run["test_acc"], "o", color=line.get_color())
    ax.axhline(100 * target, color="black", linestyle="--", linewidth=1, label=f"target {100 * target:.1f}%")
    ax.set(xlabel="wall clock (min)", ylabel="test accuracy (%)", title=title)
    lowest = min([100 * p["test_acc"] for r in runs for p in r["curve"]] + [100 * target])
    ax.set_ylim(max(lowest - 2, 0), 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def release_comparison(releases: list[dict], path: Path) -> None:
    """Test accuracy and batch-256 inference speed of each release, side by side."""
    names = [f"{m['release']}\n{m['model']}" for m in releases]
    fig, (acc_ax, speed_ax) = plt.subplots(1, 2, figsize=(9, 3.8))
    acc_ax.bar(names, [100 * m["test_acc"] for m in releases], color="tab:blue")
    acc_ax.set(ylabel="test accuracy (%)", title="accuracy (single view)")
    acc_ax.set_ylim(min(100 * m["test_acc"] for m in releases) - 5, 100)
    speed_ax.bar(names, [m["inference"]["images_per_s_batch256"] for m in releases], color="tab:orange")
    speed_ax.set(ylabel="img/s", title="inference, batch 256")
    for ax in (acc_ax, speed_ax):
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
