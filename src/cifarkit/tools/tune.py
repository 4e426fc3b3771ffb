"""`cifarkit tune`: recipe values searched with Optuna on a validation split, each trial scored by its mean validation
accuracy over seeds, each seed one `cifarkit train` run. The accuracy is the last epoch's, with TTA where the recipe
uses it. The test set is not looked at: the runs log its accuracy, and nothing here reads it, so that choosing a
recipe never does.

    cifarkit tune --space optim.filter_lr=log:0.1:0.4 --space train.epochs=float:6.5:8 --trials 30 --seeds 0 1 \
        --out runs/tune-lr
    cifarkit tune --space train.epochs=choice:7,8 --sampler grid --seeds 0..15 --out runs/tune-epochs \
        --json results/tune-epochs-KIND.json

A search space is KEY=float:LOW:HIGH, KEY=log:LOW:HIGH (uniform in the logarithm), KEY=int:LOW:HIGH[:STEP] or
KEY=choice:A,B,... (each value read as `--set` reads it). Every value of every space is checked against the recipe
before anything trains. Each run is a whole `cifarkit train` process into OUT/trial-NNNN-sSEED, a normal run folder;
its metrics.jsonl is followed as it grows, and each epoch's single-view validation accuracy goes to the pruner.

The study lives in an Optuna storage: by default OUT/study.log, a journal file; `--storage` names a shared one. The
quota is counted in trials that were asked for fresh (`--trials`, or a grid's points), the k-th of them by trial
number being slot k: the storage numbers trials atomically, so workers on one storage never take a slot twice, and a
worker that asks past the quota closes that trial unrun (`surplus`). A retry is a trial of its own, queued with the
parameters (and grid point) of the one it repeats and marked `retry_of`. A trial left RUNNING by a worker that died
(its process is gone from this machine, or on another machine its heartbeat stopped) is failed and queued again by
the next worker that starts or asks for a trial; one cut short by Ctrl-C is queued again at once. A run that fails
(a diverging lr) fails its trial, which is not retried: the same seed would fail the same way.

The pruner weighs a trial's best value so far against the median of the finished trials' at the same step, and a
trial's first seed sets its best value before the next seed's first epoch reports: so in practice it prunes within
the first seed's run, which is where it saves the most.

A grid walks its points in order, point k in slot k, with no pruning by default, and compares each point with the
first seed by seed: the way a recipe change is decided here is a paired interval over at least 16 seeds that
excludes zero. Optuna's own GridSampler hands point k to trial number k only until a retry takes a number, and after
that picks among unvisited points at random, which two workers can pick alike; hence the slots.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import logging
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import optuna
import torch
import yaml
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from cifarkit.core import device
from cifarkit.core.errors import CifarkitError, first_line
from cifarkit.core.files import portable, write_json
from cifarkit.tools.speedrun import mean_with_t_interval
from cifarkit.training import plots
from cifarkit.training.config import check_seed, load_recipe, parse_override
from cifarkit.training.tracking import stamp

log = logging.getLogger("cifarkit")

STUDY_LOG = "study.log"  # the default storage, in the run folder
# Which study and storage a run folder's trials belong to: a second study would reuse its folder names.
STUDY_MARKER = "study.json"
CHART = "tune.png"
KINDS = ("float", "log", "int", "choice")
SPACE_FORM = "KEY=float:LOW:HIGH, KEY=log:LOW:HIGH, KEY=int:LOW:HIGH[:STEP] or KEY=choice:A,B,..."
RESERVED = {"train.seed": "--seeds", "data.val_split": "--val-split"}  # keys that tune sets itself
# A trial reports seed i's epoch e as step i * SEED_STEPS + e, so that the pruner weighs each run against the other
# trials' runs of the same seed at the same epoch.
SEED_STEPS = 1000
POLL_S = 0.5  # how often a run's metrics.jsonl is read: a real run's epoch takes seconds or more
HEARTBEAT_S = 60  # a worker stamps its trial this often...
STALE_AFTER_S = 600  # ...and a trial on another machine whose stamp is this old (ten missed, or a clock off) is stale
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Dimension:
    """One --space: a recipe key and the values the search may give it."""
    text: str
    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    step: int = 1
    choices: tuple = ()

    def edges(self) -> tuple:
        """The values checked against the recipe before anything trains: every choice, or both ends of a range."""
        return self.choices if self.kind == "choice" else (self.low, self.high)

    def suggest(self, trial: optuna.Trial):
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step)
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "log")


def parse_dimension(text: str) -> Dimension:
    key, equals, spec = text.partition("=")
    kind, colon, rest = spec.partition(":")
    key = key.strip()
    if not (equals and key and colon) or kind not in KINDS:
        raise CifarkitError(f"bad --space {text!r}: write {SPACE_FORM}, e.g. optim.lr=log:0.01:0.4")
    if kind == "choice":
        return Dimension(text, key, kind, choices=_choices(text, rest))
    parts = rest.split(":")
    if len(parts) != 2 and not (kind == "int" and len(parts) == 3):
        form = "int:LOW:HIGH[:STEP]" if kind == "int" else f"{kind}:LOW:HIGH"
        raise CifarkitError(f"bad --space {text!r}: write {key}={form}")
    low, high, *step = (_number(text, part, int if kind == "int" else float) for part in parts)
    if not low < high:
        raise CifarkitError(f"bad --space {text!r}: LOW ({low}) must be below HIGH ({high}); give the smaller first, "
                            f"or fix one value with --set {key}=VALUE")
    if kind == "log" and low <= 0:
        raise CifarkitError(f"bad --space {text!r}: a log range needs LOW > 0; give a positive LOW, or use float:")
    step = step[0] if step else 1
    if kind == "int" and (step <= 0 or (high - low) % step):
        raise CifarkitError(f"bad --space {text!r}: STEP ({step}) must be positive and divide HIGH - LOW "
                            f"({high - low})")
    return Dimension(text, key, kind, low, high, step)


def _number(text: str, part: str, kind: type) -> int | float:
    try:
        value = kind(part)
    except ValueError:
        raise CifarkitError(f"bad --space {text!r}: {part!r} is not {'a whole number' if kind is int else 'a number'}"
                            ) from None
    if not math.isfinite(value):
        raise CifarkitError(f"bad --space {text!r}: {part!r} is not a finite number")
    return value


def _choices(text: str, listed: str) -> tuple:
    try:
        values = yaml.safe_load(f"[{listed}]")
    except yaml.YAMLError:
        raise CifarkitError(f"bad --space {text!r}: its choices are not a list of values; write KEY=choice:A,B,... "
                            "(a list value in brackets: choice:[5,7],[4,6])") from None
    if len(values) < 2:
        raise CifarkitError(f"bad --space {text!r}: give at least two choices (one value is a --set)")
    values = tuple(_plain(v) for v in values)
    shown = [json.dumps(v) for v in values]
    if len(set(shown)) != len(shown):
        raise CifarkitError(f"bad --space {text!r}: a choice repeats; give each once")
    return values


def _plain(value):
    """A choice as Optuna keeps it: a plain value. A list or mapping goes as its text, which --set reads back; YAML 1.1
    reads 1e-9 (no dot) as a string, and it is the number everyone means, as the recipe's own reading takes it."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value if value is None or isinstance(value, (bool, int, float)) else json.dumps(value)


