"""Time the published airbench94 next to `cifarkit train --recipe fast` on this machine, and write the ratio.

    python scripts/compare_reference.py                       # 1 run of each, interleaved
    python scripts/compare_reference.py --runs 3 --json results/compare-reference.json

The reference is the public package airbench==0.1.8 (lib_airbench94: 9.9 epochs, batch 1024, Nesterov SGD,
lookahead, TTA level 2), installed at run time into a temporary venv that sees this environment's torch through a
.pth file. Its code is written for CUDA in fp16. It is adapted here, at run time, to the device and dtype alone, as
cifarkit's own CPU path runs: tensors and modules stay on the CPU in fp32 (`.cuda()` and `.half()` do nothing), the
net's forward passes run under bf16 autocast and return fp32 logits, and torch.cuda's timing events read the host
clock. Autocast covers the forward passes only, as in cifarkit: around the whole run it would also compute the
whitening filters' patch covariance in bf16, whose rounding makes eigenvalues negative and the filters NaN (seen
here: 10% accuracy). Its data is this machine's
CIFAR-10 cache, written as the train.pt / test.pt files its loader reads first. Nothing of its code is in this
repository.

Both sides are timed the same way: the wall clock of the whole process, from launch to exit, imports included;
each process trains once and measures its test accuracy once, with TTA. The runs alternate, reference first, so a
slow minute on this shared machine falls on both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "airbench==0.1.8"

# The reference's process. It prints one JSON line: its test accuracy with TTA level 2, as the package evaluates it.
DRIVER = r"""
import json, sys, time
import torch
from torch import nn

seed, data_dir = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(seed)
# The device and dtype, adapted: nothing moves to CUDA or to fp16; bf16 autocast does the casting, as in cifarkit.
nn.Module.cuda = lambda self, *args, **kwargs: self
nn.Module.half = lambda self: self
torch.Tensor.half = lambda self, *args, **kwargs: self.float()

class HostEvent:  # torch.cuda.Event(enable_timing=True) on the host clock
    def __init__(self, *args, **kwargs):
        self.at = None
    def record(self, *args):
        self.at = time.perf_counter()
    def elapsed_time(self, end):
        return 1e3 * (end.at - self.at)

torch.cuda.Event, torch.cuda.synchronize = HostEvent, lambda *args: None

import airbench
from airbench import lib_airbench94, utils

class CpuLoader(utils.CifarLoader):  # its data on the CPU, from the train.pt / test.pt written for it
    def __init__(self, path, *args, **kwargs):
        kwargs["gpu"] = "cpu"
        super().__init__(data_dir, *args, **kwargs)

def make_net():  # its net, whose forward passes run under bf16 autocast and return fp32 logits, as cifarkit's do
    net = lib_airbench94.make_net94()
    forward = net.forward
    def autocast_forward(inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(inputs).float()
    net.forward = autocast_forward
    return net

utils.CifarLoader = lib_airbench94.CifarLoader = CpuLoader
model = lib_airbench94.train94(make_net=make_net, verbose=False)
accuracy = airbench.evaluate(model, CpuLoader(None, train=False, batch_size=2000), tta_level=2)
print(json.dumps({"test_acc": accuracy}))
"""


def reference_python(folder: Path) -> Path:
    """A venv in `folder` with the reference installed; this environment's packages (torch) visible through a .pth."""
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "cifarkit-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", REFERENCE], check=True)
    return python


def write_reference_data(folder: Path) -> None:
    """CIFAR-10 from cifarkit's cache in the layout the reference's loader reads before it would download."""
    import torch

    from cifarkit import data
    dataset = data.load()
    for name, images, labels in (("train.pt", dataset.train_x, dataset.train_y),
                                 ("test.pt", dataset.test_x, dataset.test_y)):
        # Its loader expects N x 32 x 32 x 3 uint8, as torchvision's CIFAR10.data holds them.
        torch.save({"images": images.permute(0, 2, 3, 1).contiguous(), "labels": labels,
                    "classes": list(data.CLASSES)}, folder / name)


