"""`cifarkit reference`: a recipe (`fast`) against the published CIFAR-10 speedruns, timed on this machine in the
same rounds, and the speed-up at equal accuracy.

    curl -LO https://raw.githubusercontent.com/KellerJordan/cifar10-airbench/master/airbench94_muon.py
    curl -LO https://raw.githubusercontent.com/hiverge/cifar10-speedrun/main/cifar10_speedrun.py
    cifarkit reference --muon airbench94_muon.py --record cifar10_speedrun.py --bracket-epochs 8 --runs 8 \
        --json results/compare-reference-KIND.json

The references, strongest first:
- cifar10_speedrun (the Hive, 2025: airbench94_muon's net with SiLU, a batched Newton-Schulz, a brightness and
  contrast jitter, 7.59 epochs of batch 1536, TTA on the least confident quarter), the A100 record whose values
  `fast` runs. One file of github.com/hiverge/cifar10-speedrun: download it and give its path to `--record`.
- airbench94_muon (Jordan, 2024-10: Muon on the conv filters, 8 epochs, batch 2000), whose methods `fast` adopted.
  One file of github.com/KellerJordan/cifar10-airbench: download it and give its path to `--muon`.
- airbench94 (airbench==0.1.8's lib_airbench94: 9.9 epochs, Nesterov SGD, lookahead), installed at run time into a
  temporary venv that sees this environment's torch through a .pth file, run only when named in `--references`.
None of their code is in this repository; the results record the sha256 of the user's copies.

The references are written for CUDA in fp16. Each runs here as cifarkit runs on this CPU, and differs in nothing else
(reference_drivers.py holds the small program that runs each):
- the CPU: `.cuda()` does nothing, `torch.load` maps to the CPU, CUDA's timing events read the host clock, the
  record's pinned staging buffer is plain memory;
- the machine's precision policy, cifarkit's `--precision auto`: fp32 weights, with the forward passes under bf16
  autocast where the CPU computes bf16 natively and in fp32 elsewhere; Muon's Newton-Schulz iteration in bf16 where
  bf16 is native and in fp32 elsewhere, on every side (`optim.newton_schulz_dtype`). Autocast covers the forward
  passes only, as in cifarkit: around the whole run it would also compute the whitening filters' patch covariance in
  bf16, whose rounding makes eigenvalues negative and the filters NaN. The record keeps its Muon momentum in fp16,
  as it sets it;
- nothing compiled: `fast` does not compile by default, and the references' `torch.compile` calls are bypassed
  (their plain functions run);
- the same allocator, preloaded: tcmalloc where it is installed, else mimalloc from its wheel, as cifarkit's commands
  do;
- the test set read once, at the end: airbench94_muon's per-epoch test evaluation and the record's accuracies without
  TTA after its timer stops, only printed, are skipped, as `fast` evaluates only at the end;
- the same data: this machine's CIFAR-10 cache, written as the train.pt / test.pt files their loaders read first.

`--set KEY=VALUE` (repeatable) times a variant of cifarkit's recipe, as `cifarkit train --set` makes it: the
results record the overrides, and a file's rounds are kept only for the same ones.

Accuracy: each side's own TTA as shipped, and the one that decides, 6 views of every image on every side (the image,
its mirror, and both shifted one pixel each way, weighted as airbench weights them). airbench94_muon's own TTA is
those 6 views. `fast` and the record give their extra views to the least confident quarter of the images only; their
weights are evaluated again after their process ends, untimed, with the 6 views of every image, in their training
precision, by cifarkit's evaluation.

The speed-up at equal accuracy: `--bracket-epochs E` adds a side, the same recipe trained for E epochs, to every
round. With the recipe's own budget it brackets a reference's mean accuracy (7 and 8 epochs for `fast`), and
equal_accuracy.py reads `fast`'s time at the reference's accuracy off the line between them: the reference's time
over that time is the speed-up, with a bootstrap interval over the rounds. The time to a 94% mean is reported beside
it. Without brackets only the speed ratio at the recipe's own budget is given, beside the accuracy difference.

Two timers per run: the whole process, from launch to exit, imports included; and training alone, each side's own
clock over its steps (cifarkit's `train_time_s`; a reference's CUDA-event timer, which also covers its whitening
init, less its final TTA). Rounds alternate the order of the sides (A B C, C B A, A B C, ...), so a slow spell of this
shared machine falls on all of them. Precision, allocator and threads are read from each timed process.

A comparison can take longer than one sitting (a round is a full training of every side). With `--json`, the file is
written after every round, and a later command with the same settings (the same committed src/, reference files, CPU
kind, threads, precision, allocator and brackets) keeps its rounds and runs only the missing ones: `--runs 2` today
and `--runs 8` tomorrow make the same comparison. Each round runs whole within one command.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from cifarkit.artifacts import weights
from cifarkit.core import allocator, device
from cifarkit.core.errors import CifarkitError, first_line
from cifarkit.core.files import terminate_as_interrupt, write_json
from cifarkit.data import cifar10
from cifarkit.tools import equal_accuracy
from cifarkit.tools.reference_drivers import (
    AIRBENCH94,
    AIRBENCH94_DRIVER,
    AIRBENCH94_PACKAGE,
    MUON,
    MUON_DRIVER,
    PRELUDE,
    RECORD,
    RECORD_DRIVER,
    RECORD_VIEWS,
    REFERENCES,
    USER_COPIES,
)
from cifarkit.tools.speedrun import describe_difference, difference_of_means, mean_with_t_interval, statistics_against
from cifarkit.training import optim
from cifarkit.training.config import load_recipe
from cifarkit.training.engine import evaluate

log = logging.getLogger("cifarkit")

SOURCE = Path(__file__).resolve().parents[2]  # the src/ folder of a checkout: the code a comparison times
# The goals of issue 64: `fast` at least this many times as fast as each reference, at equal accuracy.
GOALS = {MUON: 1.3, RECORD: 1.25}
ROUNDS_FOR_A_VERDICT = 8  # fewer leave the equal-accuracy figure's interval wider than the goals' margins
INTERVAL_HALF_WIDTH = 0.05  # past 8 rounds, the issue asks for more where the interval is wider than +-0.05x
ACCURACY_MARK = 0.94  # the time to this mean accuracy is reported beside the speed-ups
TIMERS = {"whole_process": "launch to exit, imports included",
          "training": "each side's own clock over its training steps"}

def check_references(names: list[str]) -> None:
    """Names that are not references fail with the list of those there are."""
    unknown = [name for name in names if name not in REFERENCES]
    if unknown:
        raise CifarkitError(f"--references {' '.join(unknown)}: no such reference; choose from {', '.join(REFERENCES)}")


def variant(recipe: str, overrides: list[str]) -> str:
    """cifarkit's side as its command line names it: the recipe, and what --set changes in it."""
    return " ".join([f"--recipe {recipe}", *(f"--set {override}" for override in overrides)])