def override(key: str, value) -> str:
    """KEY=VALUE as `cifarkit train --set` reads it back to `value`."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


@dataclass
class Plan:
    """A study's settings, every value checked against the recipe."""
    recipe: str
    fixed: list[str]  # --set KEY=VALUE, in order
    space: list[Dimension]
    seeds: list[int]
    val_split: int
    sampler: str  # tpe | random | grid
    pruner: str  # median | none
    prune_after: int  # trials that finish before the median pruner prunes (its n_startup_trials)
    trials: int  # the quota of fresh trials: --trials, or the grid's points
    grid: list[dict] | None  # a grid's points in order, {key: value} each; None for the other samplers

    def settings(self) -> dict:
        """What a study is, as JSON: a worker that joins it must bring the same (the quota may differ)."""
        return json.loads(json.dumps({
            "recipe": self.recipe, "fixed": self.fixed, "space": [d.text for d in self.space], "seeds": self.seeds,
            "val_split": self.val_split, "sampler": self.sampler, "pruner": self.pruner,
            "prune_after": self.prune_after}))

    def overrides(self, params: dict, seed: int) -> list[str]:
        # The pruner needs every epoch's validation accuracy; a --set of train.eval_every, applied later, still wins.
        evaluate = ["train.eval_every=1"] if self.pruner != "none" else []
        return [*evaluate, *self.fixed, *(override(k, v) for k, v in params.items()),
                f"data.val_split={self.val_split}", f"train.seed={seed}"]


