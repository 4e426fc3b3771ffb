"""The command line as a newcomer meets it: one line for every problem, with its exit code, a status line for every
long step, help for every option. Each case goes through the real `cifarkit` entry point."""
import argparse
import fcntl
import json
import logging
import os
import pty
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
import yaml

from cifarkit.cli import main, options
from cifarkit.cli.common import command_line
from cifarkit.cli.data import GRID_MAX
from cifarkit.core import device
from cifarkit.data import cifar10, loader
from cifarkit.tools import speedrun
from cifarkit.training.config import MAX_SEED

TINY = ["--recipe", "simplecnn", "--subset", "200", "--epochs", "1", "--batch-size", "50"]


def error_line(capsys) -> str:
    """The command's one line on stderr (argparse puts its usage above it; log lines go through caplog)."""
    return capsys.readouterr().err.strip().splitlines()[-1]


def argument_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return error_line(capsys)


# --- counts are checked before anything runs --------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["data", "show", "--out", "g.png", "--count", "0"], f"argument --count: must be from 1 to {GRID_MAX}"),
    (["data", "show", "--out", "g.png", "--count", "100000"], f"argument --count: must be from 1 to {GRID_MAX}"),
    (["data", "show", "--out", "g.png", "--count", "-3"], f"argument --count: must be from 1 to {GRID_MAX}"),
    (["bench", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["bench", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["bench", "--batch-size", "0"], "argument --batch-size: must be from 1 to 50,000"),
    (["speedrun", "--runs", "0"], "argument --runs: must be at least 1, got 0"),
    (["speedrun", "--target", "94"], "argument --target: must be from 0.0 to 1.0 (an accuracy: 0.94 is 94%)"),
    (["speedrun", "--target", "nan"], "argument --target: must be from 0.0 to 1.0"),
    (["predict", "x.png", "--topk", "11"], "argument --topk: must be from 1 to 10 (CIFAR-10 has 10 classes)"),
    (["predict", "x.png", "--topk", "0"], "argument --topk: must be from 1 to 10"),
    (["train", "--epochs", "many"], "argument --epochs: invalid number value: 'many'"),
])
def test_counts_out_of_range_are_argument_errors(capsys, argv, message):
    assert message in argument_error(capsys, argv)


