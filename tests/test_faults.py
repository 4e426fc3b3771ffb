"""Fault injection: real SIGKILLs at named points, a really full disk and a really read-only folder.

No kill, fault or bad file may lose a run, a release or a result: after each fault the command either recovers
(`--resume`, or a rerun) to exactly what an unbroken command makes, or fails with one line and leaves everything
that existed as it was. Run with `-s` to see the fault matrix.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from cifarkit.cli import main
from cifarkit.data import cifar10
from cifarkit.release import build
from conftest import sample_home
from fault_child import killed_at

pytestmark = pytest.mark.e2e

# Three short epochs with a validation split and TTA, so every stage of a run exists: checkpoints, selection on
# validation, the final TTA measurement of the chosen weights, the weights and the summary. Everything a resume must
# bring back takes part: warmup into the schedule, EMA and lookahead weights, and the augmentation's random streams
# (cutout, alternating flips). TTA reads a fifth of the images with all views, which exercises the same code as all
# of them in a fraction of the time.
RUN_SETTINGS = ["train.epochs=3", "train.batch_size=100", "data.subset=600", "data.val_split=100", "train.tta=true",
                "train.tta_share=0.2", "schedule.warmup_epochs=1", "train.ema_decay=0.9", "train.lookahead_every=3",
                "data.augment.cutout=8", "data.augment.alternate_flip=true"]
TRAIN = ["train", "--recipe", "simplecnn"] + [arg for s in RUN_SETTINGS for arg in ("--set", s)]
TIMING_KEYS = {"epoch_time_s", "images_per_s", "elapsed_s", "wall_time_s", "train_time_s"}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A CIFARKIT_HOME holding the committed real-data sample, for in-process calls and child processes alike."""
    home = tmp_path_factory.mktemp("faults-home")
    with sample_home(home) as patch:
        # In-process releases measure their speed briefly; what is tested here is where their files end up.
        patch.setattr(build, "INFERENCE_ROUNDS", 1)
        patch.setattr(build, "SECONDS_PER_SAMPLE", 0.05)
        yield home


def run_child(point: str, args: list[str]) -> subprocess.CompletedProcess:
    """`cifarkit ARGS`, killed at `point` (fault_child.py): its exit code, and what it printed as its stderr."""
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "child.log"
        code = killed_at(point, args, log)
        return subprocess.CompletedProcess(args, code, "", log.read_text())