def plan_study(recipe: str, fixed: list[str], space: list[str], seeds: list[int], val_split: int, sampler: str,
               pruner: str | None, prune_after: int, trials: int | None) -> Plan:
    """The study the options describe, or the one-line error of the first bad option; nothing is written."""
    if not space:
        raise CifarkitError(f"nothing to search: give at least one --space ({SPACE_FORM})")
    dimensions = [parse_dimension(text) for text in space]
    keys = [d.key for d in dimensions]
    fixed_keys = [parse_override(text)[0] for text in fixed]
    for key in keys + fixed_keys:
        if key in RESERVED:
            raise CifarkitError(f"{key} is set by tune's {RESERVED[key]}; give that option instead")
    repeated = sorted({k for k in keys if keys.count(k) > 1} | set(keys) & set(fixed_keys))
    if repeated:
        raise CifarkitError(f"{', '.join(repeated)} given more than once in --space and --set; search or fix each "
                            "key once")
    if len(set(seeds)) != len(seeds):
        raise CifarkitError(f"seeds repeat ({', '.join(map(str, seeds))}); give each once")
    for seed in seeds:
        check_seed(seed, "--seeds")
    grid = None
    if sampler == "grid":
        ranges = [d.text for d in dimensions if d.kind != "choice"]
        if ranges:
            raise CifarkitError(f"--sampler grid takes choice spaces only, and {ranges[0]} is a range; give "
                                "KEY=choice:A,B,... or use --sampler tpe or random")
        grid = [dict(zip(keys, values)) for values in itertools.product(*(d.choices for d in dimensions))]
        if trials is not None and trials != len(grid):
            raise CifarkitError(f"a grid's trials are its {len(grid)} points; drop --trials {trials}")
        trials = len(grid)
    elif trials is None:
        raise CifarkitError(f"--sampler {sampler} needs --trials N: how many trials the study runs")
    plan = Plan(recipe, list(fixed), dimensions, list(seeds), val_split, sampler,
                pruner or ("none" if sampler == "grid" else "median"), prune_after, trials, grid)
    _check_recipes(plan)
    return plan


def _check_recipes(plan: Plan) -> None:
    """Load the recipe of every value each space can give (every point of a grid), so that a bad key, value or
    combination fails now, not trials in."""
    base = plan.overrides({}, plan.seeds[0])
    recipes = [load_recipe(plan.recipe, base)]
    for dimension in plan.space:
        for value in dimension.edges():
            try:
                recipes.append(load_recipe(plan.recipe, base + [override(dimension.key, value)]))
            except CifarkitError as e:
                raise CifarkitError(f"--space {dimension.text}: {e}") from None
    for point in plan.grid or ():
        try:
            recipes.append(load_recipe(plan.recipe, plan.overrides(point, plan.seeds[0])))
        except CifarkitError as e:
            raise CifarkitError(f"grid point {' '.join(override(k, v) for k, v in point.items())}: {e}") from None
    longest = max(math.ceil(r.train.epochs) for r in recipes)
    if longest >= SEED_STEPS:
        raise CifarkitError(f"runs of {longest} epochs would share the pruner's steps of the next seed (at most "
                            f"{SEED_STEPS - 1}); search shorter runs")