def check_variant(recipe: str, overrides: list[str]) -> None:
    """A bad key or value of cifarkit's side fails here, not in the first round's training process."""
    try:
        load_recipe(recipe, overrides)
    except CifarkitError as e:
        raise CifarkitError(f"{variant(recipe, overrides)}: {e}") from None


def round_orders(sides: list[str], rounds: int) -> list[list[str]]:
    """The order of the sides in each round, reversed every other round: A B, B A, A B, ... (ABBA for two sides)."""
    return [list(sides) if r % 2 == 0 else list(reversed(sides)) for r in range(rounds)]


def ratio_statistics(ratios: list[float]) -> dict:
    """Mean of per-round ratios with its 95% t-interval (None for fewer than 2 rounds)."""
    mean, interval = mean_with_t_interval(ratios)
    return {"per_round": ratios, "mean": mean, "ci95": interval}


def reference_python(folder: Path) -> Path:
    """A venv in `folder` with airbench94's package installed; this environment's packages (torch) visible."""
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "cifarkit-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", AIRBENCH94_PACKAGE], check=True)
    return python


def write_reference_data(folder: Path, subset: int | None) -> None:
    """CIFAR-10 from cifarkit's cache in the layout the references' loaders read before they would download:
    N x 32 x 32 x 3 uint8, as torchvision's CIFAR10.data holds them. `subset`: that many training images,
    class-balanced, as cifarkit's --subset draws them."""
    dataset = cifar10.load()
    train_x, train_y = dataset.train_x, dataset.train_y
    if subset:
        chosen = cifar10.balanced_indices(train_y, subset, torch.Generator().manual_seed(0))
        train_x, train_y = train_x[chosen], train_y[chosen]
    folder.mkdir(parents=True)
    for name, images, labels in (("train.pt", train_x, train_y), ("test.pt", dataset.test_x, dataset.test_y)):
        torch.save({"images": images.permute(0, 2, 3, 1).contiguous(), "labels": labels,
                    "classes": list(cifar10.CLASSES)}, folder / name)


