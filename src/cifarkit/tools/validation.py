"""Recipe variants trained on a validation split, seed by seed: their validation accuracy (TTA where the recipe uses
it) and training time, each against the first variant's run on the same seed. The test set is not looked at: the
runs log its accuracy, and this table leaves it out, so that choosing a recipe never reads it.

    python lab/validation_runs.py --seeds 0 1 --variant base --variant frozen train.group_train_epochs=[5,7] \
        --runs-dir runs/validation --json results/validation-NAME.json

Each run is a whole `cifarkit train --recipe R --set data.val_split=N --seed S --set KEY=VALUE...` process, one at a
time, into RUNS_DIR/NAME-sSEED. A folder that already holds a finished run of the same recipe is read, not trained
again, so a sweep can grow over several sittings; one whose recipe differs is refused. The variants take turns
in a rotating order, seed by seed, so that a drift of the machine's speed does not favour one. Run it alone: a run
with an epoch much slower than its variant's others shared the CPU, and its time is left out of the time columns
(its accuracy stands, since a seed trains to the same weights at any speed).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import portable, write_json
from cifarkit.inference import backends
from cifarkit.tools.speedrun import mean_with_t_interval
from cifarkit.training import train
from cifarkit.training.config import flatten, load_recipe, to_dict

ROOT = Path(__file__).resolve().parent.parent
# An epoch under this share of its variant's median images/s marks its run as slowed by another job. A clean run's
# epochs stay within a few percent of each other (the first, which trains the whitening bias, is the slowest); a run
# slowed all through, with no clean epoch of its variant to compare with, is not caught.
SLOWED_BELOW = 0.85


def run_folder(runs_dir: Path, name: str, seed: int, recipe: str, overrides: list[str]) -> Path:
    """The finished run of a variant on a seed, trained here unless its folder already holds it."""
    folder = runs_dir / f"{name}-s{seed}"
    try:
        expected = to_dict(load_recipe(recipe, overrides))
    except CifarkitError as e:
        sys.exit(f"variant {name}: {e}")
    if (folder / "summary.json").exists():
        # Read as a recipe, a field added since the run was made reads as its default.
        expected, found = flatten(expected), flatten(to_dict(train.read_recipe(folder)))
        differing = sorted(key for key, value in expected.items() if found.get(key) != value)
        if differing:
            sys.exit(f"{folder} holds a run of another recipe ({', '.join(differing)} differ); give another "
                     "--runs-dir or variant name")
        return folder
    if folder.exists():
        sys.exit(f"{folder} holds an unfinished run; resume it with `cifarkit train --resume {folder}` or remove it")
    command = [sys.executable, "-m", "cifarkit", "train", "--recipe", recipe, "--out", str(folder)]
    for override in overrides:
        command += ["--set", override]
    print(f"training {folder.name}: {' '.join(command[3:])}", flush=True)
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"training {folder.name} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return folder


def read_run(folder: Path) -> dict:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    run = train.read_run_facts(folder)
    last = records[-1]
    return {
        "val_acc": last["val_acc"], "val_tta_acc": last.get("val_tta_acc"),
        "val_loss": last["val_loss"], "val_tta_loss": last.get("val_tta_loss"),
        "train_time_s": json.loads((folder / "summary.json").read_text())["train_time_s"],
        "epoch_time_s": [r["epoch_time_s"] for r in records],
        "images_per_s": [r["images_per_s"] for r in records],
        "precision": run["precision"], "allocator": run["allocator"], "threads": run["threads"],
    }


def with_interval(value: float, interval: list[float] | None, scale: float, digits: int) -> str:
    """`value` x `scale` to `digits` decimals, and its interval where there is one."""
    def shown(x: float) -> str:
        return f"{scale * x:+.{digits}f}"
    return shown(value) if interval is None else f"{shown(value)} ({shown(interval[0])} to {shown(interval[1])})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="fast")
    parser.add_argument("--val-split", type=int, default=5000, help="training images held out (default: 5000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "KEY=VALUE"),
                        help="a name and its recipe overrides; the first variant is the one the others are read "
                             "against")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/validation"))
    parser.add_argument("--json", type=Path, required=True, help="where to write the table")
    args = parser.parse_args(argv)
    names = [variant[0] for variant in args.variant]
    if len(set(names)) != len(names):
        sys.exit(f"variant names repeat ({', '.join(names)}); give each its own")
    runs = {name: {} for name in names}
    for turn, seed in enumerate(args.seeds):
        order = args.variant[turn % len(names):] + args.variant[:turn % len(names)]
        for name, *overrides in order:
            base = [f"data.val_split={args.val_split}", f"train.seed={seed}"]
            runs[name][seed] = read_run(run_folder(args.runs_dir, name, seed, args.recipe, base + overrides))

    accuracy = "val_tta_acc" if all(r["val_tta_acc"] is not None for v in runs.values() for r in v.values()) \
        else "val_acc"
    # The cross-entropy of the same logits. A run's accuracy on 5,000 images has a sampling spread of about a third
    # of a point, as large as the effects in question; the loss counts how sure every answer was, so its seed-by-seed
    # differences are steadier. It ranks variants of the same label smoothing only: more smoothing trains the model
    # to be less sure, which raises this loss whatever the accuracy.
    loss = accuracy.replace("_acc", "_loss")
    for seeds in runs.values():
        typical = statistics.median(rate for run in seeds.values() for rate in run["images_per_s"])
        for run in seeds.values():
            run["slowed"] = min(run["images_per_s"]) < SLOWED_BELOW * typical
    reference = runs[names[0]]
    variants = []
    for name, *overrides in args.variant:
        seeds = runs[name]
        clean = [s for s in seeds if not seeds[s]["slowed"]]
        paired = [s for s in clean if not reference[s]["slowed"]]
        difference, interval = mean_with_t_interval([seeds[s][accuracy] - reference[s][accuracy] for s in seeds])
        loss_difference, loss_interval = mean_with_t_interval([seeds[s][loss] - reference[s][loss] for s in seeds])
        variants.append({
            "name": name, "overrides": overrides,
            "mean_accuracy": statistics.mean(r[accuracy] for r in seeds.values()),
            # Seed by seed: the same seed draws the same held-out images, so the pairs share that part of the spread.
            "accuracy_minus_first": difference,
            "accuracy_minus_first_ci95": None if name == names[0] else interval,
            "mean_loss": statistics.mean(r[loss] for r in seeds.values()),
            "loss_minus_first": loss_difference,
            "loss_minus_first_ci95": None if name == names[0] else loss_interval,
            # Times of the runs no other job slowed; None where none is left.
            "mean_train_time_s": statistics.mean(seeds[s]["train_time_s"] for s in clean) if clean else None,
            "train_time_over_first": statistics.mean(seeds[s]["train_time_s"] / reference[s]["train_time_s"]
                                                     for s in paired) if paired else None,
            "time_seeds": paired,
            "runs": {str(seed): run for seed, run in seeds.items()},
        })
    lines = [f"| variant | {accuracy} per seed ({', '.join(map(str, args.seeds))}) | mean | minus {names[0]} "
             f"(points, 95% t-interval of the seeds' differences) | {loss} minus {names[0]}'s (95% t-interval) | "
             f"training time over {names[0]}'s (seeds neither run of which was slowed) |",
             "|---|---|---:|---:|---:|---:|"]
    for v in variants:
        per_seed = ", ".join(f"{100 * r[accuracy]:.2f}" for r in v["runs"].values())
        ratio = "-" if v["train_time_over_first"] is None else f"{v['train_time_over_first']:.3f}"
        lines.append(f"| {v['name']} {' '.join(v['overrides'])} | {per_seed} | {100 * v['mean_accuracy']:.2f}% | "
                     f"{with_interval(v['accuracy_minus_first'], v['accuracy_minus_first_ci95'], 100, 2)} | "
                     f"{with_interval(v['loss_minus_first'], v['loss_minus_first_ci95'], 1, 4)} | "
                     f"{ratio} ({', '.join(map(str, v['time_seeds']))}) |")
    print("\n".join(lines))
    typed = sys.argv[1:] if argv is None else argv
    paths = {i + 1 for i, arg in enumerate(typed) if arg in ("--runs-dir", "--json")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    write_json(args.json, {
        "command": " ".join(["python lab/validation_runs.py"]
                            + [portable(a) if i in paths else shlex.quote(a) for i, a in enumerate(typed)]),
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "written_at_commit": commit,
        "recipe": args.recipe, "val_split": args.val_split, "seeds": args.seeds, "accuracy": accuracy,
        "cpu_kind": backends.cpu_kind(), "variants": variants, "table": lines,
        "environment": device.report(torch.device("cpu")),
    })


if __name__ == "__main__":
    main()