def default_out(plan: Plan) -> Path:
    return Path("runs") / f"tune-{Path(plan.recipe).stem}-{datetime.now():%Y%m%d-%H%M%S}"


class _GridSlots(optuna.samplers.BaseSampler):
    """A grid's values for a trial: those of the point in its user attribute `grid_point`, which its slot (or the
    trial it retries) gave it."""

    def __init__(self, points: list[dict]):
        self.points = points

    def infer_relative_search_space(self, study, trial) -> dict:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.points[trial.user_attrs["grid_point"]][param_name]


def open_storage(url: str | None, out: Path) -> optuna.storages.BaseStorage:
    """The storage `--storage` names. The default is a journal file in the run folder rather than SQLite: an
    append-only log that several workers share through its lock file, on one machine or on NFS, where SQLite's locks
    are not to be trusted, and the same kind of file that `journal:PATH` shares; optuna-dashboard opens it as it is."""
    from optuna.storages import JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend
    from sqlalchemy.exc import SQLAlchemyError
    if url is None or url.startswith("journal:"):
        path = _journal(url, out)
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise CifarkitError(f"bad --storage {url!r}: give journal:PATH (a file, on a shared folder for several "
                            "machines) or a database URL such as sqlite:///study.db or postgresql://HOST/DB")
    try:
        return RDBStorage(url)
    except (ImportError, SQLAlchemyError) as e:
        raise CifarkitError(f"cannot open --storage {without_password(url)}: {first_line(e)}") from None


def _journal(url: str | None, out: Path) -> Path:
    return out / STUDY_LOG if url is None else Path(url.removeprefix("journal:"))


def without_password(url: str) -> str:
    """A storage as printed and recorded: a database URL's password hidden."""
    if url.startswith("journal:") or "://" not in url:
        return url
    from sqlalchemy.engine import make_url
    return make_url(url).render_as_string(hide_password=True)


def _recorded(url: str | None, out: Path) -> str:
    """The storage as a results file names it: a journal file relative to the working folder, a database URL without
    its password."""
    return f"journal:{portable(_journal(url, out))}" if url is None or url.startswith("journal:") \
        else without_password(url)


def dashboard_command(url: str | None, out: Path) -> str:
    """The optuna-dashboard command that opens the study's storage (give a hidden password back by hand)."""
    target = str(_journal(url, out)) if url is None or url.startswith("journal:") else without_password(url)
    return f"optuna-dashboard {shlex.quote(target)}"


def check_folder(out: Path, identity: dict) -> None:
    """Refuse a run folder that holds another study's trials, or anything else: a second study would name its trials'
    folders alike. Nothing is written here, so that a bad option leaves the folder as it was."""
    marker = out / STUDY_MARKER
    if marker.is_file():
        found = json.loads(marker.read_text())
        if found != identity:
            raise CifarkitError(f"{out} holds the trials of study {found['study']} on "
                                f"{found['storage'] or 'its own ' + STUDY_LOG}; give the same --study and --storage "
                                "as then, or another --out")
        return
    # The default storage's files, and the temporary files of a marker being written (their names start with a dot),
    # may come before the marker.
    held = sorted(p.name for p in out.iterdir() if not p.name.startswith((".", STUDY_LOG))) if out.is_dir() else []
    if held:
        raise CifarkitError(f"{out} holds other files ({', '.join(held[:3])}); give a new or empty --out")


