"""`cifarkit reference`'s parts that need no reference: the order of the rounds, the ratios' interval, the checks
of what the user gives, the results file and the printed summary, each ratio beside its accuracy difference (built
from a real run on 2,000 images, tests/fixtures/compare-reference-subset.json), and the files that earlier
versions wrote. The references themselves are not run here: airbench94_muon is not in the repository, and a full
comparison takes hours on this CPU. The README block rendered from these files is lab/tests' to test."""
from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta

import pytest
from scipy import stats

from cifarkit.cli.main import main
from cifarkit.core.errors import CifarkitError
from cifarkit.tools import reference
from cifarkit.tools.speedrun import describe_difference, difference_of_means
from conftest import ROOT

pytestmark = pytest.mark.unit

MUON, RECORD = reference.MUON, reference.RECORD
FIXTURE = ROOT / "tests" / "fixtures" / "compare-reference-subset.json"
SETTINGS = {"recipe": "fast", "references": ["airbench94_muon"], "first_seed": 0, "subset": None, "cpu_kind": "avx2",
            "processor": "AMD EPYC", "threads": 2, "precision_policy": "fp32", "newton_schulz_dtype": "float32",
            "preloaded_by_all": "libtcmalloc_minimal.so.4", "muon_sha256": "704e2925",
            "code": {"commit": "a958d0b", "src_tree": "1" * 40, "src_modified": False}}


def error_line(capsys) -> str:
    """The command's error: one line on stderr."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_rounds_alternate_abba():
    assert reference.round_orders(["cifarkit", "muon"], 4) == [["cifarkit", "muon"], ["muon", "cifarkit"],
                                                                ["cifarkit", "muon"], ["muon", "cifarkit"]]
    assert reference.round_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["c", "b", "a"]]


def test_ratio_interval_is_the_t_interval_of_the_per_round_ratios():
    ratios = [1.2, 1.4, 1.3]
    result = reference.ratio_statistics(ratios)
    half = stats.t.ppf(0.975, 2) * 0.1 / 3 ** 0.5
    assert result["mean"] == pytest.approx(1.3)
    assert result["ci95"] == pytest.approx([1.3 - half, 1.3 + half])
    assert reference.ratio_statistics([1.25])["ci95"] is None


@pytest.mark.parametrize("name, repository", [(MUON, "KellerJordan"), (RECORD, "hiverge")])
def test_a_user_copy_is_required_and_checked(tmp_path, name, repository):
    copy = reference.USER_COPIES[name]
    with pytest.raises(CifarkitError, match=f"curl -LO https://raw.githubusercontent.com/{repository}"):
        copy.check(None)
    with pytest.raises(CifarkitError, match="no such file"):
        copy.check(str(tmp_path / f"{name}.py"))
    wrong = tmp_path / "other.py"
    wrong.write_text("class CifarNet:\n    pass\n")
    with pytest.raises(CifarkitError, match=f"does not look like {name}.py .*Muon, main"):
        copy.check(str(wrong))


def test_the_command_has_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["reference", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "time a recipe against the published CIFAR-10 speedruns" in out
    assert all(option in out for option in ("--muon", "--record", "--references", "--runs", "--first-seed",
                                            "--recipe", "--set", "--bracket-epochs", "--subset", "--json"))


def test_a_bad_reference_file_is_one_line_that_names_the_problem_and_the_fix(tmp_path, capsys):
    fetch = f"download it with `curl -LO {reference.USER_COPIES[MUON].url}` and pass --muon airbench94_muon.py"
    missing = tmp_path / "airbench94_muon.py"
    assert main(["reference", "--muon", str(missing)]) == 2
    assert error_line(capsys) == f"cifarkit: error: --muon {missing}: no such file; {fetch}"
    other = tmp_path / "other.py"
    other.write_text("def main():\n    pass\n")
    assert main(["reference", "--muon", str(other)]) == 2
    assert error_line(capsys) == (f"cifarkit: error: --muon {other} does not look like airbench94_muon.py (no "
                                  f"CifarNet, CifarLoader, Muon, evaluate, zeropower_via_newtonschulz5); {fetch}")
    assert main(["reference"]) == 2
    assert error_line(capsys).startswith("cifarkit: error: airbench94_muon (Jordan's 2024 record) is not a "
                                         "package: download it with `curl -LO ")
    assert main(["reference", "--references", RECORD]) == 2
    assert "cifar10_speedrun (the Hive's 2025 record) is not a package" in error_line(capsys)
    assert main(["reference", "--references", "airbench95"]) == 2
    assert error_line(capsys) == ("cifarkit: error: --references airbench95: no such reference; choose from "
                                  "airbench94_muon, cifar10_speedrun, airbench94")


def fake_side(side, seed):
    """A side's row as a timed process reports it. The references cannot run here (see the module's docstring):
    these rows stand in for them, to test the rounds' bookkeeping only."""
    seconds = 100.0 + seed if side == "cifarkit" else 130.0 + seed
    accuracy = (0.94 if side == "cifarkit" else 0.935) + 0.001 * seed
    return {"seed": seed, "wall_time_s": seconds, "train_time_s": seconds - 5, "test_acc": accuracy,
            "test_acc_6_views": accuracy}


