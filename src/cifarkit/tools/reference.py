"""`cifarkit reference`: a recipe (`fast`) against the published airbench speedruns, timed on this machine, each speed
ratio beside the accuracy difference.

    curl -LO https://raw.githubusercontent.com/KellerJordan/cifar10-airbench/master/airbench94_muon.py
    cifarkit reference --muon airbench94_muon.py --runs 3 --json results/compare-reference-avx2.json

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

A ratio alone says nothing of what it cost: each one is reported beside the accuracy difference (cifarkit's mean test
accuracy, as shipped, minus the reference's, with its 95% Welch interval), and the goal's verdict is given in words.

A comparison can take longer than one sitting (a round is two full trainings: 1.5 hours on a 2-core AVX2 CPU). With
`--json`, the file is written after every round, and a later command with the same settings (the same committed
src/, reference file, CPU kind, threads, precision and allocator) keeps its rounds and runs only the missing ones:
`--runs 1` today and `--runs 3` tomorrow make the same ABBA comparison. Each round runs whole within one command, so
its ratio compares two runs made one after the other.
"""
from __future__ import annotations

import hashlib
import json
import logging
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

import torch
import yaml

from cifarkit.artifacts import weights
from cifarkit.core import allocator, device
from cifarkit.core.errors import CifarkitError, first_line
from cifarkit.core.files import write_json
from cifarkit.data import cifar10
from cifarkit.tools.speedrun import describe_difference, difference_of_means, mean_with_t_interval, statistics_against
from cifarkit.training import optim
from cifarkit.training.config import load_recipe
from cifarkit.training.engine import evaluate

log = logging.getLogger("cifarkit")

SOURCE = Path(__file__).resolve().parents[2]  # the src/ folder of a checkout: the code a comparison times
MUON = "airbench94_muon"
AIRBENCH94 = "airbench94"
REFERENCES = (MUON, AIRBENCH94)
AIRBENCH94_PACKAGE = "airbench==0.1.8"
MUON_URL = "https://raw.githubusercontent.com/KellerJordan/cifar10-airbench/master/airbench94_muon.py"
MUON_NAMES = ("CifarNet", "CifarLoader", "Muon", "main", "evaluate", "zeropower_via_newtonschulz5")
GOAL = 1.3  # issue 31: `fast` at least this many times as fast as airbench94_muon, at equal or better accuracy
TIMERS = {"whole_process": "launch to exit, imports included",
          "training": "each side's own clock over its training steps"}

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


def check_references(names: list[str]) -> None:
    """Names that are not references fail with the list of those there are."""
    unknown = [name for name in names if name not in REFERENCES]
    if unknown:
        raise CifarkitError(f"--references {' '.join(unknown)}: no such reference; choose from {', '.join(REFERENCES)}")


def check_muon_file(path: str | None) -> Path:
    """The user's copy of airbench94_muon.py, or an error that says how to get it."""
    fetch = f"download it with `curl -LO {MUON_URL}` and pass --muon airbench94_muon.py"
    if path is None:
        raise CifarkitError(f"airbench94_muon is the first reference and is not a package: {fetch} (or run "
                            f"--references {AIRBENCH94} alone)")
    file = Path(path)
    if not file.is_file():
        raise CifarkitError(f"--muon {path}: no such file; {fetch}")
    text = file.read_text(errors="replace")
    missing = [name for name in MUON_NAMES if f"def {name}" not in text and f"class {name}" not in text]
    if missing:
        raise CifarkitError(f"--muon {path} does not look like airbench94_muon.py (no {', '.join(missing)}); {fetch}")
    return file


def variant(recipe: str, overrides: list[str]) -> str:
    """cifarkit's side as its command line names it: the recipe, and what --set changes in it."""
    return " ".join([f"--recipe {recipe}", *(f"--set {override}" for override in overrides)])


def check_variant(recipe: str, overrides: list[str]) -> None:
    """A bad key or value of cifarkit's side fails here, not in the first round's training process."""
    try:
        load_recipe(recipe, overrides)
    except CifarkitError as e:
        raise CifarkitError(f"{variant(recipe, overrides)}: {e}") from None


def round_orders(sides: list[str], rounds: int) -> list[list[str]]:
    """The order of the sides in each round, reversed every other round: A B, B A, A B, ... (ABBA for two sides)."""
    return [list(sides) if r % 2 == 0 else list(reversed(sides)) for r in range(rounds)]


