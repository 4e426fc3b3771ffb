"""Time `cifarkit train --recipe fast` against the published airbench speedruns on this machine, and write the ratios.

    curl -LO https://raw.githubusercontent.com/KellerJordan/cifar10-airbench/master/airbench94_muon.py
    python lab/compare_reference.py --muon airbench94_muon.py --runs 3 --json results/compare-reference-avx2.json

The references, strongest first:
- airbench94_muon (Jordan, 2024-10: Muon on the conv filters, 8 epochs, batch 2000), whose recipe `fast` adopted.
  It is one file in the public repository github.com/KellerJordan/cifar10-airbench, not a package: download it as
  above and give its path to `--muon`. None of its code is in this repository; the results record its sha256.
- airbench94 (airbench==0.1.8's lib_airbench94: 9.9 epochs, Nesterov SGD, lookahead), installed at run time into a
  temporary venv that sees this environment's torch through a .pth file. `--references airbench94` runs it alone.

The references are written for CUDA in fp16. Each runs here as cifarkit runs on this CPU, and differs in nothing else:
- the CPU: `.cuda()` does nothing, `torch.load` maps to the CPU, CUDA's timing events read the host clock;
- the machine's precision policy, cifarkit's `--precision auto`: fp32 weights, with the forward passes under bf16
  autocast where the CPU computes bf16 natively and in fp32 elsewhere; Muon's Newton-Schulz iteration in bf16 where
  bf16 is native and in fp32 elsewhere, on both sides (`optim.newton_schulz_dtype`). Autocast covers the forward passes
  only, as in cifarkit: around the whole run it would also compute the whitening filters' patch covariance in bf16,
  whose rounding makes eigenvalues negative and the filters NaN;
- nothing compiled: `fast` does not compile by default, and airbench94_muon's `torch.compile` of its Newton-Schulz
  function is bypassed (its plain function runs);
- the same allocator, preloaded: tcmalloc where it is installed, else mimalloc from its wheel, as cifarkit's commands
  do;
- the test set read once, at the end: airbench94_muon's per-epoch test evaluation, only printed and outside its own
  timer, is skipped, as `fast` evaluates only at the end;
- the same data: this machine's CIFAR-10 cache, written as the train.pt / test.pt files their loaders read first.

`--set KEY=VALUE` (repeatable) times a variant of cifarkit's recipe, as `cifarkit train --set` makes it: the
results record the overrides, and a file's rounds are kept only for the same ones.

Test-time augmentation: the references evaluate 6 views of every test image (TTA level 2). `fast` as shipped gives
its 5 extra views to the least confident quarter of the images (2.25 views per image); its weights are evaluated again
after its process ends, untimed, with the same 6 views of every image, in its training precision.

Two timers per run: the whole process, from launch to exit, imports included; and training alone, each side's own
clock over its steps (cifarkit's `train_time_s`; a reference's CUDA-event timer, which also covers its whitening
init, less its final TTA). Rounds alternate the order of the sides (A B, B A, A B, ...: ABBA for two sides), so a slow
spell of this shared machine falls on all of them; the speed-up is the mean of the per-round ratios, with its 95%
t-interval. Precision, allocator and threads are read from each timed process.

A comparison can take longer than one sitting (a round is two full trainings: 1.5 hours on a 2-core AVX2 CPU). With
`--json`, the file is written after every round, and a later command with the same settings (the same committed
src/, reference file, CPU kind, threads, precision and allocator) keeps its rounds and runs only the missing ones:
`--runs 1` today and `--runs 3` tomorrow make the same ABBA comparison. Each round runs whole within one command, so
its ratio compares two runs made one after the other.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUON = "airbench94_muon"
AIRBENCH94 = "airbench94"
AIRBENCH94_PACKAGE = "airbench==0.1.8"
MUON_URL = "https://raw.githubusercontent.com/KellerJordan/cifar10-airbench/master/airbench94_muon.py"
MUON_NAMES = ("CifarNet", "CifarLoader", "Muon", "main", "evaluate", "zeropower_via_newtonschulz5")
GOAL = 1.3  # issue 31: `fast` at least this many times as fast as airbench94_muon, at equal or better accuracy

# What both reference processes do first: the CPU in place of CUDA, the machine's precision policy, and a record of
# what the process really ran. argv: seed, data folder, precision (bf16 | fp32), Newton-Schulz dtype, then the
# driver's own arguments.
PRELUDE = r"""
import json, sys, time
import torch
from torch import nn

