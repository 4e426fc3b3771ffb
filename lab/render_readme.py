"""Rewrite the generated blocks of README.md, docs/*.md and results/README.md from the registry and the measurement
files in results/; `--check` only compares, and fails where a page differs from a fresh render.

    python lab/render_readme.py
    python lab/render_readme.py --check

Each block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->`, in exactly one of those pages; nothing else
in them is touched. The numbers come only from files that `cifarkit` commands wrote, so the pages cannot drift from
the evidence. A file that no longer measures what ships lives in results/archive/, with its reason in
results/archive/reasons.yaml; the history tables show it marked so, and the README shows only current files.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from cifarkit import models
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.core import device
from cifarkit.core.files import write_text
from cifarkit.inference import backends
from cifarkit.models.winograd import blocks as winograd_blocks
from cifarkit.release.compare import compare
from cifarkit.tools.benchmark import SPEED_ONLY, device_table
from cifarkit.tools.speedrun import describe_difference, difference_of_means, mean_with_t_interval

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
# In RESULTS: the superseded files, and when and at which commit each file was made, taken from git once for the
# files that do not record it themselves, so that a render (and CI's check of it) needs no history.
ARCHIVE, PROVENANCE = "archive", "provenance.json"
SPEED_ONLY_SENTENCE = f"{SPEED_ONLY[0].upper()}{SPEED_ONLY[1:]}."
CHARTS = RESULTS  # where the blocks that draw a chart put it; `--check` draws in a scratch folder
# lab/ab_profile.py records the batch since 2026-12-06; every A/B file written before timed `fast` at batch 2,000,
# its batch until 5276c1b (`git show COMMIT:src/cifarkit/training/recipes/fast.yaml` at each file's "after").
AB_BATCH_BEFORE_RECORDED = 2000


def archive_reasons() -> dict[str, str]:
    """results/archive/'s files, each with the reason it is history (results/archive/reasons.yaml)."""
    return yaml.safe_load((RESULTS / ARCHIVE / "reasons.yaml").read_text())


def result_files(pattern: str) -> list[Path]:
    """The files of results/ matching `pattern`, then those of results/archive/: the history tables show both."""
    return sorted(RESULTS.glob(pattern)) + sorted((RESULTS / ARCHIVE).glob(pattern))


def current_files(pattern: str) -> list[tuple[Path, dict]]:
    """The current JSON files matching `pattern`, each with its contents: what the README may show."""
    return [(path, json.loads(path.read_text())) for path in sorted(RESULTS.glob(pattern))]


def rel(path: Path) -> str:
    """A results file's path as the pages name it."""
    return f"results/{path.relative_to(RESULTS).as_posix()}"


def status(path: Path) -> str:
    """"current" (with the note results/notes.yaml keeps for it, if any), or "superseded" with the archive's
    reason."""
    if path.parent != RESULTS:
        return f"superseded: {archive_reasons()[path.name]}"
    note = note_on(path)
    return f"current ({note})" if note else "current"


def note_on(path: Path) -> str | None:
    """What results/notes.yaml says of a file that the file cannot say of itself (a run stopped early)."""
    notes = RESULTS / "notes.yaml"
    return (yaml.safe_load(notes.read_text()) or {}).get(path.name) if notes.is_file() else None


def provenance() -> dict[str, dict]:
    path = RESULTS / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def _recorded_commit(data: dict) -> str | None:
    """The cifarkit commit a file says it measured, in whichever field its command recorded it."""
    runs = data.get("runs")
    first_run = runs[0] if isinstance(runs, list) and runs and isinstance(runs[0], dict) else {}
    commit = (data.get("settings", {}).get("code", {}).get("commit") or data.get("written_at_commit")
              or data.get("commit") or (data.get("source") or {}).get("commit")
              or (first_run.get("run", {}).get("source") or {}).get("commit"))
    if commit is None and isinstance(data.get("after"), str):  # an A/B: the commit of its "after" side
        commit = data["after"]
    if not commit:
        return None
    sha, _, note = commit.partition(" ")  # "with uncommitted changes to src/", where an A/B says so
    return f"{sha[:7]} {note}".strip()


def _recorded_date(data: dict) -> str | None:
    """The day a file says it was measured: its own stamp, else the last of its runs' finishing times."""
    if data.get("measured"):
        return data["measured"][:10]
    runs = data.get("runs")
    finished = [r["finished"] for r in runs if isinstance(r, dict) and r.get("finished")] if isinstance(runs, list) \
        else []
    return max(finished)[:10] if finished else None


def update_provenance() -> None:
    """Add, from git, the commit and day each results file was added in, for the files that record neither; kept
    entries stay as they are, so the record survives a shallow clone."""
    known = provenance()
    for path in result_files("*.json") + result_files("*.png"):
        data = json.loads(path.read_text()) if path.suffix == ".json" else {}
        if path.name in known or (_recorded_commit(data) and _recorded_date(data)):
            continue
        # By name in both folders, without --follow, whose guesses at renames can name another file's first commit.
        log = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h %cs", "--", f"results/{path.name}",
                              f"results/{ARCHIVE}/{path.name}"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
        if log:
            known[path.name] = {"added_in": log[-2], "date": log[-1]}
    write_text(RESULTS / PROVENANCE, json.dumps(dict(sorted(known.items())), indent=2) + "\n")


def commit_and_date(path: Path, data: dict) -> tuple[str, str]:
    """The commit and day of a results file as the index shows them: the file's own record, else the commit that
    added it (marked "added in")."""
    added = provenance().get(path.name, {})
    commit = _recorded_commit(data) or (f"added in {added['added_in']}" if added else "not recorded")
    return commit, _recorded_date(data) or added.get("date", "not recorded")


# The question each kind of results file answers, by the start of its name; the index groups the files by them.
QUESTIONS = (
    (("speedrun-", "release-"), "How accurate is a recipe, and how long does a run take? (`cifarkit speedrun`)"),
    (("compare-reference",), "How does `fast` compare with the airbench references? (`cifarkit reference`)"),
    (("profile-ab-",), "Did a code change make the training step faster? (`python lab/ab_profile.py`)"),
    (("profile-", "freeze-profile-"), "Where does a training step's time go? (`cifarkit profile`)"),
    (("bench-",), "Training throughput per model, precision, device and process count (`cifarkit bench`)"),
    (("serve-bench",), "How fast does the server answer? (`cifarkit bench-serve`)"),
    (("validation-",), "Which recipe values win on a validation split? (`cifarkit validate`)"),
    (("winograd-",), "Which convolution kernel is fastest, layer by layer? (`python lab/measure_winograd.py`)"),
    (("allocators-",), "Which memory allocator trains fastest? (`python lab/measure_allocators.py`)"),
    (("",), "Other measurements of the project (`lab/README.md` names the script of each)"),
)


def question_of(name: str) -> str:
    return next(question for prefixes, question in QUESTIONS if name.startswith(prefixes))


