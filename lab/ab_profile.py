"""A training step of a recipe, before and after a change: `cifarkit profile` of a commit against the working tree,
in ABBA order, with the per-pair ratios. Writes results/profile-ab-RECIPE-KIND.json, or --json PATH.

    python lab/ab_profile.py --before 4452932                # fast, 3 pairs of 3 steps each
    python lab/ab_profile.py --before HEAD~3 --recipe deep96 --pairs 2

The commit is checked out into a temporary git worktree and run from there (PYTHONPATH), each side as a whole
`python -m cifarkit profile` process, so each side runs its own allocator choice. Run it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from cifarkit.core import device
from cifarkit.core.files import write_json
from cifarkit.inference import backends
from cifarkit.tools.benchmark import SPEED_ONLY
from cifarkit.tools.speedrun import mean_with_t_interval

ROOT = Path(__file__).resolve().parent.parent


def profile(source: Path, recipe: str, steps: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source / "src")}
    env.pop("CIFARKIT_ALLOCATOR_TRIED", None)
    subprocess.run([sys.executable, "-m", "cifarkit", "profile", "--recipe", recipe, "--steps", str(steps),
                    "--json", str(out)], cwd=source, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    process = result["process_per_step"]
    return {"step_s": result["step_s"], "batch_size": result["batch_size"],
            "allocator": result["environment"]["allocator"], "precision": result["precision"],
            "system_share": process["system_s"] / (process["system_s"] + process["user_s"]),
            "minor_page_faults_per_step": process["minor_page_faults"], "parts_s": result["parts_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--recipe", default="fast")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per profile")
    parser.add_argument("--json", type=Path, help="where to write the result (default: "
                        "results/profile-ab-RECIPE-KIND.json); relative to the project")
    args = parser.parse_args()
    if args.json is not None and not (ROOT / args.json).resolve().is_relative_to(ROOT):
        # Checked before the minutes of measuring: the file records the command, which must not name this machine.
        sys.exit(f"--json {args.json}: give a path inside the project, such as results/profile-ab-NAME.json")
    commit, head = (subprocess.run(["git", "rev-parse", "--short", name], cwd=ROOT, check=True, capture_output=True,
                                   text=True).stdout.strip() for name in (args.before, "HEAD"))
    changed = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.strip()
    after = f"{head} with uncommitted changes to src/" if changed else head
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="ab-profile-") as scratch:
        worktree = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), commit], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            sides = {"before": worktree, "after": ROOT}
            order = [side for i in range(args.pairs) for side in (("before", "after") if i % 2 == 0
                                                                   else ("after", "before"))]
            for i, side in enumerate(order):
                result = profile(sides[side], args.recipe, args.steps, Path(scratch) / f"{i}.json")
                runs[side].append(result)
                print(f"{side}: {result['step_s']:.2f} s per step ({result['allocator']}, "
                      f"system {100 * result['system_share']:.1f}% of the CPU time)", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    ratios = [b["step_s"] / a["step_s"] for b, a in zip(runs["before"], runs["after"])]
    mean, interval = mean_with_t_interval(ratios)
    half = None if interval is None else interval[1] - mean
    print(f"speed-up per step (before / after), per pair: {', '.join(f'{r:.2f}' for r in ratios)}; mean {mean:.2f}"
          + (f" (95% t-interval {interval[0]:.2f} to {interval[1]:.2f})" if interval else ""))
    print(SPEED_ONLY)
    kind = backends.cpu_kind()
    out = ROOT / (args.json or Path("results") / f"profile-ab-{args.recipe}-{kind}.json")
    write_json(out, {
        "command": "".join(f"{name}={value} " for name, value in device.isa_caps().items())
                   + f"python lab/ab_profile.py --before {commit}"
                   + (f" --recipe {args.recipe}" if args.recipe != "fast" else "")
                   + (f" --pairs {args.pairs}" if args.pairs != 3 else "")
                   + (f" --steps {args.steps}" if args.steps != 3 else "")
                   + (f" --json {args.json}" if args.json else ""),
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_kind": kind,
        "environment": device.report(torch.device("cpu")), "before": commit, "after": after,
        "order": order, "steps_per_profile": args.steps, "runs": runs, "speedup_per_pair": ratios,
        "speedup_mean": mean, "speedup_ci95_half_width": half, "accuracy": SPEED_ONLY,
    })
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