seed, data_dir, precision, newton_schulz = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.manual_seed(seed)
observed = {"threads": torch.get_num_threads()}
nn.Module.cuda = lambda self, *args, **kwargs: self
nn.Module.half = lambda self: self
torch.Tensor.half = lambda self, *args, **kwargs: self.float()
load = torch.load
torch.load = lambda *args, **kwargs: load(*args, **{**kwargs, "map_location": "cpu"})
if newton_schulz == "float32":  # the one bf16 cast of airbench94_muon is its Newton-Schulz input
    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self.to(torch.float32, copy=True)

timed_s = 0.0  # the reference's own timer: the sum of its CUDA-event intervals

class HostEvent:  # torch.cuda.Event(enable_timing=True) on the host clock
    def __init__(self, *args, **kwargs):
        self.at = None
    def record(self, *args):
        self.at = time.perf_counter()
    def elapsed_time(self, end):
        global timed_s
        timed_s += end.at - self.at
        return 1e3 * (end.at - self.at)

torch.cuda.Event, torch.cuda.synchronize = HostEvent, lambda *args: None

def in_precision(net):
    # The forward passes in the machine's precision, returning fp32 logits as cifarkit's do.
    forward = net.forward
    def forward_in_precision(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = forward(*args, **kwargs)
        observed.setdefault("logits_dtype", str(logits.dtype).removeprefix("torch."))
        return logits.float()
    net.forward = forward_in_precision
    return net

def report(test_acc, train_time_s):
    maps = open("/proc/self/maps").read()
    observed["allocator"] = next((name for library, name in ALLOCATORS.items() if library in maps), "glibc")
    print(json.dumps({"test_acc": test_acc, "train_time_s": train_time_s, **observed}))
"""

# airbench94_muon, loaded from the user's copy (argv[5]) and run once through its own main(), in its data folder.
MUON_DRIVER = r"""
import importlib.util, os
spec = importlib.util.spec_from_file_location("airbench94_muon", sys.argv[5])
muon = importlib.util.module_from_spec(spec)
spec.loader.exec_module(muon)
compiled = muon.zeropower_via_newtonschulz5
plain = getattr(compiled, "_torchdynamo_orig_callable", None) or compiled.__wrapped__

def newton_schulz(*args, **kwargs):
    update = plain(*args, **kwargs)
    observed.setdefault("newton_schulz_dtype", str(update.dtype).removeprefix("torch."))
    return update

muon.zeropower_via_newtonschulz5 = newton_schulz
muon.print_training_details = lambda variables, is_final_entry: None
evaluate, trained = muon.evaluate, {}

def evaluate_at_end(model, loader, tta_level=0):
    if tta_level == 0:  # the per-epoch evaluation, printed only: skipped
        return float("nan")
    trained.setdefault("train_time_s", timed_s)  # its timer so far: whitening init and every training epoch
    return evaluate(model, loader, tta_level)

muon.evaluate = evaluate_at_end
os.chdir(data_dir)  # its loaders read cifar10/train.pt and cifar10/test.pt
model = in_precision(muon.CifarNet().to(memory_format=torch.channels_last))
test_acc = muon.main(seed, model)
report(test_acc, trained["train_time_s"])
"""

# airbench94 from the package: train94 without printing (so without per-epoch evaluation), then its TTA level 2.
AIRBENCH94_DRIVER = r"""
import os
import airbench
from airbench import lib_airbench94, utils

class CpuLoader(utils.CifarLoader):  # its data on the CPU, from the train.pt / test.pt written for it
    def __init__(self, path, *args, **kwargs):
        kwargs["gpu"] = "cpu"
        super().__init__(os.path.join(data_dir, "cifar10"), *args, **kwargs)

utils.CifarLoader = lib_airbench94.CifarLoader = CpuLoader
model = lib_airbench94.train94(make_net=lambda: in_precision(lib_airbench94.make_net94()), verbose=False)
train_time_s = timed_s
test_acc = airbench.evaluate(model, CpuLoader(None, train=False, batch_size=2000), tta_level=2)
report(test_acc, train_time_s)
"""


def round_orders(sides: list[str], rounds: int) -> list[list[str]]:
    """The order of the sides in each round, reversed every other round: A B, B A, A B, ... (ABBA for two sides)."""
    return [list(sides) if r % 2 == 0 else list(reversed(sides)) for r in range(rounds)]


def ratio_statistics(ratios: list[float]) -> dict:
    """Mean of per-round ratios with its 95% t-interval (None for fewer than 2 rounds)."""
    from cifarkit.tools.speedrun import mean_with_t_interval
    mean, interval = mean_with_t_interval(ratios)
    return {"per_round": ratios, "mean": mean, "ci95": interval}


def check_muon_file(path: str | None) -> Path:
    """The user's copy of airbench94_muon.py, or an error that says how to get it."""
    fetch = f"download it with `curl -LO {MUON_URL}` and pass --muon airbench94_muon.py"
    if path is None:
        sys.exit(f"airbench94_muon is the first reference and is not a package: {fetch} (or run "
                 f"--references {AIRBENCH94} alone)")
    file = Path(path)
    if not file.is_file():
        sys.exit(f"--muon {path}: no such file; {fetch}")
    text = file.read_text(errors="replace")
    missing = [name for name in MUON_NAMES if f"def {name}" not in text and f"class {name}" not in text]
    if missing:
        sys.exit(f"--muon {path} does not look like airbench94_muon.py (no {', '.join(missing)}); {fetch}")
    return file


def reference_python(folder: Path) -> Path:
    """A venv in `folder` with airbench94's package installed; this environment's packages (torch) visible."""
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "cifarkit-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", AIRBENCH94_PACKAGE], check=True)
    return python


