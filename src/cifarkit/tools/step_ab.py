"""`cifarkit profile --before COMMIT`: a recipe's training step at a commit against the working tree, in ABBA pairs.

A change that should make the step faster is judged by pairs of whole `cifarkit profile` processes, the commit's
(checked out into a temporary git worktree) and the working tree's, taking turns so that a machine that slows down
mid-way slows both sides alike; each side runs its own allocator choice. The ratios are of step time alone: what a
change does to accuracy, a speed run measures.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.tools.benchmark import SPEED_ONLY
from cifarkit.tools.speedrun import mean_with_t_interval
from cifarkit.training.tracking import git_source

SOURCE = Path(__file__).resolve().parent.parent.parent  # the src/ folder of this checkout


def _git(*args: str, cwd: Path = SOURCE) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _checkout() -> tuple[Path, str]:
    """The root of the git checkout cifarkit runs from, and its HEAD as the after side names it."""
    source = git_source()
    if source is None:
        raise CifarkitError(f"--before compares commits, and {SOURCE} is not the src/ folder of a git checkout; run "
                            f"cifarkit from a checkout (`pip install -e .` in it)")
    head = source["commit"][:7]
    after = f"{head} with uncommitted changes to src/" if source["modified"] else head
    return Path(_git("rev-parse", "--show-toplevel")), after


def _profile(source: Path, recipe: str, overrides: list[str], steps: int, out: Path) -> dict:
    """One side's step, from a whole `cifarkit profile` process run on `source`'s src/."""
    env = {**os.environ, "PYTHONPATH": str(source / "src")}
    env.pop("CIFARKIT_ALLOCATOR_TRIED", None)  # each side chooses its allocator afresh
    command = [sys.executable, "-m", "cifarkit", "profile", "--recipe", recipe, "--steps", str(steps),
               *(f"--set={override}" for override in overrides), "--json", str(out)]
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
    if done.returncode:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CifarkitError(f"`cifarkit profile` at {source.name} failed: {error}")
    result = json.loads(out.read_text())
    process = result["process_per_step"]
    return {"step_s": result["step_s"], "batch_size": result["batch_size"],
            "allocator": result["environment"]["allocator"], "precision": result["precision"],
            "system_share": process["system_s"] / (process["system_s"] + process["user_s"]),
            "minor_page_faults_per_step": process["minor_page_faults"], "parts_s": result["parts_s"]}


def compare(before: str, recipe: str, overrides: list[str], steps: int, pairs: int, log=print) -> dict:
    """The step at `before` against the working tree's, in `pairs` ABBA pairs, with the per-pair ratios."""
    root, after = _checkout()
    try:
        commit = _git("rev-parse", "--short", "--verify", f"{before}^{{commit}}")
    except subprocess.CalledProcessError:
        raise CifarkitError(f"--before {before}: no such commit in {root.name}; give a commit, tag or branch that "
                            f"`git log` shows") from None
    runs = {"before": [], "after": []}
    order = [side for i in range(pairs) for side in (("before", "after") if i % 2 == 0 else ("after", "before"))]
    with tempfile.TemporaryDirectory(prefix="cifarkit-ab-") as scratch:
        worktree = Path(scratch) / commit
        _git("worktree", "add", "--detach", str(worktree), commit, cwd=root)
        try:
            for i, side in enumerate(order):
                result = _profile(worktree if side == "before" else root, recipe, overrides, steps,
                                  Path(scratch) / f"{i}.json")
                runs[side].append(result)
                log(f"{side}: {result['step_s']:.2f} s per step ({result['allocator']}, system "
                    f"{100 * result['system_share']:.1f}% of the CPU time)")
        finally:
            _git("worktree", "remove", "--force", str(worktree), cwd=root)
    ratios = [b["step_s"] / a["step_s"] for b, a in zip(runs["before"], runs["after"])]
    mean, interval = mean_with_t_interval(ratios)
    return {"cpu_kind": device.cpu_kind(), "environment": device.report(torch.device("cpu")), "before": commit,
            "after": after, "recipe": recipe, "overrides": overrides, "order": order, "steps_per_profile": steps,
            "runs": runs, "speedup_per_pair": ratios, "speedup_mean": mean,
            "speedup_ci95_half_width": None if interval is None else interval[1] - mean, "accuracy": SPEED_ONLY}


def summary(result: dict) -> str:
    """The per-pair ratios and their mean, with the speed-only note."""
    half = result["speedup_ci95_half_width"]
    spread = f" (95% t-interval +- {half:.2f})" if half is not None else ""
    return (f"speed-up per step (before {result['before']} / after {result['after']}), per pair: "
            f"{', '.join(f'{r:.2f}' for r in result['speedup_per_pair'])}; mean {result['speedup_mean']:.2f}{spread}"
            f"\n{SPEED_ONLY}")
