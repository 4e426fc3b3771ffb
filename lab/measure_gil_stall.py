"""Why the server runs traced models: time a forward pass alone and next to a busy Python thread, eager and traced.

    python lab/measure_gil_stall.py            # prints a table, writes results/gil-stall.json

A server's event loop is a Python thread that is busy under load. Eager mode takes the GIL back after every layer
and waits for it while another thread holds it; a traced TorchScript graph runs its layers in C++ without it.
Version B, a batch of 32, one torch thread (as `cifarkit serve` gives its model thread on 2 cores), median of
--passes forward passes each way.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from cifarkit.core import device
from cifarkit.core.files import write_json
from cifarkit.inference.classifier import Classifier

ROOT = Path(__file__).resolve().parent.parent


def medians_ms(classifiers: dict[str, Classifier], pixels: np.ndarray, passes: int) -> dict[str, float]:
    """Median ms of a forward pass of each classifier, their passes interleaved: a noisy machine slows both alike."""
    times: dict[str, list[float]] = {name: [] for name in classifiers}
    for _ in range(passes):
        for name, classifier in classifiers.items():
            started = time.perf_counter()
            classifier.logits(pixels)
            times[name].append(time.perf_counter() - started)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def next_to_busy_thread(measure):
    """`measure()` while another Python thread runs pure Python, holding the GIL but for the switch interval."""
    done = threading.Event()

    def spin():
        while not done.is_set():
            sum(range(1000))
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        return measure()
    finally:
        done.set()
        spinner.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="B")
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gil-stall.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 32, 3), dtype=np.uint8)
    # On the CPU: the stall is of torch's CPU thread team, which the event loop competes with.
    classifiers = {mode: Classifier.load(args.model, device="cpu", traced=mode == "traced")
                   for mode in ("eager", "traced")}
    medians_ms(classifiers, pixels, 5)  # warm-up: kernel choice, the graph executor's first runs
    alone = medians_ms(classifiers, pixels, args.passes)
    contended = next_to_busy_thread(lambda: medians_ms(classifiers, pixels, args.passes))
    rows = [{"mode": mode, "backend": classifier.backend, "alone_ms": round(alone[mode], 2),
             "next_to_busy_thread_ms": round(contended[mode], 2)} for mode, classifier in classifiers.items()]
    print(f"| {args.model}, batch 32, 1 thread | alone | next to a busy Python thread |\n|---|---:|---:|")
    for row in rows:
        print(f"| {row['mode']} ({row['backend']}) | {row['alone_ms']:.1f} ms | "
              f"{row['next_to_busy_thread_ms']:.1f} ms |")
    write_json(args.out, {"command": "python lab/measure_gil_stall.py", "model": args.model, "batch_size": 32,
                          "threads": 1, "passes": args.passes, "environment": device.report(torch.device("cpu")),
                          "rows": rows})
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