def _what(path: Path, data: dict) -> str:
    """A few words on what one results file measured."""
    name = path.name
    if path.suffix == ".png":
        return "chart"
    n = data.get("accuracy", {}).get("n") if isinstance(data.get("accuracy"), dict) else None
    overrides = "".join(f" `{o}`" for o in data.get("overrides") or [])
    if name.startswith(("speedrun-", "release-")):
        return f"`{data['recipe']}`{overrides}, {n} run(s)"
    if name.startswith("compare-reference"):
        against = ", ".join(data.get("references") or {}) or data.get("reference_package", "airbench94")
        return f"`{data.get('recipe', 'fast')}`{overrides} against {against}"
    if name.startswith("profile-ab-"):
        return f"step time before ({data['before']}) and after ({data['after']})"
    if name.startswith(("profile-", "freeze-profile-")):
        return f"`{data['recipe']}` step, {data['precision']}, batch {data['batch_size']:,}"
    if name.startswith("serve-bench"):
        return f"release {data['model']} through {data['servers']['batched']['served']['backend']}"
    if name.startswith("validation-"):
        return f"`{data['recipe']}`: " + " vs ".join(f"`{v['name']}`" for v in data["variants"])
    if name.startswith("winograd-"):
        return f"`{data['model']}`, {data.get('precision', 'fp32')}"
    if data.get("what"):
        return data["what"]
    return f"`{data['command']}`" if data.get("command") else name


def _device_of(data: dict) -> tuple[str, str]:
    """(device kind, processor or GPU) of a results file, or "-" where it measured no device."""
    environment = data.get("environment") or {}
    if environment.get("device", "").startswith("cuda"):
        return "GPU", environment["gpus"][0]["name"]
    kind = data.get("cpu_kind") or (cpu_kind_of(environment) if environment else "-")
    processor = processor_of(environment) if environment.get("processor") else data.get("processor", "-")
    return kind, processor


def index_block() -> str:
    """Every file of results/ and results/archive/, by the question it answers: what it measured, where, at which
    commit, when, and whether it is current."""
    files = [p for p in result_files("*") if p.suffix in (".json", ".png") and p.name != PROVENANCE]
    parts = []
    for _, question in QUESTIONS:
        rows = []
        for path in files:
            if question_of(path.name) != question:
                continue
            data = json.loads(path.read_text()) if path.suffix == ".json" else {}
            kind, processor = _device_of(data)
            commit, day = commit_and_date(path, data)
            link = path.relative_to(RESULTS).as_posix()
            rows.append(f"| [{link}]({link}) | {_what(path, data)} | {kind} | {processor} | {commit} | {day} | "
                        f"{status(path)} |")
        if rows:
            parts += [f"### {question}", "", "| file | what | device kind | processor | commit | date | status |",
                      "|---|---|---|---|---|---|---|", *rows, ""]
    return "\n".join(parts).rstrip()


KIND_NAMES = {"amx": "Intel Xeon with AMX", "avx512_bf16": "AVX512-BF16, no AMX", "avx2": "AVX2 only"}
# The AMD generations behind the x86 family and model that the files record (virtual machines name them alike).
ZEN = {"family 23 model 49": "Zen 2", "family 25 model 1": "Zen 3", "family 25 model 17": "Zen 4",
       "family 26 model 2": "Zen 5"}
ACCURACY_GOAL = 0.94


def _shipped_fast(data: dict) -> bool:
    """A run of `fast` as it ships: no overrides but the device, on all the training data."""
    return data.get("recipe") == "fast" and not data.get("subset") and all(
        o.startswith("train.device=") for o in data.get("overrides") or [])


def _training_evidence(device: str) -> list[dict]:
    """Each current file that timed the shipped `fast` on `device` ("cpu" or "cuda"): speed runs and comparisons
    with a reference, with its accuracies, mean time a run and day."""
    found = []
    for path, data in current_files("speedrun-fast*.json"):
        if _shipped_fast(data) and data["environment"].get("device", "cpu").split(":")[0] == device:
            found.append({"path": path, "environment": data["environment"], "day": _recorded_date(data),
                          "accuracies": [r["test_acc"] for r in data["runs"]], "seconds": data["wall_time_s"]["mean"],
                          "timer": "a run"})
    for path, data in current_files("compare-reference*.json"):
        if device == "cpu" and "references" in data and _shipped_fast(data):
            found.append({"path": path, "environment": data["environment"], "day": _recorded_date(data),
                          "accuracies": [r["test_acc"] for r in data["cifarkit"]["runs"]],
                          "seconds": data["cifarkit"]["wall_time_s"], "timer": "a run, whole process",
                          "comparison": data})
    return found


def _accuracy_words(accuracies: list[float]) -> str:
    mean, interval = mean_with_t_interval(accuracies)
    spread = f", 95% interval {100 * interval[0]:.2f}-{100 * interval[1]:.2f}%" if interval else ""
    verdict = "" if mean >= ACCURACY_GOAL else f": under {100 * ACCURACY_GOAL:.0f}% on the mean"
    return f"{100 * mean:.2f}% mean test accuracy (n = {len(accuracies)}{spread}){verdict}"


def _against_reference(comparison: dict | None) -> str:
    """`fast`'s speed-up over the strongest reference of a comparison, always with the accuracy difference, its
    interval, and in words whether that is a speed-up at equal accuracy."""
    if comparison is None:
        return "no reference timed on this processor yet"
    name, side = next(iter(comparison["references"].items()))  # the script lists the strongest first
    ratio = side["speedup"]["whole_process"]
    ours = [r["test_acc"] for r in comparison["cifarkit"]["runs"]]
    difference = difference_of_means(ours, [r["test_acc"] for r in side["runs"]])
    interval = difference["ci95"]
    spread = f" (95% interval {100 * interval[0]:+.2f} to {100 * interval[1]:+.2f})" if interval else ""
    verdict = ("as accurate or more on the mean: faster at equal accuracy" if difference["difference"] >= 0
               else "less accurate on the mean: not yet faster at equal accuracy")
    rounds = len(comparison.get("rounds", ours))
    return (f"{ratio['mean']:.2f}x as fast as {name} at {100 * difference['difference']:+.2f} points of accuracy"
            f"{spread}, {rounds} rounds: {verdict}")


def _evidence(path: Path) -> str:
    """A link to a results file, with what results/notes.yaml says of it."""
    note = note_on(path)
    return f"[{path.name}]({rel(path)})" + (f" ({note})" if note else "")


def _machine(environment: dict) -> str:
    zen = ZEN.get(environment.get("cpu_model") or "")
    return processor_of(environment, zen) if zen else processor_of(environment)


