"""lab/validation_runs.py: recipe variants on a validation split, read seed by seed against the first, from
real training runs; finished runs are read again rather than retrained, and a folder of another recipe is refused."""
import json

import pytest

from conftest import ROOT, load_script

validation = load_script(ROOT / "lab" / "validation_runs.py")


def test_variants_are_read_against_the_first_on_each_seed(cifar_home, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ["train.epochs=1", "data.subset=300"]
    argv = ["--recipe", "simplecnn", "--val-split", "100", "--seeds", "0", "1", "--variant", "base", *common,
            "--variant", "slow", *common, "optim.lr=1e-5", "--runs-dir", "runs", "--json", "out.json"]
    validation.main(argv)
    printed = capsys.readouterr().out
    # The variants take turns: seed 1 starts with the second.
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("training")] == [
        "base-s0:", "slow-s0:", "slow-s1:", "base-s1:"]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["accuracy"] == "val_acc" and result["seeds"] == [0, 1]  # simplecnn has no TTA
    base, slow = result["variants"]
    for variant in (base, slow):
        for seed, run in variant["runs"].items():
            last = json.loads((tmp_path / "runs" / f"{variant['name']}-s{seed}" / "metrics.jsonl").read_text()
                              .splitlines()[-1])
            assert run["val_acc"] == last["val_acc"] and run["val_loss"] == last["val_loss"] and "test_acc" not in run
    assert base["accuracy_minus_first"] == 0
    assert base["train_time_over_first"] == (1 if base["time_seeds"] else None)  # 300-image runs time noisily
    differences = [slow["runs"][s]["val_acc"] - base["runs"][s]["val_acc"] for s in ("0", "1")]
    assert slow["accuracy_minus_first"] == pytest.approx(sum(differences) / 2)
    # Two seeds: the t-interval's half width is 12.71 x |d0 - d1| / 2 (the differences' stdev over sqrt 2).
    low, high = slow["accuracy_minus_first_ci95"]
    assert (high - low) / 2 == pytest.approx(12.706 * abs(differences[0] - differences[1]) / 2, rel=1e-3)
    assert base["accuracy_minus_first_ci95"] is None
    # The loss of the same logits, read the same way.
    loss_differences = [slow["runs"][s]["val_loss"] - base["runs"][s]["val_loss"] for s in ("0", "1")]
    assert slow["loss_minus_first"] == pytest.approx(sum(loss_differences) / 2) and base["loss_minus_first"] == 0
    low, high = slow["loss_minus_first_ci95"]
    assert low <= slow["loss_minus_first"] <= high and base["loss_minus_first_ci95"] is None
    assert f"| {100 * slow['accuracy_minus_first']:+.2f} ({100 * slow['accuracy_minus_first_ci95'][0]:+.2f} to " \
        in printed and f"| {slow['loss_minus_first']:+.4f} ({low:+.4f} to {high:+.4f}) |" in printed
    assert "| slow train.epochs=1 data.subset=300 optim.lr=1e-5 |" in printed and result["table"][-1] in printed
    assert result["command"].endswith("--runs-dir runs --json out.json")

    validation.main(argv)  # the same sweep again: every run is read from its folder
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("training")]
    assert json.loads((tmp_path / "out.json").read_text())["variants"][1]["runs"] == slow["runs"]

    # A run slowed by another job, made by rewriting the records of finished runs: a real one cannot be slowed on
    # cue. Its time is left out of the time columns; its accuracy stands.
    for folder in (tmp_path / "runs").iterdir():
        rate = 400.0 if folder.name == "slow-s1" else 1000.0
        records = [{**json.loads(line), "images_per_s": rate} for line in (folder / "metrics.jsonl").read_text()
                   .splitlines()]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    validation.main(argv)
    printed = capsys.readouterr().out
    base, slow = json.loads((tmp_path / "out.json").read_text())["variants"]
    assert [run["slowed"] for run in slow["runs"].values()] == [False, True] and slow["time_seeds"] == [0]
    assert slow["mean_train_time_s"] == slow["runs"]["0"]["train_time_s"]
    assert slow["train_time_over_first"] == slow["runs"]["0"]["train_time_s"] / base["runs"]["0"]["train_time_s"]
    assert slow["accuracy_minus_first"] == pytest.approx(
        sum(slow["runs"][s]["val_acc"] - base["runs"][s]["val_acc"] for s in ("0", "1")) / 2)
    assert printed.splitlines()[-1].endswith(f"| {slow['train_time_over_first']:.3f} (0) |")

    argv[argv.index("optim.lr=1e-5")] = "optim.lr=1e-4"
    with pytest.raises(SystemExit, match=r"runs/slow-s0 holds a run of another recipe \(optim.lr differ"):
        validation.main(argv)


def test_a_bad_variant_or_a_failed_run_is_named(cifar_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--recipe", "simplecnn", "--val-split", "100", "--seeds", "0", "--runs-dir", "runs", "--json", "out.json"]
    with pytest.raises(SystemExit, match=r"^variant base: bad value for train.epochs: 0 \(must be > 0 and finite\)$"):
        validation.main(argv + ["--variant", "base", "train.epochs=0"])
    with pytest.raises(SystemExit, match=r"^training base-s0 failed: .*subset 100000 is larger than the 1900 training"):
        validation.main(argv + ["--variant", "base", "data.subset=100000"])
    assert not (tmp_path / "out.json").exists()
