"""`cifarkit validate` (cifarkit.tools.validation): recipe variants on a validation split, read seed by seed against
the first, from real training runs; finished runs are read again rather than retrained, a folder of another recipe
is refused, and a bad variant is named before anything trains."""
import json
import logging
from pathlib import Path

import pytest

from cifarkit.cli import main
from cifarkit.tools import validation

COMMON = ["train.epochs=1", "data.subset=300"]


def error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def trained(caplog) -> list[str]:
    """The runs the last command trained, in their order."""
    names = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("training ")]
    caplog.clear()
    return names


def test_variants_are_read_against_the_first_on_each_seed(cifar_home, tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="cifarkit")
    argv = ["validate", "--recipe", "simplecnn", "--val-split", "100", "--seeds", "0", "1", "--variant", "base",
            *COMMON, "--variant", "slow", *COMMON, "optim.lr=1e-5", "--runs-dir", "runs", "--json", "out.json"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # The variants take turns: seed 1 starts with the second.
    assert trained(caplog) == ["base-s0:", "slow-s0:", "slow-s1:", "base-s1:"]
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
    assert printed.splitlines()[-1] == "wrote out.json"
    # What lab/render_readme.py's validation block reads, and the command as typed.
    assert result["command"] == "cifarkit " + " ".join(argv)
    assert result["measured"].endswith("+00:00") and result["val_split"] == 100 and result["recipe"] == "simplecnn"
    assert result["written_at_commit"] == result["source"]["commit"][:7] and base["runs"]["0"]["precision"]
    assert {"environment", "cpu_kind"} <= set(result)

    assert main(argv) == 0  # the same sweep again: every run is read from its folder
    assert trained(caplog) == []
    assert json.loads((tmp_path / "out.json").read_text())["variants"][1]["runs"] == slow["runs"]

    # A run slowed by another job, made by rewriting the records of finished runs: a real one cannot be slowed on
    # cue. Its time is left out of the time columns; its accuracy stands.
    for folder in (tmp_path / "runs").iterdir():
        rate = 1000.0 * (validation.SLOWED_BELOW / 2 if folder.name == "slow-s1" else 1)
        records = [{**json.loads(line), "images_per_s": rate} for line in (folder / "metrics.jsonl").read_text()
                   .splitlines()]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = validation.run("simplecnn", [["base", *COMMON], ["slow", *COMMON, "optim.lr=1e-5"]], [0, 1], 100,
                            Path("runs"))
    base, slow = report["variants"]
    assert [run["slowed"] for run in slow["runs"].values()] == [False, True] and slow["time_seeds"] == [0]
    assert slow["mean_train_time_s"] == slow["runs"]["0"]["train_time_s"]
    assert slow["train_time_over_first"] == slow["runs"]["0"]["train_time_s"] / base["runs"]["0"]["train_time_s"]
    assert slow["accuracy_minus_first"] == pytest.approx(
        sum(slow["runs"][s]["val_acc"] - base["runs"][s]["val_acc"] for s in ("0", "1")) / 2)
    assert report["table"][-1].endswith(f"| {slow['train_time_over_first']:.3f} (0) |")

    argv[argv.index("optim.lr=1e-5")] = "optim.lr=1e-4"
    assert main(argv) == 2
    assert error_line(capsys).startswith(
        "cifarkit: error: runs/slow-s0 holds a run of another recipe (optim.lr differ); give another --runs-dir")


def test_a_failed_run_is_named(cifar_home, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "--recipe", "simplecnn", "--val-split", "100", "--seeds", "0", "--variant", "base",
                 "data.subset=100000", "--runs-dir", "runs", "--json", "out.json"]) == 2
    line = error_line(capsys)
    assert line.startswith("cifarkit: error: training base-s0 failed: ") and \
        "subset 100000 is larger than the 1900 training" in line
    assert not (tmp_path / "out.json").exists()


@pytest.mark.unit
@pytest.mark.parametrize("variants, seeds, expected", [
    (["--variant", "base", "--variant", "typo", "train.epoch=5"], ["0"],
     "cifarkit: error: variant typo: unknown key 'train.epoch'; valid keys here: train.epochs, "),
    (["--variant", "base", "train.epochs=0"], ["0"],
     "cifarkit: error: variant base: bad value for train.epochs: 0 (must be > 0 and finite)"),
    (["--variant", "a", "--variant", "a"], ["0"], "cifarkit: error: variant names repeat (a, a); give each once"),
    (["--variant", "base"], ["0", "0"], "cifarkit: error: seeds repeat (0, 0); give each once"),
    (["--variant", "base"], ["4294967296"], "cifarkit: error: bad value for --seeds: 4294967296 (a seed is a whole "
                                            "number from 0 to 4,294,967,295)"),
], ids=["unknown-key", "bad-value", "names-repeat", "seeds-repeat", "seed-too-large"])
def test_a_bad_variant_or_seed_is_named_before_anything_trains(tmp_path, capsys, monkeypatch, variants, seeds,
                                                               expected):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "--recipe", "simplecnn", "--seeds", *seeds, *variants, "--json", "out.json"]) == 2
    assert error_line(capsys).startswith(expected)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_help_names_the_options_and_a_missing_one_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["validate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert done.value.code == 0 and "compare each with the first (never reads the test set)" in out
    assert all(option in out for option in ("--recipe", "--val-split", "--seeds", "--variant", "--runs-dir", "--json"))
    with pytest.raises(SystemExit) as done:
        main(["validate", "--json", "out.json"])
    assert done.value.code == 2
    assert error_line(capsys) == "cifarkit validate: error: the following arguments are required: --variant"
    with pytest.raises(SystemExit):
        main(["validate", "--variant", "base", "--json", "out.json", "--val-split", "0"])
    assert error_line(capsys) == ("cifarkit validate: error: argument --val-split: must be at least 1 (images held "
                                  "out to validate on), got 0")
