"""Figures: training curves, a labelled sample grid, a confusion matrix, speed-run, release and tuning charts.

Each function writes its file atomically, in the format its suffix names (FORMATS), and returns the figure, which
pyplot never holds, so its axes can be inspected.
"""
from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path

import torch

# Figures built without pyplot need no backend and open no window (runs happen on servers and in CI), and leave the
# user's own backend alone: a notebook that imports cifarkit keeps its inline pictures.
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import atomic_path

FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".pdf": "pdf", ".svg": "svg"}  # suffix -> matplotlib's


def figure_format(path: Path) -> str:
    """The format a figure file's suffix names; a CifarkitError for any other suffix, which would otherwise get a
    file whose contents do not match its name."""
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise CifarkitError(f"cannot write a figure to {path}: name a file ending in {', '.join(FORMATS)}")
    return fmt


def _save(fig: Figure, path: Path) -> Figure:
    fmt = figure_format(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, dpi=110, bbox_inches="tight")
    return fig


def _subplots(*grid: int, figsize: tuple[float, float], squeeze: bool = True):
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*grid, squeeze=squeeze)


def curves(records: list[dict], path: Path) -> Figure:
    fig, (ax_loss, ax_acc) = _subplots(1, 2, figsize=(10, 4))
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
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole: no tick at epoch 1.5
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def sample_grid(images: torch.Tensor, labels: torch.Tensor, classes, path: Path, columns: int = 8) -> Figure:
    """images: N x 3 x 32 x 32 uint8."""
    rows = (len(images) + columns - 1) // columns
    fig, axes = _subplots(rows, columns, figsize=(columns * 1.3, rows * 1.45))
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label in zip(axes.flat, images, labels):
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(classes[int(label)], fontsize=8)
    return _save(fig, path)


