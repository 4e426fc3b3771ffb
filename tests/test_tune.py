"""`cifarkit tune` (cifarkit.tools.tune): a study on the validation split that resumes after a kill -9 mid-trial, two
workers on one storage that never run a trial twice, the pruner stopping a trial that learns nothing, and a bad
--set or --space named on one line before anything trains."""
import json
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from cifarkit.cli import main
from cifarkit.tools import tune as tune_tool

# Runs of a few seconds, most of it the start of a Python process: 100 of the committed sample's images trained on,
# 100 held out.
TINY = ["--recipe", "simplecnn", "--subset", "100", "--val-split", "100", "--precision", "fp32"]


def tune(*args: str) -> list[str]:
    return [sys.executable, "-m", "cifarkit", "tune", *TINY, *args]


def trials_of(journal, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=JournalStorage(JournalFileBackend(str(journal)))).get_trials()


@pytest.mark.e2e  # a fault: kill -9 mid-trial
def test_a_study_killed_mid_trial_resumes_and_retries_that_trial(cifar_home, tmp_path):
    out = tmp_path / "study"
    command = tune("--set", "train.epochs=5", "--space", "optim.lr=log:1e-4:1e-2", "--sampler", "random",
                   "--trials", "2", "--seeds", "0", "--out", str(out))
    worker = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = out / "trial-0001-s0" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not second.exists():  # the second trial's run has finished an epoch of its 5
        assert worker.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    first_finished = (out / "trial-0000-s0" / "summary.json").stat().st_mtime_ns
    worker.send_signal(signal.SIGKILL)
    worker.wait()

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    first, killed, retry = trials_of(out / "study.log", "study")
    assert first.state == TrialState.COMPLETE and "retry_of" not in first.user_attrs
    assert (out / "trial-0000-s0" / "summary.json").stat().st_mtime_ns == first_finished  # kept, not trained again
    assert killed.state == TrialState.FAIL
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["retry_of"] == 1 and retry.params == killed.params
    assert "| 1 | interrupted, retried as trial 2 |" in again.stdout
    # The killed study's run died with it (alive, it would have finished during the retry); each trial has its own
    # folders.
    assert not (out / "trial-0001-s0" / "summary.json").exists()
    assert sorted(p.name for p in out.glob("trial-*")) == ["trial-0000-s0", "trial-0001-s0", "trial-0002-s0"]


@pytest.mark.e2e  # two workers on one study, as on two machines
def test_two_workers_on_one_storage_never_run_a_grid_point_twice(cifar_home, tmp_path, capsys):
    # Two machines, each with its own run folder, on one journal file; a grid of 3 points, 2 seeds each.
    shared = ["--set", "train.epochs=1", "--space", "optim.lr=choice:0.001,0.003,0.0003", "--sampler", "grid",
              "--seeds", "0", "1", "--storage", f"journal:{tmp_path / 'shared.log'}", "--study", "shared"]
    outs = [tmp_path / "a", tmp_path / "b"]
    workers = [subprocess.Popen(tune(*shared, "--out", str(out)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for out in outs]
    for worker in workers:
        _, errors = worker.communicate(timeout=300)
        assert worker.returncode == 0, errors

    trials = trials_of(tmp_path / "shared.log", "shared")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.user_attrs["grid_point"] for t in complete) == [0, 1, 2]
    assert sorted(t.params["optim.lr"] for t in complete) == [0.0003, 0.001, 0.003]
    # A worker that asked once the grid was all taken closed that trial unrun; nothing else failed.
    assert all(t.user_attrs.get("surplus") for t in trials if t.state != TrialState.COMPLETE)
    folders = sorted(p.name for out in outs for p in out.glob("trial-*"))
    assert folders == sorted(f"trial-{t.number:04d}-s{seed}" for t in complete for seed in (0, 1))
    assert all(any(out.glob("trial-*")) for out in outs)  # both workers trained

    # The finished study again: nothing left to train, only its table, each point against the first seed by seed.
    assert main(["tune", *TINY, *shared, "--out", str(outs[0]), "--json", str(tmp_path / "tune.json")]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "tune.json").read_text())
    first, *others = report["trials"]
    assert [row["grid_point"] for row in report["trials"]] == [0, 1, 2] and first["minus_first"] is None
    for row in others:
        differences = [row["values_by_seed"][s] - first["values_by_seed"][s] for s in ("0", "1")]
        assert row["minus_first"] == pytest.approx(sum(differences) / 2)
        low, high = row["minus_first_ci95"]  # two seeds: a half width of 12.71 x |d0 - d1| / 2
        assert (high - low) / 2 == pytest.approx(12.706 * abs(differences[0] - differences[1]) / 2, rel=1e-3)
    assert report["table"][2].endswith("| first point |") and "\n".join(report["table"]) in printed
    assert report["command"].startswith("cifarkit tune ") and report["measured"] and report["sampler"] == "grid"
    assert printed.splitlines()[-1] == f"the study in a browser (pip install optuna-dashboard): optuna-dashboard " \
                                       f"{tmp_path / 'shared.log'}"


