"""Gather finished validation runs (`cifarkit train ... --set data.val_split=N`) into one results file.

    python lab/collect_validation_runs.py runs/b-tta-w07-45 runs/b-deephalf-45 --recipe fast \
        --json results/candidates-B-amx.json

Long runs chosen between one at a time (a distilled release B, 30 minutes a run here) are trained with
`cifarkit train`, not in a `cifarkit tune` study; this records what each run did differently from the recipe, and
its validation accuracy per evaluated epoch, read from the run's own config.yaml and metrics.jsonl. Test accuracy
is left out on purpose: the choice is made on the validation split.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from cifarkit.core import device
from cifarkit.core.files import write_json
from cifarkit.tools.tune import override
from cifarkit.training.config import flatten, load_recipe, to_dict


def overrides_of(config: dict, recipe: dict) -> list[str]:
    """The recipe keys whose value in the run's config differs from the recipe's, as `--set` would write them."""
    ran, base = flatten(config), flatten(recipe)
    return [override(key, value) for key, value in ran.items() if key in base and base[key] != value]


def run_record(folder: Path, recipe: dict) -> dict:
    config = yaml.safe_load((folder / "config.yaml").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evaluated = [row for row in rows if "val_acc" in row]
    if not evaluated:
        raise SystemExit(f"{folder}: no validation accuracy in metrics.jsonl; train with --set data.val_split=N")
    summary = json.loads((folder / "summary.json").read_text())
    run = config.get("run", {})
    return {
        "folder": folder.name,
        "overrides": overrides_of({k: v for k, v in config.items() if k != "run"}, recipe),
        "seed": config["train"]["seed"],
        "val_split": config["data"]["val_split"],
        "val_acc": evaluated[-1]["val_acc"],
        "val_acc_by_epoch": {row["epoch"]: row["val_acc"] for row in evaluated},
        "train_acc": rows[-1].get("train_acc"),
        "wall_time_s": summary["wall_time_s"],
        "train_time_s": summary["train_time_s"],
        "teacher_targets_s": run.get("teacher", {}).get("targets_s"),
        "precision": run.get("precision"),
        "threads": run.get("threads"),
        "cpu_features": run.get("cpu_features"),
        "source": run.get("source"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, each trained with a validation split")
    parser.add_argument("--recipe", required=True, help="the recipe the runs' overrides are read against")
    parser.add_argument("--json", type=Path, required=True, help="the results file to write")
    args = parser.parse_args(argv)
    recipe = to_dict(load_recipe(args.recipe))
    records = [run_record(folder, recipe) for folder in args.runs]
    kinds = {device.cpu_kind(r["cpu_features"]) for r in records}
    here = device.cpu_kind()
    if kinds != {here}:
        sys.exit(f"the runs come from {', '.join(sorted(kinds))} CPUs and this one is {here}: collect them on the "
                 "machine that trained them, whose environment the file records")
    result = {
        "what": f"validation runs of `{args.recipe}` with overrides, one seed each, single-view validation accuracy",
        "command": shlex.join(["python", "lab/collect_validation_runs.py",
                               *(str(p) for p in args.runs), "--recipe", args.recipe, "--json", str(args.json)]),
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": args.recipe,
        "cpu_kind": here,
        "environment": device.report(torch.device("cpu")),
        "runs": records,
    }
    write_json(args.json, result)
    for r in records:
        print(f"{r['folder']}: val {100 * r['val_acc']:.2f}% (seed {r['seed']}), {r['wall_time_s'] / 60:.1f} min, "
              f"{' '.join(r['overrides'])}")


if __name__ == "__main__":
    main()