def timed(command: list[str], env: dict) -> tuple[float, str]:
    """(seconds from launch to exit, stdout) of `command`, run to its end."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        log.error("%s", done.stderr[-3000:])
        raise CifarkitError(f"{' '.join(command[:4])} ... failed with exit status {done.returncode} (its last "
                            f"messages are above); fix what they name and run the same command again")
    return seconds, done.stdout


def six_view_accuracy(run_dir: Path, precision_name: str) -> float:
    """The test accuracy of a run's weights with 6 views of every image, the references' TTA, in `precision_name`."""
    model, meta = weights.load_weights(run_dir / "model.safetensors")
    dataset = cifar10.load()
    result = evaluate(model.to(memory_format=torch.channels_last), dataset.test_x, dataset.test_y, meta["mean"],
                      meta["std"], torch.device("cpu"), device.PRECISIONS[precision_name], tta=True, tta_share=1.0)
    return result["acc"]


def cifarkit_run(recipe: str, overrides: list[str], seed: int, subset: int | None, folder: Path, env: dict) -> dict:
    command = [sys.executable, "-m", "cifarkit", "train", "--recipe", recipe, "--seed", str(seed), "--out",
               str(folder)] + (["--subset", str(subset)] if subset else [])
    for override in overrides:
        command += ["--set", override]
    seconds, _ = timed(command, env)
    summary = json.loads((folder / "summary.json").read_text())
    run = yaml.safe_load((folder / "config.yaml").read_text())["run"]
    return {"seed": seed, "wall_time_s": seconds, "train_time_s": summary["train_time_s"],
            "test_acc": summary["test_acc"], "test_acc_6_views": six_view_accuracy(folder, summary["precision"]),
            "precision": summary["precision"], "newton_schulz_dtype": run.get("newton_schulz_dtype"),
            "allocator": run["allocator"], "threads": run["threads"]}


def code_version() -> dict:
    """The cifarkit code a run times: the commit, the git tree of src/ (recipes included), and whether src/ differs
    from it (then no later command may add rounds: the code could not be shown to be the same)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=SOURCE, check=True, capture_output=True, text=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "--short", "HEAD"), "src_tree": git("rev-parse", "HEAD:./"),
                "src_modified": bool(git("status", "--porcelain", "."))}
    except (OSError, subprocess.CalledProcessError):
        raise CifarkitError(f"the results name the commit of the code they time, and {SOURCE} is not the src/ folder "
                            f"of a git checkout; run cifarkit from a checkout (`pip install -e .` in it)") from None