def write_reference_data(folder: Path, subset: int | None) -> None:
    """CIFAR-10 from cifarkit's cache in the layout the references' loaders read before they would download:
    N x 32 x 32 x 3 uint8, as torchvision's CIFAR10.data holds them. `subset`: that many training images,
    class-balanced, as cifarkit's --subset draws them."""
    import torch

    from cifarkit.data import cifar10
    dataset = cifar10.load()
    train_x, train_y = dataset.train_x, dataset.train_y
    if subset:
        chosen = cifar10.balanced_indices(train_y, subset, torch.Generator().manual_seed(0))
        train_x, train_y = train_x[chosen], train_y[chosen]
    folder.mkdir(parents=True)
    for name, images, labels in (("train.pt", train_x, train_y), ("test.pt", dataset.test_x, dataset.test_y)):
        torch.save({"images": images.permute(0, 2, 3, 1).contiguous(), "labels": labels,
                    "classes": list(cifar10.CLASSES)}, folder / name)


def timed(command: list[str], env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def six_view_accuracy(run_dir: Path, precision_name: str) -> float:
    """The test accuracy of a run's weights with 6 views of every image, the references' TTA, in `precision_name`."""
    import torch

    from cifarkit.artifacts import weights
    from cifarkit.core import device
    from cifarkit.data import cifar10
    from cifarkit.training.engine import evaluate
    model, meta = weights.load_weights(run_dir / "model.safetensors")
    cpu = torch.device("cpu")
    dataset = cifar10.load()
    result = evaluate(model.to(memory_format=torch.channels_last), dataset.test_x, dataset.test_y, meta["mean"],
                      meta["std"], cpu, device.PRECISIONS[precision_name], tta=True, tta_share=1.0)
    return result["acc"]


def cifarkit_run(recipe: str, overrides: list[str], seed: int, subset: int | None, folder: Path, env: dict) -> dict:
    import yaml
    command = [sys.executable, "-m", "cifarkit", "train", "--recipe", recipe, "--seed", str(seed), "--out",
               str(folder)] + (["--subset", str(subset)] if subset else [])
    for override in overrides:
        command += ["--set", override]
    seconds, _ = timed(command, env)
    summary = json.loads((folder / "summary.json").read_text())
    run = yaml.safe_load((folder / "config.yaml").read_text())["run"]
    return {"seed": seed, "wall_time_s": seconds, "train_time_s": summary["train_time_s"],
            "test_acc": summary["test_acc"], "test_acc_6_views": six_view_accuracy(folder, summary["precision"]),
            "precision": summary["precision"], "newton_schulz_dtype": run.get("newton_schulz_dtype"),
            "allocator": run["allocator"], "threads": run["threads"]}


def side_summary(runs: list[dict], with_six_views: bool) -> dict:
    from cifarkit.tools.speedrun import statistics_against
    summary = {"accuracy": statistics_against([r["test_acc"] for r in runs], 0.94),
               "wall_time_s": statistics.fmean(r["wall_time_s"] for r in runs),
               "train_time_s": statistics.fmean(r["train_time_s"] for r in runs), "runs": runs}
    if with_six_views:
        summary["accuracy_6_views"] = statistics_against([r["test_acc_6_views"] for r in runs], 0.94)
    return summary


def variant(recipe: str, overrides: list[str]) -> str:
    """cifarkit's side as its command line names it: the recipe, and what --set changes in it."""
    return " ".join([f"--recipe {recipe}", *(f"--set {override}" for override in overrides)])


def print_table(result: dict) -> None:
    ours = result["cifarkit"]
    print("| side | runs | test acc (its TTA) | test acc (6 views) | whole process | training | speed-up, whole "
          "(95% CI) | speed-up, training (95% CI) |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| cifarkit {variant(result['recipe'], result['overrides'])} | {ours['accuracy']['n']} | "
          f"{100 * ours['accuracy']['mean']:.2f}% | {100 * ours['accuracy_6_views']['mean']:.2f}% | "
          f"{ours['wall_time_s']:.1f} s | {ours['train_time_s']:.1f} s | | |")
    for name, side in result["references"].items():
        cells = []
        for timer in ("whole_process", "training"):
            ratio = side["speedup"][timer]
            interval = f" ({ratio['ci95'][0]:.2f}-{ratio['ci95'][1]:.2f})" if ratio["ci95"] else ""
            cells.append(f"{ratio['mean']:.2f}x{interval}")
        print(f"| {name} | {side['accuracy']['n']} | | {100 * side['accuracy']['mean']:.2f}% | "
              f"{side['wall_time_s']:.1f} s | {side['train_time_s']:.1f} s | {cells[0]} | {cells[1]} |")


def code_version() -> dict:
    """The cifarkit code a run times: the commit, the git tree of src/ (recipes included), and whether src/ differs
    from it (then no later command may add rounds: the code could not be shown to be the same)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "--short", "HEAD"), "src_tree": git("rev-parse", "HEAD:src"),
            "src_modified": bool(git("status", "--porcelain", "src"))}


def kept_rounds(json_path: str | None, settings: dict) -> list[dict]:
    """The finished rounds of an earlier command that wrote `json_path` with the same settings: a comparison too
    long for one sitting is finished by several commands, each round timed whole within one of them. Where rounds
    are kept, `settings["code"]` becomes the earlier record, of the same src/ tree, so that the results name the
    commit the comparison began at rather than a later one whose src/ is the same."""
    if not json_path or not Path(json_path).is_file():
        return []
    previous = json.loads(Path(json_path).read_text())
    earlier = previous.get("settings")
    if earlier is None:
        sys.exit(f"--json {json_path} was written by an earlier version of this script, which did not record what "
                 f"its rounds ran; give another --json, or delete the file to start again")
    if earlier["code"]["src_modified"] or settings["code"]["src_modified"]:
        sys.exit(f"--json {json_path}: src/ has uncommitted changes (then or now), so its rounds cannot be shown to "
                 f"time the same code; commit them, then give another --json or delete the file")
    differing = sorted(key for key in settings.keys() | earlier.keys()
                       if key != "code" and settings.get(key) != earlier.get(key))
    if earlier["code"]["src_tree"] != settings["code"]["src_tree"]:
        differing.insert(0, f"src/ (commit {earlier['code']['commit']} then, {settings['code']['commit']} now)")
    if differing:
        sys.exit(f"--json {json_path} holds rounds of another comparison (it differs in {', '.join(differing)}); "
                 f"give another --json, or delete the file to start again")
    settings["code"] = earlier["code"]
    return previous["rounds"]


def complete_rounds(rounds: list[dict], sides: list[str], runs: int, first_seed: int, run_side, save,
                    commit: str) -> None:
    """Run the rounds that `rounds` lacks of `runs`, in their ABBA order and with their seeds, each side by
    `run_side(side, seed)`; `save()` after every round, so that a command stopped later keeps what finished. Each
    round records `commit`, the checkout that ran it: its src/ is the comparison's, but its scripts may be later."""
    for number, order in enumerate(round_orders(sides, runs)[len(rounds):], start=len(rounds)):
        seed, rows = first_seed + number, {}
        for side in order:
            row = rows[side] = run_side(side, seed)
            print(f"round {number + 1}, {side} seed {seed}: {100 * row['test_acc']:.2f}%, {row['wall_time_s']:.1f} "
                  f"s whole, {row['train_time_s']:.1f} s training", file=sys.stderr)
        rounds.append({"seed": seed, "order": order, "runs": rows, "commit": commit,
                       "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        save()


def summarize(rounds: list[dict], references: list[str], muon_file: Path | None) -> dict:
    """Each side's accuracy and times over the rounds, and each reference's per-round speed-up ratios."""
    ours = [r["runs"]["cifarkit"] for r in rounds]
    summary = {"orders": [r["order"] for r in rounds], "cifarkit": side_summary(ours, with_six_views=True),
               "references": {}}
    for name in references:
        theirs = [r["runs"][name] for r in rounds]
        side = side_summary(theirs, with_six_views=False)
        side["speedup"] = {timer: ratio_statistics([t[key] / m[key] for t, m in zip(theirs, ours)])
                           for timer, key in (("whole_process", "wall_time_s"), ("training", "train_time_s"))}
        side["source"] = (f"{muon_file.name}, sha256 {hashlib.sha256(muon_file.read_bytes()).hexdigest()}"
                          if name == MUON else AIRBENCH94_PACKAGE)
        summary["references"][name] = side
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--muon", help="path of a local copy of airbench94_muon.py (see above for how to get it)")
    parser.add_argument("--references", nargs="+", choices=[MUON, AIRBENCH94], default=[MUON, AIRBENCH94],
                        help=f"which references to run (default: {MUON} {AIRBENCH94})")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, in alternating rounds (default: 3)")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first round (default: 0)")
    parser.add_argument("--recipe", default="fast", help="cifarkit's side (default: fast)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a field of cifarkit's recipe, as `cifarkit train --set` does (repeatable): "
                             "time a variant of it")
    parser.add_argument("--subset", type=int, help="train every side on this many images: a check that everything "
                                                   "runs, not a comparison")
    parser.add_argument("--json", help="write the results to this file after each round; rounds it already holds "
                                       "with the same settings are kept, and only the others run")
    args = parser.parse_args()
    muon_file = check_muon_file(args.muon) if MUON in args.references else None
    if args.runs < 1:
        sys.exit(f"--runs {args.runs}: give 1 or more (3 or more for a confidence interval worth reading)")
    from cifarkit.core.errors import CifarkitError
    from cifarkit.training.config import load_recipe
    try:  # a bad key or value fails here, not in the first round's training process
        load_recipe(args.recipe, args.overrides)
    except CifarkitError as e:
        sys.exit(f"{variant(args.recipe, args.overrides)}: {e}")

    import torch

    from cifarkit.core import allocator, device
    from cifarkit.core.files import portable, write_json
    from cifarkit.inference import backends
    from cifarkit.tools.speedrun import describe_difference, difference_of_means
    from cifarkit.training import optim
    cpu = torch.device("cpu")
    precision = device.pick_precision("auto", cpu).name
    newton_schulz = str(optim.newton_schulz_dtype(cpu)).removeprefix("torch.")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.TRIED)}
    reference_env = allocator.preload_environment(env) or env  # what cifarkit's own restart preloads
    environment = device.report(cpu)
    settings = {"recipe": args.recipe, "references": args.references, "first_seed": args.first_seed,
                "subset": args.subset, "cpu_kind": backends.cpu_kind(), "processor": environment["processor"],
                "cpu_model": environment.get("cpu_model"), "threads": torch.get_num_threads(),
                "precision_policy": precision, "newton_schulz_dtype": newton_schulz,
                "preloaded_by_all": Path(reference_env["LD_PRELOAD"]).name if "LD_PRELOAD" in reference_env else None,
                "muon_sha256": hashlib.sha256(muon_file.read_bytes()).hexdigest() if muon_file else None,
                "code": code_version()}
    if args.overrides:  # only where given: the files written before --set existed hold no such key
        settings["overrides"] = args.overrides
    checkout = settings["code"]["commit"]  # before kept_rounds, which may name the comparison's first commit there
    rounds = kept_rounds(args.json, settings)
    if rounds:
        print(f"keeping {len(rounds)} round(s) from {args.json} (the last finished {rounds[-1]['finished']})",
              file=sys.stderr)
    sides = ["cifarkit", *args.references]
    command = "python lab/compare_reference.py " + " ".join(
        ([f"--muon {muon_file.name}"] if muon_file else []) + [f"--references {' '.join(args.references)}",
         f"--runs {args.runs}", f"--first-seed {args.first_seed}", variant(args.recipe, args.overrides)]
        + ([f"--subset {args.subset}"] if args.subset else []) + ([f"--json {portable(args.json)}"]
                                                                   if args.json else []))

    def result() -> dict:
        return {"command": command, "measured": rounds[-1]["finished"], "cpu_kind": settings["cpu_kind"],
                "recipe": args.recipe, "overrides": args.overrides, "subset": args.subset,
                "precision_policy": precision,
                "newton_schulz_dtype": newton_schulz, "preloaded_by_all": settings["preloaded_by_all"],
                "timers": {"whole_process": "launch to exit, imports included",
                           "training": "each side's own clock over its training steps"},
                **summarize(rounds, args.references, muon_file), "environment": environment, "settings": settings,
                "rounds": rounds}

    with tempfile.TemporaryDirectory(prefix="cifarkit-reference-") as scratch:
        scratch = Path(scratch)
        write_reference_data(scratch / "data" / "cifar10", args.subset)
        prelude = f"ALLOCATORS = {allocator.NAMES!r}\n" + PRELUDE
        pythons, drivers = {}, {}
        if MUON in sides:
            pythons[MUON] = Path(sys.executable)
            drivers[MUON] = (scratch / "muon_driver.py", MUON_DRIVER, [str(muon_file.resolve())])
        if AIRBENCH94 in sides:
            print(f"installing {AIRBENCH94_PACKAGE} into a temporary venv", file=sys.stderr)
            pythons[AIRBENCH94] = reference_python(scratch / "venv")
            drivers[AIRBENCH94] = (scratch / "airbench94_driver.py", AIRBENCH94_DRIVER, [])
        for path, body, _ in drivers.values():
            path.write_text(prelude + body)

        def run_side(side: str, seed: int) -> dict:
            if side == "cifarkit":
                return cifarkit_run(args.recipe, args.overrides, seed, args.subset, scratch / f"cifarkit-{seed}",
                                    env)
            path, _, extra = drivers[side]
            seconds, out = timed([str(pythons[side]), str(path), str(seed), str(scratch / "data"), precision,
                                  newton_schulz, *extra], reference_env)
            return {"seed": seed, "wall_time_s": seconds, **json.loads(out.strip().splitlines()[-1])}

        complete_rounds(rounds, sides, args.runs, args.first_seed, run_side,
                        save=lambda: write_json(args.json, result()) if args.json else None, commit=checkout)

    final = result()
    if args.json:  # also when every round was kept: the file then names the code as the rounds' first command did
        write_json(args.json, final)
    print_table(final)
    if MUON in args.references and not args.subset:
        muon, mine = final["references"][MUON], final["cifarkit"]
        met = muon["speedup"]["whole_process"]["mean"] >= GOAL and \
            mine["accuracy"]["mean"] >= muon["accuracy"]["mean"]
        side = variant(args.recipe, args.overrides)
        print(f"goal ({side} >= {GOAL}x {MUON}, whole process, at equal or better mean accuracy): "
              f"{'met' if met else 'not met'}")
        difference = difference_of_means([r["test_acc"] for r in mine["runs"]], [r["test_acc"] for r in muon["runs"]])
        print(f"mean accuracy, {side} minus {MUON}: {describe_difference(difference)}")
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
