import json
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cifarkit.cli import main
from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.data import cifar10, loader
from cifarkit.training import train
from cifarkit.training.config import load_recipe
from conftest import ROOT, interrupt_as_epoch_starts

# Small but complete: dropout (RNG), warmup + step schedule (SequentialLR), EMA, lookahead and augmentation
# (alternating flips included) all take part.
QUICK = ["train.epochs=3", "train.batch_size=50", "data.subset=500", "schedule.warmup_epochs=1",
         "train.ema_decay=0.9", "train.lookahead_every=3", "data.augment.cutout=8", "data.augment.alternate_flip=true"]


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_run_folder_contents(cifar_home, tmp_path):
    out = tmp_path / "run"
    summary = train.run(load_recipe("cifar10net", QUICK), out=out)
    for name in ("config.yaml", "train.log", "metrics.jsonl", "curves.png", "checkpoints/last.pt",
                 "model.safetensors", "summary.json"):
        assert (out / name).is_file(), name
    assert any((out / "tb").iterdir())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    for key in ("train_loss", "train_acc", "test_loss", "test_acc", "lr", "epoch_time_s", "images_per_s"):
        assert all(key in r for r in records), key
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["train"]["seed"] == 0 and config["train"]["epochs"] == 3
    assert config["run"]["versions"]["torch"] == torch.__version__
    # a run's speed is read against the CPU's instruction sets (AMX trains bf16 several times faster than AVX-512)
    assert config["run"]["cpu_features"] == device.cpu_features()
    # which code trained it, where that code is a git checkout (as the tests' is, in CI's clean clone)
    head, status = (subprocess.run(["git", *args], cwd=ROOT / "src" / "cifarkit", capture_output=True, text=True)
                    for args in (["rev-parse", "HEAD"], ["status", "--porcelain", "--", "."]))
    if head.returncode == 0:
        assert config["run"]["source"] == {"commit": head.stdout.strip(), "modified": bool(status.stdout.strip())}
    else:
        assert "source" not in config["run"]
    saved = json.loads((out / "summary.json").read_text())
    assert saved == summary
    for key in ("test_acc", "wall_time_s", "train_time_s", "params", "device", "precision", "seed", "torch",
                "dataset_sha256"):
        assert key in saved, key
    assert saved["params"] == 815_018 and saved["dataset_sha256"] == cifar10.load().sha256
    assert saved["test_acc"] == records[-1]["test_acc"]
    log = (out / "train.log").read_text()
    assert "epoch 3 | train loss" in log and "done: test accuracy" in log


def test_same_seed_same_weights(cifar_home, tmp_path):
    recipe = ["train.epochs=2", "train.batch_size=50", "data.subset=200"]
    train.run(load_recipe("cifar10net", recipe), out=tmp_path / "a")
    train.run(load_recipe("cifar10net", recipe), out=tmp_path / "b")
    train.run(load_recipe("cifar10net", recipe + ["train.seed=1"]), out=tmp_path / "c")
    assert_same_weights(weights(tmp_path / "a"), weights(tmp_path / "b"))
    # Equal weights make equal files, so a release's weights_sha256 identifies the weights themselves.
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert not torch.equal(weights(tmp_path / "a")["0.0.weight"], weights(tmp_path / "c")["0.0.weight"])