def open_study(plan: Plan, storage, name: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # cifarkit logs its own lines about each trial
    sampler = _GridSlots(plan.grid) if plan.grid is not None else (
        optuna.samplers.TPESampler() if plan.sampler == "tpe" else optuna.samplers.RandomSampler())
    pruner = optuna.pruners.MedianPruner(n_startup_trials=plan.prune_after) if plan.pruner == "median" \
        else optuna.pruners.NopPruner()
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=sampler,
                                pruner=pruner, load_if_exists=True)
    settings = plan.settings()
    if "cifarkit" not in study.user_attrs:
        if study.get_trials(deepcopy=False):
            raise CifarkitError(f"study {name} holds trials that cifarkit tune did not make; give another --study")
        study.set_user_attr("cifarkit", settings)
    recorded = study.user_attrs["cifarkit"]
    if recorded != settings:
        differing = sorted(key for key in settings if recorded.get(key) != settings[key])
        raise CifarkitError(f"study {name} was started with other settings ({', '.join(differing)} differ); give the "
                            "same options as then, or another --study or --out")
    return study


def _process_start(pid: int) -> str | None:
    """When a process started, in clock ticks since boot (/proc/PID/stat's 22nd field), or None where there is no
    such process or no /proc: with the pid, it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # after the name, which may hold spaces: fields 3 onwards


def _machine() -> str:
    """This process's machine as far as its pids go: the host's name, and its pid namespace where it has one (two
    containers of one host may share the name, not their pids)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {namespace}".strip()


def this_worker() -> dict:
    return {"host": _machine(), "pid": os.getpid(), "started": _process_start(os.getpid())}


def _gone(worker: dict) -> bool:
    """Whether a worker of this machine has died."""
    if worker["started"] is not None:
        return _process_start(worker["pid"]) != worker["started"]
    try:
        os.kill(worker["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's live process
        return False
    return False


def _stale(trial: optuna.trial.FrozenTrial, host: str) -> bool:
    """Whether a RUNNING trial's worker is dead: gone from this machine, or silent too long on another one."""
    worker = trial.user_attrs.get("worker")
    if worker is None:  # killed between asking for the trial and recording itself, milliseconds apart
        return (datetime.now() - trial.datetime_start).total_seconds() > STALE_AFTER_S
    if worker["host"] == host:
        return _gone(worker)
    return time.time() - trial.user_attrs.get("alive_at", trial.datetime_start.timestamp()) > STALE_AFTER_S


def _fresh_slot(trials: list[optuna.trial.FrozenTrial], number: int) -> int:
    """The slot of fresh trial `number`: how many fresh trials the storage numbered before it."""
    return sum(1 for t in trials if t.number < number and "retry_of" not in t.user_attrs)


def retry(study: optuna.Study, trial: optuna.trial.FrozenTrial, plan: Plan) -> None:
    """Queue `trial`'s parameters and grid point again, as a trial of its own, unless it was past the quota."""
    attrs = {"retry_of": trial.number}
    if "retry_of" not in trial.user_attrs:
        slot = _fresh_slot(study.get_trials(deepcopy=False), trial.number)
        if slot >= plan.trials:
            return
        if plan.grid is not None:
            attrs["grid_point"] = slot
    if "grid_point" in trial.user_attrs:
        attrs["grid_point"] = trial.user_attrs["grid_point"]
    study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, params=trial.params,
                                              distributions=trial.distributions, user_attrs=attrs))
    log.info("trial %d queued again, as a retry", trial.number)


def fail_stale_trials(study: optuna.Study, plan: Plan) -> None:
    """Fail and queue again every trial left RUNNING by a dead worker. Two workers may find the same one: the
    storage lets one of them finish it, and only that one queues it."""
    host = _machine()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not _stale(trial, host):
            continue
        try:
            failed = study.tell(trial.number, state=TrialState.FAIL)
        except (ValueError, UpdateFinishedTrialError):  # finished meanwhile, by its worker or another one
            continue
        worker = trial.user_attrs.get("worker")
        log.warning("trial %d was left running by %s, which is gone; failed", trial.number,
                    "a worker" if worker is None else f"the worker of pid {worker['pid']} on {worker['host']}")
        retry(study, failed, plan)