@pytest.fixture(scope="module")
def unbroken(home, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unbroken") / "run"
    assert main(TRAIN + ["--out", str(out)]) == 0
    return out


def comparable(run: Path) -> tuple:
    """What must match an unbroken run: the weights' bytes, and every metric that is not a timing."""
    records = [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
               for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = {k: v for k, v in json.loads((run / "summary.json").read_text()).items() if k not in TIMING_KEYS}
    return (run / "model.safetensors").read_bytes(), records, summary


def leftovers(folder: Path) -> list[str]:
    """Temporary files or folders (hidden, '.tmp' in the name) anywhere below `folder`."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if ".tmp" in p.name)


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("point", ["epoch-1", "mid-epoch", "checkpoint-write", "last-epoch-eval",
                                   "after-last-checkpoint", "final-eval", "weights-write", "summary-write"])
def test_a_run_killed_anywhere_resumes_to_the_unbroken_result(point, home, unbroken, tmp_path, capsys):
    run = tmp_path / "run"
    killed = run_child(point, TRAIN + ["--out", str(run)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (run / "summary.json").exists()
    checkpoint = run / "checkpoints" / "last.pt"
    left = f"last.pt of epoch {torch.load(checkpoint, weights_only=True)['epoch']}" if checkpoint.exists() \
        else "no checkpoint"
    temps = leftovers(run)

    assert main(["train", "--resume", str(run)]) == 0
    assert comparable(run) == comparable(unbroken)
    assert leftovers(run) == []  # a dead writer's half-written temporary is removed by the next write
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2  # and a finished run is not trained again
    assert "has finished already (it has summary.json)" in capsys.readouterr().err
    assert comparable(run) == comparable(unbroken)
    print(f"\nFAULT | SIGKILL {point} | left: {left}, temporaries {temps or 'none'} | `--resume`: complete, "
          f"model.safetensors byte-identical to the unbroken run's")


def test_a_run_that_fails_before_writing_leaves_nothing_and_can_be_rerun(home, unbroken, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(TRAIN + ["--out", str(run), "--set", "data.subset=60000"]) == 2
    assert "subset 60000 is larger than" in capsys.readouterr().err
    assert main(TRAIN + ["--out", str(run), "--set", "distill.teacher=no/such/release"]) == 2
    assert "no/such/release" in capsys.readouterr().err
    assert not run.exists()
    assert main(TRAIN + ["--out", str(run)]) == 0
    assert comparable(run) == comparable(unbroken)


def test_a_damaged_config_is_one_line_and_stays_as_it_was(home, tmp_path, capsys):
    run = tmp_path / "run"
    killed = run_child("mid-epoch", TRAIN + ["--out", str(run)])
    assert killed.returncode == -signal.SIGKILL
    (run / "config.yaml").write_text("model: {name: simplecnn\ntrain: [")
    before = tree(run)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.yaml is damaged" in err[0] and "--out NEW_FOLDER" in err[0]
    assert tree(run) == before


def previous_release(released: Path, root: Path) -> Path:
    """The run behind the suite's shared release, whose copy `root` then holds as the release a new one replaces."""
    shutil.copytree(released, root / released.name)
    return released.parent.parent / "run"


def test_a_killed_release_leaves_the_previous_version_working(home, released, tmp_path):
    from cifarkit import Classifier
    root = tmp_path / "models"
    run = previous_release(released, root)
    before = tree(root / "version_T")
    killed = run_child("release-measure", ["release", str(run), "--name", "T", "--out", str(root), "--force"])
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == ["version_T"]
    assert tree(root / "version_T") == before
    image = np.zeros((32, 32, 3), np.uint8)
    assert Classifier.load(root / "version_T").predict_proba(image).sum() == pytest.approx(1.0, abs=1e-5)
    assert main(["release", str(run), "--name", "T", "--out", str(root), "--force"]) == 0
    assert leftovers(root) == []
    print("\nFAULT | SIGKILL `cifarkit release --force` while measuring | left: the previous version_T intact, "
          "staging folder hidden | rerun: replaced, no leftovers")


def test_a_killed_import_leaves_the_cache_working(home, synthetic_archive):
    cache = home / cifar10.CACHE_NAME
    before = cache.read_bytes()
    killed = run_child("cache-write", ["data", "import", str(synthetic_archive)])
    assert killed.returncode == -signal.SIGKILL
    assert cache.read_bytes() == before and len(cifar10.load_cache(cache).test_y) == 500
    temps = leftovers(home)
    assert temps  # the half-written new cache is there, hidden, and nothing loads it
    try:
        assert main(["data", "import", str(synthetic_archive)]) == 0
        assert leftovers(home) == [] and len(cifar10.load_cache(cache).test_y) == 10_000
    finally:
        cache.write_bytes(before)
    print(f"\nFAULT | SIGKILL `cifarkit data import` during the cache write | left: old cache intact, "
          f"{temps} | rerun: imported, temporary removed")


@pytest.fixture
def mount(tmp_path):
    """mount(options) -> a fresh tmpfs folder; really mounted, so the kernel itself says ENOSPC or EROFS."""
    mounted = []

    def make(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
        mounted.append(point)
        return point
    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def fill(folder: Path, leave: int) -> Path:
    """Take all free space on `folder`'s file system but `leave` bytes."""
    stat = os.statvfs(folder)
    filler = folder / "filler"
    filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
    return filler


def test_a_full_disk_stops_the_run_in_one_line_and_resume_finishes_it(home, unbroken, mount, capsys):
    disk = mount("size=16m")
    run = disk / "run"
    killed = run_child("mid-epoch", TRAIN + ["--out", str(run)])  # epoch 1 is saved, epoch 2 is not
    assert killed.returncode == -signal.SIGKILL
    checkpoint = (run / "checkpoints" / "last.pt").read_bytes()
    filler = fill(disk, leave=64 * 1024)  # room for the log and metrics lines, not for weights
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(err) == 1 and err[0].startswith("cifarkit: error: No space left on device: ") \
        and "free some disk space" in err[0], err
    assert (run / "checkpoints" / "last.pt").read_bytes() == checkpoint
    assert leftovers(run) == [] and not (run / "summary.json").exists()
    filler.unlink()
    assert main(["train", "--resume", str(run)]) == 0
    assert comparable(run) == comparable(unbroken)
    print("\nFAULT | disk full (tmpfs) during epoch 2 | `cifarkit: error: No space left on device: ...; free some "
          "disk space ...`, exit 2, last.pt of epoch 1 untouched | `--resume` after freeing: byte-identical")


def test_a_full_disk_during_a_release_keeps_the_previous_one(home, released, mount, capsys):
    root = mount("size=16m")
    run = previous_release(released, root)
    before = tree(root / "version_T")
    fill(root, leave=16 * 1024)
    capsys.readouterr()
    assert main(["release", str(run), "--name", "T", "--out", str(root), "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cifarkit: error: No space left on device") and not any("Traceback" in e for e in err)
    assert tree(root / "version_T") == before and leftovers(root) == []


def test_a_read_only_folder_is_one_line_and_nothing_changes(home, unbroken, mount, capsys):
    read_only = mount("ro,size=1m")
    capsys.readouterr()
    assert main(TRAIN + ["--out", str(read_only / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"cifarkit: error: Read-only file system: {read_only / 'run'}; choose a folder on a writable disk")
    assert main(["release", str(unbroken), "--name", "T", "--out", str(read_only)]) == 2
    assert "Read-only file system" in capsys.readouterr().err.strip().splitlines()[-1]
    assert list(read_only.iterdir()) == []