def ratio_statistics(ratios: list[float]) -> dict:
    """Mean of per-round ratios with its 95% t-interval (None for fewer than 2 rounds)."""
    mean, interval = mean_with_t_interval(ratios)
    return {"per_round": ratios, "mean": mean, "ci95": interval}


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
    """(seconds from launch to exit, stdout) of `command`, run to its end."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        log.error("%s", done.stderr[-3000:])
        raise CifarkitError(f"{' '.join(command[:4])} ... failed with exit status {done.returncode} (its last "
                            f"messages are above); fix what they name and run the same command again")
    return seconds, done.stdout


def six_view_accuracy(run_dir: Path, precision_name: str) -> float:
    """The test accuracy of a run's weights with 6 views of every image, the references' TTA, in `precision_name`."""
    model, meta = weights.load_weights(run_dir / "model.safetensors")
    dataset = cifar10.load()
    result = evaluate(model.to(memory_format=torch.channels_last), dataset.test_x, dataset.test_y, meta["mean"],
                      meta["std"], torch.device("cpu"), device.PRECISIONS[precision_name], tta=True, tta_share=1.0)
    return result["acc"]


def cifarkit_run(recipe: str, overrides: list[str], seed: int, subset: int | None, folder: Path, env: dict) -> dict:
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


def code_version() -> dict:
    """The cifarkit code a run times: the commit, the git tree of src/ (recipes included), and whether src/ differs
    from it (then no later command may add rounds: the code could not be shown to be the same)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=SOURCE, check=True, capture_output=True, text=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "--short", "HEAD"), "src_tree": git("rev-parse", "HEAD:./"),
                "src_modified": bool(git("status", "--porcelain", "."))}
    except (OSError, subprocess.CalledProcessError):
        raise CifarkitError(f"the results name the commit of the code they time, and {SOURCE} is not the src/ folder "
                            f"of a git checkout; run cifarkit from a checkout (`pip install -e .` in it)") from None