def _work_left(study: optuna.Study, quota: int) -> bool:
    trials = study.get_trials(deepcopy=False)
    fresh = sum(1 for t in trials if "retry_of" not in t.user_attrs)
    return fresh < quota or any(t.state == TrialState.WAITING for t in trials)


def run(plan: Plan, out: Path, storage_url: str | None = None, study_name: str | None = None) -> dict:
    """Run the study's trials until its quota is asked for and its queue is empty, and return the report of every
    trial it holds: the table `cifarkit tune` prints, less its command."""
    name = study_name or out.name
    # storage None: the folder's own study.log. The marker is a file too: no password in it.
    identity = {"study": name, "storage": None if storage_url is None else without_password(storage_url)}
    check_folder(out, identity)
    study = open_study(plan, open_storage(storage_url, out), name)
    if not (out / STUDY_MARKER).is_file():  # workers that share the folder write the same one
        write_json(out / STUDY_MARKER, identity)
    while True:
        fail_stale_trials(study, plan)
        if not _work_left(study, plan.trials):
            break
        trial = study.ask()
        trial.set_user_attr("worker", this_worker())
        trial.set_user_attr("alive_at", time.time())
        if "retry_of" not in trial.user_attrs:
            slot = _fresh_slot(study.get_trials(deepcopy=False), trial.number)
            if slot >= plan.trials:
                trial.set_user_attr("surplus", True)
                study.tell(trial, state=TrialState.FAIL)
                log.info("trial %d closed unrun: the study's %d trials were all asked for by then", trial.number,
                         plan.trials)
                continue
            if plan.grid is not None:
                trial.set_user_attr("grid_point", slot)
        run_trial(study, trial, plan, out)
    return report(study, plan, out, name, storage_url)


class RunFailed(Exception):
    """A trial's training run exited with an error."""


def run_trial(study: optuna.Study, trial: optuna.Trial, plan: Plan, out: Path) -> None:
    """Train the trial's runs, seed by seed, and tell the study how it ended."""
    params = {d.key: d.suggest(trial) for d in plan.space}
    retried = trial.user_attrs.get("retry_of")
    log.info("trial %d%s: %s", trial.number, "" if retried is None else f" (retry of trial {retried})",
             " ".join(override(k, v) for k, v in params.items()))
    try:
        value = _score(trial, plan, out, params)
    except optuna.TrialPruned as e:
        study.tell(trial, state=TrialState.PRUNED)
        log.info("trial %d pruned: %s", trial.number, e)
    except RunFailed as e:
        trial.set_user_attr("error", str(e))
        study.tell(trial, state=TrialState.FAIL)
        log.warning("trial %d failed: %s", trial.number, e)
    except UpdateFinishedTrialError:
        log.warning("trial %d was failed by another worker, which took this one for dead (a clock more than %d s "
                    "off, or a long pause); its retry counts instead", trial.number, STALE_AFTER_S)
    except KeyboardInterrupt:
        retry(study, study.tell(trial, state=TrialState.FAIL), plan)
        raise KeyboardInterrupt(f"interrupted in trial {trial.number}, which is queued again: the same command "
                                "resumes the study") from None
    except BaseException:
        study.tell(trial, state=TrialState.FAIL)
        raise
    else:
        study.tell(trial, value)
        log.info("trial %d: %.2f%% on the mean of %d seed(s)", trial.number, 100 * value, len(plan.seeds))


