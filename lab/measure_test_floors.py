"""Measure the accuracy floors that the tests assert, and write them to results/test-floors.json.

    python lab/measure_test_floors.py --real-data PATH_TO/cifar-10-python.tar.gz
    python lab/measure_test_floors.py --real-data PATH --only fast-2-epochs-2-ranks-sample   # one check again
    python lab/measure_test_floors.py --real-data PATH --only releases   # the shipped releases' floors again

A test that says "this training learns" needs a floor, and a floor must be measured, not guessed. Each check below
is run here exactly as its test runs it (same recipe, overrides and data), over several seeds; the floor is the
worst seed minus a margin. The tests read their settings and floors from the JSON, so the two cannot drift apart.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "results" / "test-floors.json"
FIXTURE = ROOT / "tests" / "fixtures" / "cifar10-mini.safetensors"
SEEDS = (0, 1, 2, 3, 4)
# The tests run seed 0 on whatever CPU runs CI; other CPUs round differently, so a floor sits under the worst of
# five seeds by a margin of the size of the seed-to-seed spread seen here (a few points on 500 test images).
TRAINING_MARGIN = 0.05
# A shipped release is judged by fixed weights on fixed images: only kernel rounding differs between CPUs, so the
# margin is one point (5 of the fixture's 500 test images).
RELEASE_MARGIN = 0.01
# The gate reads each release through the backend `auto` picks on the CPU that runs it (cifarkit.inference.backends),
# so each backend's floor is measured; they guard the weights and the model's code, each backend's agreement with
# fp32 is measured by the release itself.
TRAINING_CHECKS = {
    # test_fast.py: one epoch of the fast recipe on 1,000 of the committed sample's training images, all 500 test
    # images
    "fast-1-epoch-sample": {"recipe": "fast", "overrides": ["train.epochs=1", "train.batch_size=100",
                                                            "data.subset=1000"],
                            "data": "sample"},
    # test_learning.py: cifar10net, 4 epochs on the sample (on 1,000 of its images, one seed of five stayed near
    # chance: too weak a check)
    "cifar10net-4-epochs-sample": {"recipe": "cifar10net", "overrides": ["train.epochs=4", "train.batch_size=64"],
                                   "data": "sample"},
    # test_learning.py (real data only): cifar10net, 2 epochs on 2,500 real training images, all 10,000 test images
    # read once, after the last epoch
    "cifar10net-2-epochs-real-2500": {"recipe": "cifar10net", "overrides": ["train.epochs=2", "data.subset=2500",
                                                                            "train.eval_every=2"],
                                      "data": "real"},
    # test_distributed.py: the fast recipe on 2 gloo ranks (`cifarkit train --nproc 2`), 2 epochs of 400 of the
    # sample's training images, without TTA: six such launches must fit in the suite's time. The whitening bias freezes
    # after epoch 1, so that DDP meets a parameter that stops training mid-run.
    "fast-2-epochs-2-ranks-sample": {"recipe": "fast", "overrides": ["train.epochs=2", "train.batch_size=100",
                                                                     "data.subset=400", "train.tta=false",
                                                                     "train.whiten_bias_epochs=1"],
                                     "data": "sample", "nproc": 2},
}


def _use_home(folder: Path, real_data: str | None) -> None:
    os.environ["CIFARKIT_HOME"] = str(folder)
    if real_data:
        os.environ["CIFARKIT_DATA"] = real_data
    else:
        os.environ.pop("CIFARKIT_DATA", None)


def measure_training(name: str, check: dict, scratch: Path) -> dict:
    from cifarkit.cli import main
    accuracies = []
    for seed in SEEDS:
        out = scratch / f"{name}-seed{seed}"
        settings = [arg for text in check["overrides"] + [f"train.seed={seed}"] for arg in ("--set", text)]
        if main(["train", "--recipe", check["recipe"], *settings, "--nproc", str(check.get("nproc", 1)),
                 "--out", str(out)]):
            raise SystemExit(f"measure_test_floors: {name} seed {seed} failed")
        summary = json.loads((out / "summary.json").read_text())
        accuracies.append(summary["test_acc"])
        print(f"{name} seed {seed}: {100 * summary['test_acc']:.2f}%", flush=True)
    return {**check, "seeds": list(SEEDS), "test_acc": accuracies, "mean": statistics.fmean(accuracies),
            "min": min(accuracies), "floor": round(min(accuracies) - TRAINING_MARGIN, 4),
            "rule": f"worst seed minus {TRAINING_MARGIN:g}"}


def measure_releases() -> dict:
    """Single-view accuracy of each shipped release through each backend, on the sample's 500 test images."""
    from cifarkit import Classifier
    from cifarkit.artifacts.releases import SHIPPED
    from cifarkit.data import cifar10
    from cifarkit.inference import backends
    sample = cifar10.load_cache(FIXTURE)
    pixels, labels = sample.test_x.permute(0, 2, 3, 1).numpy(), sample.test_y.tolist()
    result = {}
    for folder in sorted(SHIPPED.glob("version_*")):
        version = folder.name.removeprefix("version_")
        floors = {}
        for backend in backends.BACKENDS:
            # On the CPU, where the tests that read these floors run.
            predictions = Classifier.pretrained(version, backend=backend, device="cpu").predict_batch(pixels)
            accuracy = sum(int(p == y) for p, y in zip(predictions, labels)) / len(labels)
            print(f"release {version} on the sample, {backend}: {100 * accuracy:.2f}%", flush=True)
            floors[backend] = {"test_acc": accuracy, "floor": round(accuracy - RELEASE_MARGIN, 4)}
        result[version] = {"images": len(labels), "backends": floors, "rule": f"measured minus {RELEASE_MARGIN:g}"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-data", required=True, help="the real cifar-10-python.tar.gz (for the real-data check)")
    parser.add_argument("--only", nargs="+", choices=[*TRAINING_CHECKS, "releases"], metavar="CHECK",
                        help="measure these training checks (or the releases) again, and keep the others' figures")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="test-floors-"))
    try:
        sample_home, real_home = scratch / "sample-home", scratch / "real-home"
        sample_home.mkdir()
        shutil.copy(FIXTURE, sample_home / "cifar10.safetensors")
        kept = json.loads(TARGET.read_text()) if args.only else {}
        checks = {name: figures for name, figures in kept.get("training", {}).items() if name in TRAINING_CHECKS}
        for name, check in TRAINING_CHECKS.items():
            if args.only and name not in args.only:
                continue
            real = check["data"] == "real"
            _use_home(real_home if real else sample_home, args.real_data if real else None)
            checks[name] = measure_training(name, check, scratch)
        import torch

        from cifarkit.core import device
        from cifarkit.core.files import write_json
        measured = {"measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "environment": device.report(torch.device("cpu"))}
        for name in checks:  # when each check was measured, and where: they may differ once --only was used
            if args.only is None or name in args.only:
                checks[name] = {**checks[name], **measured}
        if args.only is None:
            releases = measure_releases()
        elif "releases" in args.only:
            releases = {version: {**figures, **measured} for version, figures in measure_releases().items()}
        else:
            releases = kept["releases"]
        write_json(TARGET, {
            "command": "python lab/measure_test_floors.py --real-data PATH_TO/cifar-10-python.tar.gz",
            **(kept if args.only else measured),
            "training": {name: checks[name] for name in TRAINING_CHECKS if name in checks},
            "releases": releases,
        })
        print(f"wrote {TARGET.relative_to(ROOT)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
