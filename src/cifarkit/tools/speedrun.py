"""`cifarkit speedrun`: train a recipe over several seeds back to back and report accuracy and time honestly.

A claim like "94% in N minutes" is a mean over seeds with its spread, a confidence interval and a test against the
target, and a wall clock that covers everything a user waits for.
"""
from __future__ import annotations

import json
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path

from cifarkit.core import device
from cifarkit.core.errors import CifarkitError, first_line
from cifarkit.core.files import portable, write_json
from cifarkit.tools import benchmark
from cifarkit.training import plots, train
from cifarkit.training.config import load_recipe
from cifarkit.training.tracking import stamp

TIMER_COVERS = ("wall_time_s: from the start of the run (loading the cached uint8 data) through model "
                "initialization, training, {evals} and the final test evaluation{tta}, to the weights being saved; "
                "Python and torch import time is not included, nor, on CUDA or under torch.compile, the warm-up at "
                "the training shapes (compilation, cuDNN autotuning) that precedes the clock, as airbench times its "
                "runs: each run records it as warmup_s. No checkpoints are written (a speed run cannot resume)")
# A speed run's time cannot be resumed, so it writes no checkpoint: on a GPU one per epoch is a real share of it.
SPEED_RUN_SETTINGS = ("train.checkpoints=false",)


def t_interval_half_width(values: list[float]) -> float | None:
    """Half the width of the 95% Student-t interval of the mean of `values` (None for fewer than 2): a handful of
    runs or pairs is too few for the normal 1.96."""
    from scipy import stats
    if len(values) < 2:
        return None
    return float(stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


def mean_with_t_interval(values: list[float]) -> tuple[float, list[float] | None]:
    """The mean of `values` and its 95% Student-t interval (None for fewer than 2)."""
    mean, half = statistics.fmean(values), t_interval_half_width(values)
    return mean, None if half is None else [mean - half, mean + half]


def statistics_against(accuracies: list[float], target: float) -> dict:
    """Mean, sample std, 95% t-interval and the one-sided t-test of H0: mean <= target against H1: mean > target."""
    from scipy import stats
    n = len(accuracies)
    mean = statistics.fmean(accuracies)
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "ci95": None, "p_value_mean_above_target": None}
    std = statistics.stdev(accuracies)
    sem = std / math.sqrt(n)
    half = t_interval_half_width(accuracies)
    if sem > 0:
        p_value = float(stats.t.sf((mean - target) / sem, n - 1))
    else:  # every run scored the same: the test degenerates to a comparison
        p_value = 0.0 if mean > target else 1.0
    # An accuracy lies in [0, 1]; a t-interval reaching past it says only that n is too small.
    low, high = max(mean - half, 0.0), min(mean + half, 1.0)
    return {"n": n, "mean": mean, "std": std, "ci95": [low, high],
            "ci95_clipped": (low, high) != (mean - half, mean + half), "p_value_mean_above_target": p_value}


def difference_of_means(first: list[float], second: list[float]) -> dict:
    """`first`'s mean minus `second`'s, with the 95% Welch interval (None with fewer than 2 values on a side): two
    programs' runs are independent samples, and their spreads need not be equal."""
    from scipy import stats
    difference = statistics.fmean(first) - statistics.fmean(second)
    if min(len(first), len(second)) < 2:
        return {"difference": difference, "ci95": None}
    interval = stats.ttest_ind(first, second, equal_var=False).confidence_interval(0.95)
    return {"difference": difference, "ci95": [float(interval.low), float(interval.high)]}


def describe_difference(difference: dict) -> str:
    """A difference_of_means of accuracies in points, with its interval where there is one."""
    interval = difference["ci95"]
    return f"{100 * difference['difference']:+.2f} points" + (
        f" (95% Welch interval {100 * interval[0]:+.2f} to {100 * interval[1]:+.2f})" if interval else "")