def _score(trial: optuna.Trial, plan: Plan, out: Path, params: dict) -> float:
    """The mean validation accuracy of the trial's runs, recorded seed by seed as the trial's `values_by_seed`."""
    values = {}
    for place, seed in enumerate(plan.seeds):
        folder = out / f"trial-{trial.number:04d}-s{seed}"
        record = follow_run(trial, plan.recipe, plan.overrides(params, seed), folder, place * SEED_STEPS, seed)
        accuracy = "val_tta_acc" if record.get("val_tta_acc") is not None else "val_acc"
        values[str(seed)] = record[accuracy]
        trial.set_user_attr("accuracy", accuracy)
        trial.set_user_attr("values_by_seed", values)
    return statistics.fmean(values.values())


def _dies_with_this_process():
    """A preexec_fn after which Linux kills the child when this process dies, by a kill -9 too: a study killed
    mid-trial leaves no run training on unseen. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # this process died before the line above
            os._exit(1)
    return arm


def follow_run(trial: optuna.Trial, recipe: str, overrides: list[str], folder: Path, first_step: int,
               seed: int) -> dict:
    """Train one run as `cifarkit train`, reporting each evaluated epoch's validation accuracy to the trial as it
    lands in metrics.jsonl; return the run's last record. The run is stopped when the pruner prunes the trial."""
    command = [sys.executable, "-m", "cifarkit", "train", "--recipe", recipe, "--out", str(folder),
               *itertools.chain.from_iterable(("--set", o) for o in overrides)]
    log.info("training %s", folder)
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: the run never waits on a reader
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors,
                                 preexec_fn=_dies_with_this_process())
        try:
            records = _follow(child, trial, folder / "metrics.jsonl", first_step, seed)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if child.returncode:
            errors.seek(0)
            lines = errors.read().decode(errors="replace").strip().splitlines() or ["no output"]
            raise RunFailed(f"{folder.name}: {lines[-1]}")
    return records[-1]


def _follow(child: subprocess.Popen, trial: optuna.Trial, metrics: Path, first_step: int, seed: int) -> list[dict]:
    reported, stamped = 0, time.monotonic()
    while True:
        ended = child.poll() is not None  # before the read: a run that has ended has written its last epoch
        # Each epoch rewrites the file atomically, so a read sees whole lines.
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        for record in records[reported:]:
            if "val_acc" not in record:  # an epoch without evaluation (train.eval_every)
                continue
            trial.report(record["val_acc"], first_step + record["epoch"])
            if trial.should_prune():
                trial.set_user_attr("pruned_at", {"seed": seed, "epoch": record["epoch"]})
                raise optuna.TrialPruned(f"seed {seed}, epoch {record['epoch']}: validation accuracy "
                                         f"{100 * record['val_acc']:.2f}%")
        reported = len(records)
        if ended:
            return records
        if time.monotonic() - stamped > HEARTBEAT_S:
            trial.set_user_attr("alive_at", time.time())
            stamped = time.monotonic()
        try:
            child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass


def _state(trial: optuna.trial.FrozenTrial, retried_as: dict[int, int]) -> str:
    """How a finished trial ended, in words."""
    if trial.state == TrialState.COMPLETE:
        return "complete"
    if trial.state == TrialState.PRUNED:
        where = trial.user_attrs.get("pruned_at")
        return f"pruned (seed {where['seed']}, epoch {where['epoch']})" if where else "pruned"
    if trial.number in retried_as:
        return f"interrupted, retried as trial {retried_as[trial.number]}"
    return f"failed: {trial.user_attrs.get('error', 'no error recorded')}"


def trial_rows(study: optuna.Study, plan: Plan) -> list[dict]:
    """Every finished trial, bar those closed unrun past the quota: a grid's by point, the others' by number."""
    trials = study.get_trials(deepcopy=False)
    retried_as = {t.user_attrs["retry_of"]: t.number for t in trials if "retry_of" in t.user_attrs}
    rows = [{"number": t.number, "state": _state(t, retried_as), "params": t.params,
             "values_by_seed": t.user_attrs.get("values_by_seed", {}), "accuracy": t.user_attrs.get("accuracy"),
             "mean": t.value if t.state == TrialState.COMPLETE else None, "grid_point": t.user_attrs.get("grid_point"),
             "retry_of": t.user_attrs.get("retry_of")}
            for t in trials if t.state.is_finished() and not t.user_attrs.get("surplus")]
    if plan.grid is not None:
        # A trial killed before its slot was recorded has no point; its retry has.
        rows.sort(key=lambda row: (-1 if row["grid_point"] is None else row["grid_point"], row["number"]))
        _against_first_point(rows, plan.seeds)
    return rows


