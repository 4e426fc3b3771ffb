"""Measure each backend of the shipped releases on this machine, and record it in their metrics.json.

    python lab/measure_release_backends.py --real-data PATH_TO/cifar-10-python.tar.gz
    python lab/measure_release_backends.py --real-data PATH --releases B --no-accuracy   # speeds only

`auto` (cifarkit.inference.backends) needs two things from a release: each backend's test accuracy and top-1
agreement with fp32 on the 10,000 test images (the accuracy rule), and each backend's speed on a CPU of the kind
that runs it. This writes both for the CPU kind of this machine: `inference.accuracy_by_cpu_kind[KIND]` (bf16 rounds
differently on each kind; the release's own figures, from the machine that made it, stay) and
`inference.speed_by_cpu_kind[KIND]`. The weights, config, preprocess and model card are not touched, so
the release's recorded sha256s still hold.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone

import torch

from cifarkit.artifacts.releases import SHIPPED, read_metrics
from cifarkit.core import device
from cifarkit.core.files import write_json
from cifarkit.data import cifar10
from cifarkit.inference import backends
from cifarkit.inference.classifier import Classifier
from cifarkit.release import build


def measure(version: str, accuracy: bool) -> dict:
    folder = SHIPPED / f"version_{version}"
    metrics = read_metrics(folder)
    inference = metrics["inference"]
    classifiers = {backend: Classifier.load(folder, backend=backend) for backend in backends.BACKENDS}
    dataset = cifar10.load()
    pixels, labels = dataset.test_x.permute(0, 2, 3, 1).numpy(), dataset.test_y.numpy()
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    kind = backends.cpu_kind()
    if accuracy:
        accuracies, agreements = build.backend_accuracies(classifiers, pixels, labels)
        for backend, value in accuracies.items():
            print(f"{version} {backend}: {100 * value:.2f}%, agreeing with fp32 on {100 * agreements[backend]:.2f}%")
        inference.setdefault("accuracy_by_cpu_kind", {})[kind] = {
            "measured": now, "command": "python lab/measure_release_backends.py",
            "test_acc_by_backend": accuracies, "top1_agreement_with_fp32": agreements}
        inference["accuracy_rule"] = backends.ACCURACY_RULE
    rows = build.throughput_rows(classifiers, pixels)
    inference.setdefault("speed_by_cpu_kind", {})[kind] = {
        "measured_on": device.report(torch.device("cpu")), "measured": now,
        "command": "python lab/measure_release_backends.py",
        "what": inference["what"], "throughput": rows,
    }
    for r in rows:
        print(f"{version} {kind} {r['backend']} batch {r['batch_size']}: {r['images_per_s']:,.0f} img/s", flush=True)
    choice = backends.choose(metrics)
    print(f"{version}: auto on this {kind} CPU is {choice.backend} ({choice.reason})")
    write_json(folder / "metrics.json", metrics)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-data", required=True, help="the real cifar-10-python.tar.gz")
    parser.add_argument("--releases", nargs="+", default=["A", "B"])
    parser.add_argument("--no-accuracy", action="store_true", help="keep the recorded accuracies; measure speeds")
    args = parser.parse_args()
    os.environ["CIFARKIT_DATA"] = args.real_data
    for version in args.releases:
        measure(version, accuracy=not args.no_accuracy)


if __name__ == "__main__":
    sys.exit(main())
