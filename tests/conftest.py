import io
import json
import os
import pickle
import shutil
import tarfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

# pytest-xdist's workers (pyproject's addopts) share the cores: each worker, and every process it starts, gets its
# share as OpenMP threads, set before torch is imported. On the project's 2 cores, one run each, back to back: two
# workers of two threads ran the suite in 720 s, two of one thread in 457 s. OpenMP threads spin while a descheduled
# peer keeps them waiting.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

ROOT = Path(__file__).resolve().parent.parent  # the project's checkout
FIXTURE = Path(__file__).parent / "fixtures" / "cifar10-mini.safetensors"
# Accuracy floors, each measured over five seeds by `python lab/measure_test_floors.py`, with the settings the
# tests must use to meet them.
FLOORS = json.loads((ROOT / "results" / "test-floors.json").read_text())
# What each test file cost in a measured run of the suite (`python lab/measure_test_durations.py`).
DURATIONS = ROOT / "results" / "test-durations.json"


def pytest_collection_modifyitems(items):
    """Costliest files first, and every test marked with its cost. xdist's loadfile hands each worker whole files in
    collection order (pyproject turns off its reordering by test count): when the long files start first and the short
    ones fill in at the end, the two workers finish together. A file the record does not know goes last, in its usual
    place among the others."""
    costs = json.loads(DURATIONS.read_text())["files"] if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -costs.get(item.nodeid.split("::")[0], 0.0))  # stable: a file's tests keep their order
    for item in items:  # a test marked neither unit nor e2e is an integration test (pyproject's markers)
        if item.get_closest_marker("unit") is None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.integration)


@contextmanager
def sample_home(home: Path):
    """CIFARKIT_HOME set to `home`, which gets the committed sample as its cache, for in-process calls and child
    processes alike; yields the MonkeyPatch, for more."""
    shutil.copy(FIXTURE, home / "cifar10.safetensors")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CIFARKIT_HOME", str(home))
        patch.delenv("CIFARKIT_DATA", raising=False)
        yield patch


@pytest.fixture(autouse=True)
def quick_machine_probe(monkeypatch):
    """Speed runs probe the machine before and after each run (benchmark.PROBE): fastnet at batch 256 takes seconds
    per probe in fp32 on one core of an AVX2 CPU. The tests check that the probe is taken and recorded, not its
    figure, so they probe the proxy net on small batches."""
    from cifarkit.tools import benchmark
    monkeypatch.setattr(benchmark, "PROBE", {"model": "fastnet_proxy", "batch_size": 32, "steps": 2})


@pytest.fixture
def cifar_home(tmp_path, monkeypatch):
    """A CIFARKIT_HOME whose cache is the committed real-data sample (2,000 train / 500 test images)."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(FIXTURE, home / "cifar10.safetensors")
    monkeypatch.setenv("CIFARKIT_HOME", str(home))
    monkeypatch.delenv("CIFARKIT_DATA", raising=False)
    return home


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    home = tmp_path / "empty-home"
    monkeypatch.setenv("CIFARKIT_HOME", str(home))
    monkeypatch.delenv("CIFARKIT_DATA", raising=False)
    return home


def make_batch(first_label: int = 0, count: int = 10_000, labels=None) -> bytes:
    """A protocol-2 pickle laid out like the real batches: bytes keys, uint8 data, a list of int labels."""
    labels = [(first_label + i) % 10 for i in range(count)] if labels is None else labels
    # Each image is a flat grey whose level encodes its label: compressible, and checkable after import.
    data = np.repeat(np.array(labels, dtype=np.uint8)[:, None] * 20, 3072, axis=1)
    return pickle.dumps({b"batch_label": b"synthetic", b"labels": labels, b"data": data}, protocol=2)


def write_archive(path: Path, batches: dict[str, bytes] | None = None) -> Path:
    """A cifar-10-python.tar.gz-shaped archive; `batches` replaces or (with None values) drops members."""
    members = {f"data_batch_{i}": make_batch(i) for i in range(1, 6)}
    members["test_batch"] = make_batch(0)
    members.update(batches or {})
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, raw in members.items():
            if raw is None:
                continue
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


@pytest.fixture(scope="session")
def synthetic_archive(tmp_path_factory):
    return write_archive(tmp_path_factory.mktemp("archive") / "cifar-10-python.tar.gz")


@pytest.fixture(scope="session")
def released(tmp_path_factory):
    """A release of a one-epoch SimpleCNN run on the fixture data, made once per session (speed measured briefly)."""
    from cifarkit.release import build
    from cifarkit.training import train
    from cifarkit.training.config import load_recipe
    root = tmp_path_factory.mktemp("released")
    (root / "home").mkdir()
    shutil.copy(FIXTURE, root / "home" / "cifar10.safetensors")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CIFARKIT_HOME", str(root / "home"))
        patch.delenv("CIFARKIT_DATA", raising=False)
        patch.setattr(build, "INFERENCE_ROUNDS", 1)
        patch.setattr(build, "SECONDS_PER_SAMPLE", 0.05)
        train.run(load_recipe("simplecnn", ["train.epochs=1", "data.subset=500"]), out=root / "run")
        return build.make_release(root / "run", "T", root / "models")


def interrupt_as_epoch_starts(monkeypatch, epoch: int):
    """Make train.run raise KeyboardInterrupt (a Ctrl-C) as `epoch` starts, after the epoch before it was checkpointed;
    returns the real train_one_epoch, to put back before the run is resumed."""
    from cifarkit.training import train
    real_epoch, started = train.train_one_epoch, []

    def interrupted(*args, **kwargs):
        started.append(1)
        if len(started) == epoch:
            raise KeyboardInterrupt
        return real_epoch(*args, **kwargs)
    monkeypatch.setattr(train, "train_one_epoch", interrupted)
    return real_epoch
