"""A reference on a CUDA GPU as its author runs it, the anchor for `cifarkit speedrun --device cuda`.

    python lab/reference_cuda.py --reference airbench94_muon --file airbench94_muon.py --runs 5 \
        --json device-check/airbench94_muon-cuda.json
    python lab/reference_cuda.py --reference cifar10_speedrun --file cifar10_speedrun.py --runs 5 \
        --json device-check/cifar10_speedrun-cuda.json

Each reference's own __main__, minus its 200 runs: the model compiled with mode="max-autotune", one warm-up run on
random labels (compilation, not timed), then --runs runs with seeds 0, 1, ... (the 2025 record also empties the
cache and idles the GPU for a moment before each run, as its __main__ does). Each run's time is the reference's own
timer (CUDA events over the whitening init, the training and the final 6-view TTA, per-epoch evaluations excluded),
as its published figure is. `--compile-mode default` drops every mode= its torch.compile calls give, for a lease too
short for max-autotune's warm-up; the results say which ran. The data: this machine's CIFAR-10 cache, written as the
cifar10/train.pt and test.pt their loaders read first. `cifarkit reference` is the CPU comparison; it runs the
references uncompiled, as cifarkit runs there.
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
from cifarkit.tools.reference import write_reference_data
from cifarkit.tools.reference_drivers import MUON, RECORD, USER_COPIES


def muon_run(module, model, run) -> dict:
    """airbench94_muon's main(): it returns the TTA accuracy and prints its timer in the run's last row."""
    finals = []
    printed = module.print_training_details
    module.print_training_details = lambda variables, is_final_entry: (
        finals.append(dict(variables)) if is_final_entry else None, printed(variables, is_final_entry))
    try:
        accuracy = module.main(run, model)
    finally:
        module.print_training_details = printed
    return {"test_acc": accuracy, "train_time_s": finals[-1]["time_seconds"]}


def record_run(module, model, run) -> dict:
    """The 2025 record's main(): it returns (single-view accuracy, TTA accuracy, its timer)."""
    import torch
    if run != "warmup":  # what its __main__ does before each timed run
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda._sleep(6_000_000_000)
    single_view, accuracy, seconds = module.main(run, model)
    return {"test_acc": accuracy, "test_acc_single_view": single_view, "train_time_s": seconds}


PROTOCOLS = {MUON: muon_run, RECORD: record_run}


def without_compile_modes(torch) -> None:
    """torch.compile and Module.compile from here on ignore mode=: the compiler's default, no autotuning."""
    compile_with_mode = torch.compile

    def compile_default(model=None, **options):
        options.pop("mode", None)
        return compile_with_mode(model, **options) if model is not None else compile_with_mode(**options)
    torch.compile = compile_default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, choices=sorted(PROTOCOLS))
    parser.add_argument("--file", required=True, help="your copy of the reference's script")
    parser.add_argument("--runs", type=int, default=5, help="timed runs after the warm-up (default: 5)")
    parser.add_argument("--compile-mode", choices=("max-autotune", "default"), default="max-autotune",
                        help="max-autotune, as the authors run it (default), or the compiler's default, quicker")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    try:
        script = USER_COPIES[args.reference].check(args.file).resolve()
    except CifarkitError as e:
        sys.exit(f"reference_cuda: {e}")

    import torch

    from cifarkit.core import device
    from cifarkit.core.files import write_json
    if not torch.cuda.is_available():
        sys.exit("reference_cuda: torch sees no CUDA device here; `cifarkit reference` compares on the CPU")
    if args.compile_mode == "default":
        without_compile_modes(torch)
    spec = importlib.util.spec_from_file_location(args.reference, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    protocol = PROTOCOLS[args.reference]

    with tempfile.TemporaryDirectory(prefix="cifarkit-reference-") as scratch:
        write_reference_data(Path(scratch) / "cifar10", None)
        os.chdir(scratch)
        torch.manual_seed(0)
        model = module.CifarNet().cuda().to(memory_format=torch.channels_last)
        model.compile(mode="max-autotune")
        protocol(module, model, "warmup")
        runs = []
        for seed in range(args.runs):
            torch.manual_seed(seed)
            runs.append({"seed": seed, **protocol(module, model, seed)})
    result = {"command": f"python lab/reference_cuda.py --reference {args.reference} --file {script.name} "
                         f"--runs {args.runs} --compile-mode {args.compile_mode}",
              "reference": args.reference, "compiled": args.compile_mode,
              "timer": "its own CUDA events: whitening init, training and the final 6-view TTA",
              "accuracy_mean": statistics.fmean(r["test_acc"] for r in runs),
              "train_time_s_mean": statistics.fmean(r["train_time_s"] for r in runs), "runs": runs,
              "environment": device.report(torch.device("cuda"))}
    print(f"{args.reference} on {torch.cuda.get_device_name()}: {100 * result['accuracy_mean']:.2f}% in "
          f"{result['train_time_s_mean']:.2f} s (mean of {args.runs}, compiled with {args.compile_mode})")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