def test_a_later_command_runs_only_the_missing_rounds_in_abba_order(tmp_path):
    sides, saved = ["cifarkit", "airbench94_muon"], []
    rounds = []
    reference.complete_rounds(rounds, sides, 1, 0, fake_side, save=lambda: saved.append(len(rounds)),
                              commit="a958d0b")
    assert saved == [1]
    reference.complete_rounds(rounds, sides, 3, 0, fake_side, save=lambda: saved.append(len(rounds)),
                              commit="c000000")
    assert saved == [1, 2, 3]
    assert [r["commit"] for r in rounds] == ["a958d0b", "c000000", "c000000"]
    assert [r["order"] for r in rounds] == reference.round_orders(sides, 3)
    assert [r["seed"] for r in rounds] == [0, 1, 2]
    muon_file = tmp_path / "airbench94_muon.py"
    muon_file.write_text("# the user's copy\n")
    summary = reference.summarize(rounds, ["airbench94_muon"], {MUON: muon_file}, None)
    assert summary["orders"] == reference.round_orders(sides, 3)
    ratios = summary["references"]["airbench94_muon"]["speedup"]["whole_process"]["per_round"]
    assert ratios == pytest.approx([130 / 100, 131 / 101, 132 / 102])


def test_a_stopped_command_keeps_the_rounds_that_finished():
    rounds, saved = [], []

    def dies_in_round_two(side, seed):
        if seed == 1:
            raise KeyboardInterrupt
        return fake_side(side, seed)
    with pytest.raises(KeyboardInterrupt):
        reference.complete_rounds(rounds, ["cifarkit", "airbench94_muon"], 3, 0, dies_in_round_two,
                                  save=lambda: saved.append([r["seed"] for r in rounds]), commit="a958d0b")
    assert saved == [[0]] and len(rounds) == 1


def test_a_round_is_saved_before_its_lines_announce_it(caplog):
    # A kill sent as "round N:" appears (a watcher stopping after a round) must find round N on disk.
    rounds, events = [], []
    with caplog.at_level(logging.INFO, logger=reference.log.name):
        reference.complete_rounds(rounds, ["cifarkit", "airbench94_muon"], 1, 0, fake_side,
                                  save=lambda: events.append(("saved", len(caplog.records))), commit="a958d0b")
    announced = [i for i, r in enumerate(caplog.records) if r.getMessage().startswith("round 1: cifarkit")]
    assert announced and events == [("saved", announced[0])]