def expect_block() -> str:
    """What a user gets on each device kind, from current files only: `fast` as shipped (accuracy with n, time,
    the speed-up over the strongest reference at its accuracy difference), and serving with the defaults."""
    lines = ["| device | what | you get | evidence |", "|---|---|---|---|"]
    for kind in (k for k in backends.CPU_KINDS if k in KIND_NAMES):
        training = [e for e in _training_evidence("cpu") if cpu_kind_of(e["environment"]) == kind]
        if training:
            latest = max(training, key=lambda e: e["day"])
            comparison = next((e for e in sorted(training, key=lambda e: e["day"], reverse=True) if "comparison" in e
                               and _machine(e["environment"]) == _machine(latest["environment"])), None)
            evidence = ", ".join(dict.fromkeys(_evidence(e["path"]) for e in (latest, comparison) if e))
            lines.append(f"| {KIND_NAMES[kind]}: {_machine(latest['environment'])} | `cifarkit train` (`fast`) | "
                         f"{_accuracy_words(latest['accuracies'])}; {latest['seconds'] / 60:.1f} min "
                         f"{latest['timer']}; "
                         f"{_against_reference(comparison['comparison'] if comparison else None)} | {evidence} |")
        else:
            lines.append(f"| {KIND_NAMES[kind]} | `cifarkit train` (`fast`) | not measured with the current `fast` "
                         f"yet | [history](docs/measurements.md) |")
        serving = [(path, data) for path, data in current_files("serve-bench*.json")
                   if cpu_kind_of(data["environment"]) == kind and _serves_defaults(data)]
        if serving:
            path, data = max(serving, key=lambda item: item[1]["measured"])
            goals = data["summary"]["goals"]["concurrency_64"]
            lines.append(f"| {KIND_NAMES[kind]}: {_machine(data['environment'])} | `cifarkit serve` (defaults: "
                         f"{data['servers']['batched']['served']['backend']}) | {goals['req_per_s']:,.0f} requests/s "
                         f"from 64 connections, p99 latency {goals['p99_ms']:.0f} ms | "
                         f"[{path.name}]({rel(path)}) |")
    for gpu in sorted({data["environment"]["gpus"][0]["name"] for path in result_files("speedrun-fast*.json")
                       if (data := json.loads(path.read_text()))["environment"].get("device", "").startswith("cuda")}):
        measured = [e for e in _training_evidence("cuda") if e["environment"]["gpus"][0]["name"] == gpu]
        if measured:
            latest = max(measured, key=lambda e: e["day"])
            lines.append(f"| {gpu} | `cifarkit train` (`fast`) | {_accuracy_words(latest['accuracies'])}; "
                         f"{latest['seconds']:.1f} s {latest['timer']} | "
                         f"[{latest['path'].name}]({rel(latest['path'])}) |")
        else:
            lines.append(f"| {gpu} | `cifarkit train` (`fast`) | not measured with the current `fast` yet: its one "
                         f"run timed the earlier recipe | [history](docs/measurements.md) |")
    return "\n".join(lines)



def quickstart_block() -> str:
    """What `cifarkit train` with no options gives: the default seed's run in the newest current speed run of `fast`,
    beside the mean of that speed run's seeds."""
    with_seed_0 = [(path, data) for path, data in current_files("speedrun-fast*.json")
                   if _shipped_fast(data) and any(r["seed"] == 0 for r in data["runs"])]
    if not with_seed_0:
        return "No current speed run of `fast` yet: `cifarkit speedrun --recipe fast --runs 5` makes one."
    path, data = max(with_seed_0, key=lambda item: _recorded_date(item[1]))
    first = next(r for r in data["runs"] if r["seed"] == 0)
    reach = "reaches" if first["test_acc"] >= ACCURACY_GOAL else "is under"
    return (f"On {hardware(data['environment'])}, seed 0 scored {100 * first['test_acc']:.2f}% in "
            f"{first['wall_time_s'] / 60:.1f} min, which {reach} {100 * ACCURACY_GOAL:.0f}%; seeds "
            f"{data['runs'][0]['seed']}-{data['runs'][-1]['seed']} of the same speed run give "
            f"{_accuracy_words([r['test_acc'] for r in data['runs']])} ([{path.name}]({rel(path)})).")

def _serves_defaults(bench: dict) -> bool:
    """A serving benchmark of `cifarkit serve` as it starts: backend auto, no options added."""
    command = shlex.split(bench["command"])
    return ("--backend" not in command or command[command.index("--backend") + 1] == "auto") \
        and not serve_options(bench)


def models_block() -> str:
    lines = ["| model | params | MACs / image |", "|---|---:|---:|"]
    for name in models.names():
        model = models.create(name)
        lines.append(f"| `{name}` | {models.count_params(model):,} | {models.count_macs(model):,} |")
    return "\n".join(lines)


def _importlinter() -> dict:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _summary(path: Path) -> str:
    """The first sentence of a module's (or a package's __init__'s) docstring."""
    import ast
    paragraph = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].split())
    return re.split(r"(?<=\.) ", paragraph)[0].rstrip(".")


def layers_block() -> str:
    """The layer map of pyproject.toml's `layers` contract, top to bottom, each layer with its modules and what it
    is, read from the package itself, so the map cannot drift from the code or from what `lint-imports` checks."""
    package = ROOT / "src" / "cifarkit"
    [contract] = [c for c in _importlinter()["contracts"] if c["type"] == "layers"]
    lines = ["| layer (imports only from the rows below it) | modules | what it is |", "|---|---|---|"]
    for level in contract["layers"]:
        for name in (part.strip() for part in level.split("|")):
            folder = package / name
            init = folder / "__init__.py" if folder.is_dir() else package / f"{name}.py"
            modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") if folder.is_dir() else []
            shown = f"`{name}`" + (" (independent of the other in this row)" if "|" in level else "")
            lines.append(f"| {shown} | {', '.join(modules) or '-'} | {_summary(init)} |")
    return "\n".join(lines)


