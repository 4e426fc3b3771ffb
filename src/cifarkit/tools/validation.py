"""`cifarkit validate`: recipe variants trained on a validation split, seed by seed, each read against the first
variant's run on the same seed. The table gives validation accuracy (TTA where the recipe uses it), loss and training
time. The test set is not looked at: the runs log its accuracy, and this table leaves it out, so that choosing a
recipe never reads it.

    cifarkit validate --seeds 0 1 --variant base --variant frozen 'train.group_train_epochs=[5,7]' \
        --runs-dir runs/validation --json results/validation-NAME.json

Each run is a whole `cifarkit train --recipe R --out RUNS_DIR/NAME-sSEED --set data.val_split=N --set train.seed=S
--set KEY=VALUE...` process, one at a time. A folder that already holds a finished run of the same recipe is read,
not trained again, so a sweep can grow over several sittings; one whose recipe differs is refused. Every run's recipe
is checked before the first one trains. The variants take turns in a rotating order, seed by seed, so that a drift
of the machine's speed does not favour one. Run it alone: a run with an epoch much slower than its variant's others
shared the CPU, and its time is left out of the time columns (its accuracy stands, since a seed trains to the same
weights at any speed).

The grid is walked here, not by a sweep library's grid sampler (Optuna's GridSampler with a study in the runs
folder): nothing is optimized, the run folders already record which runs finished and with which recipe (a study
would be a second record that can disagree with them), and the rotating turns are an order that a sampler does not
keep.
"""
from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.tools.speedrun import mean_with_t_interval
from cifarkit.training import train
from cifarkit.training.config import flatten, load_recipe, to_dict
from cifarkit.training.tracking import stamp

log = logging.getLogger(__name__)

# An epoch under this share of its variant's median images/s marks its run as slowed by another job. A clean run's
# epochs stay within a few percent of each other (the first, which trains the whitening bias, is the slowest); a run
# slowed all through, with no clean epoch of its variant to compare with, is not caught.
SLOWED_BELOW = 0.85


def run(recipe: str, variants: list[list[str]], seeds: list[int], val_split: int, runs_dir: Path) -> dict:
    """Every variant (its name, then its KEY=VALUE overrides) trained or read on every seed, and the table of each
    against the first: the report `cifarkit validate` writes, less its command."""
    names = [name for name, *_ in variants]
    for what, given in (("variant names", names), ("seeds", seeds)):
        if len(set(given)) != len(given):
            raise CifarkitError(f"{what} repeat ({', '.join(map(str, given))}); give each once")
    planned = {(name, seed): [f"data.val_split={val_split}", f"train.seed={seed}", *overrides]
               for name, *overrides in variants for seed in seeds}
    expected = {key: _recipe_of(key[0], recipe, overrides) for key, overrides in planned.items()}
    runs = {name: {} for name in names}
    for turn, seed in enumerate(seeds):
        for name, *_ in variants[turn % len(names):] + variants[:turn % len(names)]:
            folder = run_folder(runs_dir / f"{name}-s{seed}", recipe, planned[name, seed], expected[name, seed])
            runs[name][seed] = read_run(folder)
    accuracy = "val_tta_acc" if all(r["val_tta_acc"] is not None for v in runs.values() for r in v.values()) \
        else "val_acc"
    for by_seed in runs.values():
        typical = statistics.median(rate for r in by_seed.values() for rate in r["images_per_s"])
        for r in by_seed.values():
            r["slowed"] = min(r["images_per_s"]) < SLOWED_BELOW * typical
    stamped = stamp()
    report = {
        **stamped,
        # A built-in recipe's values change with the code: this commit (short, as the tables show it) names its runs'.
        "written_at_commit": stamped["source"]["commit"][:7] if stamped["source"] else None,
        "recipe": recipe, "val_split": val_split, "seeds": seeds, "accuracy": accuracy,
        "variants": [_against_first(name, overrides, runs[name], runs[names[0]], accuracy, name == names[0])
                     for name, *overrides in variants],
        "environment": device.report(torch.device("cpu")), "cpu_kind": device.cpu_kind(),
    }
    report["table"] = table(report)
    return report


def _recipe_of(name: str, recipe: str, overrides: list[str]) -> dict:
    try:
        return to_dict(load_recipe(recipe, overrides))
    except CifarkitError as e:
        raise CifarkitError(f"variant {name}: {e}") from None