def confusion(matrix: torch.Tensor, classes, path: Path, title: str) -> Figure:
    fig, ax = _subplots(figsize=(7, 6))
    ax.imshow(matrix.numpy(), cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set(xlabel="predicted", ylabel="true", title=title)
    peak = matrix.max().item()
    for i in range(len(classes)):
        for j in range(len(classes)):
            value = matrix[i, j].item()
            ax.text(j, i, value, ha="center", va="center", fontsize=7, color="white" if value > peak / 2 else "black")
    return _save(fig, path)


def accuracy_vs_time(runs: list[dict], target: float, path: Path, title: str, overrides=(),
                     final_tta: bool = False) -> Figure:
    """Test accuracy after each epoch against wall-clock minutes, one line per seed, and each run's final score as
    a dot. With `final_tta` the last epoch's evaluation is the final one, with TTA (train.py): it is drawn as the dot
    only, joined by a dotted step, because that step adds TTA to an epoch's learning and is not like the single-view
    steps before it. `overrides`, the --set values the runs shared, are printed under the title."""
    fig, ax = _subplots(figsize=(7, 4.5))
    for run in runs:
        single_view = run["curve"][:-1] if final_tta else run["curve"]
        minutes = [p["elapsed_s"] / 60 for p in single_view]
        accuracies = [100 * p["test_acc"] for p in single_view]
        line, = ax.plot(minutes, accuracies, marker=".", alpha=0.7, label=f"seed {run['seed']}")
        final = (run["wall_time_s"] / 60, 100 * run["test_acc"])
        if single_view:
            ax.plot([minutes[-1], final[0]], [accuracies[-1], final[1]], ":", color=line.get_color(), alpha=0.7)
        ax.plot(*final, "o", color=line.get_color())
    final_label = "final score, with TTA (mirror + 1-pixel shifts)" if final_tta else "final score (single view)"
    marker = Line2D([], [], marker="o", linestyle="none", color="dimgray", label=final_label)
    ax.axhline(100 * target, color="black", linestyle="--", linewidth=1, label=f"target {100 * target:.1f}%")
    setting = textwrap.fill("--set " + " ".join(overrides), 90) if overrides else "no overrides"
    ax.set(xlabel="wall clock (min)", ylabel="test accuracy (%), single view per epoch", title=f"{title}\n{setting}")
    ax.set_xlim(left=0)
    lowest = min([100 * p["test_acc"] for r in runs for p in r["curve"]] + [100 * target])
    ax.set_ylim(max(lowest - 2, 0), 100)
    ax.grid(alpha=0.3)
    ax.legend(handles=[*ax.get_legend_handles_labels()[0], marker], fontsize=8)
    return _save(fig, path)


def release_comparison(releases: list[dict], path: Path) -> Figure:
    """Test accuracy and batch-256 inference speed of each release, side by side, each bar labelled with its value.
    The accuracy axis starts at 0: a one-point gap looks like one point."""
    names = [f"{m['release']}\n{m['model']}" for m in releases]
    accuracies = [100 * m["test_acc"] for m in releases]
    speeds = [m["inference"]["images_per_s_batch256"] for m in releases]
    fig, (acc_ax, speed_ax) = _subplots(1, 2, figsize=(9, 3.8))
    acc_ax.bar_label(acc_ax.bar(names, accuracies, color="tab:blue"), [f"{a:.2f}%" for a in accuracies], padding=2)
    # 0 to 100 in ticks; the axis runs a little past 100 so a label on a bar near the top stays inside the frame
    acc_ax.set(ylabel="test accuracy (%)", title="accuracy (single view)", ylim=(0, 108), yticks=range(0, 101, 20))
    speed_ax.bar_label(speed_ax.bar(names, speeds, color="tab:orange"), [f"{v:,.0f}" for v in speeds], padding=2)
    speed_ax.set(ylabel="img/s", title="inference, batch 256")
    speed_ax.set_ylim(0, 1.12 * max(speeds))  # headroom for the tallest bar's label
    for ax in (acc_ax, speed_ax):
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def device_speedups(report: dict, path: Path) -> Figure:
    """Training speed-up over the CPU in fp32 of each model on each device and mode (`cifarkit bench --devices`),
    models side by side, on a log axis: a 40x GPU and a 2x bf16 CPU both stay readable."""
    names = list(dict.fromkeys(r["model"] for r in report["rows"]))
    series: dict[str, dict] = {}  # label -> {model: row}; CUDA's rows with the autotuning off are a series apart
    for r in report["rows"]:
        off = ", cuDNN autotuning off" if r.get("cudnn_benchmark") is False else ""
        series.setdefault(f"{r['device']} {r['mode']}{off}", {})[r["model"]] = r
    width = 0.8 / len(series)
    fig, ax = _subplots(figsize=(max(6.0, 1.4 * len(names) * len(series) ** 0.5), 4))
    for i, (label, rows) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, name in enumerate(names) if name in rows]
        values = [rows[name]["speedup_vs_cpu_fp32"] for name in names if name in rows]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, [f"{v:.1f}x" for v in values], padding=2, fontsize=7)
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(FuncFormatter(lambda value, _: f"{value:g}x"))  # 2x, 3x, 10x rather than 2 x 10^0
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="training img/s / CPU fp32", title=f"training speed-up over the CPU in fp32 (batch "
                                                      f"{report['batch_size']})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3, which="both")
    return _save(fig, path)


def tune_history(trials: list[dict], searched: dict[str, bool], path: Path) -> Figure:
    """A tuning study (`cifarkit tune`): each complete trial's mean validation accuracy by trial number, with the best
    so far, then one panel per searched key (`searched`: key -> drawn on a log axis) with that accuracy against its
    value. Pruned and failed trials have no mean and are left out."""
    scored = [t for t in trials if t["mean"] is not None]
    fig, axes = _subplots(1, 1 + len(searched), figsize=(4.5 * (1 + len(searched)), 4), squeeze=False)
    history, *panels = axes[0]
    numbers, means = [t["number"] for t in scored], [100 * t["mean"] for t in scored]
    history.plot(numbers, means, "o", label="trial")
    history.step(numbers, list(itertools.accumulate(means, max)), where="post", label="best so far")
    history.set(xlabel="trial", ylabel="mean validation accuracy (%)", title="history")
    history.xaxis.set_major_locator(MaxNLocator(integer=True))
    history.legend(fontsize=8)
    for ax, (key, log) in zip(panels, searched.items()):
        values = [t["params"][key] for t in scored]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            ax.plot(values, means, "o")
            if log:
                ax.set_xscale("log")
                ax.tick_params(axis="x", which="minor", labelbottom=False)  # 2x10^-4, 3x10^-4, ... would overlap
        else:  # choices that are not numbers: one column each, in the order first met, written as --set takes them
            shown = [v if isinstance(v, str) else json.dumps(v) for v in values]
            labels = list(dict.fromkeys(shown))
            ax.plot([labels.index(v) for v in shown], means, "o")
            ax.set_xticks(range(len(labels)), labels)
        ax.set(xlabel="value", title=key)
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    return _save(fig, path)
