"""Time a short `fast` training under each memory allocator, in ABBA order, and write results/allocators-KIND.json.

    python lab/measure_allocators.py                     # glibc against mimalloc (and tcmalloc where installed)
    python lab/measure_allocators.py --subset 10000 --rounds 2

Each run is a real `cifarkit train --recipe fast` process (one epoch on a subset of the training images, then the
evaluation of the 10,000 test images) with CIFARKIT_ALLOCATOR set; its CPU time in user and kernel mode and its
minor page faults come from wait4, and the allocator that ran from the run's own config.yaml. Run it alone: the
kernel's share is what it compares, and another job's page faults are not counted but its contention is.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from cifarkit.core import allocator, device
from cifarkit.core.files import write_json
from cifarkit.inference import backends

ROOT = Path(__file__).resolve().parent.parent
# CIFARKIT_ALLOCATOR value of each allocator: "system" keeps glibc's malloc as it is.
SETTINGS = {"glibc": "system", "mimalloc": "mimalloc", "tcmalloc": ""}


def run_once(setting: str, subset: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (allocator.TRIED, "LD_PRELOAD")}
    command = [sys.executable, "-m", "cifarkit", "train", "--recipe", "fast", "--set", "train.epochs=1",
               "--set", f"data.subset={subset}", "--set", "train.tta=false", "--out", str(out)]
    start = time.perf_counter()
    child = subprocess.Popen(command, env={**env, allocator.ENV: setting}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"measure_allocators: the run with {allocator.ENV}={setting!r} failed: "
                         f"{child.stderr.read()[-2000:]}")
    ran = yaml.safe_load((out / "config.yaml").read_text())["run"]["allocator"]
    cpu = usage.ru_utime + usage.ru_stime
    return {"allocator": ran, "wall_s": wall, "user_s": usage.ru_utime, "system_s": usage.ru_stime,
            "system_share": usage.ru_stime / cpu, "minor_page_faults": usage.ru_minflt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subset", type=int, default=6000, help="training images of the one epoch")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds: each allocator runs twice per round")
    parser.add_argument("--allocators", nargs="+", choices=list(SETTINGS), help="default: glibc, mimalloc and "
                        "tcmalloc where it is installed")
    parser.add_argument("--out", type=Path, help="default: results/allocators-KIND.json")
    args = parser.parse_args()
    names = args.allocators or ["glibc", "mimalloc"] + (["tcmalloc"] if allocator.find() else [])
    order = [name for _ in range(args.rounds) for name in names + names[::-1]]
    runs = []
    with tempfile.TemporaryDirectory(prefix="allocators-") as scratch:
        for i, name in enumerate(order):
            result = {"asked": name, **run_once(SETTINGS[name], args.subset, Path(scratch) / f"run{i}")}
            runs.append(result)
            print(f"{name}: {result['wall_s']:.1f} s wall, {result['user_s']:.1f} s user, {result['system_s']:.1f} s "
                  f"system ({100 * result['system_share']:.1f}% of the CPU time), "
                  f"{result['minor_page_faults']:,} minor page faults", flush=True)
    summary = {name: {key: statistics.fmean(r[key] for r in runs if r["asked"] == name)
                      for key in ("wall_s", "system_share", "minor_page_faults")} for name in names}
    print("\n| allocator | wall s | kernel share of CPU time | minor page faults |\n|---|---:|---:|---:|")
    for name, s in summary.items():
        print(f"| {name} | {s['wall_s']:.1f} | {100 * s['system_share']:.1f}% | {s['minor_page_faults']:,.0f} |")
    kind = backends.cpu_kind()
    out = (args.out or ROOT / "results" / f"allocators-{kind}.json").resolve()
    write_json(out, {
        "command": "python lab/measure_allocators.py" + (f" --subset {args.subset}" if args.subset != 6000 else "")
                   + (f" --rounds {args.rounds}" if args.rounds != 1 else "")
                   + (f" --allocators {' '.join(args.allocators)}" if args.allocators else "")
                   + (f" --out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out.name}" if args.out else ""),
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_kind": kind,
        "environment": device.report(torch.device("cpu")),
        "what": f"cifarkit train --recipe fast, 1 epoch of {args.subset} training images and the test set, no TTA",
        "order": order, "runs": runs, "mean": summary,
    })
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    sys.exit(main())
