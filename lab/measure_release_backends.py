"""Measure each backend of the shipped releases on this machine, and record it in their metrics.json.

    python lab/measure_release_backends.py --real-data PATH_TO/cifar-10-python.tar.gz
    python lab/measure_release_backends.py --real-data PATH --releases B --no-accuracy   # speeds only
    python lab/measure_release_backends.py --real-data PATH --device cuda               # on this machine's GPU

`auto` (cifarkit.inference.backends) needs two things from a release: each backend's test accuracy and top-1
agreement with fp32 on the 10,000 test images (the accuracy rule), and each backend's speed on a device of the kind
that runs it. This writes both for the kind of this machine's device: `inference.accuracy_by_cpu_kind[KIND]` (bf16
rounds differently on each CPU kind, fp16 and bf16 differently again on a GPU; the release's own figures, from the
machine that made it, stay) and `inference.speed_by_cpu_kind[KIND]`, where KIND is the CPU's kind, or "cuda". On a
GPU the backends are GPU_BACKENDS, judged against fp32 on the same GPU; onnxruntime among them only where its
session reaches the GPU (onnxruntime-gpu installed). The weights, config, preprocess and model card are not touched,
so the release's recorded sha256s still hold.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone

import torch

from cifarkit.artifacts.releases import SHIPPED, read_metrics
from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import write_json
from cifarkit.data import cifar10
from cifarkit.inference import backends
from cifarkit.inference.classifier import Classifier
from cifarkit.release import build


def loaded(folder, where: torch.device) -> dict:
    """Every backend of the device `where`, loaded on it; on a GPU, onnxruntime only where it reaches the GPU."""
    classifiers = {}
    for backend in backends.BACKENDS if where.type == "cpu" else backends.GPU_BACKENDS:
        try:
            classifiers[backend] = Classifier.load(folder, backend=backend, device=where.type)
        except CifarkitError as e:
            if backend != "onnxruntime":
                raise
            print(f"skipped onnxruntime: {e}", flush=True)
    return classifiers


def measure(version: str, accuracy: bool, where: torch.device) -> dict:
    folder = SHIPPED / f"version_{version}"
    metrics = read_metrics(folder)
    inference = metrics["inference"]
    classifiers = loaded(folder, where)
    dataset = cifar10.load()
    pixels, labels = dataset.test_x.permute(0, 2, 3, 1).numpy(), dataset.test_y.numpy()
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    kind = backends.device_kind(where.type)
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
        "measured_on": device.report(where), "measured": now,
        "command": "python lab/measure_release_backends.py",
        "what": inference["what"], "throughput": rows,
    }
    for r in rows:
        print(f"{version} {kind} {r['backend']} batch {r['batch_size']}: {r['images_per_s']:,.0f} img/s", flush=True)
    choice = backends.choose(metrics, where.type)
    print(f"{version}: auto on this machine's {kind} is {choice.backend} ({choice.reason})")
    write_json(folder / "metrics.json", metrics)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-data", required=True, help="the real cifar-10-python.tar.gz")
    parser.add_argument("--releases", nargs="+", default=["A", "B"])
    parser.add_argument("--no-accuracy", action="store_true", help="keep the recorded accuracies; measure speeds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device to measure on")
    args = parser.parse_args()
    os.environ["CIFARKIT_DATA"] = args.real_data
    where = device.pick_device(args.device)
    device.configure(where)  # on a GPU, cuDNN's autotuner, as `cifarkit serve` runs
    for version in args.releases:
        measure(version, accuracy=not args.no_accuracy, where=where)


if __name__ == "__main__":
    sys.exit(main())