def test_the_pruner_stops_a_trial_that_learns_nothing(cifar_home, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # On this sample, seed 0's first epoch scores 16% with lr 0.003 at batch 16, and chance (10%) with lr 1e-9.
    assert main(["tune", *TINY, "--batch-size", "16", "--set", "train.epochs=6", "--space",
                 "optim.lr=choice:0.003,1e-9", "--sampler", "grid", "--pruner", "median", "--prune-after", "1",
                 "--seeds", "0", "--out", "study"]) == 0
    learned, stalled = trials_of(tmp_path / "study" / "study.log", "study")
    assert learned.state == TrialState.COMPLETE and stalled.state == TrialState.PRUNED
    assert list(stalled.intermediate_values) == [1]  # seed 0's place, epoch 1
    assert stalled.intermediate_values[1] < learned.intermediate_values[1]
    # Its run stopped there, leaving the epochs it had trained in a run folder that can be looked at.
    epochs = (tmp_path / "study" / "trial-0001-s0" / "metrics.jsonl").read_text().splitlines()
    assert len(epochs) < 6 and not (tmp_path / "study" / "trial-0001-s0" / "summary.json").exists()
    assert "| 1 | pruned (seed 0, epoch 1) | 1e-09 |" in capsys.readouterr().out


@pytest.mark.parametrize("bad, named", [
    (["--set", "train.epoch=5"], "cifarkit: error: unknown key 'train.epoch'; valid keys here: train.epochs, "),
    (["--space", "train.batch_size=float:32:64"],
     "cifarkit: error: --space train.batch_size=float:32:64: bad value for train.batch_size: 32.0 (expected int)"),
], ids=["set", "space"])
def test_a_bad_set_or_space_is_one_line_before_anything_trains(tmp_path, bad, named):
    done = subprocess.run(tune("--space", "optim.lr=log:1e-4:1e-2", "--trials", "1", *bad, "--out",
                               str(tmp_path / "study")), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(named)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
@pytest.mark.parametrize("options, expected", [
    (["--space", "optim.lr"], "bad --space 'optim.lr': write KEY=float:LOW:HIGH, KEY=log:LOW:HIGH, "),
    (["--space", "optim.lr=uniform:0:1"], "bad --space 'optim.lr=uniform:0:1': write KEY=float:LOW:HIGH, "),
    (["--space", "optim.lr=float:0.4:0.1"], "bad --space 'optim.lr=float:0.4:0.1': LOW (0.4) must be below HIGH "
                                            "(0.1); give the smaller first, or fix one value with --set optim.lr="),
    (["--space", "optim.lr=log:0:1"], "bad --space 'optim.lr=log:0:1': a log range needs LOW > 0"),
    (["--space", "optim.lr=float:a:1"], "bad --space 'optim.lr=float:a:1': 'a' is not a number"),
    (["--space", "train.batch_size=int:32:64:10"], "bad --space 'train.batch_size=int:32:64:10': STEP (10) must be "
                                                   "positive and divide HIGH - LOW (32)"),
    (["--space", "train.tta=choice:true"], "bad --space 'train.tta=choice:true': give at least two choices"),
    (["--space", "optim.lrr=float:0.1:0.2", "--trials", "2"], "--space optim.lrr=float:0.1:0.2: unknown key "
                                                              "'optim.lrr'; valid keys here: optim.name, "),
    (["--space", "optim.lr=float:0:0.1", "--trials", "2"], "--space optim.lr=float:0:0.1: bad value for optim.lr: 0.0 "
                                                           "(must be > 0 and finite)"),
    (["--space", "optim.lr=float:0.1:0.2", "--sampler", "grid"], "--sampler grid takes choice spaces only, and "
                                                                 "optim.lr=float:0.1:0.2 is a range; give "),
    (["--space", "optim.lr=choice:0.1,0.2", "--sampler", "grid", "--trials", "3"], "a grid's trials are its 2 "
                                                                                  "points; drop --trials 3"),
    (["--space", "optim.lr=float:0.1:0.2"], "--sampler tpe needs --trials N"),
    (["--space", "optim.lr=float:0.1:0.2", "--set", "optim.lr=0.3", "--trials", "2"],
     "optim.lr given more than once in --space and --set; search or fix each key once"),
    (["--space", "train.seed=int:0:3", "--trials", "2"], "train.seed is set by tune's --seeds; give that option"),
    (["--space", "optim.lr=choice:0.1,0.2", "--seeds", "1", "1", "--sampler", "grid"], "seeds repeat (1, 1)"),
    ([], "nothing to search: give at least one --space"),
], ids=["no-kind", "unknown-kind", "low-above-high", "log-from-zero", "not-a-number", "step", "one-choice",
        "unknown-key", "bad-value", "grid-range", "grid-trials", "no-trials", "searched-and-fixed", "reserved",
        "seeds-repeat", "no-space"])
def test_a_bad_option_is_named_before_anything_is_written(tmp_path, capsys, monkeypatch, options, expected):
    monkeypatch.chdir(tmp_path)
    assert main(["tune", "--recipe", "simplecnn", *options, "--out", "study"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"cifarkit: error: {expected}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_a_run_folder_of_another_kind_is_refused(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("model: {}\n")
    assert main(["tune", "--recipe", "simplecnn", "--space", "optim.lr=float:0.1:0.2", "--trials", "1", "--out",
                 str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"cifarkit: error: {tmp_path} holds other files (config.yaml); give a new or empty --out")
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


@pytest.mark.unit
def test_a_trial_whose_worker_died_is_failed_and_queued_again():
    plan = tune_tool.plan_study("simplecnn", [], ["optim.lr=choice:0.1,0.2"], [0], 100, "grid", None, 5, None)
    study = optuna.create_study(direction="maximize")
    here, now = tune_tool.this_worker()["host"], time.time()
    workers = {  # (the worker a trial records, its last heartbeat)
        "gone here": ({"host": here, "pid": 2**22 + 1, "started": "1"}, now),  # past Linux's largest pid
        "silent there": ({"host": "there", "pid": 1, "started": "1"}, now - tune_tool.STALE_AFTER_S - 1),
        "alive there": ({"host": "there", "pid": 1, "started": "1"}, now - 1),
    }
    for point, (worker, alive_at) in enumerate(list(workers.values())[:2]):
        trial = study.ask()
        trial.set_user_attr("grid_point", point)
        trial.suggest_categorical("optim.lr", [0.1, 0.2])
        trial.set_user_attr("worker", worker)
        trial.set_user_attr("alive_at", alive_at)
    alive = study.ask()
    alive.set_user_attr("worker", workers["alive there"][0])
    alive.set_user_attr("alive_at", workers["alive there"][1])

    tune_tool.fail_stale_trials(study, plan)
    tune_tool.fail_stale_trials(study, plan)  # a second worker finds them failed already, and queues nothing more
    gone, silent, running, *retries = study.get_trials()
    assert gone.state == silent.state == TrialState.FAIL and running.state == TrialState.RUNNING
    assert [(t.state, t.user_attrs, t.params) for t in retries] == [
        (TrialState.WAITING, {"retry_of": 0, "grid_point": 0}, gone.params),
        (TrialState.WAITING, {"retry_of": 1, "grid_point": 1}, silent.params)]