def kept_rounds(json_path: str | None, settings: dict) -> list[dict]:
    """The finished rounds of an earlier command that wrote `json_path` with the same settings: a comparison too
    long for one sitting is finished by several commands, each round timed whole within one of them. Where rounds
    are kept, `settings["code"]` becomes the earlier record, of the same src/ tree, so that the results name the
    commit the comparison began at rather than a later one whose src/ is the same."""
    if not json_path or not Path(json_path).is_file():
        return []
    try:
        previous = json.loads(Path(json_path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CifarkitError(f"--json {json_path} is not a comparison's results ({first_line(e)}); give another "
                            f"--json, or delete the file to start again") from None
    earlier = previous.get("settings")
    if earlier is None:
        raise CifarkitError(f"--json {json_path} was written by an earlier version of the comparison, which did not "
                            f"record what its rounds ran; give another --json, or delete the file to start again")
    if earlier["code"]["src_modified"] or settings["code"]["src_modified"]:
        raise CifarkitError(f"--json {json_path}: src/ has uncommitted changes (then or now), so its rounds cannot be "
                            f"shown to time the same code; commit them, then give another --json or delete the file")
    differing = sorted(key for key in settings.keys() | earlier.keys()
                       if key != "code" and settings.get(key) != earlier.get(key))
    if earlier["code"]["src_tree"] != settings["code"]["src_tree"]:
        differing.insert(0, f"src/ (commit {earlier['code']['commit']} then, {settings['code']['commit']} now)")
    if differing:
        raise CifarkitError(f"--json {json_path} holds rounds of another comparison (it differs in "
                            f"{', '.join(differing)}); give another --json, or delete the file to start again")
    settings["code"] = earlier["code"]
    return previous["rounds"]


def accuracy_difference(ours: list[dict], theirs: list[dict]) -> dict:
    """cifarkit's mean test accuracy, as shipped, minus a reference's, with its 95% Welch interval."""
    return difference_of_means([r["test_acc"] for r in ours], [r["test_acc"] for r in theirs])


def round_lines(rounds: list[dict], references: list[str]) -> list[str]:
    """The last round's ratio against each reference, beside the accuracy difference over the rounds so far."""
    ours = [r["runs"]["cifarkit"] for r in rounds]
    lines = []
    for name in references:
        theirs = [r["runs"][name] for r in rounds]
        whole, training = (theirs[-1][key] / ours[-1][key] for key in ("wall_time_s", "train_time_s"))
        lines.append(f"round {len(rounds)}: cifarkit {whole:.2f}x as fast as {name}, whole process ({training:.2f}x "
                     f"training); mean accuracy over {len(rounds)} round(s), cifarkit minus {name}: "
                     f"{describe_difference(accuracy_difference(ours, theirs))}")
    return lines


def complete_rounds(rounds: list[dict], sides: list[str], runs: int, first_seed: int, run_side, save,
                    commit: str) -> None:
    """Run the rounds that `rounds` lacks of `runs`, in their ABBA order and with their seeds, each side by
    `run_side(side, seed)`; `save()` after every round, so that a command stopped later keeps what finished. Each
    round records `commit`, the checkout that ran it: its src/ is the comparison's, but its scripts may be later."""
    for number, order in enumerate(round_orders(sides, runs)[len(rounds):], start=len(rounds)):
        seed, rows = first_seed + number, {}
        for side in order:
            row = rows[side] = run_side(side, seed)
            log.info("round %d, %s seed %d: %.2f%%, %.1f s whole, %.1f s training", number + 1, side, seed,
                     100 * row["test_acc"], row["wall_time_s"], row["train_time_s"])
        rounds.append({"seed": seed, "order": order, "runs": rows, "commit": commit,
                       "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        for line in round_lines(rounds, [side for side in sides if side != "cifarkit"]):
            log.info(line)
        save()


def side_summary(runs: list[dict], with_six_views: bool) -> dict:
    summary = {"accuracy": statistics_against([r["test_acc"] for r in runs], 0.94),
               "wall_time_s": statistics.fmean(r["wall_time_s"] for r in runs),
               "train_time_s": statistics.fmean(r["train_time_s"] for r in runs), "runs": runs}
    if with_six_views:
        summary["accuracy_6_views"] = statistics_against([r["test_acc_6_views"] for r in runs], 0.94)
    return summary


def summarize(rounds: list[dict], references: list[str], muon_file: Path | None) -> dict:
    """Each side's accuracy and times over the rounds, and each reference's per-round speed-up ratios beside the
    accuracy difference."""
    ours = [r["runs"]["cifarkit"] for r in rounds]
    summary = {"orders": [r["order"] for r in rounds], "cifarkit": side_summary(ours, with_six_views=True),
               "references": {}}
    for name in references:
        theirs = [r["runs"][name] for r in rounds]
        side = side_summary(theirs, with_six_views=False)
        side["speedup"] = {timer: ratio_statistics([t[key] / m[key] for t, m in zip(theirs, ours)])
                           for timer, key in (("whole_process", "wall_time_s"), ("training", "train_time_s"))}
        side["accuracy_difference"] = accuracy_difference(ours, theirs)
        side["source"] = (f"{muon_file.name}, sha256 {hashlib.sha256(muon_file.read_bytes()).hexdigest()}"
                          if name == MUON else AIRBENCH94_PACKAGE)
        summary["references"][name] = side
    return summary


def verdict(references: dict, subset: int | None) -> str:
    """The goal's verdict in words: "met", "not met: " and why, or "not judged: " where the rounds cannot say."""
    if subset:
        return f"not judged: trained on {subset:,} images only, a check that every side runs"
    if MUON not in references:
        return f"not judged: the goal is against {MUON}, which this comparison did not run"
    muon = references[MUON]
    speedup, difference = muon["speedup"]["whole_process"]["mean"], muon["accuracy_difference"]["difference"]
    shortfalls = ([f"{speedup:.2f}x as fast, under {GOAL}x"] if speedup < GOAL else []) + (
        [f"mean accuracy {-100 * difference:.2f} points lower"] if difference < 0 else [])
    return ("not met: " + " and ".join(shortfalls)) if shortfalls else "met"


def results(rounds: list[dict], settings: dict, environment: dict, command: str, muon_file: Path | None) -> dict:
    """The results file: what ran, where and when, each side over the rounds, and the goal's verdict."""
    summary = summarize(rounds, settings["references"], muon_file)
    return {"command": command, "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "verdict": verdict(summary["references"], settings["subset"]), "cpu_kind": settings["cpu_kind"],
            "recipe": settings["recipe"], "overrides": settings.get("overrides", []), "subset": settings["subset"],
            "precision_policy": settings["precision_policy"], "newton_schulz_dtype": settings["newton_schulz_dtype"],
            "preloaded_by_all": settings["preloaded_by_all"], "timers": TIMERS, **summary,
            "environment": environment, "settings": settings, "rounds": rounds}


def table(result: dict) -> str:
    """The results as the command prints them: every ratio beside the accuracy difference, then the goal's verdict."""
    ours, side = result["cifarkit"], variant(result["recipe"], result.get("overrides") or [])
    lines = ["| side | runs | test acc (its TTA) | test acc (6 views) | whole process | training | speed-up, whole "
             "(95% CI) | speed-up, training (95% CI) | mean accuracy, cifarkit minus it |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| cifarkit {side} | {ours['accuracy']['n']} | {100 * ours['accuracy']['mean']:.2f}% | "
             f"{100 * ours['accuracy_6_views']['mean']:.2f}% | {ours['wall_time_s']:.1f} s | "
             f"{ours['train_time_s']:.1f} s | | | |"]
    for name, reference in result["references"].items():
        cells = []
        for timer in ("whole_process", "training"):
            ratio = reference["speedup"][timer]
            interval = f" ({ratio['ci95'][0]:.2f}-{ratio['ci95'][1]:.2f})" if ratio["ci95"] else ""
            cells.append(f"{ratio['mean']:.2f}x{interval}")
        lines.append(f"| {name} | {reference['accuracy']['n']} | | {100 * reference['accuracy']['mean']:.2f}% | "
                     f"{reference['wall_time_s']:.1f} s | {reference['train_time_s']:.1f} s | {cells[0]} | "
                     f"{cells[1]} | {describe_difference(reference['accuracy_difference'])} |")
    lines.append("")
    for name, reference in result["references"].items():
        lines.append(f"{side} against {name}: {reference['speedup']['whole_process']['mean']:.2f}x as fast (whole "
                     f"process), mean test accuracy {describe_difference(reference['accuracy_difference'])}")
    lines.append(f"goal ({side} >= {GOAL}x {MUON}, whole process, at equal or better mean accuracy): "
                 f"{result['verdict']}")
    return "\n".join(lines)


def _reference_drivers(scratch: Path, references: list[str], muon_file: Path | None) -> dict[str, list[str]]:
    """Each reference's command line before its run's arguments: its python and its driver, written into `scratch`.
    The muon driver's own argument, the user's file, goes after the run's (see PRELUDE)."""
    prelude = f"ALLOCATORS = {allocator.NAMES!r}\n" + PRELUDE
    drivers = {}
    if MUON in references:
        (scratch / "muon_driver.py").write_text(prelude + MUON_DRIVER)
        drivers[MUON] = [sys.executable, str(scratch / "muon_driver.py")]
    if AIRBENCH94 in references:
        log.info("installing %s into a temporary venv", AIRBENCH94_PACKAGE)
        (scratch / "airbench94_driver.py").write_text(prelude + AIRBENCH94_DRIVER)
        drivers[AIRBENCH94] = [str(reference_python(scratch / "venv")), str(scratch / "airbench94_driver.py")]
    return drivers


def compare(*, muon_file: Path | None, references: list[str], runs: int, first_seed: int, recipe: str,
            overrides: list[str], subset: int | None, json_path: str | None, command: str) -> dict:
    """The comparison's results, after running the rounds that `json_path` (when given, written after every round)
    does not hold yet."""
    cpu = torch.device("cpu")
    precision = device.pick_precision("auto", cpu).name
    newton_schulz = str(optim.newton_schulz_dtype(cpu)).removeprefix("torch.")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.TRIED)}
    reference_env = allocator.preload_environment(env) or env  # what cifarkit's own restart preloads
    environment = device.report(cpu)
    settings = {"recipe": recipe, "references": references, "first_seed": first_seed, "subset": subset,
                "cpu_kind": device.cpu_kind(), "processor": environment["processor"],
                "cpu_model": environment.get("cpu_model"), "threads": torch.get_num_threads(),
                "precision_policy": precision, "newton_schulz_dtype": newton_schulz,
                "preloaded_by_all": Path(reference_env["LD_PRELOAD"]).name if "LD_PRELOAD" in reference_env else None,
                "muon_sha256": hashlib.sha256(muon_file.read_bytes()).hexdigest() if muon_file else None,
                "code": code_version()}
    if overrides:  # only where given: the files written before --set existed hold no such key
        settings["overrides"] = overrides
    checkout = settings["code"]["commit"]  # before kept_rounds, which may name the comparison's first commit there
    rounds = kept_rounds(json_path, settings)
    if rounds:
        log.info("keeping %d round(s) from %s (the last finished %s)", len(rounds), json_path, rounds[-1]["finished"])

    def save() -> dict:
        result = results(rounds, settings, environment, command, muon_file)
        if json_path:
            write_json(json_path, result)
        return result

    with tempfile.TemporaryDirectory(prefix="cifarkit-reference-") as scratch:
        scratch = Path(scratch)
        data = scratch / "data"
        write_reference_data(data / "cifar10", subset)
        drivers = _reference_drivers(scratch, references, muon_file)

        def run_side(side: str, seed: int) -> dict:
            if side == "cifarkit":
                return cifarkit_run(recipe, overrides, seed, subset, scratch / f"cifarkit-{seed}", env)
            own = [str(muon_file.resolve())] if side == MUON else []
            seconds, out = timed([*drivers[side], str(seed), str(data), precision, newton_schulz, *own],
                                 reference_env)
            return {"seed": seed, "wall_time_s": seconds, **json.loads(out.strip().splitlines()[-1])}

        complete_rounds(rounds, ["cifarkit", *references], runs, first_seed, run_side, save, commit=checkout)
    return save()  # also when every round was kept: the file then names the code as the rounds' first command did