def modules_block() -> str:
    """Every module of the package with the first sentence of its docstring, by layer folder."""
    package = ROOT / "src" / "cifarkit"
    lines = ["| module | what it holds |", "|---|---|"]
    for path in sorted(package.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") or "pretrained" in path.parts:
            continue
        lines.append(f"| `{path.relative_to(package).as_posix()}` | {_summary(path)} |")
    return "\n".join(lines)


def contracts_block() -> str:
    """The other import rules of pyproject.toml's [tool.importlinter], which `lint-imports` checks in CI."""
    lines = ["| rule | modules | may not import |", "|---|---|---|"]
    for contract in _importlinter()["contracts"]:
        if contract["type"] == "layers":
            continue
        if contract["type"] == "acyclic_siblings":
            sources, forbidden = contract["ancestors"], ["one another in a cycle"]
        else:
            sources, forbidden = contract["source_modules"], contract["forbidden_modules"]
        lines.append(f"| {contract['name']} | {', '.join(f'`{m}`' for m in sources)} | "
                     f"{', '.join(f'`{m}`' for m in forbidden)} |")
    return "\n".join(lines)


def full_runs() -> list[tuple[str, dict]]:
    """(folder name, summary) of each kept `cifarkit train` run in results/."""
    return [(path.parent.name, json.loads(path.read_text())) for path in sorted(RESULTS.glob("*/summary.json"))]


def training_block() -> str:
    lines = ["| run | recipe | epochs | test accuracy | wall time | train time | device | precision | torch |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for folder, s in full_runs():
        lines.append(f"| `results/{folder}` | `{s['recipe']}` | {s['epochs']} | "
                     f"{100 * s['test_acc']:.2f}% | {s['wall_time_s'] / 60:.1f} min | {s['train_time_s'] / 60:.1f} min "
                     f"| {s['device']} | {s['precision']} | {s['torch']} |")
    return "\n".join(lines)


def bench_block() -> str:
    bench = json.loads((RESULTS / "bench-train-cpu.json").read_text())
    env = bench["environment"]
    baseline = bench["results"][0]["mode"]
    model_names = " ".join(dict.fromkeys(r["model"] for r in bench["results"]))
    modes = " ".join(dict.fromkeys(r["mode"] for r in bench["results"]))
    command = (f"cifarkit bench --models {model_names} --modes {modes} --batch-size {bench['batch_size']} "
               f"--steps {bench['steps']} --rounds {bench['rounds']} --json results/bench-train-cpu.json")
    lines = [f"{processor_of(env)}, {env['threads']} threads, torch {env['torch']}, memory allocator "
             f"{env['allocator']}; batch {bench['batch_size']}, median of {bench['rounds']} interleaved rounds of "
             f"{bench['steps']} steps (`{command}`).", "",
             f"| model | mode | training img/s | vs {baseline} |", "|---|---|---:|---:|"]
    for r in bench["results"]:
        lines.append(f"| `{r['model']}` | {r['mode']} | {r['images_per_s']:,.0f} | "
                     f"{r[f'speedup_vs_{baseline}']:.2f}x |")
    return "\n".join(lines + ["", SPEED_ONLY_SENTENCE])


def speedrun_block() -> str:
    """Every speed run, current and superseded, with the command that made it."""
    lines = ["| recipe | n | mean test accuracy | std | 95% CI | p (mean > target) | wall time mean / max | device | "
             "precision | machine speed before each run | status | command |",
             "|---|---:|---:|---:|---|---:|---:|---|---|---:|---|---|"]
    for path in result_files("*speedrun-*.json"):
        report = json.loads(path.read_text())
        acc, wall = report["accuracy"], report["wall_time_s"]
        overrides = "".join(f" `{o}`" for o in report["overrides"])
        if acc["std"] is None:
            spread = "n/a | n/a | n/a"
        else:
            spread = (f"{100 * acc['std']:.2f} | [{100 * acc['ci95'][0]:.2f}, {100 * acc['ci95'][1]:.2f}] | "
                      f"{acc['p_value_mean_above_target']:.3g} (target {100 * report['target']:.1f}%)")
        lines.append(f"| `{report['recipe']}`{overrides} | {acc['n']} | {100 * acc['mean']:.2f}% | {spread} | "
                     f"{_duration(wall['mean'])} / {_duration(wall['max'])} | {hardware(report['environment'])} | "
                     f"{_precision(report)} | {machine_speeds(report['runs'])} | {status(path)} | "
                     f"{_speedrun_command(report)} (`{rel(path)}`) |")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def cpu_kind_of(environment: dict) -> str:
    """The CPU kind of a recorded environment; results from before the CPU's features were recorded say so."""
    features = environment.get("cpu_features")
    return backends.cpu_kind(features) if features is not None else "not recorded"


def step_block() -> str:
    """Where a step's time goes per CPU kind (`cifarkit profile`), and the A/B step times of code changes, each
    marked current or superseded. They time steps only: a step's accuracy is the speed runs' to measure."""
    lines = ["| CPU kind | processor | what | measured | status | command |", "|---|---|---|---|---|---|"]
    for path in result_files("profile-ab-fast-*.json"):
        ab = json.loads(path.read_text())
        after = ab["runs"]["after"]
        step = statistics.fmean(r["step_s"] for r in after)
        batch = after[0].get("batch_size", AB_BATCH_BEFORE_RECORDED)
        half = ab.get("speedup_ci95_half_width")
        spread = f", 95% CI +- {half:.2f}" if half is not None else ""
        lines.append(f"| {ab['cpu_kind']} | {processor_of(ab['environment'])} | `fast` training step, "
                     f"{after[0]['precision']}, batch {batch:,}, {after[0]['allocator']} | {step:.1f} s per step "
                     f"({batch / step:,.0f} img/s) at {ab['after']}, {ab['speedup_mean']:.2f}x the step at "
                     f"{ab['before']} (n = {len(after)} pairs{spread}); accuracy not measured (step time only) | "
                     f"{status(path)} | `{ab['command']}` (`{rel(path)}`) |")
    for path in result_files("*profile-*.json"):  # `cifarkit profile --json`: the convolutions' share of peak
        if path.name.startswith("profile-ab-"):
            continue
        profiled = json.loads(path.read_text())
        peak = profiled["matmul_peak"]
        # Files from before the computed count have only the direct one.
        rate, counted = next((profiled[key], what) for key, what in (
            ("convolution_computed_flop_per_s", "of the products computed"),
            ("convolution_flop_per_s", "counted as direct convolutions")) if profiled.get(key))
        lines.append(f"| {cpu_kind_of(profiled['environment'])} | {processor_of(profiled['environment'])} | "
                     f"`{profiled['recipe']}` step's convolutions, {profiled['precision']}, batch "
                     f"{profiled['batch_size']:,} | {rate / 1e12:.3f} TFLOP/s {counted}, "
                     f"{rate / peak['flop_per_s']:.2f}x a {peak['size']}^3 {peak['dtype']} matmul's "
                     f"{peak['flop_per_s'] / 1e12:.3f} in the same run; {profiled['step_s']:.1f} s per step | "
                     f"{status(path)} | `{profiled['command']}` (`{rel(path)}`) |")
    return "\n".join(lines)


def _precision(report: dict) -> str:
    return report["runs"][0].get("run", {}).get("precision", "not recorded")


def _speedrun_command(report: dict) -> str:
    """The command the JSON records; from files written before it did, as far as they tell it: the overrides, and
    --no-curve where no run has a per-epoch curve."""
    if report.get("command"):
        return f"`{report['command']}`"
    overrides = "".join(f" --set {o}" for o in report["overrides"])
    no_curve = " --no-curve" if all(len(r.get("curve", [])) <= 1 for r in report["runs"]) else ""
    return f"`cifarkit speedrun --recipe {report['recipe']} --runs {report['accuracy']['n']}{overrides}{no_curve}`"


def processor_of(environment: dict, *details: str) -> str:
    """The processor's name, with its x86 family and model where recorded (VMs name Zen 3, 4 and 5 alike "AMD EPYC"),
    the ISA caps that made it imitate an older CPU, and `details`."""
    caps = device.caps_text(environment.get("isa_caps") or {})
    details = ((environment["cpu_model"],) if environment.get("cpu_model") else ()) + (*caps, *details)
    return f"{environment['processor']} ({', '.join(details)})" if details else environment["processor"]


def hardware(environment: dict) -> str:
    """The GPU of a CUDA run; else the processor and whether it has AMX, which sets its bf16 training speed (about
    2x that of AVX512-BF16 alone)."""
    if environment.get("device") == "cuda":
        return environment["gpus"][0]["name"]
    features = environment.get("cpu_features")
    if features is None:  # speed runs from before the CPU's instruction sets were recorded
        return processor_of(environment)
    return processor_of(environment, "AMX" if "amx" in features else "no AMX")


def machine_speeds(runs: list[dict]) -> str:
    """The probe's img/s before each run, or why there is none: speed runs from before the probe have none."""
    probed = [r["machine_speed"]["before"]["images_per_s"] for r in runs if r.get("machine_speed")]
    if not probed:
        return "not probed"
    return ", ".join(f"{rate:,.0f}" for rate in probed) + " img/s" + ("" if len(probed) == len(runs) else
                                                                    f" ({len(runs) - len(probed)} not probed)")


def releases_block() -> str:
    return compare(SHIPPED, CHARTS / "releases.png")


def inference_block() -> str:
    """Each shipped release's speeds per CPU kind measured, the accuracy rule's figures `auto` judges on that kind,
    and what it picks there (cifarkit.inference.backends)."""
    lines = ["| release | CPU kind | backend | img/s, batch 1 | ms, batch 1 | img/s, batch 256 | test acc | "
             "top-1 = fp32 | accuracy figures |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for path in sorted(SHIPPED.glob("version_*/metrics.json")):
        m = json.loads(path.read_text())
        inference = m["inference"]
        for kind, table in sorted(backends.speed_tables(inference).items()):
            picked = backends.choose(m, features=list(backends.CPU_KINDS[backends.CPU_KINDS.index(kind):])).backend
            figures, where = backends.accuracy_figures(inference, kind)
            accuracy, agreement = figures.get("test_acc_by_backend", {}), figures["top1_agreement_with_fp32"]
            speed = {(r["backend"], r["batch_size"]): r for r in table}
            for backend in backends.BACKENDS:
                one, many = speed[(backend, 1)], speed[(backend, 256)]
                acc = f"{100 * accuracy[backend]:.2f}%" if backend in accuracy else "-"
                lines.append(f"| {m['release']} | {kind} | {backend}{' (auto)' if backend == picked else ''} | "
                             f"{one['images_per_s']:,.0f} | {one['ms_per_batch']:.2f} | {many['images_per_s']:,.0f} | "
                             f"{acc} | {100 * agreement[backend]:.2f}% | {where} |")
    return "\n".join(lines)


def predict_block() -> str:
    """What the README's `cifarkit predict` example prints, run here as written."""
    images = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples" / "images").glob("*.png"))
    printed = subprocess.run([sys.executable, "-m", "cifarkit", "predict", *images, "--topk", "3"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    return "```\n" + printed + "```"


def _measured(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _not_measured(name: str, command: str) -> str:
    return f"Not measured yet: `{command}` writes `results/{name}`, and `lab/render_readme.py` renders it here."


def serve_options(bench: dict) -> str:
    """The `cifarkit serve` options a bench_serve run added to the defaults (its --serve-args), or ""."""
    command = shlex.split(bench["command"])
    return command[command.index("--serve-args") + 1] if "--serve-args" in command else ""


def serving_goals_block() -> str:
    """The serving goals at 64 connections on each CPU kind measured (results/serve-bench*.json), each beside what
    the model alone allows in the same run: a closed loop of C connections answered at R req/s waits C / R on
    average (Little's law), so the model's best img/s bounds the mean latency from below, and the most batching can
    give is the model's own gain from batch 1 to its best batch."""
    rows = []
    for path in result_files("serve-bench*.json"):
        bench = json.loads(path.read_text())
        goals, alone = bench["summary"]["goals"]["concurrency_64"], bench["model_alone"]
        constants = bench["summary"]["goal_constants"]
        best = max(alone[f"batch_{b}_images_per_s"] for b in (1, 32, 64))
        options = serve_options(bench)
        backend = bench["servers"]["batched"]["served"]["backend"]
        rows.append({"path": path, "kind": cpu_kind_of(bench["environment"]),
                     "processor": processor_of(bench["environment"]), "defaults": _serves_defaults(bench),
                     "backend": f"{backend}, `{options}`" if options else backend, "goals": goals,
                     "constants": constants, "best": best, "gain": best / alone["batch_1_images_per_s"]})
    if not rows:
        return _not_measured("serve-bench*.json", "cifarkit bench-serve")
    best_by_machine = {}  # a kind's processors differ (Zen 2 and Zen 3 are both AVX2): compare on one only
    for row in rows:
        machine = row["kind"], row["processor"]
        best_by_machine[machine] = max(best_by_machine.get(machine, 0.0), row["goals"]["req_per_s"])
    c = rows[0]["constants"]
    lines = [f"| CPU kind | processor | backend | req/s at {c['concurrency']} connections | "
             f"p99 ms (goal <= {c['p99_ms']}) | "
             f"batched / unbatched (goal >= {c['ratio']}x) | the model alone: best batch / batch 1 | the model alone: "
             f"least mean latency at {c['concurrency']} connections | defaults / best here (goal >= 0.9x) | "
             f"status | file |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        g = row["goals"]
        best_here = best_by_machine[row["kind"], row["processor"]]
        versus = f"{g['req_per_s'] / best_here:.2f}x" if row["defaults"] else "-"
        defaults = " (defaults)" if row["defaults"] else ""
        lines.append(f"| {row['kind']} | {row['processor']} | {row['backend']}{defaults} | "
                     f"{g['req_per_s']:,.0f} | {g['p99_ms']:.0f} {'met' if g['p99_met'] else 'not met'} | "
                     f"{g['ratio']:.2f}x {'met' if g['ratio_met'] else 'not met'} | {row['gain']:.2f}x | "
                     f"{1000 * c['concurrency'] / row['best']:.0f} ms | {versus} | {status(row['path'])} | "
                     f"`{rel(row['path'])}` |")
    return "\n".join(lines + ["", "Both servers of a file serve one release through one backend: the ratios are of "
                                  "speed. The accuracy each backend serves is the release's, measured per CPU kind "
                                  "([releases](releases.md)), and `auto` takes bf16 only where it keeps it."])


def serve_block() -> str:
    """The newest current benchmark of `cifarkit serve` (`cifarkit bench-serve`), one of its defaults where there is
    one: batched against unbatched per concurrency."""
    benches = current_files("serve-bench*.json")
    if not benches:
        return _not_measured("serve-bench.json", "cifarkit bench-serve")
    path, bench = max(benches, key=lambda item: (_serves_defaults(item[1]), item[1]["measured"]))
    env, servers, summary = bench["environment"], bench["servers"], bench["summary"]
    batching = servers["batched"]["batching"]
    unbatched = {level["concurrency"]: level for level in servers["unbatched"]["levels"]}
    ratios = {row["concurrency"]: row["ratio"] for row in summary["levels"]}

    def ms(level):
        return " / ".join("n/a" if level[k] is None else f"{level[k]:.1f}" for k in ("p50_ms", "p95_ms", "p99_ms"))

    lines = [f"Release {bench['model']} on {processor_of(env)} ({env['cpu_count']} cores, torch {env['torch']}, "
             f"uvicorn {env['versions']['uvicorn']}); {bench['requests_per_level']:,} requests per level, each a "
             f"{bench['image']['sent']} of {bench['image']['bytes']:,} bytes, from the benchmark's own client on the "
             f"same cores ({bench['client']['tool']}, one connection per concurrent client). Batched: up to "
             f"{batching['max_batch']} images "
             f"per forward pass, waiting at most {batching['max_wait_ms']:g} ms for them; unbatched: one.", "",
             "| concurrency | batched req/s | unbatched req/s | ratio | p50 / p95 / p99 ms, batched | "
             "p50 / p95 / p99 ms, unbatched | errors, batched / unbatched | mean batch |",
             "|---:|---:|---:|---:|---|---|---:|---:|"]
    for level in servers["batched"]["levels"]:
        c, u = level["concurrency"], unbatched.get(level["concurrency"])
        ratio = "n/a" if ratios.get(c) is None else f"{ratios[c]:.2f}x"
        other = (f"{u['req_per_s']:,.0f}", ms(u), f" / {u['errors']:,}") if u else ("n/a", "n/a", "")
        lines.append(f"| {c} | {level['req_per_s']:,.0f} | {other[0]} | {ratio} | {ms(level)} | {other[1]} | "
                     f"{level['errors']:,}{other[2]} | {level['batches']['mean_size']:.2f} |")
    lines.append("")
    if "overload" in servers:
        goal, after = summary["goals"]["overload"], servers["overload"]["after"]
        lines.append(f"- Overload (queue of {goal['max_queue']} images, concurrency {goal['concurrency']}): "
                     f"{100 * goal['share_503']:.1f}% of {goal['requests']:,} requests answered 503, those with a "
                     f"p99 of {goal['p99_503_ms']:.1f} ms (the 200s: {goal['p99_200_ms']:.1f} ms); "
                     f"{goal['other_errors']} other errors; afterwards /healthz {after['healthz']}, /readyz "
                     f"{after['readyz']}, a prediction {after['predict']}.")
    if "soak" in servers["batched"]:
        soak = servers["batched"]["soak"]
        rss = soak["rss_mib"]
        lines.append(f"- Soak (batched, concurrency {soak['concurrency']}, {soak['seconds']:.0f} s): "
                     f"{soak['requests']:,} requests ({soak['req_per_s']:,.0f} req/s), {soak['errors']:,} errors, "
                     f"the worst p99 of its {soak['chunk_s']:g} s runs "
                     f"{soak['worst_chunk_p99_ms']:.1f} ms; RSS {rss['start']:.0f} -> {rss['end']:.0f} MiB "
                     f"({rss['growth_pct']:+.1f}%, at most {rss['max']:.0f} MiB).")
    starts = "; ".join(f"{name} {server['start_s']:.1f} s and {server['ready_memory']['rss_mib']:.0f} MiB (peak "
                       f"{server['final_memory']['peak_rss_mib']:.0f} MiB)" for name, server in servers.items())
    lines.append(f"- Start, from launch to the ready line, and RSS then: {starts}.")
    if alone := bench.get("model_alone"):
        speeds = ", ".join(f"{alone[f'batch_{n}_images_per_s']:,.0f} img/s at batch {n}" for n in (1, 32, 64))
        lines.append(f"- The model alone, timed in the same run ({alone['backend']}, traced, {alone['threads']} "
                     f"thread(s)), for the machine's speed at the time: {speeds}.")
    def missed(goal: dict) -> str:
        figures = []
        for key, met in goal.items():
            name = key.removesuffix("_met")
            if key.endswith("_met") and not met:
                value = goal.get(name, goal.get(f"{name}_ms"))
                figures.append(f"{name.replace('_per_', '/').replace('_', ' ')} {value:,}" if value is not None
                               else name.replace("_", " "))
        return ", ".join(figures)

    verdicts = [f"{name.replace('_', ' ')} " + ("met" if goal["met"] else f"missed ({missed(goal)})")
                for name, goal in summary["goals"].items()]
    lines.append(f"- The issue's goals in this run: {'; '.join(verdicts)}.")
    lines.append(f"- Written by `{bench['command']}` (`{rel(path)}`).")
    return "\n".join(lines)


def scaling_block() -> str:
    bench = json.loads((RESULTS / "bench-scaling-cpu.json").read_text())
    env, result = bench["environment"], bench["scaling"]
    lines = [f"{processor_of(env)}, {env['threads']} cores, torch {env['torch']}; `{result['model']}` in "
             f"{result['mode']}, global batch {result['batch_size']}, median of {result['rounds']} interleaved rounds "
             f"of {result['steps']} steps, each count launched by torchrun (`{bench['command']}`).", "",
             "| processes | training img/s | speed-up | efficiency |", "|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['processes']} | {row['images_per_s']:,.0f} | {row['speedup']:.2f}x | "
                     f"{100 * row['efficiency']:.0f}% |")
    seconds = result["eval_images"] / result["eval_images_per_s"]
    lines += ["", f"Rank 0 evaluates alone: {result['eval_images_per_s']:,.0f} img/s, {seconds:.1f} s per pass over "
                  f"{result['eval_images']:,} test images, during which the other ranks wait. " + SPEED_ONLY_SENTENCE]
    return "\n".join(lines)


def devices_block() -> str:
    """results/bench-devices.json, written by `cifarkit bench --devices cpu cuda`: the CPU rows measured on this
    project's machine, the CUDA rows on a GPU when one was lent (lab/device_check.sh)."""
    result = json.loads((RESULTS / "bench-devices.json").read_text())
    env = result["environment"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "no GPU"
    lines = [f"{processor_of(env)} ({env['threads']} threads), {gpus}; torch {env['torch']} (`{result['command']}`).",
             "", device_table(result), "", SPEED_ONLY_SENTENCE]
    if result["skipped"]:
        lines += ["", "Not measured: " + "; ".join(f"{what} ({why})" for what, why in result["skipped"].items()) + "."]
    lines += ["", "![training speed-up over the CPU in fp32, per model, device and mode](results/bench-devices.png)"]
    return "\n".join(lines)


def reference_block() -> str:
    """results/compare-reference*.json, written by `cifarkit reference`: the published airbench speedruns next
    to `fast`, timed on one machine in alternating rounds; a file per machine measured."""
    blocks = []
    for path in result_files("compare-reference*.json"):
        result = json.loads(path.read_text())
        table = _reference_comparison(result) if "references" in result else _airbench94_only(result)
        blocks.append(f"**`{rel(path)}`**, {status(path)}:\n\n{table}")
    return "\n\n".join(blocks)


def _reference_comparison(result: dict) -> str:
    env, ours = result["environment"], result["cifarkit"]
    lines = [f"{hardware(env)}, {env['threads']} cores, torch {env['torch']}; "
             f"precision {result['precision_policy']}, "
             f"Newton-Schulz in {result['newton_schulz_dtype']}, {result['preloaded_by_all'] or 'no allocator'} "
             f"preloaded by every side (`{result['command']}`).", ""]
    if result["subset"]:
        lines += [f"Trained on {result['subset']:,} images only: a check that every side runs, not a comparison.", ""]
    lines += ["| side | runs | test accuracy, its own TTA | 6 views of every image | whole process | training "
              "| `fast`'s speed-up, whole process (95% CI) | training (95% CI) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|",
              f"| `cifarkit train --recipe {_variant(result)}` | {ours['accuracy']['n']} | "
              f"{100 * ours['accuracy']['mean']:.2f}% | {100 * ours['accuracy_6_views']['mean']:.2f}% | "
              f"{ours['wall_time_s'] / 60:.1f} min | {ours['train_time_s'] / 60:.1f} min | | |"]
    for name, side in result["references"].items():
        ratios = [f"{r['mean']:.2f}x" + (f" ({r['ci95'][0]:.2f}-{r['ci95'][1]:.2f})" if r["ci95"] else "")
                  for r in (side["speedup"]["whole_process"], side["speedup"]["training"])]
        lines.append(f"| {name} (`{side['source'].split(',')[0]}`) | {side['accuracy']['n']} | | "
                     f"{100 * side['accuracy']['mean']:.2f}% | {side['wall_time_s'] / 60:.1f} min | "
                     f"{side['train_time_s'] / 60:.1f} min | {ratios[0]} | {ratios[1]} |")
    lines += ["", *(_accuracy_difference(_variant(result), ours["runs"], name, side["runs"])
                    for name, side in result["references"].items())]
    observed = "; ".join(f"{name}: " + ", ".join(sorted({_observed(run) for run in side["runs"]}))
                         for name, side in [("cifarkit", ours), *result["references"].items()])
    lines += ["", f"Read from each timed process: {observed}."]
    if "settings" in result:  # the script's rounds form, which a later command may extend
        finished = ", ".join(r["finished"].replace("T", " ").removesuffix("+00:00")
                             + (f" (run from {r['commit']})" if "commit" in r else "") for r in result["rounds"])
        lines.append(f"cifarkit's src/ at commit {result['settings']['code']['commit']}; the rounds finished at "
                     f"{finished} UTC.")
        if len(result["rounds"]) < _rounds_asked(result):
            lines.append(f"Unfinished: {_rounds_done(result)} so far. The same command, on this CPU kind with the "
                         f"same src/, allocator and threads, runs the rest and keeps these.")
    return "\n".join(lines)


def _accuracy_difference(recipe: str, ours: list[dict], name: str, theirs: list[dict]) -> str:
    """`recipe`'s mean accuracy minus a reference's, as shipped and with the reference's 6 views, with the intervals
    that say whether a handful of runs can tell the difference from zero."""
    cells = []
    for label, key in (("its own TTA", "test_acc"), ("6 views", "test_acc_6_views")):
        difference = difference_of_means([r[key] for r in ours], [r["test_acc"] for r in theirs])
        cells.append(f"{label} {describe_difference(difference)}")
    return f"Mean test accuracy, `{recipe}` minus {name}: {'; '.join(cells)}."


def _rounds_asked(result: dict) -> int:
    """The rounds the comparison's command asks for; a file may hold fewer while the comparison is unfinished."""
    return int(re.search(r"--runs (\d+)", result["command"]).group(1))


def _rounds_done(result: dict) -> str:
    done = len(result.get("rounds", result["cifarkit"]["runs"]))
    asked = _rounds_asked(result)
    return str(done) if done >= asked else f"{done} of the command's {asked} rounds"


def _variant(result: dict) -> str:
    """cifarkit's side of a comparison as its command line named it: the recipe, then any --set."""
    return " ".join([result["recipe"], *(f"--set {o}" for o in result.get("overrides") or [])])


def _side_of(result: dict) -> str:
    """The README's name for cifarkit's side: the recipe, and the fields a --set changed in it."""
    changed = ", ".join(f"`{o}`" for o in result.get("overrides") or [])
    return f"`{result['recipe']}`" + (f" with {changed}" if changed else "")


def _code_of(result: dict) -> str:
    """The cifarkit commit a comparison timed, where the file records it: two files on one kind are two versions."""
    return f", src/ at {result['settings']['code']['commit']}" if "settings" in result else ""


def _observed(run: dict) -> str:
    """What one timed process ran: its precision (cifarkit's, or the dtype of a reference's logits), Newton-Schulz
    dtype where it has one, allocator and threads."""
    precision = run.get("precision") or run["logits_dtype"]
    newton_schulz = f", Newton-Schulz {run['newton_schulz_dtype']}" if run.get("newton_schulz_dtype") else ""
    return f"{precision}{newton_schulz}, {run['allocator']}, {run['threads']} threads"


def _airbench94_only(result: dict) -> str:
    """The first form of the comparison: airbench94 alone, with bf16 autocast forced on it, one timer."""
    env = result["environment"]
    lines = [f"{hardware(env)}, {env['threads']} cores, torch {env['torch']} "
             f"(`{result['command']}`, an earlier version of the script; timer: {result['timer_covers']}).", "",
             "| | runs | test accuracy (TTA), each | mean | whole process, each | mean |",
             "|---|---:|---|---:|---|---:|"]
    for name, label in (("reference", f"`{result['reference_package']}` `lib_airbench94` (CPU, bf16 autocast)"),
                        ("cifarkit", "`cifarkit train --recipe fast` (2.25 TTA views per image)")):
        side = result[name]
        accuracies = ", ".join(f"{100 * r['test_acc']:.2f}%" for r in side["runs"])
        walls = ", ".join(f"{r['wall_time_s'] / 60:.1f}" for r in side["runs"])
        lines.append(f"| {label} | {side['accuracy']['n']} | {accuracies} | {100 * side['accuracy']['mean']:.2f}% | "
                     f"{walls} min | {side['wall_time_s'] / 60:.1f} min |")
    lines += ["", f"`fast` took {1 / result['speedup']:.2f}x the reference's time: {result['speedup']:.2f}x as fast."]
    return "\n".join(lines)


def containers_block() -> str:
    """results/container-check.json, written by lab/container_check.py: both images built offline and run."""
    result = _measured("container-check.json")
    if result is None:
        return _not_measured("container-check.json",
                             "python lab/container_check.py --json results/container-check.json")
    base, wheels, cpu = result["base"], result["wheelhouse"], result["cpu"]
    serving = cpu["serving"]
    releases = ", ".join(sorted({p["model"] for p in serving["predictions"].values()}))
    answers = f"release {releases} answered " + ", ".join(f"{name} {p['label']} {p['confidence']:.0%}"
                                                        for name, p in serving["predictions"].items())
    lines = [f"{result['engine']}, base `{base['image']}` (Python {base['python']}: {base['made_by']}), "
             f"{wheels['wheels']} wheels ({wheels['mib']:,} MiB) in the wheelhouse (`{result['command']}`).", "",
             "| image | built offline | size | user | command | in the container |", "|---|---:|---:|---|---|---|",
             f"| `{cpu['dockerfile']}` on `{cpu['base']}` | {cpu['build_seconds']:.0f} s | {cpu['image_mib']:,} MiB | "
             f"{cpu['user']} (uid {serving['uid']}) | `{' '.join(cpu['cmd'])}` | healthy "
             f"{serving['healthy_seconds']:.1f} s after the start; {answers} |"]
    if "cuda" in result:
        cuda, training = result["cuda"], result["cuda"]["training"]
        verdict = "passes" if training["healthcheck_passes"] else "fails, as it should without a GPU"
        lines.append(f"| `{cuda['dockerfile']}` on the stand-in `{cuda['base']}` | {cuda['build_seconds']:.0f} s | "
                     f"{cuda['image_mib']:,} MiB | {cuda['user']} | `{' '.join(cuda['cmd'])}` | "
                     f"`{training['command']}`: {training['seconds']:.0f} s on the {training['device']} "
                     f"({training['precision']}), test accuracy {training['test_acc']:.1%}; "
                     f"the healthcheck {verdict} |")
    lines += ["", "The wheelhouse here holds PyPI's torch, the CUDA build, so the CPU image measured here carries "
                  "CUDA's libraries; built online from PyTorch's CPU-only index it would not (that index is not "
                  "reachable here)."]
    return "\n".join(lines)


PLAN_NAMES = {"onednn": "every layer on oneDNN", "f2_only": "F(2x2, 3x3) alone, as before F(4x4, 3x3)",
              "without_winograd": "the kernel plan without Winograd",
              "pooled_up_to_8": "the pooled 15x15 layer on oneDNN, pooled layers up to 8x8 on Winograd"}


def winograd_block() -> str:
    """Each 3x3 layer's forward + backward time in fp32 or bf16, oneDNN against Winograd's F(2x2, 3x3) and F(4x4,
    3x3), per CPU kind measured (lab/measure_winograd.py), and the path training takes there (in bf16, also timed
    as it takes it)."""
    parts = []
    for path in result_files("winograd-layers-*.json"):
        result = json.loads(path.read_text())
        precision = result.get("precision", "fp32")
        variants = [name.removeprefix("winograd").split("_") for name in result["layers"][0]["median_s"]
                    if name.startswith("winograd")]
        variants = sorted((int(tile), int(rows)) for tile, rows in variants)
        chosen_rows = {int(tile): rows for tile, rows in result["tile_rows_chosen"].items()}
        parts.append(f"{result['cpu_kind']}, {processor_of(result['environment'])}, `{result['model']}`, batch "
                     f"{result['batch_size']:,}, {result['threads']} threads, medians of {result['rounds']} "
                     f"interleaved rounds (`{result['command']}`, `{rel(path)}`, {status(path)}):\n")
        timed_as_trained = "as_trained" in result["layers"][0]["median_s"]  # bf16: each layer on its kernel plan
        parts.append(f"| layer | input gradient | {precision} training takes | oneDNN, ms | "
                     + ("as training takes it, ms | " if timed_as_trained else "")
                     + " | ".join(f"F({tile}x{tile}), {rows:,} tiles a slice, ms" for tile, rows in variants)
                     + " | oneDNN / training's choice |")
        parts.append("|---|---|---|---:|" + "---:|" * (len(variants) + timed_as_trained) + "---:|")
        for layer in result["layers"]:
            medians, tile, kept = layer["median_s"], layer["winograd_tile"], layer["kept_outputs"]
            shape = f"{layer['c_in']} -> {layer['c_out']} at {layer['width']}x{layer['width']}"
            if layer["pooled"]:
                shape += f", pooled ({kept}x{kept} kept)"
            training_path = layer[f"{precision}_training_path"]
            winograd = training_path.startswith("winograd")
            computed = tile * winograd_blocks(kept, tile)
            if winograd and computed != kept:  # the outputs Winograd computes and crops, where training takes it
                shape += f" ({computed}x{computed} by F({tile}x{tile}))"
            takes = f"F({tile}x{tile}, 3x3)" if winograd else "oneDNN" if training_path == "plain" else training_path
            chosen = medians["as_trained"] if timed_as_trained else (
                medians[f"winograd{tile}_{chosen_rows[tile]}"] if winograd else medians["onednn"])
            parts.append(f"| {shape} | {'yes' if layer['input_gradient'] else 'no'} | {takes} | "
                         f"{1e3 * medians['onednn']:,.0f} | "
                         + (f"{1e3 * chosen:,.0f} | " if timed_as_trained else "")
                         + " | ".join(f"{1e3 * medians[f'winograd{tile}_{rows}']:,.0f}" for tile, rows in variants)
                         + f" | {medians['onednn'] / chosen:.2f}x |")
        if "whole_model" in result:
            whole = result["whole_model"]
            rounds = len(next(iter(whole["samples_s"].values())))
            trained = whole["median_s"]["as_trained"]
            parts.append(f"\nThe whole `{result['model']}`, forward and backward, the choices taking turns (medians of "
                         f"{rounds} rounds): " + ", ".join(
                             f"{PLAN_NAMES[plan]} {1e3 * s:,.0f} ms ({s / trained:.2f}x training's choice)"
                             for plan, s in whole["median_s"].items() if plan != "as_trained")
                         + f", as {precision} training takes them {1e3 * trained:,.0f} ms.")
        parts.append("")
    if not parts:
        return "No measurement yet: `python lab/measure_winograd.py`."
    return "\n".join(parts) + SPEED_ONLY_SENTENCE


def validation_block() -> str:
    """Every recipe sweep on a validation split (`cifarkit validate`), oldest first, with the table the
    script printed."""
    sweeps = sorted(((json.loads(path.read_text()), path) for path in RESULTS.glob("validation-*.json")),
                    key=lambda sweep: sweep[0]["measured"])
    parts = []
    for result, path in sweeps:
        first_run = next(iter(result["variants"][0]["runs"].values()))
        # A recipe's values change over time: the commit the table was written at names the ones its runs had.
        parts.append(f"`{result['recipe']}` as at {result['written_at_commit']}, on {result['val_split']:,} held-out "
                     f"training images, {hardware(result['environment'])}, {first_run['precision']} "
                     f"(`{result['command']}`, `results/{path.name}`):\n\n"
                     + "\n".join(result["table"]))
    return "\n\n".join(parts) or "No sweep yet: `cifarkit validate`."


BLOCKS = {"models": models_block, "training": training_block, "speedrun": speedrun_block, "bench": bench_block,
          "releases": releases_block, "inference": inference_block, "expect": expect_block,
          "quickstart": quickstart_block, "steps": step_block, "index": index_block, "predict": predict_block,
          "serve": serve_block, "scaling": scaling_block, "reference": reference_block, "devices": devices_block,
          "containers": containers_block, "contracts": contracts_block, "layers": layers_block,
          "serving-goals": serving_goals_block, "winograd": winograd_block, "modules": modules_block,
          "validation": validation_block}


# Blocks that run a command here rather than read results/: their figures are this machine's (a prediction's
# confidences differ in the last digit between CPU kinds), so `--check` leaves them out.
LIVE_BLOCKS = {"predict"}


def pages() -> list[Path]:
    """The pages that may hold generated blocks: the README, the docs, and the index of results/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]


def render(pages_text: dict[Path, str], skip: set[str]) -> dict[Path, str]:
    """The pages with every block but `skip` rendered afresh."""
    texts = dict(pages_text)
    for name, block_of in BLOCKS.items():
        if name in skip:
            continue
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        holders = [page for page, text in texts.items() if pattern.search(text)]
        if len(holders) != 1:
            found = ", ".join(page.relative_to(ROOT).as_posix() for page in holders) or "none of them"
            raise SystemExit(f"the block <!-- {name}:begin --> ... <!-- {name}:end --> must be in exactly one of "
                             f"README.md, docs/*.md and results/README.md; found in {found}")
        page = holders[0]
        block = block_of()
        if page.parent.name == "docs":  # the blocks link results/ from the project's root
            block = block.replace("](results/", "](../results/").replace("](docs/", "](")
        texts[page] = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), texts[page])
    return texts


def stale_pages() -> list[str]:
    """The pages whose blocks differ from a fresh render of results/ (the live blocks aside), with the first line
    that differs; the charts of the check are drawn in a scratch folder."""
    global CHARTS
    texts = {page: page.read_text() for page in pages()}
    kept, CHARTS = CHARTS, Path(tempfile.mkdtemp())
    try:
        fresh = render(texts, skip=LIVE_BLOCKS)
    finally:
        shutil.rmtree(CHARTS)
        CHARTS = kept
    stale = []
    for page, text in texts.items():
        if fresh[page] != text:
            line = next(new for old, new in zip(text.splitlines() + [""], fresh[page].splitlines() + [""])
                        if old != new)
            stale.append(f"{page.relative_to(ROOT).as_posix()}: differs first at {line[:100]!r}")
    return stale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each page that differs from a fresh render")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        if stale:
            raise SystemExit("stale renders, fix with `python lab/render_readme.py`:\n" + "\n".join(stale))
        print("every generated block matches results/")
        return
    update_provenance()
    for page, text in render({page: page.read_text() for page in pages()}, skip=set()).items():
        write_text(page, text)
    print(f"rewrote {', '.join(BLOCKS)} in README.md, docs/ and results/README.md")


if __name__ == "__main__":
    main()
