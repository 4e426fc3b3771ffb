"""A folder of cifarkit's results files, read as a whole: which files are current and which superseded (their
reasons in archive/reasons.yaml), what each measured, where, at which commit and when (`cifarkit results` prints this
index), and what a user can expect on each kind of device from the current files alone: `fast` as it ships, with its
accuracy beside every speed-up, and the server with its defaults.

A file that no longer measures what ships moves to the folder's archive/ with its reason; notes.yaml says of a
current file what it cannot say of itself (a run stopped early); provenance.json gives the commit and day a file was
added, for files that record neither.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from cifarkit.core import device
from cifarkit.tools import reference
from cifarkit.tools.speedrun import difference_of_means, mean_with_t_interval

ARCHIVE, PROVENANCE = "archive", "provenance.json"


def archive_reasons(folder: Path) -> dict[str, str]:
    """The archive's files, each with the reason it is history (archive/reasons.yaml; none where it is missing)."""
    reasons = folder / ARCHIVE / "reasons.yaml"
    return (yaml.safe_load(reasons.read_text()) or {}) if reasons.is_file() else {}


def result_files(folder: Path, pattern: str) -> list[Path]:
    """The files of results/ matching `pattern`, then those of results/archive/: the history tables show both."""
    return sorted(folder.glob(pattern)) + sorted((folder / ARCHIVE).glob(pattern))


def current_files(folder: Path, pattern: str) -> list[tuple[Path, dict]]:
    """The current JSON files matching `pattern`, each with its contents: all that the standing may show."""
    return [(path, json.loads(path.read_text())) for path in sorted(folder.glob(pattern))]


def rel(folder: Path, path: Path) -> str:
    """A results file's path as the pages name it."""
    return f"{folder.name}/{path.relative_to(folder).as_posix()}"


def status(folder: Path, path: Path) -> str:
    """"current" (with the note results/notes.yaml keeps for it, if any), or "superseded" with the archive's
    reason."""
    if path.parent != folder:
        return f"superseded: {archive_reasons(folder).get(path.name, 'no reason given in archive/reasons.yaml')}"
    note = note_on(folder, path)
    return f"current ({note})" if note else "current"


def note_on(folder: Path, path: Path) -> str | None:
    """What results/notes.yaml says of a file that the file cannot say of itself (a run stopped early)."""
    notes = folder / "notes.yaml"
    return (yaml.safe_load(notes.read_text()) or {}).get(path.name) if notes.is_file() else None


def provenance(folder: Path) -> dict[str, dict]:
    path = folder / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def recorded_commit(data: dict) -> str | None:
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


def recorded_time(data: dict) -> str | None:
    """When a file says it was measured, as its ISO timestamp (UTC): its own stamp, else the last of its runs'
    finishing times."""
    if data.get("measured"):
        return data["measured"]
    runs = data.get("runs")
    finished = [r["finished"] for r in runs if isinstance(r, dict) and r.get("finished")] if isinstance(runs, list) \
        else []
    return max(finished) if finished else None


def recorded_date(data: dict) -> str | None:
    """The day a file says it was measured."""
    time = recorded_time(data)
    return time[:10] if time else None


def commit_and_date(folder: Path, path: Path, data: dict) -> tuple[str, str]:
    """The commit and day of a results file as the index shows them: the file's own record, else the commit that
    added it (marked "added in")."""
    added = provenance(folder).get(path.name, {})
    commit = recorded_commit(data) or (f"added in {added['added_in']}" if added else "not recorded")
    return commit, recorded_date(data) or added.get("date", "not recorded")


