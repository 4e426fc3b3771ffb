"""Images per second of `engine.evaluate` on the CPU at each evaluation batch size, per model and thread count, and
write results/eval-batch-KIND.json (KIND: the CPU kind, as in backends.CPU_KINDS).

    python lab/measure_eval_batch.py
    python lab/measure_eval_batch.py --batch-sizes 128 256 1000 --rounds 3

The batch sizes take turns within each round (ABAB...), so drift on a shared machine falls on every size alike; the
median over rounds is kept. engine.EVAL_BATCH_CPU is chosen from these tables. Run it alone.
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from cifarkit import models
from cifarkit.core import device
from cifarkit.core.files import write_json
from cifarkit.inference import backends
from cifarkit.training.engine import evaluate

ROOT = Path(__file__).resolve().parent.parent
# Images per timed pass: enough for several batches of the largest size, few enough for the slowest model.
IMAGES = {"resnet18": 1000, "fastnet": 2000}
DEFAULT_IMAGES = 4000


def images_per_s(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> float:
    cpu, fp32 = torch.device("cpu"), device.PRECISIONS["fp32"]
    start = time.perf_counter()
    evaluate(model, images, labels, (0.5,) * 3, (0.25,) * 3, cpu, fp32, batch_size=batch_size)
    return len(images) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["simplecnn", "cifar10net", "fastnet", "resnet18"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[256, 1000])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, torch.get_num_threads()])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name in args.models:
        model = models.create(name).eval().to(memory_format=torch.channels_last)
        count = IMAGES.get(name, DEFAULT_IMAGES)
        images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, 10, (count,), generator=generator)
        for threads in sorted(set(args.threads)):
            torch.set_num_threads(threads)
            for size in args.batch_sizes:  # warm-up: oneDNN picks and caches its kernels per shape
                images_per_s(model, images[:size], labels[:size], size)
            samples = {size: [] for size in args.batch_sizes}
            for _ in range(args.rounds):
                for size in args.batch_sizes:
                    samples[size].append(images_per_s(model, images, labels, size))
            best = max(args.batch_sizes, key=lambda size: statistics.median(samples[size]))
            for size in args.batch_sizes:
                median = statistics.median(samples[size])
                rows.append({"model": name, "threads": threads, "batch_size": size, "images": count,
                             "images_per_s": round(median, 1), "samples": [round(s, 1) for s in samples[size]],
                             "vs_best": round(median / statistics.median(samples[best]), 3)})
                print(f"{name:11s} {threads} thread(s) batch {size:5d}: {median:8.1f} img/s", flush=True)
    kind = backends.cpu_kind()
    write_json(ROOT / "results" / f"eval-batch-{kind}.json", {
        "what": "img/s of engine.evaluate (fp32, single view, channels-last) on random uint8 images, median of "
                f"{args.rounds} interleaved rounds",
        "command": "python lab/measure_eval_batch.py",
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_kind": kind, "processor": device.report()["processor"], "torch": torch.__version__,
        "rows": rows,
    })
    print(f"written to results/eval-batch-{kind}.json")


if __name__ == "__main__":
    main()