def test_an_interrupted_run_resumes_bit_identically(cifar_home, tmp_path, monkeypatch):
    """Stopped as its second epoch starts, then resumed: dropout's random stream, the warmup into the schedule, EMA
    and lookahead weights and the augmentation's streams all come back with the checkpoint, so the run ends on the
    unbroken run's weights and metrics. (test_faults kills real processes at every stage of a run.)"""
    recipe = load_recipe("cifar10net", QUICK)
    train.run(recipe, out=tmp_path / "whole")
    real_epoch = interrupt_as_epoch_starts(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        train.run(recipe, out=tmp_path / "broken")
    monkeypatch.setattr(train, "train_one_epoch", real_epoch)
    assert torch.load(tmp_path / "broken" / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1

    train.run(resume=tmp_path / "broken")
    assert_same_weights(weights(tmp_path / "whole"), weights(tmp_path / "broken"))
    whole, resumed = ([json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                      for name in ("whole", "broken"))
    assert [(r["epoch"], r["train_loss"], r["test_acc"]) for r in resumed] == \
        [(r["epoch"], r["train_loss"], r["test_acc"]) for r in whole]


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(cifar_home, tmp_path, monkeypatch, capsys):
    real_augment = loader.augment

    def poisoned_from_epoch_2(images, cfg, mean, std, generator, flip=None, crop=None):
        out = real_augment(images, cfg, mean, std, generator, flip, crop)
        return out * float("nan") if generator.initial_seed() % 100_003 >= 2 else out
    monkeypatch.setattr(loader, "augment", poisoned_from_epoch_2)
    out = tmp_path / "nan"
    code = main(["train", "--recipe", "cifar10net", "--epochs", "3", "--subset", "500", "--batch-size", "100",
                 "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("cifarkit: error: training diverged: the loss became NaN/inf") and "--lr" in err
    assert err.endswith(f"of epoch 2; lower the learning rate (--lr) or set train.grad_clip; the checkpoint of "
                        f"epoch 1 is kept in {out / 'checkpoints' / 'last.pt'}")
    last = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert last["epoch"] == 1 and all(torch.isfinite(v).all() for v in last["model"].values())
    assert not (out / "model.safetensors").exists()


def test_existing_run_folder_is_never_overwritten(cifar_home, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CifarkitError, match="already holds a run; continue it with --resume"):
        train.run(load_recipe("cifar10net"), out=out)
    assert (out / "notes.txt").read_text() == "mine"


def test_val_split_selects_the_checkpoint_on_single_views_and_reads_the_last_with_tta(cifar_home, tmp_path):
    out = tmp_path / "val"
    summary = train.run(load_recipe("simplecnn", ["train.epochs=3", "data.val_split=200", "data.subset=800",
                                                  "train.tta=true"]), out=out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = max(records, key=lambda r: r["val_acc"])
    assert summary["selected_by"] == "val_acc" and summary["selected_epoch"] == best["epoch"]
    # The last epoch is also read with TTA, as the test set is, and that figure takes no part in the choice.
    assert [("val_tta_acc" in r) for r in records] == [False, False, True]
    assert records[-1]["val_tta_loss"] != records[-1]["val_loss"]


@pytest.mark.skipif(not device.is_x86(), reason="the cap is an x86 instruction set")
def test_a_run_under_an_isa_cap_records_the_cap_beside_the_capped_features(cifar_home, tmp_path, monkeypatch):
    # Imitating an AVX2 CPU on a newer one: config.yaml and train.log say the features are capped, and by what.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    out = tmp_path / "run"
    train.run(load_recipe("simplecnn", ["train.epochs=1", "data.subset=100"]), out=out)
    run = yaml.safe_load((out / "config.yaml").read_text())["run"]
    assert run["isa_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and set(run["cpu_features"]) <= {"avx2"}
    assert "capped by ONEDNN_MAX_CPU_ISA=AVX2" in (out / "train.log").read_text()


def test_eval_command(cifar_home, tmp_path, capsys):
    out = tmp_path / "run"
    summary = train.run(load_recipe("simplecnn", ["train.epochs=1", "data.subset=500"]), out=out)
    assert main(["eval", str(out), "--json", "--precision", summary["precision"]]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["test_acc"] == pytest.approx(summary["test_acc"])
    assert set(result["per_class_acc"]) == set(cifar10.CLASSES)
    assert sum(map(sum, result["confusion_matrix"])) == 500
    assert (out / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", str(out / "model.safetensors"), "--tta"]) == 0
    assert "TTA" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert "no weights at" in capsys.readouterr().err


def test_env_command(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("torch", "cuda_available", "cuda_version", "cudnn_version", "cudnn_enabled", "cpu_bf16", "cpu_features",
                "threads", "gpus", "device"):
        assert key in info, key


def test_the_cpu_evaluates_in_batches_of_its_own_size():
    """Batches that stay in a CPU's caches (engine.EVAL_BATCH_CPU, chosen from results/eval-batch-*.json)."""
    from cifarkit.training.engine import EVAL_BATCH_CPU, evaluate
    seen = []
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    model.register_forward_hook(lambda module, inputs, output: seen.append(len(inputs[0])))
    images = torch.zeros(600, 3, 32, 32, dtype=torch.uint8)
    evaluate(model, images, torch.zeros(600, dtype=torch.long), (0.5,) * 3, (0.25,) * 3, torch.device("cpu"),
             device.PRECISIONS["fp32"])
    size = EVAL_BATCH_CPU
    assert seen == [size] * (600 // size) + [600 % size]
