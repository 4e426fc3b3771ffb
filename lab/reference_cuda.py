"""airbench94_muon on a CUDA GPU as its author runs it, the anchor for `cifarkit speedrun --device cuda`.

    python lab/reference_cuda.py --muon airbench94_muon.py --runs 5 --json device-check/airbench94-muon-cuda.json

Its own __main__, minus the 200 runs: the model compiled with mode="max-autotune", one warm-up run on random labels
(compilation, not timed), then --runs runs with seeds 0, 1, ... Each run's time is its own timer (CUDA events over
the whitening init, the 8 epochs and the final TTA, its per-epoch evaluations excluded), as its published figure is.
The data: this machine's CIFAR-10 cache, written as the cifar10/train.pt and test.pt its loader reads first.
`cifarkit reference` is the CPU comparison; it runs the reference uncompiled, as cifarkit runs there.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

from cifarkit.core.errors import CifarkitError
from cifarkit.tools.reference import USER_COPIES, write_reference_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--muon", required=True, help="path of a local copy of airbench94_muon.py")
    parser.add_argument("--runs", type=int, default=5, help="timed runs after the warm-up (default: 5)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    try:
        muon_file = USER_COPIES["airbench94_muon"].check(args.muon).resolve()
    except CifarkitError as e:
        sys.exit(f"reference_cuda: {e}")

    import torch

    from cifarkit.core import device
    from cifarkit.core.files import write_json
    if not torch.cuda.is_available():
        sys.exit("reference_cuda: torch sees no CUDA device here; `cifarkit reference` compares on the CPU")
    spec = importlib.util.spec_from_file_location("airbench94_muon", muon_file)
    muon = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(muon)
    finals = []  # the variables of each run's last printed row: its accuracy and its own timer
    printed = muon.print_training_details
    muon.print_training_details = lambda variables, is_final_entry: (
        finals.append(dict(variables)) if is_final_entry else None, printed(variables, is_final_entry))

    with tempfile.TemporaryDirectory(prefix="cifarkit-reference-") as scratch:
        write_reference_data(Path(scratch) / "cifar10", None)
        os.chdir(scratch)
        torch.manual_seed(0)
        model = muon.CifarNet().cuda().to(memory_format=torch.channels_last)
        model.compile(mode="max-autotune")
        muon.main("warmup", model)
        runs = []
        for seed in range(args.runs):
            torch.manual_seed(seed)
            accuracy = muon.main(seed, model)
            runs.append({"seed": seed, "test_acc": accuracy, "train_time_s": finals[-1]["time_seconds"]})
    result = {"command": f"python lab/reference_cuda.py --muon {muon_file.name} --runs {args.runs}",
              "reference": "airbench94_muon", "compiled": "max-autotune",
              "timer": "its own CUDA events: whitening init, 8 epochs and the final 6-view TTA",
              "accuracy_mean": statistics.fmean(r["test_acc"] for r in runs),
              "train_time_s_mean": statistics.fmean(r["train_time_s"] for r in runs), "runs": runs,
              "environment": device.report(torch.device("cuda"))}
    print(f"airbench94_muon on {torch.cuda.get_device_name()}: {100 * result['accuracy_mean']:.2f}% in "
          f"{result['train_time_s_mean']:.2f} s (mean of {args.runs})")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