def timed(command: list[str], env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of each side, alternating (default: 1)")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first run of each side (default: 0)")
    parser.add_argument("--recipe", default="fast", help="cifarkit's side (default: fast)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()

    from cifarkit import allocator, device
    from cifarkit.files import portable, write_json
    from cifarkit.speedrun import statistics_against
    with tempfile.TemporaryDirectory(prefix="cifarkit-reference-") as scratch:
        scratch = Path(scratch)
        print(f"installing {REFERENCE} into a temporary venv", file=sys.stderr)
        python = reference_python(scratch / "venv")
        (scratch / "data").mkdir()
        write_reference_data(scratch / "data")
        (scratch / "driver.py").write_text(DRIVER)
        # Both sides on the same allocator: cifarkit preloads tcmalloc when it is installed, so the reference does too.
        library = allocator.find()
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.TRIED)}
        reference_env = {**env, "LD_PRELOAD": str(library)} if library else env
        runs = {"reference": [], "cifarkit": []}
        for seed in range(args.first_seed, args.first_seed + args.runs):
            seconds, out = timed([str(python), str(scratch / "driver.py"), str(seed), str(scratch / "data")],
                                 reference_env)
            runs["reference"].append({"seed": seed, "wall_time_s": seconds,
                                      "test_acc": json.loads(out.strip().splitlines()[-1])["test_acc"]})
            print(f"reference seed {seed}: {100 * runs['reference'][-1]['test_acc']:.2f}% in {seconds:.1f} s",
                  file=sys.stderr)
            folder = scratch / f"cifarkit-{seed}"
            seconds, _ = timed([sys.executable, "-m", "cifarkit", "train", "--recipe", args.recipe, "--set",
                                f"train.seed={seed}", "--out", str(folder)], env)
            summary = json.loads((folder / "summary.json").read_text())
            runs["cifarkit"].append({"seed": seed, "wall_time_s": seconds, "test_acc": summary["test_acc"],
                                     "train_time_s": summary["train_time_s"]})
            print(f"cifarkit {args.recipe} seed {seed}: {100 * summary['test_acc']:.2f}% in {seconds:.1f} s",
                  file=sys.stderr)

    sides = {name: {"accuracy": statistics_against([r["test_acc"] for r in rows], 0.94),
                    "wall_time_s": statistics.fmean(r["wall_time_s"] for r in rows), "runs": rows}
             for name, rows in runs.items()}
    ratio = sides["reference"]["wall_time_s"] / sides["cifarkit"]["wall_time_s"]
    print("| | runs | mean test acc (TTA) | mean wall time, whole process |\n|---|---:|---:|---:|")
    for name, label in (("reference", f"airbench94 ({REFERENCE}), CPU, bf16 autocast"),
                        ("cifarkit", f"cifarkit train --recipe {args.recipe}")):
        side = sides[name]
        print(f"| {label} | {side['accuracy']['n']} | {100 * side['accuracy']['mean']:.2f}% | "
              f"{side['wall_time_s']:.1f} s |")
    print(f"cifarkit is {ratio:.2f}x as fast as the reference, whole process against whole process")
    if args.json:
        write_json(args.json, {
            "command": f"python scripts/compare_reference.py --runs {args.runs} --first-seed {args.first_seed} "
                       f"--recipe {args.recipe} --json {portable(args.json)}", "reference_package": REFERENCE,
            "adaptation": "CPU instead of CUDA; fp32 weights under bf16 autocast instead of fp16 weights; host-clock "
                          "timing events; data from cifarkit's cache",
            "timer_covers": "the whole process, launch to exit, imports included; one training and one TTA test "
                            "evaluation each",
            "preloaded_by_both": library.name if library else None,
            "speedup": ratio, **sides, "environment": device.report(device.pick_device("cpu"))})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