# The question each kind of results file answers, by the start of its name; the index groups the files by them.
QUESTIONS = (
    (("speedrun-", "release-"), "How accurate is a recipe, and how long does a run take? (`cifarkit speedrun`)"),
    (("compare-reference",), "How does `fast` compare with the airbench references? (`cifarkit reference`)"),
    (("profile-ab-",), "Did a code change make the training step faster? (`cifarkit profile --before COMMIT`)"),
    (("profile-", "freeze-profile-"), "Where does a training step's time go? (`cifarkit profile`)"),
    (("bench-",), "Training throughput per model, precision, device and process count (`cifarkit bench`)"),
    (("serve-bench",), "How fast does the server answer? (`cifarkit bench-serve`)"),
    (("tune-", "validation-"), "Which recipe values win on a validation split? (`cifarkit tune`; the `validation-` "
                               "files, the former `cifarkit validate`)"),
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


def index_table(folder: Path) -> str:
    """Every file of results/ and results/archive/, by the question it answers: what it measured, where, at which
    commit, when, and whether it is current."""
    files = [p for p in result_files(folder, "*") if p.suffix in (".json", ".png") and p.name != PROVENANCE]
    parts = []
    for _, question in QUESTIONS:
        rows = []
        for path in files:
            if question_of(path.name) != question:
                continue
            data = json.loads(path.read_text()) if path.suffix == ".json" else {}
            kind, processor = _device_of(data)
            commit, day = commit_and_date(folder, path, data)
            link = path.relative_to(folder).as_posix()
            rows.append(f"| [{link}]({link}) | {_what(path, data)} | {kind} | {processor} | {commit} | {day} | "
                        f"{status(folder, path)} |")
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


def _training_evidence(folder: Path, device: str) -> list[dict]:
    """Each current file that timed the shipped `fast` on `device` ("cpu" or "cuda"): speed runs and comparisons
    with a reference, with its accuracies, mean time a run and day."""
    found = []
    for path, data in current_files(folder, "speedrun-fast*.json"):
        if _shipped_fast(data) and data["environment"].get("device", "cpu").split(":")[0] == device:
            found.append({"path": path, "environment": data["environment"], "time": recorded_time(data) or "",
                          "accuracies": [r["test_acc"] for r in data["runs"]], "seconds": data["wall_time_s"]["mean"],
                          "timer": "a run"})
    for path, data in current_files(folder, "compare-reference*.json"):
        if device == "cpu" and "references" in data and _shipped_fast(data):
            found.append({"path": path, "environment": data["environment"], "time": recorded_time(data) or "",
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
    """`fast`'s speed-up over each reference of a comparison, the strongest first: at equal accuracy where the
    comparison bracketed the reference's accuracy, else at `fast`'s own budget, always with the accuracy difference,
    its interval, and in words whether that is a speed-up at equal accuracy."""
    if comparison is None:
        return "no reference timed on this processor yet"
    ours = [r["test_acc"] for r in comparison["cifarkit"]["runs"]]
    rounds = len(comparison.get("rounds", ours))
    # The verdict in the words of today's code, from the figures the file holds (it keeps the words of the code
    # that ran the rounds).
    goals = (f" (the goals: {reference.verdict(comparison['references'], comparison['subset'], rounds)})"
             if comparison.get("verdict") else "")
    return "; ".join([*(_against(name, side, ours) for name, side in comparison["references"].items()),
                      f"{rounds} round{'s' if rounds != 1 else ''}{goals}"])


def _against(name: str, side: dict, ours: list[float]) -> str:
    figure = side.get("equal_accuracy")
    if figure and figure["defined"]:  # the speed-up: `fast`'s time read at the reference's accuracy
        ratio = figure["whole_process"]
        interval = f" (95% interval {ratio['ci95'][0]:.2f}-{ratio['ci95'][1]:.2f})" if ratio["ci95"] else ""
        extended = ", extrapolated beyond the budgets timed" if figure["extrapolated"] else ""
        return f"{ratio['ratio']:.2f}x as fast as {name} at equal accuracy{interval}{extended}"
    difference = difference_of_means(ours, [r["test_acc"] for r in side["runs"]])
    interval = difference["ci95"]
    spread = f" (95% interval {100 * interval[0]:+.2f} to {100 * interval[1]:+.2f})" if interval else ""
    verdict = ("as accurate or more on the mean: faster at equal accuracy" if difference["difference"] >= 0
               else "less accurate on the mean: not yet faster at equal accuracy")
    return (f"{side['speedup']['whole_process']['mean']:.2f}x as fast as {name} at "
            f"{100 * difference['difference']:+.2f} points of accuracy{spread}: {verdict}")


def _evidence(folder: Path, path: Path) -> str:
    """A link to a results file, with what results/notes.yaml says of it."""
    note = note_on(folder, path)
    return f"[{path.name}]({rel(folder, path)})" + (f" ({note})" if note else "")


def _machine(environment: dict) -> str:
    zen = ZEN.get(environment.get("cpu_model") or "")
    return processor_of(environment, zen) if zen else processor_of(environment)


def expect_table(folder: Path) -> str:
    """What a user gets on each device kind, from current files only: `fast` as shipped (accuracy with n, time,
    the speed-up over the strongest reference at its accuracy difference), and serving with the defaults."""
    lines = ["| device | what | you get | evidence |", "|---|---|---|---|"]
    for kind in (k for k in device.CPU_KINDS if k in KIND_NAMES):
        training = [e for e in _training_evidence(folder, "cpu") if cpu_kind_of(e["environment"]) == kind]
        if training:
            latest = max(training, key=lambda e: e["time"])  # to the second: two files of one day are not a tie
            comparison = next((e for e in sorted(training, key=lambda e: e["time"], reverse=True) if "comparison" in e
                               and _machine(e["environment"]) == _machine(latest["environment"])), None)
            evidence = ", ".join(dict.fromkeys(_evidence(folder, e["path"]) for e in (latest, comparison) if e))
            lines.append(f"| {KIND_NAMES[kind]}: {_machine(latest['environment'])} | `cifarkit train` (`fast`) | "
                         f"{_accuracy_words(latest['accuracies'])}; {latest['seconds'] / 60:.1f} min "
                         f"{latest['timer']}; "
                         f"{_against_reference(comparison['comparison'] if comparison else None)} | {evidence} |")
        else:
            lines.append(f"| {KIND_NAMES[kind]} | `cifarkit train` (`fast`) | not measured with the current `fast` "
                         f"yet | [history](docs/measurements.md) |")
        serving = [(path, data) for path, data in current_files(folder, "serve-bench*.json")
                   if cpu_kind_of(data["environment"]) == kind and serves_defaults(data)]
        if serving:
            path, data = max(serving, key=lambda item: item[1]["measured"])
            goals = data["summary"]["goals"]["concurrency_64"]
            lines.append(f"| {KIND_NAMES[kind]}: {_machine(data['environment'])} | `cifarkit serve` (defaults: "
                         f"{data['servers']['batched']['served']['backend']}) | {goals['req_per_s']:,.0f} requests/s "
                         f"from 64 connections, p99 latency {goals['p99_ms']:.0f} ms | "
                         f"[{path.name}]({rel(folder, path)}) |")
    for gpu in sorted({data["environment"]["gpus"][0]["name"] for path in result_files(folder, "speedrun-fast*.json")
                       if (data := json.loads(path.read_text()))["environment"].get("device", "").startswith("cuda")}):
        measured = [e for e in _training_evidence(folder, "cuda") if e["environment"]["gpus"][0]["name"] == gpu]
        if measured:
            latest = max(measured, key=lambda e: e["time"])
            lines.append(f"| {gpu} | `cifarkit train` (`fast`) | {_accuracy_words(latest['accuracies'])}; "
                         f"{latest['seconds']:.1f} s {latest['timer']} | "
                         f"[{latest['path'].name}]({rel(folder, latest['path'])}) |")
        else:
            lines.append(f"| {gpu} | `cifarkit train` (`fast`) | not measured with the current `fast` yet: its one "
                         f"run timed the earlier recipe | [history](docs/measurements.md) |")
    lines += _gpu_report_rows(folder)
    return "\n".join(lines)


def _gpu_report_rows(folder: Path) -> list[str]:
    """A row per GPU of a current `cifarkit bench --devices` report: the write-ups' three GPU tables in a line, the
    training speed-up over the CPU per model, amp against fp32 with its memory, and cuDNN's autotuning on and off."""
    rows = []
    for path, data in current_files(folder, "bench-devices*.json"):
        comparisons, gpus = data.get("comparisons") or {}, data["environment"].get("gpus") or []
        if not gpus or not comparisons.get("against_cpu"):
            continue
        parts = [", ".join(f"{c['model']} {c['speedup']:.2f}x the CPU in {c['mode']}"
                           for c in comparisons["against_cpu"])]
        parts += [f"{c['model']} in amp ({c['measured_as']}) {c['speedup']:.2f}x fp32"
                  + (f" at {c['memory_vs_fp32']:.2f}x its peak memory" if c["memory_vs_fp32"] else "")
                  for c in comparisons["against_fp32"] if c["mode"] != "fp32"]
        parts += [f"{c['model']} {c['speedup']:.2f}x with cuDNN autotuning" for c in comparisons["autotuning"]]
        rows.append(f"| {gpus[0]['name']} | `cifarkit bench --devices cpu cuda` | training speed only: "
                    f"{'; '.join(parts)} | [{path.name}]({rel(folder, path)}) |")
    return rows


def quickstart_text(folder: Path) -> str:
    """What `cifarkit train` with no options gives: the default seed's run in the newest current speed run of `fast`,
    beside the mean of that speed run's seeds."""
    with_seed_0 = [(path, data) for path, data in current_files(folder, "speedrun-fast*.json")
                   if _shipped_fast(data) and any(r["seed"] == 0 for r in data["runs"])]
    if not with_seed_0:
        return "No current speed run of `fast` yet: `cifarkit speedrun --recipe fast --runs 5` makes one."
    path, data = max(with_seed_0, key=lambda item: recorded_time(item[1]) or "")
    first = next(r for r in data["runs"] if r["seed"] == 0)
    reach = "reaches" if first["test_acc"] >= ACCURACY_GOAL else "is under"
    return (f"On {hardware(data['environment'])}, seed 0 scored {100 * first['test_acc']:.2f}% in "
            f"{first['wall_time_s'] / 60:.1f} min, which {reach} {100 * ACCURACY_GOAL:.0f}%; seeds "
            f"{data['runs'][0]['seed']}-{data['runs'][-1]['seed']} of the same speed run give "
            f"{_accuracy_words([r['test_acc'] for r in data['runs']])} ([{path.name}]({rel(folder, path)})).")


def serves_defaults(bench: dict) -> bool:
    """A serving benchmark of `cifarkit serve` as it starts: backend auto, no options added."""
    command = shlex.split(bench["command"])
    return ("--backend" not in command or command[command.index("--backend") + 1] == "auto") \
        and not serve_options(bench)


def serve_options(bench: dict) -> str:
    """The `cifarkit serve` options a bench_serve run added to the defaults (its --serve-args), or ""."""
    command = shlex.split(bench["command"])
    return command[command.index("--serve-args") + 1] if "--serve-args" in command else ""


def cpu_kind_of(environment: dict) -> str:
    """The CPU kind of a recorded environment; results from before the CPU's features were recorded say so."""
    features = environment.get("cpu_features")
    return device.cpu_kind(features) if features is not None else "not recorded"


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


def rounds_asked(result: dict) -> int:
    """The rounds the comparison's command asks for; a file may hold fewer while the comparison is unfinished."""
    return int(re.search(r"--runs (\d+)", result["command"]).group(1))
