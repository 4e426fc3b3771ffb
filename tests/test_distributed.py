"""Distributed data-parallel training for real: torchrun, gloo ranks on the CPU, the committed real-data sample.

Each launch starts real processes (torchrun's agent and its ranks), so the runs are short: the `fast` recipe for two
epochs of 400 of the sample's images, 100 per step (results/test-floors.json holds the settings and the floor).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cifarkit.cli import main
from cifarkit.data import loader
from cifarkit.data.config import DataConfig
from cifarkit.training import distributed
from conftest import FLOORS, sample_home

pytestmark = pytest.mark.e2e

CHECK = FLOORS["training"]["fast-2-epochs-2-ranks-sample"]  # its settings and floor, measured on 2 ranks
TRAIN = ["train", "--recipe", CHECK["recipe"]] + [arg for s in CHECK["overrides"] for arg in ("--set", s)]
FAULT_CHILD = Path(__file__).with_name("dist_fault_child.py")
# Now and then a 2-rank launch loses rank 1 to this abort from libstdc++ (a std::thread destroyed while joinable,
# somewhere in native code; seen in about one of six full suites, in resumed launches and once in the first launch
# at the end of epoch 1, never alone; the cause is not known yet). Launching or resuming again completes the run,
# byte for byte: that much is tested, and the abort is reported as a warning so that it stays visible.
KNOWN_ABORT = "terminate called without an active exception"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with sample_home(tmp_path_factory.mktemp("dist-home")):
        yield


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def epochs(run: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_ranks(home, tmp_path_factory) -> Path:
    """`cifarkit train --nproc 2` without --out, in a folder of its own: the unbroken 2-rank run."""
    where = tmp_path_factory.mktemp("two-ranks")
    launch = [sys.executable, "-m", "cifarkit", *TRAIN, "--nproc", "2"]
    done = subprocess.run(launch, cwd=where, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and KNOWN_ABORT in done.stderr:  # the abort below, seen here too: a fresh launch
        warnings.warn(f"the 2-rank launch aborted ({KNOWN_ABORT!r}); launched it again")
        shutil.rmtree(where / "runs")
        done = subprocess.run(launch, cwd=where, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((where / "runs").iterdir())
    assert len(runs) == 1, runs  # rank 0 names the folder, and the other rank writes nothing
    return runs[0]


def test_two_ranks_write_one_run_folder_that_learned(two_ranks):
    assert sorted(p.name for p in two_ranks.iterdir()) == ["checkpoints", "config.yaml", "curves.png",
                                                            "metrics.jsonl", "model.safetensors", "summary.json",
                                                            "tb", "train.log"]
    assert epochs(two_ranks) == [1, 2]
    summary = json.loads((two_ranks / "summary.json").read_text())
    assert summary["test_acc"] >= CHECK["floor"]
    config = (two_ranks / "config.yaml").read_text()
    assert "world_size: 2" in config and "backend: gloo" in config and "images_per_rank_per_step: 50" in config
    log = (two_ranks / "train.log").read_text()
    assert "rank 1" not in log and "done: test accuracy" in log


def test_two_ranks_match_one_process_accumulating_two_micro_batches(home, two_ranks, tmp_path):
    """The correctness test of the distributed path: rank r's shard of a batch is micro-batch r of one process.

    The tolerance is zero, measured: with two ranks the all-reduce's order cannot matter (a + b = b + a, and the
    halving is exact), so what could differ is the kernels. Each rank runs one thread (torchrun's default), and so
    does this process: the weights come out bit for bit the same, BatchNorm statistics included. With this process
    on 2 threads, oneDNN picks other kernels: in fp32, 1.8e-4 of the largest weight apart after one step and 3.8e-2
    after 40, measured once here (the BatchNorm shifts train at 64x the lr, which amplifies any difference).
    """
    one = tmp_path / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(TRAIN + ["--set", "train.accumulate_steps=2", "--out", str(one)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert same(weights(one), weights(two_ranks))
    assert epochs(one) == [1, 2]


def test_a_rank_dead_in_native_code_names_where_and_the_restarted_ranks_resume_to_the_unbroken_result(home, two_ranks,
                                                                                                      tmp_path):
    """Rank 1 dies of SIGABRT (what a C++ std::terminate raises) in epoch 2: it names where its Python code was, and
    torchrun's restart resumes the run from its last checkpoint to exactly the unbroken run's weights."""
    run = tmp_path / "run"
    done = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(FAULT_CHILD),
                    *TRAIN, "--out", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Fatal Python error: Aborted" in done.stderr, done.stderr[-3000:]
    assert "in train_one_epoch" in done.stderr.split("Fatal Python error: Aborted")[1], done.stderr[-3000:]
    assert "resuming" in (run / "train.log").read_text()
    assert epochs(run) == [1, 2]  # every epoch once: the killed attempt's epoch 2 was never recorded
    assert same(weights(run), weights(two_ranks))


def resume_two_ranks(run: Path, capfd) -> int:
    capfd.readouterr()
    code = main(["train", "--nproc", "2", "--resume", str(run)])
    if code != 0 and KNOWN_ABORT in capfd.readouterr().err:
        warnings.warn(f"a resumed 2-rank launch aborted ({KNOWN_ABORT!r}); resumed it again")
        code = main(["train", "--nproc", "2", "--resume", str(run)])
    return code


def test_a_stopped_two_rank_run_is_finished_by_resume_with_nproc_2(home, two_ranks, tmp_path, capfd):
    """What a launch killed after its last checkpoint leaves (test_faults covers each stage of a run in one process):
    `cifarkit train --nproc 2 --resume` measures and writes what was missing, the unbroken run's weights."""
    run = tmp_path / "run"
    shutil.copytree(two_ranks, run)
    for written_last in ("summary.json", "model.safetensors"):
        (run / written_last).unlink()
    assert resume_two_ranks(run, capfd) == 0
    assert epochs(run) == [1, 2]
    assert same(weights(run), weights(two_ranks))
    assert json.loads((run / "summary.json").read_text())["test_acc"] == \
        json.loads((two_ranks / "summary.json").read_text())["test_acc"]


def test_two_nodes_on_loopback_train_one_run(home, two_ranks, tmp_path):
    """Two torchrun launches, one per node, meeting through the c10d rendezvous on 127.0.0.1."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(rank), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               endpoint, "--rdzv-id", "cifarkit-test", "-m", "cifarkit", *TRAIN],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              # one thread per rank, as torchrun gives each of 2 ranks on one node: the same kernels
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                              start_new_session=True)  # a process group per node: agent and rank stop together
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        # One hang in a full suite so far (after epoch 1, under load): stop both launches, ranks included, and show
        # what each had printed, so that the next one says where it stood.
        for node in nodes:
            os.killpg(node.pid, signal.SIGKILL)
        outputs = [node.communicate()[0] for node in nodes]
        pytest.fail("the two-node launch did not finish in 300 s\n" + "\n".join(
            f"node {rank}:\n{output[-3000:]}" for rank, output in enumerate(outputs)))
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    assert epochs(runs[0]) == [1, 2]
    # The same 2 ranks as on one node, so the same weights: the rendezvous changes nothing of the training.
    assert same(weights(runs[0]), weights(two_ranks))


def test_a_run_resumes_only_with_the_world_size_it_was_trained_with(home, two_ranks, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_ranks, run)
    (run / "summary.json").unlink()  # a run stopped after its last checkpoint
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "trained by 2 process(es) and this is 1" in err and "--nproc 2" in err


def test_batches_must_split_evenly_into_ranks_and_micro_batches(home, tmp_path, capsys):
    assert main(TRAIN + ["--set", "train.accumulate_steps=3", "--out", str(tmp_path / "run")]) == 2
    assert "train.batch_size 100 does not split into 1 process(es) x 3 micro-batch(es)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_shard_s_holds_the_same_images_whichever_process_takes_it():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(64)
    cfg = DataConfig()
    whole = loader.TrainLoader(images, labels, 16, cfg, seed=5)
    together = loader.TrainLoader(images, labels, 16, cfg, seed=5, shards=4, own=range(4))
    apart = [loader.TrainLoader(images, labels, 16, cfg, seed=5, shards=4, own=range(r, r + 1)) for r in range(4)]
    for epoch in (1, 2):
        for step, (full, shards, *single) in enumerate(zip(whole.epoch(epoch), together.epoch(epoch),
                                                          *(part.epoch(epoch) for part in apart))):
            assert [len(y) for _, y in shards] == [4, 4, 4, 4]
            # the batch's images, cut in 4: every image once, in the one-process run's order
            assert torch.equal(torch.cat([y for _, y in shards]), full[0][1])
            for (x, y), [(x1, y1)] in zip(shards, single):
                assert torch.equal(x, x1) and torch.equal(y, y1)


def test_sync_batchnorm_is_refused_on_the_cpu_with_the_reason():
    from cifarkit import models
    with pytest.raises(Exception, match="SyncBatchNorm does not run on the CPU or MPS"):
        distributed.sync_batchnorm(models.create("simplecnn"), distributed.Group(0, 2, 0), torch.device("cpu"))