def kept_rounds(json_path: str | None, settings: dict) -> list[dict]:
    """The finished rounds of an earlier command that wrote `json_path` with the same settings: a comparison too
    long for one sitting is finished by several commands, each round timed whole within one of them. Where rounds
    are kept, `settings["code"]` becomes the earlier record, of the same src/ tree, so that the results name the
    commit the comparison began at rather than a later one whose src/ is the same."""
    if not json_path or not Path(json_path).is_file():
        return []
    try:
        previous = json.loads(Path(json_path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CifarkitError(f"--json {json_path} is not a comparison's results ({first_line(e)}); give another "
                            f"--json, or delete the file to start again") from None
    earlier = previous.get("settings")
    if earlier is None:
        raise CifarkitError(f"--json {json_path} was written by an earlier version of the comparison, which did not "
                            f"record what its rounds ran; give another --json, or delete the file to start again")
    if earlier["code"]["src_modified"] or settings["code"]["src_modified"]:
        raise CifarkitError(f"--json {json_path}: src/ has uncommitted changes (then or now), so its rounds cannot be "
                            f"shown to time the same code; commit them, then give another --json or delete the file")
    differing = sorted(key for key in settings.keys() | earlier.keys()
                       if key != "code" and settings.get(key) != earlier.get(key))
    if earlier["code"]["src_tree"] != settings["code"]["src_tree"]:
        differing.insert(0, f"src/ (commit {earlier['code']['commit']} then, {settings['code']['commit']} now)")
    if differing:
        raise CifarkitError(f"--json {json_path} holds rounds of another comparison (it differs in "
                            f"{', '.join(differing)}); give another --json, or delete the file to start again")
    settings["code"] = earlier["code"]
    return previous["rounds"]


def accuracy_difference(ours: list[dict], theirs: list[dict]) -> dict:
    """cifarkit's mean test accuracy, as shipped, minus a reference's, with its 95% Welch interval."""
    return difference_of_means([r["test_acc"] for r in ours], [r["test_acc"] for r in theirs])


def bracket_side(epochs: float) -> str:
    """The name of cifarkit's side trained for `epochs`, beside the recipe's own budget ("cifarkit")."""
    return f"cifarkit@{epochs:g}"


def budgets(recipe: str, overrides: list[str], brackets: list[float]) -> dict[str, float]:
    """cifarkit's sides -> their epochs: the recipe's own budget ("cifarkit"), then each of `brackets`. A bracket
    equal to the recipe's budget, or given twice, fails here."""
    own = load_recipe(recipe, overrides).train.epochs
    if len(set(brackets)) != len(brackets) or own in brackets:
        raise CifarkitError(f"--bracket-epochs {' '.join(f'{e:g}' for e in brackets)}: each must differ from the "
                            f"others and from the recipe's own {own:g} epochs; give other epochs")
    for epochs in brackets:
        check_variant(recipe, [*overrides, f"train.epochs={epochs:g}"])
    return {"cifarkit": own, **{bracket_side(epochs): epochs for epochs in brackets}}


def round_lines(rounds: list[dict], references: list[str]) -> list[str]:
    """The last round's ratio against each reference, beside the accuracy difference over the rounds so far."""
    ours = [r["runs"]["cifarkit"] for r in rounds]
    lines = []
    for name in references:
        theirs = [r["runs"][name] for r in rounds]
        whole, training = (theirs[-1][key] / ours[-1][key] for key in ("wall_time_s", "train_time_s"))
        lines.append(f"round {len(rounds)}: cifarkit {whole:.2f}x as fast as {name}, whole process ({training:.2f}x "
                     f"training); mean accuracy over {len(rounds)} round(s), cifarkit minus {name}: "
                     f"{describe_difference(accuracy_difference(ours, theirs))}")
    return lines


def complete_rounds(rounds: list[dict], sides: list[str], runs: int, first_seed: int, run_side, save,
                    commit: str) -> None:
    """Run the rounds that `rounds` lacks of `runs`, in their alternating order and with their seeds, each side by
    `run_side(side, seed)`; `save()` after every round, so that a command stopped later keeps what finished. Each
    round records `commit`, the checkout that ran it: its src/ is the comparison's, but its scripts may be later."""
    for number, order in enumerate(round_orders(sides, runs)[len(rounds):], start=len(rounds)):
        seed, rows = first_seed + number, {}
        for side in order:
            row = rows[side] = run_side(side, seed)
            log.info("round %d, %s seed %d: %.2f%%, %.1f s whole, %.1f s training", number + 1, side, seed,
                     100 * row["test_acc"], row["wall_time_s"], row["train_time_s"])
        rounds.append({"seed": seed, "order": order, "runs": rows, "commit": commit,
                       "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        save()  # before the round's lines: a kill that follows the line they announce must not lose the round
        for line in round_lines(rounds, [side for side in sides if not side.startswith("cifarkit")]):
            log.info(line)


def side_summary(runs: list[dict]) -> dict:
    """A side's accuracy (as shipped, and with 6 views where its runs have them) and mean times over its runs."""
    summary = {"accuracy": statistics_against([r["test_acc"] for r in runs], ACCURACY_MARK),
               "wall_time_s": statistics.fmean(r["wall_time_s"] for r in runs),
               "train_time_s": statistics.fmean(r["train_time_s"] for r in runs), "runs": runs}
    if all("test_acc_6_views" in r for r in runs):  # a reference's rows before the 6 views were recorded lack them
        summary["accuracy_6_views"] = statistics_against([r["test_acc_6_views"] for r in runs], ACCURACY_MARK)
    return summary


def source(name: str, files: dict[str, Path]) -> str:
    """Where a reference's code came from: the user's copy, by name and sha256, or the package."""
    if name in USER_COPIES:
        return f"{files[name].name}, sha256 {hashlib.sha256(files[name].read_bytes()).hexdigest()}"
    return AIRBENCH94_PACKAGE


def summarize(rounds: list[dict], references: list[str], files: dict[str, Path],
              sides_epochs: dict[str, float] | None) -> dict:
    """Each side's accuracy and times over the rounds, each reference's per-round speed-up ratios beside the
    accuracy difference, and, with bracketing budgets (`sides_epochs`), the speed-up at equal accuracy and the times
    to a 94% mean."""
    ours = [r["runs"]["cifarkit"] for r in rounds]
    summary = {"orders": [r["order"] for r in rounds], "cifarkit": side_summary(ours), "references": {}}
    if sides_epochs:
        summary["brackets"] = {side: {"epochs": epochs, **side_summary([r["runs"][side] for r in rounds])}
                               for side, epochs in sides_epochs.items() if side != "cifarkit"}
    for name in references:
        theirs = [r["runs"][name] for r in rounds]
        side = side_summary(theirs)
        side["speedup"] = {timer: ratio_statistics([t[key] / m[key] for t, m in zip(theirs, ours)])
                           for timer, key in (("whole_process", "wall_time_s"), ("training", "train_time_s"))}
        side["accuracy_difference"] = accuracy_difference(ours, theirs)
        side["source"] = source(name, files)
        if sides_epochs and "accuracy_6_views" in side:
            side["equal_accuracy"] = equal_accuracy.speedup(rounds, sides_epochs, name)
        summary["references"][name] = side
    if sides_epochs:
        with_six_views = [name for name, side in summary["references"].items() if "accuracy_6_views" in side]
        summary["time_to_mark"] = equal_accuracy.time_to(rounds, sides_epochs, with_six_views, ACCURACY_MARK)
    return summary


def _short_of(ratio: float, goal: float) -> str:
    """A ratio under its goal, with the digits that show it under: 1.297x, never 1.30x, against 1.3x."""
    digits = next((digits for digits in range(2, 6) if round(ratio, digits) < goal), 6)
    return f"{ratio:.{digits}f}x"


def _shortfall(name: str, reference: dict) -> str | None:
    """Why `fast` misses its goal against one reference, None where it meets it: at equal accuracy where the
    comparison bracketed the reference's accuracy, else at its own budget and no less accurate on the mean."""
    goal = GOALS[name]
    figure = reference.get("equal_accuracy")
    if figure is not None:
        if not figure["defined"]:
            return f"{name}: no figure at equal accuracy ({figure['why']})"
        ratio = figure["whole_process"]["ratio"]
        extended = " (extrapolated beyond the budgets)" if figure["extrapolated"] else ""
        if ratio < goal:
            return f"{name} {_short_of(ratio, goal)} at equal accuracy{extended}, under {goal}x"
        # Above the goal only beyond the budgets timed: a line's end is no measurement.
        return f"{name} {ratio:.2f}x at equal accuracy{extended}, not a measurement" if extended else None
    speedup, difference = reference["speedup"]["whole_process"]["mean"], reference["accuracy_difference"]["difference"]
    shortfalls = ([f"{_short_of(speedup, goal)} as fast, under {goal}x"] if speedup < goal else []) + (
        [f"mean accuracy {-100 * difference:.2f} points lower"] if difference < 0 else [])
    return f"{name}: " + " and ".join(shortfalls) if shortfalls else None


def verdict(references: dict, subset: int | None, rounds: int) -> str:
    """The goals' verdict in words: "met", "not met: " and why, or "not judged: " where the rounds cannot say."""
    if subset:
        return f"not judged: trained on {subset:,} images only, a check that every side runs"
    judged = [name for name in GOALS if name in references]
    if not judged:
        return f"not judged: the goals are against {' and '.join(GOALS)}, which this comparison did not run"
    shortfalls = [why for why in (_shortfall(name, references[name]) for name in judged) if why]
    found = ("not met: " + "; ".join(shortfalls)) if shortfalls else "met"
    brackets = any("equal_accuracy" in references[name] for name in judged)
    if brackets and rounds < ROUNDS_FOR_A_VERDICT:
        return f"not judged: {rounds} of the {ROUNDS_FOR_A_VERDICT} rounds a verdict needs; so far {found}"
    wide = [why for why in (_too_wide(name, references[name], rounds) for name in judged) if why]
    return found + (f"; {'; '.join(wide)}" if wide else "")


def _too_wide(name: str, reference: dict, rounds: int) -> str | None:
    """Where the equal-accuracy figure's interval is wider than +-INTERVAL_HALF_WIDTH: how wide, and about how many
    rounds would narrow it to that (a bootstrap interval narrows as one over the root of the rounds)."""
    figure = reference.get("equal_accuracy") or {}
    interval = figure.get("whole_process", {}).get("ci95") if figure.get("defined") else None
    half_width = (interval[1] - interval[0]) / 2 if interval else 0.0
    if half_width <= INTERVAL_HALF_WIDTH:
        return None
    needed = math.ceil(rounds * (half_width / INTERVAL_HALF_WIDTH) ** 2)
    return (f"{name}'s interval {interval[0]:.2f}-{interval[1]:.2f} is +-{half_width:.2f}x, wider than "
            f"+-{INTERVAL_HALF_WIDTH}x: about {needed} rounds would narrow it to that")


def results(rounds: list[dict], settings: dict, environment: dict, command: str, files: dict[str, Path]) -> dict:
    """The results file: what ran, where and when, each side over the rounds, and the goals' verdict."""
    summary = summarize(rounds, settings["references"], files, settings.get("budgets"))
    return {"command": command, "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "verdict": verdict(summary["references"], settings["subset"], len(rounds)),
            "cpu_kind": settings["cpu_kind"], "recipe": settings["recipe"], "overrides": settings.get("overrides", []),
            "subset": settings["subset"], "precision_policy": settings["precision_policy"],
            "newton_schulz_dtype": settings["newton_schulz_dtype"], "preloaded_by_all": settings["preloaded_by_all"],
            "timers": TIMERS, **summary, "environment": environment, "settings": settings, "rounds": rounds}


def equal_accuracy_lines(result: dict) -> list[str]:
    """The speed-up at equal accuracy against each reference, and the times to a 94% mean, in words."""
    lines = []
    for name, reference in result["references"].items():
        figure = reference.get("equal_accuracy")
        if figure is None:
            continue
        if not figure["defined"]:
            lines.append(f"at {name}'s accuracy: no figure, {figure['why']}")
            continue
        ratios = ", ".join(f"{equal_accuracy.ratio_text(figure[timer]['ratio'], figure[timer]['ci95'])} {words}"
                           for timer, words in (("whole_process", "whole process"), ("training", "training")))
        undefined = (f"; {figure['undefined_resamples']:,} of {figure['resamples']:,} resamples had no figure"
                     if figure["undefined_resamples"] else "")
        extended = ", extrapolated beyond the budgets" if figure["extrapolated"] else ""
        lines.append(f"at {name}'s accuracy ({100 * figure['reference_accuracy']:.2f}%, 6 views): cifarkit needs "
                     f"{figure['epochs']:.2f} epochs{extended}; {ratios} (95% bootstrap interval over "
                     f"{figure['rounds']} rounds{undefined})")
    marks = result.get("time_to_mark")
    if marks:
        times = "; ".join(f"{side} " + (f"{mark['wall_time_s']:.1f} s" if mark else "not reached")
                          for side, mark in marks.items() if side != "target")
        lines.append(f"time to a {100 * marks['target']:.1f}% mean (6 views), whole process: {times}")
    return lines


def table(result: dict) -> str:
    """The results as the command prints them: every ratio beside the accuracy difference, the speed-ups at equal
    accuracy, then the goals' verdict."""
    ours, side = result["cifarkit"], variant(result["recipe"], result.get("overrides") or [])

    def six_views(summary: dict) -> str:
        return f"{100 * summary['accuracy_6_views']['mean']:.2f}%" if "accuracy_6_views" in summary else ""
    lines = ["| side | runs | test acc (its TTA) | test acc (6 views) | whole process | training | speed-up, whole "
             "(95% CI) | speed-up, training (95% CI) | mean accuracy, cifarkit minus it |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, summary in [("cifarkit", ours), *result.get("brackets", {}).items()]:
        label = side if name == "cifarkit" else f"{side} --set train.epochs={summary['epochs']:g}"
        lines.append(f"| cifarkit {label} | {summary['accuracy']['n']} | {100 * summary['accuracy']['mean']:.2f}% | "
                     f"{six_views(summary)} | {summary['wall_time_s']:.1f} s | {summary['train_time_s']:.1f} s | | | |")
    for name, reference in result["references"].items():
        cells = [equal_accuracy.ratio_text(ratio["mean"], ratio["ci95"])
                 for ratio in (reference["speedup"]["whole_process"], reference["speedup"]["training"])]
        lines.append(f"| {name} | {reference['accuracy']['n']} | {100 * reference['accuracy']['mean']:.2f}% | "
                     f"{six_views(reference)} | {reference['wall_time_s']:.1f} s | {reference['train_time_s']:.1f} s "
                     f"| {cells[0]} | {cells[1]} | {describe_difference(reference['accuracy_difference'])} |")
    lines.append("")
    for name, reference in result["references"].items():
        lines.append(f"{side} against {name}: {reference['speedup']['whole_process']['mean']:.2f}x as fast (whole "
                     f"process), mean test accuracy {describe_difference(reference['accuracy_difference'])}")
    lines += equal_accuracy_lines(result)
    goals = " and ".join(f"{goal}x {name}" for name, goal in GOALS.items())
    lines.append(f"goals ({side} >= {goals}, whole process, at equal accuracy): {result['verdict']}")
    return "\n".join(lines)


RECORD_6_VIEWS = f"{RECORD}-views"  # the record's 6-view evaluation, a process of its own after its timed run
# (driver name, the reference it serves, its code) for the references that are the user's copies.
DRIVERS = ((MUON, MUON, MUON_DRIVER), (RECORD, RECORD, RECORD_DRIVER), (RECORD_6_VIEWS, RECORD, RECORD_VIEWS))


def _reference_drivers(scratch: Path, references: list[str]) -> dict[str, list[str]]:
    """Each reference's command line before its run's arguments: its python and its driver, written into `scratch`.
    A user copy's own arguments go after the run's (see PRELUDE)."""
    prelude = f"ALLOCATORS = {allocator.NAMES!r}\n" + PRELUDE
    drivers = {}
    for name, reference, driver in DRIVERS:
        if reference in references:
            (scratch / f"{name}.py").write_text(prelude + driver)
            drivers[name] = [sys.executable, str(scratch / f"{name}.py")]
    if AIRBENCH94 in references:
        log.info("installing %s into a temporary venv", AIRBENCH94_PACKAGE)
        (scratch / "airbench94_driver.py").write_text(prelude + AIRBENCH94_DRIVER)
        drivers[AIRBENCH94] = [str(reference_python(scratch / "venv")), str(scratch / "airbench94_driver.py")]
    return drivers


def compare(*, files: dict[str, Path], references: list[str], runs: int, first_seed: int, recipe: str,
            overrides: list[str], brackets: list[float], subset: int | None, json_path: str | None,
            command: str) -> dict:
    """The comparison's results, after running the rounds that `json_path` (when given, written after every round)
    does not hold yet. `files`: the user's copies of the references that are not packages."""
    cpu = torch.device("cpu")
    precision = device.pick_precision("auto", cpu).name
    newton_schulz = str(optim.newton_schulz_dtype(cpu)).removeprefix("torch.")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.TRIED)}
    reference_env = allocator.preload_environment(env) or env  # what cifarkit's own restart preloads
    environment = device.report(cpu)
    settings = {"recipe": recipe, "references": references, "first_seed": first_seed, "subset": subset,
                "cpu_kind": device.cpu_kind(), "processor": environment["processor"],
                "cpu_model": environment.get("cpu_model"), "threads": torch.get_num_threads(),
                "precision_policy": precision, "newton_schulz_dtype": newton_schulz,
                "preloaded_by_all": Path(reference_env["LD_PRELOAD"]).name if "LD_PRELOAD" in reference_env else None,
                "muon_sha256": hashlib.sha256(files[MUON].read_bytes()).hexdigest() if MUON in files else None,
                "code": code_version()}
    # Only where given: the files written before the record, --set and --bracket-epochs existed hold no such keys.
    if RECORD in files:
        settings["record_sha256"] = hashlib.sha256(files[RECORD].read_bytes()).hexdigest()
    if overrides:
        settings["overrides"] = overrides
    sides_epochs = budgets(recipe, overrides, brackets) if brackets else None
    if sides_epochs:
        settings["budgets"] = sides_epochs
    checkout = settings["code"]["commit"]  # before kept_rounds, which may name the comparison's first commit there
    rounds = kept_rounds(json_path, settings)
    if rounds:
        log.info("keeping %d round(s) from %s (the last finished %s)", len(rounds), json_path, rounds[-1]["finished"])

    def save() -> dict:
        result = results(rounds, settings, environment, command, files)
        if json_path:
            write_json(json_path, result)
        return result

    # A kill stops the comparison as Ctrl-C does: the rounds that finished are saved, and the scratch folder (the
    # data copy and every run's folder, hundreds of MB) goes with the command.
    with terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix="cifarkit-reference-") as scratch:
        scratch = Path(scratch)
        data = scratch / "data"
        write_reference_data(data / "cifar10", subset)
        drivers = _reference_drivers(scratch, references)

        def run_side(side: str, seed: int) -> dict:
            if side.startswith("cifarkit"):
                budget = [] if side == "cifarkit" else [f"train.epochs={sides_epochs[side]:g}"]
                return cifarkit_run(recipe, [*overrides, *budget], seed, subset, scratch / f"{side}-{seed}", env)
            arguments = [str(seed), str(data), precision, newton_schulz]
            own = [str(files[side].resolve())] if side in files else []
            weights_file = [str(scratch / f"{side}-{seed}.pt")] if side == RECORD else []
            seconds, out = timed([*drivers[side], *arguments, *own, *weights_file], reference_env)
            row = {"seed": seed, "wall_time_s": seconds, **json.loads(out.strip().splitlines()[-1])}
            if side == RECORD:  # its 6 views, in a process of their own, after its timed one
                _, out = timed([*drivers[RECORD_6_VIEWS], *arguments, *own, *weights_file], reference_env)
                row.update(json.loads(out.strip().splitlines()[-1]))
            return row

        sides = ["cifarkit", *(side for side in sides_epochs or {} if side != "cifarkit"), *references]
        complete_rounds(rounds, sides, runs, first_seed, run_side, save, commit=checkout)
    return save()  # also when every round was kept: the file then names the code as the rounds' first command did