def test_rounds_are_kept_only_from_the_same_comparison(tmp_path):
    path = tmp_path / "compare.json"
    assert reference.kept_rounds(str(path), SETTINGS) == []
    rounds = [{"seed": 0, "order": ["cifarkit", "airbench94_muon"], "runs": {}, "finished": "2026-12-03T23:50:00"}]
    path.write_text(json.dumps({"settings": SETTINGS, "rounds": rounds}))
    assert reference.kept_rounds(str(path), json.loads(json.dumps(SETTINGS))) == rounds
    later = {**SETTINGS, "code": {**SETTINGS["code"], "commit": "c000000"}}  # a later commit, the same src/ tree
    assert reference.kept_rounds(str(path), later) == rounds and later["code"]["commit"] == "a958d0b"
    with pytest.raises(CifarkitError, match=r"another comparison \(it differs in threads\); give another --json"):
        reference.kept_rounds(str(path), {**SETTINGS, "threads": 1})
    other_code = {**SETTINGS, "code": {"commit": "b000000", "src_tree": "2" * 40, "src_modified": False}}
    with pytest.raises(CifarkitError, match=r"differs in src/ \(commit a958d0b then, b000000 now\)"):
        reference.kept_rounds(str(path), other_code)
    with pytest.raises(CifarkitError, match="src/ has uncommitted changes"):
        reference.kept_rounds(str(path), {**SETTINGS, "code": {**SETTINGS["code"], "src_modified": True}})
    path.write_text(json.dumps({"cifarkit": {}, "references": {}}))
    with pytest.raises(CifarkitError, match="earlier version of the comparison"):
        reference.kept_rounds(str(path), SETTINGS)
    path.write_text("{not json")
    with pytest.raises(CifarkitError, match="is not a comparison's results"):
        reference.kept_rounds(str(path), SETTINGS)


def test_a_variant_is_checked_first_trained_as_set_and_kept_apart(tmp_path, capsys, monkeypatch):
    assert main(["reference", "--references", "airbench94", "--set", "train.epochs=x"]) == 2
    assert error_line(capsys).startswith("cifarkit: error: --recipe fast --set train.epochs=x: bad value for "
                                         "train.epochs")

    commands = []

    def stop(command, env):
        commands.append(command)
        raise RuntimeError("not trained here")
    monkeypatch.setattr(reference, "timed", stop)
    with pytest.raises(RuntimeError):
        reference.cifarkit_run("fast", ["train.epochs=7.59", "train.tta=false"], 3, None, tmp_path, {})
    assert commands[0][-4:] == ["--set", "train.epochs=7.59", "--set", "train.tta=false"]

    path = tmp_path / "compare.json"
    variant_settings = {**SETTINGS, "overrides": ["train.epochs=7.59"]}
    path.write_text(json.dumps({"settings": variant_settings, "rounds": [{"seed": 0}]}))
    with pytest.raises(CifarkitError, match=r"it differs in overrides"):
        reference.kept_rounds(str(path), SETTINGS)
    assert reference.kept_rounds(str(path), json.loads(json.dumps(variant_settings))) == [{"seed": 0}]


def rounds_of(ours: list[float], theirs: list[float], speedup: float) -> list[dict]:
    """Rounds built from the fixture's real rows, with these accuracies, and the reference `speedup` times slower."""
    fixture = json.loads(FIXTURE.read_text())
    mine, muon = fixture["cifarkit"]["runs"][0], fixture["references"][MUON]["runs"][0]
    orders = reference.round_orders(["cifarkit", MUON], len(ours))
    return [{"seed": seed, "order": order, "commit": "a958d0b", "finished": "2026-12-04T09:10:00+00:00",
             "runs": {"cifarkit": {**mine, "seed": seed, "test_acc": a, "test_acc_6_views": a},
                      MUON: {**muon, "seed": seed, "test_acc": b, "wall_time_s": speedup * mine["wall_time_s"],
                             "train_time_s": speedup * mine["train_time_s"]}}}
            for seed, (order, a, b) in enumerate(zip(orders, ours, theirs))]


def comparison(rounds: list[dict], tmp_path, settings: dict = SETTINGS) -> dict:
    files = {}
    for name in reference.USER_COPIES:  # the user's copies, of every reference that is one
        files[name] = tmp_path / f"{name}.py"
        files[name].write_text("# the user's copy\n")
    environment = json.loads(FIXTURE.read_text())["environment"]
    command = "cifarkit reference --muon airbench94_muon.py --references airbench94_muon --runs 3 --json r.json"
    return reference.results(rounds, json.loads(json.dumps(settings)), environment, command, files)