def run_folder(folder: Path, recipe: str, overrides: list[str], expected: dict) -> Path:
    """`folder` holding the finished run of `recipe` with `overrides` (resolved: `expected`), trained here unless it
    already holds it."""
    if (folder / "summary.json").exists():
        # Read as a recipe, a field added since the run was made reads as its default.
        expected, found = flatten(expected), flatten(to_dict(train.read_recipe(folder)))
        differing = sorted(key for key, value in expected.items() if found.get(key) != value)
        if differing:
            raise CifarkitError(f"{folder} holds a run of another recipe ({', '.join(differing)} differ); give "
                                "another --runs-dir or variant name")
        return folder
    if folder.exists():
        raise CifarkitError(f"{folder} holds an unfinished run; resume it with `cifarkit train --resume {folder}` "
                            "or remove it")
    command = [sys.executable, "-m", "cifarkit", "train", "--recipe", recipe, "--out", str(folder)]
    for override in overrides:
        command += ["--set", override]
    log.info("training %s: %s", folder.name, " ".join(command[3:]))
    try:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"interrupted in the run of {folder.name}; the same command again reads the finished "
                                "runs and says what to do with this one") from None
    if done.returncode:
        raise CifarkitError(f"training {folder.name} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return folder


def read_run(folder: Path) -> dict:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    facts = train.read_run_facts(folder)
    last = records[-1]
    return {
        "val_acc": last["val_acc"], "val_tta_acc": last.get("val_tta_acc"),
        "val_loss": last["val_loss"], "val_tta_loss": last.get("val_tta_loss"),
        "train_time_s": json.loads((folder / "summary.json").read_text())["train_time_s"],
        "epoch_time_s": [r["epoch_time_s"] for r in records],
        "images_per_s": [r["images_per_s"] for r in records],
        "precision": facts["precision"], "allocator": facts["allocator"], "threads": facts["threads"],
    }


def _against_first(name: str, overrides: list[str], seeds: dict, reference: dict, accuracy: str, first: bool) -> dict:
    # The cross-entropy of the same logits. A run's accuracy on 5,000 images has a sampling spread of about a third
    # of a point, as large as the effects in question; the loss counts how sure every answer was, so its seed-by-seed
    # differences are steadier. It ranks variants of the same label smoothing only: more smoothing trains the model
    # to be less sure, which raises this loss whatever the accuracy.
    loss = accuracy.replace("_acc", "_loss")
    clean = [s for s in seeds if not seeds[s]["slowed"]]
    paired = [s for s in clean if not reference[s]["slowed"]]
    difference, interval = mean_with_t_interval([seeds[s][accuracy] - reference[s][accuracy] for s in seeds])
    loss_difference, loss_interval = mean_with_t_interval([seeds[s][loss] - reference[s][loss] for s in seeds])
    return {
        "name": name, "overrides": overrides,
        "mean_accuracy": statistics.mean(r[accuracy] for r in seeds.values()),
        # Seed by seed: the same seed draws the same held-out images, so the pairs share that part of the spread.
        "accuracy_minus_first": difference,
        "accuracy_minus_first_ci95": None if first else interval,
        "mean_loss": statistics.mean(r[loss] for r in seeds.values()),
        "loss_minus_first": loss_difference,
        "loss_minus_first_ci95": None if first else loss_interval,
        # Times of the runs no other job slowed; None where none is left.
        "mean_train_time_s": statistics.mean(seeds[s]["train_time_s"] for s in clean) if clean else None,
        "train_time_over_first": statistics.mean(seeds[s]["train_time_s"] / reference[s]["train_time_s"]
                                                 for s in paired) if paired else None,
        "time_seeds": paired,
        "runs": {str(seed): r for seed, r in seeds.items()},
    }


def with_interval(value: float, interval: list[float] | None, scale: float, digits: int) -> str:
    """`value` x `scale` to `digits` decimals, and its interval where there is one."""
    def shown(x: float) -> str:
        return f"{scale * x:+.{digits}f}"
    return shown(value) if interval is None else f"{shown(value)} ({shown(interval[0])} to {shown(interval[1])})"


def table(report: dict) -> list[str]:
    """The report as Markdown table rows, one per variant."""
    accuracy, first = report["accuracy"], report["variants"][0]["name"]
    loss = accuracy.replace("_acc", "_loss")
    lines = [f"| variant | {accuracy} per seed ({', '.join(map(str, report['seeds']))}) | mean | minus {first} "
             f"(points, 95% t-interval of the seeds' differences) | {loss} minus {first}'s (95% t-interval) | "
             f"training time over {first}'s (seeds neither run of which was slowed) |",
             "|---|---|---:|---:|---:|---:|"]
    for v in report["variants"]:
        per_seed = ", ".join(f"{100 * r[accuracy]:.2f}" for r in v["runs"].values())
        ratio = "-" if v["train_time_over_first"] is None else f"{v['train_time_over_first']:.3f}"
        lines.append(f"| {v['name']} {' '.join(v['overrides'])} | {per_seed} | {100 * v['mean_accuracy']:.2f}% | "
                     f"{with_interval(v['accuracy_minus_first'], v['accuracy_minus_first_ci95'], 100, 2)} | "
                     f"{with_interval(v['loss_minus_first'], v['loss_minus_first_ci95'], 1, 4)} | "
                     f"{ratio} ({', '.join(map(str, v['time_seeds']))}) |")
    return lines
