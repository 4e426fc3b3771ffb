"""`cifarkit compare`: the releases of a folder side by side, as a table and a chart."""
from __future__ import annotations

import json
from pathlib import Path

from cifarkit.artifacts.releases import (
    METRICS_NAME,
    known_releases,
)
from cifarkit.core.errors import CifarkitError
from cifarkit.training import plots


def compare(root: Path | None, figure: Path | None = None) -> str:
    """The side-by-side markdown table of every release under `root`, and a PNG chart (default: beside them). With no
    root, of every release a version name reaches: ./cifar10_models and the shipped ones, as `--model NAME` finds
    them."""
    folders = sorted(Path(root).glob("version_*")) if root else list(known_releases().values())
    releases = [json.loads((folder / METRICS_NAME).read_text()) for folder in folders
                if (folder / METRICS_NAME).is_file()]
    if not releases:
        raise CifarkitError(f"no releases (version_*/metrics.json) under {root}; write one with `cifarkit release`")
    lines = ["| version | recipe | model | params | test acc | test acc TTA | seeds (mean +- std) | training time | "
             "img/s batch 1 | img/s batch 256 | weights |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for m in releases:
        s = m["speedrun"]
        seeds = "n = 1"
        if s and s["std"] is not None:
            seeds = f"n = {s['n']}: {100 * s['mean']:.2f}% +- {100 * s['std']:.2f}"
        inf = m["inference"]
        lines.append(f"| {m['release']} | `{m['recipe']}` | `{m['model']}` | {m['params']:,} | "
                     f"{100 * m['test_acc']:.2f}% | {100 * m['test_acc_tta']:.2f}% | {seeds} | "
                     f"{m['training']['wall_time_s'] / 60:.1f} min ({m['training']['device']}) | "
                     f"{inf['images_per_s_batch1']:,.0f} | {inf['images_per_s_batch256']:,.0f} | "
                     f"{m['weights_bytes'] / 1e6:.1f} MB |")
    plots.release_comparison(releases, figure or Path(root or "") / "comparison.png")
    return "\n".join(lines)
