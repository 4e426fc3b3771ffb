"""`cifarkit compare`: releases side by side with the seed's two, as a table, and a chart of the measured ones."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from cifarkit import models
from cifarkit.artifacts.releases import (
    METRICS_NAME,
    known_releases,
    release_dir,
    versions,
)
from cifarkit.core.errors import CifarkitError
from cifarkit.inference import backends
from cifarkit.training import plots

# Seed 000's two ResNet-18 releases as its write-up states them, trained and timed on an RTX 3090: claims, never
# measured here. None where the write-up states no figure. Their parameters and MACs are not claims: they are counted
# from the same architecture, cifarkit's `resnet18`.
SEED_MODEL = "resnet18"
SEED_DEVICE = "RTX 3090"
SEED_CLAIMS = (
    {"release": "A", "recipe": "resnet18-sgd", "test_acc": 0.952, "training_min": 182.0,
     "images_per_s_batch256": None},
    {"release": "B", "recipe": "resnet18-adamw", "test_acc": 0.947, "training_min": None,
     "images_per_s_batch256": 2150.0},
)
NOT_STATED = "not stated"


def holds_releases(path: Path) -> bool:
    """Whether `path` names a folder of version_* releases rather than one release (which has its metrics.json)."""
    return path.is_dir() and not (path / METRICS_NAME).is_file()


def selected_releases(names: list[str] | None) -> list[Path]:
    """The release folders `names` mean, in their order: each a version name, a release folder, or a folder of
    version_* releases (all of them). With none, every release a version name reaches."""
    if not names:
        return list(known_releases().values())
    folders = []
    for name in names:
        path = Path(name)
        if holds_releases(path):
            found = [folder for folder in versions(path).values() if (folder / METRICS_NAME).is_file()]
            if not found:
                raise CifarkitError(f"no releases (version_*/{METRICS_NAME}) under {path}; write one with "
                                    f"`cifarkit release`, or name a release (A, B, or a release folder)")
            folders += found
            continue
        folder = release_dir(name, accepts="a release folder or a folder of version_* releases")
        if not (folder / METRICS_NAME).is_file():
            raise CifarkitError(f"{folder} has no {METRICS_NAME}: it is not a release; write one with "
                                f"`cifarkit release RUN --name V`")
        folders.append(folder)
    return list(dict.fromkeys(folders))


def compare(names: list[str] | None = None, figure: Path | None = None) -> str:
    """The markdown table of the releases `names` select (see `selected_releases`) with the seed's two claimed rows
    under them, and a PNG chart of the measured ones (default: comparison.png here)."""
    folders = selected_releases(names)
    releases = [json.loads((folder / METRICS_NAME).read_text()) for folder in folders]
    lines = ["| version | recipe | model | params | MACs / image | test acc | test acc TTA | seeds (mean +- std) | "
             "training time | img/s batch 1 | img/s batch 256 | inference on | weights |",
             "|---|---|---|---:|---:|---:|---:|---|---|---:|---:|---|---:|"]
    together = _speeds_side_by_side(releases)
    speeds = together or [(m["inference"]["images_per_s_batch1"], m["inference"]["images_per_s_batch256"],
                           f"{_inference_device(m['inference'])}, {m['inference']['default_backend']}")
                          for m in releases]
    for folder, m, (batch_1, batch_256, where) in zip(folders, releases, speeds):
        lines.append(f"| {m['release']} | `{m['recipe']}` | `{m['model']}` | {m['params']:,} | {m['macs']:,} | "
                     f"{100 * m['test_acc']:.2f}% | {100 * m['test_acc_tta']:.2f}% | {_seeds(folder, m)} | "
                     f"{m['training']['wall_time_s'] / 60:.1f} min ({m['training']['device']}) | "
                     f"{batch_1:,.0f} | {batch_256:,.0f} | {where} | {m['weights_bytes'] / 1e6:.1f} MB |")
    lines += _seed_rows()
    plots.release_comparison(releases, figure or Path("comparison.png"))
    timed = ("timed on one CPU kind by one command, `python lab/measure_release_backends.py`, the releases one after "
             "the other" if together is not None and len(releases) > 1 else "timed as each release was made")
    return "\n".join(lines) + (
        f"\n\nseed A and seed B: seed 000's write-up, as it states them for an {SEED_DEVICE} (not measured here; "
        f"{NOT_STATED}: it gives no figure); their params and MACs are counted from the same architecture, "
        f"`{SEED_MODEL}`. cifarkit's rows are measured, their inference with each release's default backend, "
        f"{timed}.")


def _speeds_side_by_side(releases: list[dict]) -> list[tuple[float, float, str]] | None:
    """Each release's img/s at batch 1 and 256 with its default backend, and where, from the CPU kind on which
    `lab/measure_release_backends.py` last timed all of them; None where no kind has them all. A release's own
    figures are taken when it is made, on a shared machine whose speed drifts by the hour: two releases made on
    different days are not compared by them."""
    tables = [m["inference"].get("speed_by_cpu_kind", {}) for m in releases]
    common = set.intersection(*(set(t) for t in tables)) - {"cuda"} if tables else set()
    if not common:
        return None
    kind = max(common, key=lambda k: min(t[k]["measured"] for t in tables))
    speeds = []
    for m, table in zip(releases, tables):
        measured = table[kind]
        backend = backends.choose(m, "cpu", measured["measured_on"]["cpu_features"]).backend
        rows = {r["batch_size"]: r["images_per_s"] for r in measured["throughput"] if r["backend"] == backend}
        if not {1, 256} <= rows.keys():
            return None
        speeds.append((rows[1], rows[256], f"{kind} CPU, {measured['measured_on']['threads']} threads, {backend}"))
    return speeds


def _seeds(folder: Path, metrics: dict) -> str:
    """The spread over the recipe's seeds, and the evaluation it was taken with: a recipe that evaluates with TTA
    (A's) has a spread above the single-view test acc column, and must not read as if it were that column's."""
    spread = metrics["speedrun"]
    if not spread or spread["std"] is None:
        return "n = 1"
    tta = yaml.safe_load((folder / "config.yaml").read_text())["training"]["train"]["tta"]
    return (f"n = {spread['n']}: {100 * spread['mean']:.2f}% +- {100 * spread['std']:.2f}, "
            f"{'TTA' if tta else 'single view'}")


def _inference_device(inference: dict) -> str:
    measured_on = inference["measured_on"]
    if measured_on.get("device") == "cuda" and measured_on.get("gpus"):
        return measured_on["gpus"][0]["name"]
    kind = f"{inference['cpu_kind']} CPU" if "cpu_kind" in inference else "CPU"
    return f"{kind}, {measured_on['threads']} threads"


def _seed_rows() -> list[str]:
    model = models.create(SEED_MODEL)
    params, macs = models.count_params(model), models.count_macs(model)
    rows = []
    for claim in SEED_CLAIMS:
        minutes, speed = claim["training_min"], claim["images_per_s_batch256"]
        training = f"{minutes:.0f} min ({SEED_DEVICE})" if minutes is not None else NOT_STATED
        rows.append(f"| seed {claim['release']} | `{claim['recipe']}` | `{SEED_MODEL}` | {params:,} | {macs:,} | "
                    f"{100 * claim['test_acc']:.1f}% | {NOT_STATED} | {NOT_STATED} | {training} | {NOT_STATED} | "
                    f"{f'{speed:,.0f}' if speed is not None else NOT_STATED} | "
                    f"{SEED_DEVICE if speed is not None else NOT_STATED} | {NOT_STATED} |")
    return rows