def _against_first_point(rows: list[dict], seeds: list[int]) -> None:
    """Each complete grid point's mean difference from the first point's, seed by seed, with the 95% t-interval of
    those differences: the same seed holds out the same images and starts from the same weights, so the pairs share
    that part of the spread."""
    first = next((r for r in rows if r["grid_point"] == 0 and r["mean"] is not None), None)
    for row in rows:
        row["minus_first"] = row["minus_first_ci95"] = None
        if first is None or row["mean"] is None or row is first:
            continue
        differences = [row["values_by_seed"][str(s)] - first["values_by_seed"][str(s)] for s in seeds]
        row["minus_first"], row["minus_first_ci95"] = mean_with_t_interval(differences)


def _shown(value) -> str:
    """A parameter's value in the table: a float to 4 figures, others as --set reads them."""
    return f"{value:.4g}" if isinstance(value, float) else value if isinstance(value, str) else json.dumps(value)


def table(rows: list[dict], plan: Plan) -> list[str]:
    """The trials as Markdown table rows."""
    keys = [d.key for d in plan.space]
    grid = plan.grid is not None
    header = ["trial", "state", *keys, f"validation accuracy per seed ({', '.join(map(str, plan.seeds))})", "mean"]
    if grid:
        header.append("minus the first point (points, 95% t-interval of the seeds' differences)")
    lines = ["| " + " | ".join(header) + " |", "|---:|---|" + "---|" * len(keys) + "---|---:|" + "---:|" * grid]
    for row in rows:
        cells = [str(row["number"]), row["state"], *(_shown(row["params"].get(k, "-")) for k in keys),
                 ", ".join(f"{100 * v:.2f}" for v in row["values_by_seed"].values()) or "-",
                 "-" if row["mean"] is None else f"{100 * row['mean']:.2f}%"]
        if grid:
            cells.append(_against_first_cell(row))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _against_first_cell(row: dict) -> str:
    if row["minus_first"] is None:
        return "first point" if row["grid_point"] == 0 and row["mean"] is not None else "-"
    interval = row["minus_first_ci95"]
    shown = f"{100 * row['minus_first']:+.2f}"
    return shown if interval is None else f"{shown} ({100 * interval[0]:+.2f} to {100 * interval[1]:+.2f})"


def report(study: optuna.Study, plan: Plan, out: Path, name: str, storage_url: str | None) -> dict:
    """Every finished trial as rows and as a table, the best one, the chart drawn, and where and when: the results
    file `cifarkit tune --json` writes, less its command."""
    rows = trial_rows(study, plan)
    complete = [r for r in rows if r["mean"] is not None]
    best = max(complete, key=lambda r: r["mean"]) if complete else None
    chart = out / CHART
    plots.tune_history(rows, {d.key: d.kind == "log" for d in plan.space}, chart)
    stamped = stamp()
    return {
        **stamped,
        # A built-in recipe's values change with the code: this commit (short, as the tables show it) names its runs'.
        "written_at_commit": stamped["source"]["commit"][:7] if stamped["source"] else None,
        **plan.settings(), "trials_planned": plan.trials, "study": name,
        "storage": _recorded(storage_url, out), "trials": rows,
        "best": None if best is None else {"number": best["number"], "params": best["params"], "mean": best["mean"]},
        "table": table(rows, plan), "chart": portable(chart),
        "environment": device.report(torch.device("cpu")), "cpu_kind": device.cpu_kind(),
    }
