"""Run the test suite as CI runs it and write what each test file cost to results/test-durations.json.

    python lab/measure_test_durations.py                  # the whole suite, pyproject's pytest settings
    python lab/measure_test_durations.py -- -k distributed   # anything after -- goes to pytest

It records the suite's wall time, the seconds each test file took (setup, call and teardown of its tests, from
pytest's JUnit report), the 15 slowest tests and the CPU kind. tests/conftest.py hands the files to the xdist
workers costliest first, by these seconds, so that the workers finish together. Run it alone, with CIFARKIT_DATA
set as CI sets it (the real-data tests are among the slowest), and without another job on the machine.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch

from cifarkit.core import device
from cifarkit.core.files import write_json
from cifarkit.inference import backends

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "results" / "test-durations.json"
SLOWEST = 15


def test_costs(report: Path) -> tuple[Counter, list[dict]]:
    """Seconds per test file and per test, from a JUnit XML report (its classname is the file's dotted path)."""
    files, tests = Counter(), []
    for case in ElementTree.parse(report).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        seconds = float(case.get("time", 0.0))
        files[path] += seconds
        tests.append({"test": f"{path}::{case.get('name')}", "seconds": round(seconds, 1)})
    return files, sorted(tests, key=lambda t: -t["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    parser.add_argument("--out", type=Path, default=TARGET, help="the JSON to write (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "junit.xml"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", f"--junitxml={report}", *args.pytest_args], cwd=ROOT)
        wall = time.perf_counter() - start
        files, tests = test_costs(report)
    if done.returncode != 0:
        sys.exit(f"pytest failed (exit {done.returncode}); durations of a failing suite are not recorded")
    result = {
        "what": "seconds per test file (setup + call + teardown of its tests), from pytest's JUnit report; "
                "tests/conftest.py orders the files for the xdist workers by them",
        "command": " ".join(["python lab/measure_test_durations.py", *(["--", *args.pytest_args]
                                                                          if args.pytest_args else [])]),
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_kind": backends.cpu_kind(),
        "processor": device.report()["processor"],
        "torch": torch.__version__,
        "tests": len(tests),
        "wall_s": round(wall, 1),
        "test_seconds_total": round(sum(files.values()), 1),
        "files": {path: round(seconds, 1) for path, seconds in files.most_common()},
        "slowest": tests[:SLOWEST],
        "every_test": {test["test"]: test["seconds"] for test in tests},
    }
    write_json(args.out, result)
    print(f"{len(tests)} tests in {wall:.0f} s of wall time ({result['test_seconds_total']:.0f} s of test time), "
          f"CPU kind {result['cpu_kind']}; written to {args.out}")
    for path, seconds in files.most_common(10):
        print(f"{seconds:8.1f} s  {path}")


if __name__ == "__main__":
    main()