@pytest.mark.parametrize("argv, message", [
    (["train", "--epochs", "0"], "bad value for train.epochs: 0 (must be > 0 and finite)"),
    (["train", "--batch-size", "-5"], "bad value for train.batch_size: -5 (must be > 0 and finite)"),
    (["train", "--subset", "3"], "bad value for data.subset: 3 (need at least 10, one per class)"),
    (["train", "--subset", "100000"], "subset 100000 is larger than the 2000 training images left"),
    (["train", "--batch-size", "300", "--subset", "200"], "batch size 300 exceeds the 200 training images"),
    (["train", "--recipe", "cifar10net", "--set", "train.whiten_bias_epochs=3"],
     "train.whiten_bias_epochs is set, but model cifar10net has no whitening layer; "
     "remove the setting (or use fastnet)"),
    (["train", "--recipe", "cifar10net", "--set", "train.group_train_epochs=[3]"],
     "train.group_train_epochs=[3] lists more conv groups than model cifar10net has (0); list at most 0, or use a "
     "fastnet model"),
    (["train", "--seed", "-1"], f"bad value for train.seed: -1 (a seed is a whole number from 0 to {MAX_SEED:,})"),
    # seed * 100_003 + epoch seeds an epoch's generator: this one would overflow torch's 64 bits mid-run.
    (["train", "--seed", str(10**15)], "bad value for train.seed"),
    (["train", "--epochs", "1", "--set", "train.epochs=2"], "--set train.epochs=2 and --epochs 1 both set "
                                                             "train.epochs; give it once"),
    (["train", "--compile", "--set", "train.compile=false"], "--set train.compile=false and --compile both set"),
    (["speedrun", "--epochs", "1", "--set", "train.epochs=2"], "both set train.epochs; give it once"),
    (["speedrun", "--first-seed", str(MAX_SEED), "--runs", "2"], "bad value for the last seed"),
    (["data", "show", "--out", "g.png", "--seed", "-4"], "bad value for --seed: -4"),
])
def test_bad_values_are_one_line_and_leave_no_run_folder(cifar_home, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    out = ["--out", str(tmp_path / "run")] if argv[0] in ("train", "speedrun") else []
    assert main(argv + out) == 2
    line = error_line(capsys)
    assert line.startswith("cifarkit: error: ") and message in line
    assert os.listdir(tmp_path) == [cifar_home.name]  # no run folder, no figure


def test_data_show_draws_exactly_the_count(cifar_home, tmp_path, capsys):
    assert main(["data", "show", "--out", str(tmp_path / "one.png"), "--count", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'one.png'} (1 train image)"


# --- wrong files and URLs ---------------------------------------------------------------------------------------

def test_a_picture_given_as_recipe(tmp_path, capsys):
    picture = tmp_path / "some.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    assert main(["train", "--recipe", str(picture)]) == 2
    line = error_line(capsys)
    assert line.startswith(f"cifarkit: error: recipe {picture} is not a text file") and "simplecnn" in line


def test_a_url_is_named_as_given_and_refused(empty_home, monkeypatch, capsys):
    url = "https://example.com/cifar-10-python.tar.gz"
    assert main(["data", "import", url]) == 2
    line = error_line(capsys)
    assert line.startswith(f"cifarkit: error: {url} is a URL;") and "cifarkit data import FILE" in line
    monkeypatch.setenv("CIFARKIT_DATA", url)
    assert main(["data", "info"]) == 2
    line = error_line(capsys)
    assert line.startswith(f"cifarkit: error: CIFARKIT_DATA={url} is a URL;") and "unset it" in line
    assert not empty_home.exists()


def test_data_info_names_the_archive_not_its_fingerprint(cifar_home, tmp_path, capsys):
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(b"stands in for the archive the cache was made from")
    cached = cifar10.load_cache()
    tensors = {"train_x": cached.train_x, "train_y": cached.train_y.to(torch.uint8), "test_x": cached.test_x,
               "test_y": cached.test_y.to(torch.uint8)}
    cifar10.save_cache(tensors, cached.sha256, cifar10.source_key(archive))
    assert main(["data", "info"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"source: {archive.resolve()}"
    os.makedirs(cifar10.home() / "downloads")
    official = cifar10.home() / "downloads" / cifar10.ARCHIVE_NAME
    official.write_bytes(b"x")
    cifar10.save_cache(tensors, cached.sha256, cifar10.source_key(official))
    official.unlink()  # as after a download: the archive is deleted once imported
    assert main(["data", "info", "--json"]) == 0
    source = json.loads(capsys.readouterr().out)["source"]
    assert source == f"the official archive, downloaded from {cifar10.OFFICIAL_URL}"


# --- hints point the right way ----------------------------------------------------------------------------------

def test_bench_names_its_own_option_for_an_unusable_mode(capsys):
    assert main(["bench", "--models", "simplecnn", "--modes", "fp32", "fp16+cl", "--device", "cpu"]) == 2
    line = error_line(capsys)
    assert line == ("cifarkit: error: mode fp16+cl: fp16 autocast is not supported for training on the CPU; on cpu "
                    "choose --modes from fp32, fp32+cl, bf16+cl")


def test_a_nan_in_epoch_1_does_not_promise_a_checkpoint(cifar_home, tmp_path, monkeypatch, capsys):
    real_augment = loader.augment
    monkeypatch.setattr(loader, "augment", lambda *args, **kwargs: real_augment(*args, **kwargs) * float("nan"))
    assert main(["train", *TINY, "--out", str(tmp_path / "run")]) == 2
    assert error_line(capsys) == (
        "cifarkit: error: training diverged: the loss became NaN/inf by step 4 of epoch 1; lower the learning rate "
        "(--lr) or set train.grad_clip; no epoch had finished, so there is no checkpoint")
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


# --- long steps say what they are doing -------------------------------------------------------------------------

def test_long_steps_say_what_they_are_doing(cifar_home, tmp_path, monkeypatch, caplog, capsys):
    """torch.compile holds the first step for tens of seconds, and TTA the last epoch's line: each is announced.
    torch.compile is replaced by what it says on a machine without CUDA, so the test takes a second, not minutes."""
    def compile_without_cuda(model, **kwargs):
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='/usr'")
        return model
    monkeypatch.setattr(torch, "compile", compile_without_cuda)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="cifarkit"):
        assert main(["train", *TINY, "--set", "train.tta=true", "--set", "data.val_split=100", "--compile",
                     "--device", "cpu", "--out", str(out)]) == 0
    assert "CUDA_HOME" not in capsys.readouterr().err  # torch's warning means nothing on a CPU
    lines = [r.getMessage() for r in caplog.records if r.name == "cifarkit"]

    def index(start: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(start))
    assert "batch 50, epochs 1, precision" in lines[index("recipe simplecnn:")]
    assert index("compiling the model with torch.compile") < index("epoch 1 trained; measuring the test accuracy "
                                                                    "with test-time augmentation") < index("epoch 1 |")
    assert index("epoch 1 |") < index("measuring the test accuracy of epoch 1's weights, chosen on validation "
                                      "(with test-time augmentation)") < index("done:")


# --- Ctrl-C and a closed pipe -----------------------------------------------------------------------------------

def test_ctrl_c_during_training_prints_the_resume_command(cifar_home, tmp_path):
    """SIGINT, as Ctrl-C sends it, to a real training process as its second epoch starts, its stderr a terminal so
    that tqdm draws its bar: one line of its own with the exact command for that run, and exit code 130. The signal
    lands near the new bar's first drawing, the moment most likely to leave a bar on the line."""
    work = tmp_path / "work"
    work.mkdir()
    run = work / "runs" / "try1"
    args = [sys.executable, "-m", "cifarkit", "train", "--recipe", "simplecnn", "--subset", "200", "--batch-size",
            "50", "--epochs", "1000", "--out", "runs/try1"]  # relative: the line must give the real path
    terminal, child_end = pty.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a width, or tqdm draws nothing
    # A shell starts its background jobs (`cmd &` in a script) with SIGINT ignored, and a child inherits that, so
    # under such a job the run would never see the signal. Ctrl-C reaches a terminal's foreground job, whose SIGINT
    # has its default action: the child is started with that, whatever this process inherited.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(args, cwd=work, stdout=subprocess.DEVNULL, stderr=child_end)
    finally:
        signal.signal(signal.SIGINT, inherited)
    os.close(child_end)
    shown, deadline, interrupted = b"", time.monotonic() + 120, False
    while True:  # read all the while: a full terminal buffer would stop the child
        if select.select([terminal], [], [], 0.05)[0]:
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # the child has gone and closed its end
                chunk = b""
            if not chunk:
                break
            shown += chunk
        if not interrupted and (run / "checkpoints" / "last.pt").exists():
            proc.send_signal(signal.SIGINT)
            interrupted = True
        assert time.monotonic() < deadline, shown.decode(errors="replace")
    os.close(terminal)
    assert proc.wait(timeout=60) == 130
    # What the terminal shows of each line: the text after its last carriage return (tqdm redraws with them).
    screen = [line.split("\r")[-1].rstrip() for line in shown.decode().replace("\r\n", "\n").split("\n")]
    assert [line for line in screen if line.strip() and " INFO " not in line] == [
        f"cifarkit: error: interrupted; continue this run with `cifarkit train --resume "
        f"{shlex.quote(str(run.resolve()))}`"]
    assert b"img/s]" in shown  # the bar was drawn: the line above was not written to a pipe


def test_a_reader_that_stops_early_gets_no_traceback(cifar_home):
    """`cifarkit data info | head -0`: the reader is gone before the first line is written."""
    proc = subprocess.Popen([sys.executable, "-m", "cifarkit", "data", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and err == ""


# --- help and options -------------------------------------------------------------------------------------------

def test_every_option_has_help():
    assert [(command, option) for command, option, _, text in options() if not text] == []


def test_speedrun_has_trains_shortcuts():
    by_command = {}
    for command, option, _, _ in options():
        by_command.setdefault(command, set()).add(option)
    assert {"--epochs", "--batch-size", "--lr", "--subset", "--device", "--precision", "--compile/--no-compile",
            "--set", "--recipe"} <= by_command["cifarkit speedrun"]
    # Only the seed differs (--first-seed sets it per run), and a speed run's runs are single processes.
    assert by_command["cifarkit train"] - by_command["cifarkit speedrun"] == {"--seed", "--resume", "--nproc"}


def test_top_level_help_speaks_to_users(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "train, measure, release and serve CIFAR-10 classifiers" in out and "parses arguments" not in out
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0 and "train a recipe (default: fast) into a run folder" in capsys.readouterr().out
    assert argument_error(capsys, ["data"]) == \
        "cifarkit data: error: the following arguments are required: {import,info,show}"


def test_speedrun_takes_the_training_shortcuts(cifar_home, tmp_path, capsys):
    out = tmp_path / "speed"
    assert main(["speedrun", *TINY, "--runs", "1", "--target", "0.1", "--no-curve", "--out", str(out)]) == 0
    assert "n = 1: accuracy" in capsys.readouterr().out
    report = json.loads((out / "speedrun.json").read_text())
    assert report["recipe"] == "simplecnn"
    assert report["overrides"] == ["train.epochs=1", "train.batch_size=50", "data.subset=200"]
    assert json.loads((out / "seed0" / "summary.json").read_text())["epochs"] == 1


def test_a_recorded_command_line_holds_no_absolute_path(tmp_path):
    inside = Path.cwd() / "results" / "profile.json"
    argv = ["profile", f"--json={tmp_path / 'p.json'}", "--out", str(tmp_path / "run"), str(inside), "--steps", "2"]
    assert command_line(argparse.Namespace(argv=argv)) == \
        "cifarkit profile --json=p.json --out run results/profile.json --steps 2"


def test_a_speedrun_into_the_same_folder_keeps_the_seeds_that_finished(cifar_home, tmp_path, capsys):
    out = tmp_path / "speed"
    again = ["speedrun", *TINY, "--target", "0.1", "--no-curve", "--out", str(out)]
    assert main(again + ["--runs", "1"]) == 0
    first = (out / "seed0" / "summary.json").read_bytes()
    probed_first = json.loads((out / "speedrun.json").read_text())["runs"][0]["machine_speed"]
    capsys.readouterr()
    assert main(again + ["--runs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "kept from an earlier command into the same folder: seed 0 (finished 20" in printed
    report = json.loads((out / "speedrun.json").read_text())
    assert [(r["seed"], r["kept_from_an_earlier_command"]) for r in report["runs"]] == [(0, True), (1, False)]
    assert report["accuracy"]["n"] == 2 and (out / "seed0" / "summary.json").read_bytes() == first
    # The kept run brings its own machine speed and facts from the command that trained it, not this one's.
    kept, trained = report["runs"]
    assert kept["machine_speed"] == probed_first and kept["machine_speed"] != trained["machine_speed"]
    assert all(r["machine_speed"][when]["images_per_s"] > 0 for r in report["runs"] for when in ("before", "after"))
    assert kept["run"] == yaml.safe_load((out / "seed0" / "config.yaml").read_text())["run"]
    assert kept["run"]["allocator"] == trained["run"]["allocator"] and "cpu_features" in kept["run"]
    probe = kept["machine_speed"]["before"]["images_per_s"]
    assert f"| 0 | {100 * kept['test_acc']:.2f}% |" in printed and f"| {probe:,.0f} / " in printed

    # Refused before anything trains, and nothing removed: other settings, and a run that did not finish.
    assert main(again + ["--runs", "3", "--lr", "0.01"]) == 2
    assert error_line(capsys) == (f"cifarkit: error: {out / 'seed0'} was trained with other settings than this "
                                  f"speed run's; give another --out")
    (out / "seed1" / "summary.json").unlink()
    assert main(again + ["--runs", "3"]) == 2
    assert error_line(capsys) == (f"cifarkit: error: {out / 'seed1'} holds a run that did not finish, and a run's "
                                  f"time cannot be resumed: delete {out / 'seed1'} to train this seed again, or give "
                                  f"another --out")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["seed0", "seed1"]
    assert (out / "seed1" / "model.safetensors").exists() and (out / "seed0" / "summary.json").read_bytes() == first


def test_env_shows_the_cudnn_version(capsys):
    assert main(["env"]) == 0
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    assert f"cuDNN {device.cudnn_text(version)}" in capsys.readouterr().out
    assert (device.cudnn_text(90100), device.cudnn_text(8902), device.cudnn_text(None)) == ("9.1.0", "8.9.2", "none")


def test_a_confidence_interval_past_0_or_100_percent_is_clipped_and_says_why():
    accuracies = [0.08, 0.15]  # two seeds far apart: the t-interval reaches below 0
    result = speedrun.statistics_against(accuracies, 0.1)
    half = result["ci95"][1] - result["mean"]
    assert result["ci95"][0] == 0.0 and result["mean"] - half < 0 and result["ci95_clipped"]
    report = {"runs": [], "accuracy": result, "target": 0.1, "wall_time_s": {"mean": 1.0, "max": 1.0}}
    assert f"95% CI [0.00, {100 * result['ci95'][1]:.2f}] (clipped to [0, 100]%: n = 2 is too small for a useful " \
           f"interval; run more seeds)" in speedrun.table(report)
    assert not speedrun.statistics_against([0.941, 0.943, 0.939], 0.94)["ci95_clipped"]