def _finished_earlier(run_dir: Path, recipe) -> dict | None:
    """The summary of this seed's run if an earlier speed run into the same folder finished it, else None. So a long
    speed run can be finished by several commands: each run was timed whole, on its own, and its figures stand. A run
    cut short cannot be continued: its time would miss what its restart cost."""
    if not run_dir.exists():
        return None
    if not (run_dir / "summary.json").is_file():
        raise CifarkitError(f"{run_dir} holds a run that did not finish, and a run's time cannot be resumed: delete "
                            f"{run_dir} to train this seed again, or give another --out")
    try:
        trained = train.read_recipe(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CifarkitError(f"{run_dir} is not a usable finished run ({first_line(e)}); delete it to train this "
                            f"seed again, or give another --out") from None
    if trained != recipe:
        raise CifarkitError(f"{run_dir} was trained with other settings than this speed run's; give another --out")
    return summary


MACHINE_SPEED = "machine-speed.json"  # in a run's folder: the probe's img/s just before and just after the run


def _probe(recipe) -> dict:
    """The machine-speed probe (benchmark.PROBE) on the run's device and precision, timed outside the run."""
    run_device = device.pick_device(recipe.train.device)
    return benchmark.machine_speed(run_device, device.pick_precision(recipe.train.precision, run_device).name)


def run(recipe_name: str, runs: int, target: float, out_dir: Path | None = None, first_seed: int = 0,
        curve: bool = True, overrides: tuple = (), command: str | None = None) -> dict:
    out_dir = out_dir or Path("runs") / f"speedrun-{Path(recipe_name).stem}-{datetime.now():%Y%m%d-%H%M%S}"
    # Every seed's recipe is checked before the first run trains: a bad value fails now, not an hour in.
    recipes = {seed: load_recipe(recipe_name, [*SPEED_RUN_SETTINGS, *overrides, f"train.seed={seed}"]
                                 + (["train.eval_every=1"] if curve else []))
               for seed in range(first_seed, first_seed + runs)}
    kept = {seed: _finished_earlier(out_dir / f"seed{seed}", recipe) for seed, recipe in recipes.items()}
    results = []
    for seed, recipe in recipes.items():
        run_dir = out_dir / f"seed{seed}"
        if kept[seed] is None:
            speed = {"before": _probe(recipe)}
            try:
                summary = train.run(recipe, out=run_dir)
            except KeyboardInterrupt:
                raise KeyboardInterrupt(
                    f"interrupted in the run of seed {seed}; a run's time cannot be resumed, but finished seeds are "
                    f"kept: delete {run_dir} and run the speed run again with --out {out_dir}") from None
            speed["after"] = _probe(recipe)
            # In the run's folder, so that a later command that keeps this run keeps its machine speed too.
            write_json(run_dir / MACHINE_SPEED, speed)
        else:
            summary = kept[seed]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        speed_file = run_dir / MACHINE_SPEED
        results.append({
            "seed": seed, "test_acc": summary["test_acc"], "wall_time_s": summary["wall_time_s"],
            "train_time_s": summary["train_time_s"], "warmup_s": summary.get("warmup_s", 0.0),
            "run_dir": portable(run_dir),
            "finished": datetime.fromtimestamp((run_dir / "summary.json").stat().st_mtime, timezone.utc)
                                .isoformat(timespec="seconds"),
            "kept_from_an_earlier_command": kept[seed] is not None,
            # Each run's own facts (versions, allocator, CPU features): a kept run may come from another command.
            "run": train.read_run_facts(run_dir),
            "machine_speed": json.loads(speed_file.read_text()) if speed_file.is_file() else None,
            "curve": [{"epoch": r["epoch"], "elapsed_s": r["elapsed_s"], "test_acc": r["test_acc"]}
                      for r in records if "test_acc" in r],
        })
    accuracies = [r["test_acc"] for r in results]
    walls = [r["wall_time_s"] for r in results]
    evals = "a test evaluation after every epoch" if curve else "no per-epoch evaluation"
    report = {
        **stamp(), "command": command, "recipe": recipe_name, "overrides": list(overrides), "target": target,
        "timer_covers": TIMER_COVERS.format(evals=evals, tta=" with TTA" if recipe.train.tta else ""),
        "accuracy": statistics_against(accuracies, target),
        "wall_time_s": {"mean": statistics.fmean(walls), "max": max(walls), "min": min(walls)},
        "environment": device.report(device.pick_device(recipe.train.device)),
        "runs": results,
    }
    plots.accuracy_vs_time(results, target, out_dir / "speedrun.png", Path(recipe_name).stem, overrides,
                           final_tta=recipe.train.tta)
    write_json(out_dir / "speedrun.json", report)
    report["out_dir"] = str(out_dir)
    return report


def table(report: dict) -> str:
    lines = ["| seed | test accuracy | wall time | train time | machine speed, before / after |",
             "|---:|---:|---:|---:|---:|"]
    for r in report["runs"]:
        lines.append(f"| {r['seed']} | {100 * r['test_acc']:.2f}% | {r['wall_time_s']:.1f} s | "
                     f"{r['train_time_s']:.1f} s | {probe_text(r['machine_speed'])} |")
    acc = report["accuracy"]
    lines.append("")
    if acc["std"] is None:
        lines.append(f"n = 1: accuracy {100 * acc['mean']:.2f}% (run more seeds for a spread and a test)")
    else:
        low, high = acc["ci95"]
        clipped = (f" (clipped to [0, 100]%: n = {acc['n']} is too small for a useful interval; run more seeds)"
                   if acc["ci95_clipped"] else "")
        lines.append(f"n = {acc['n']}: mean {100 * acc['mean']:.2f}% +- {100 * acc['std']:.2f} (std), "
                     f"95% CI [{100 * low:.2f}, {100 * high:.2f}]{clipped}, one-sided t-test of mean > "
                     f"{100 * report['target']:.2f}%: p = {acc['p_value_mean_above_target']:.3g}")
    kept = [r for r in report["runs"] if r["kept_from_an_earlier_command"]]
    if kept:
        lines.append("kept from an earlier command into the same folder: " + ", ".join(
            f"seed {r['seed']} (finished {r['finished']})" for r in kept))
    wall = report["wall_time_s"]
    lines.append(f"wall time per run: mean {wall['mean']:.1f} s, max {wall['max']:.1f} s")
    lines.append(f"machine speed: {benchmark.PROBE['model']}'s training img/s at batch "
                 f"{benchmark.PROBE['batch_size']}, "
                 f"{benchmark.PROBE['steps']} steps, just before and after each run")
    return "\n".join(lines)


def probe_text(speed: dict | None) -> str:
    if speed is None:
        return "not probed"
    return f"{speed['before']['images_per_s']:,.0f} / {speed['after']['images_per_s']:,.0f} img/s"