def test_every_ratio_stands_beside_the_accuracy_difference_and_the_goal_is_judged_in_words(tmp_path):
    ours, theirs = [0.941, 0.943, 0.939], [0.937, 0.935, 0.934]
    difference = difference_of_means(ours, theirs)
    rounds = rounds_of(ours, theirs, 1.4)
    result = comparison(rounds, tmp_path)
    muon = result["references"][MUON]
    assert muon["accuracy_difference"] == difference and difference["ci95"] is not None
    assert muon["speedup"]["whole_process"]["mean"] == pytest.approx(1.4)
    assert result["verdict"] == "met"
    assert result["command"].startswith("cifarkit reference ")
    assert datetime.fromisoformat(result["measured"]).utcoffset() == timedelta(0)
    assert result["settings"]["code"]["commit"] == "a958d0b" and result["rounds"] == rounds

    printed = reference.table(result).splitlines()
    row = next(line for line in printed if line.startswith(f"| {MUON} |"))
    assert "| 1.40x (1.40-1.40) |" in row and row.endswith(f"| {describe_difference(difference)} |")
    assert "95% Welch interval" in row
    assert (f"--recipe fast against {MUON}: 1.40x as fast (whole process), mean test accuracy "
            f"{describe_difference(difference)}") in printed
    assert printed[-1] == (f"goals (--recipe fast >= 1.3x {MUON} and 1.25x {RECORD}, whole process, at equal "
                           f"accuracy): met")
    round_line = reference.round_lines(rounds, [MUON])[0]
    assert round_line.startswith(f"round 3: cifarkit 1.40x as fast as {MUON}, whole process (1.40x training)")
    assert round_line.endswith(f"cifarkit minus {MUON}: {describe_difference(difference)}")

    slower = comparison(rounds_of(ours, theirs, 1.2), tmp_path)
    assert slower["verdict"] == f"not met: {MUON}: 1.20x as fast, under 1.3x"
    lower = comparison(rounds_of(theirs, ours, 1.2), tmp_path)
    shortfall = (f"not met: {MUON}: 1.20x as fast, under 1.3x and mean accuracy {100 * difference['difference']:.2f} "
                 f"points lower")
    assert lower["verdict"] == shortfall and reference.table(lower).endswith(f"accuracy): {shortfall}")
    subset = comparison(rounds[:1], tmp_path, {**SETTINGS, "subset": 2000})
    assert subset["verdict"] == "not judged: trained on 2,000 images only, a check that every side runs"
    assert subset["references"][MUON]["accuracy_difference"]["ci95"] is None


def test_a_comparison_is_resumed_from_its_results_file(tmp_path):
    path = tmp_path / "compare.json"
    result = comparison(rounds_of([0.94], [0.93], 1.4), tmp_path)
    path.write_text(json.dumps(result))
    settings = json.loads(json.dumps(SETTINGS))
    assert reference.kept_rounds(str(path), settings) == result["rounds"]


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "results").rglob("compare-reference*.json")
                                        if "settings" in json.loads(p.read_text())),
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_results_that_earlier_versions_wrote_are_still_read(path, tmp_path):
    """A file that `python scripts/compare_reference.py` or `python lab/compare_reference.py` wrote: its rounds are
    kept, and give the figures it holds."""
    written = json.loads(path.read_text())
    settings = json.loads(json.dumps(written["settings"]))
    assert reference.kept_rounds(str(path), settings) == written["rounds"]
    result = comparison(written["rounds"], tmp_path, settings)
    for name, side in written["references"].items():
        again = result["references"][name]
        for timer, ratio in side["speedup"].items():
            assert again["speedup"][timer]["per_round"] == pytest.approx(ratio["per_round"])
        assert again["accuracy"]["mean"] == pytest.approx(side["accuracy"]["mean"])
    six_views = written["cifarkit"]["accuracy_6_views"]["mean"]
    assert result["cifarkit"]["accuracy_6_views"]["mean"] == pytest.approx(six_views)
    assert result["verdict"].startswith(("met", "not met: ", "not judged: "))
