"""lab/compare_reference.py's parts that need no reference: the order of the rounds, the ratios' interval, the
check of the user's airbench94_muon.py, and the README block rendered from a JSON the script wrote (a real run on
2,000 images, tests/fixtures/compare-reference-subset.json). The references themselves are not run here: airbench94_muon
is not in the repository, and a full comparison takes hours on this CPU."""
from __future__ import annotations

import json

import pytest
from scipy import stats

from conftest import ROOT, load_script

pytestmark = pytest.mark.unit

compare = load_script(ROOT / "lab" / "compare_reference.py")
render = load_script(ROOT / "lab" / "render_readme.py")


def test_rounds_alternate_abba():
    assert compare.round_orders(["cifarkit", "muon"], 4) == [["cifarkit", "muon"], ["muon", "cifarkit"],
                                                              ["cifarkit", "muon"], ["muon", "cifarkit"]]
    assert compare.round_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["c", "b", "a"]]


def test_ratio_interval_is_the_t_interval_of_the_per_round_ratios():
    ratios = [1.2, 1.4, 1.3]
    result = compare.ratio_statistics(ratios)
    half = stats.t.ppf(0.975, 2) * 0.1 / 3 ** 0.5
    assert result["mean"] == pytest.approx(1.3)
    assert result["ci95"] == pytest.approx([1.3 - half, 1.3 + half])
    assert compare.ratio_statistics([1.25])["ci95"] is None


def test_muon_file_is_required_and_checked(tmp_path):
    with pytest.raises(SystemExit, match="curl -LO https://raw.githubusercontent.com/KellerJordan"):
        compare.check_muon_file(None)
    with pytest.raises(SystemExit, match="no such file"):
        compare.check_muon_file(str(tmp_path / "airbench94_muon.py"))
    wrong = tmp_path / "other.py"
    wrong.write_text("class CifarNet:\n    pass\n")
    with pytest.raises(SystemExit, match="does not look like airbench94_muon.py .*Muon, main"):
        compare.check_muon_file(str(wrong))


def test_readme_block_renders_a_real_result(tmp_path, monkeypatch):
    result = json.loads((ROOT / "tests" / "fixtures" / "compare-reference-subset.json").read_text())
    (tmp_path / "compare-reference-subset.json").write_text(json.dumps(result))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    block = render.reference_block()
    muon = result["references"]["airbench94_muon"]
    assert "not a comparison" in block
    row = next(line for line in block.splitlines() if line.startswith("| airbench94_muon"))
    assert f"{muon['speedup']['whole_process']['mean']:.2f}x" in row
    assert f"{100 * muon['accuracy']['mean']:.2f}%" in row
    assert f"{100 * result['cifarkit']['accuracy_6_views']['mean']:.2f}%" in block
    assert "airbench94_muon: float32, Newton-Schulz float32, tcmalloc, 2 threads" in block


def test_the_block_gives_the_accuracy_difference_with_its_interval_where_there_are_rounds_enough():
    result = json.loads((ROOT / "tests" / "fixtures" / "compare-reference-subset.json").read_text())
    ours, theirs = result["cifarkit"]["runs"][0], result["references"]["airbench94_muon"]["runs"][0]
    one_round = (f"Mean test accuracy, `fast` minus airbench94_muon: "
                 f"its own TTA {100 * (ours['test_acc'] - theirs['test_acc']):+.2f} points; "
                 f"6 views {100 * (ours['test_acc_6_views'] - theirs['test_acc']):+.2f} points.")
    assert one_round in render._reference_comparison(result)
    # Three and four runs whose Welch interval is +0.10 to +0.90 points (tests/test_fast.py checks the arithmetic).
    result["cifarkit"]["runs"] = [{**ours, "test_acc": a, "test_acc_6_views": a} for a in (0.941, 0.943, 0.939)]
    result["references"]["airbench94_muon"]["runs"] = [{**theirs, "test_acc": a}
                                                       for a in (0.937, 0.935, 0.934, 0.938)]
    assert ("its own TTA +0.50 points (95% Welch interval +0.10 to +0.90); 6 views +0.50 points (95% Welch "
            "interval +0.10 to +0.90)." in render._reference_comparison(result))


SETTINGS = {"recipe": "fast", "references": ["airbench94_muon"], "first_seed": 0, "subset": None, "cpu_kind": "avx2",
            "processor": "AMD EPYC", "threads": 2, "precision_policy": "fp32", "newton_schulz_dtype": "float32",
            "preloaded_by_all": "libtcmalloc_minimal.so.4", "muon_sha256": "704e2925",
            "code": {"commit": "a958d0b", "src_tree": "1" * 40, "src_modified": False}}


def fake_side(side, seed):
    """A side's row as a timed process reports it. The references cannot run here (see the module's docstring):
    these rows stand in for them, to test the rounds' bookkeeping only."""
    seconds = 100.0 + seed if side == "cifarkit" else 130.0 + seed
    return {"seed": seed, "wall_time_s": seconds, "train_time_s": seconds - 5, "test_acc": 0.94,
            "test_acc_6_views": 0.94}


def test_a_later_command_runs_only_the_missing_rounds_in_abba_order(tmp_path):
    sides, saved = ["cifarkit", "airbench94_muon"], []
    rounds = []
    compare.complete_rounds(rounds, sides, 1, 0, fake_side, save=lambda: saved.append(len(rounds)), commit="a958d0b")
    assert saved == [1]
    compare.complete_rounds(rounds, sides, 3, 0, fake_side, save=lambda: saved.append(len(rounds)), commit="c000000")
    assert saved == [1, 2, 3]
    assert [r["commit"] for r in rounds] == ["a958d0b", "c000000", "c000000"]
    assert [r["order"] for r in rounds] == compare.round_orders(sides, 3)
    assert [r["seed"] for r in rounds] == [0, 1, 2]
    muon_file = tmp_path / "airbench94_muon.py"
    muon_file.write_text("# the user's copy\n")
    summary = compare.summarize(rounds, ["airbench94_muon"], muon_file)
    assert summary["orders"] == compare.round_orders(sides, 3)
    ratios = summary["references"]["airbench94_muon"]["speedup"]["whole_process"]["per_round"]
    assert ratios == pytest.approx([130 / 100, 131 / 101, 132 / 102])


def test_a_stopped_command_keeps_the_rounds_that_finished():
    rounds, saved = [], []

    def dies_in_round_two(side, seed):
        if seed == 1:
            raise KeyboardInterrupt
        return fake_side(side, seed)
    with pytest.raises(KeyboardInterrupt):
        compare.complete_rounds(rounds, ["cifarkit", "airbench94_muon"], 3, 0, dies_in_round_two,
                                save=lambda: saved.append([r["seed"] for r in rounds]), commit="a958d0b")
    assert saved == [[0]] and len(rounds) == 1


def test_rounds_are_kept_only_from_the_same_comparison(tmp_path):
    path = tmp_path / "compare.json"
    assert compare.kept_rounds(str(path), SETTINGS) == []
    rounds = [{"seed": 0, "order": ["cifarkit", "airbench94_muon"], "runs": {}, "finished": "2026-12-03T23:50:00"}]
    path.write_text(json.dumps({"settings": SETTINGS, "rounds": rounds}))
    assert compare.kept_rounds(str(path), json.loads(json.dumps(SETTINGS))) == rounds
    later = {**SETTINGS, "code": {**SETTINGS["code"], "commit": "c000000"}}  # a later commit, the same src/ tree
    assert compare.kept_rounds(str(path), later) == rounds and later["code"]["commit"] == "a958d0b"
    with pytest.raises(SystemExit, match=r"another comparison \(it differs in threads\); give another --json"):
        compare.kept_rounds(str(path), {**SETTINGS, "threads": 1})
    other_code = {**SETTINGS, "code": {"commit": "b000000", "src_tree": "2" * 40, "src_modified": False}}
    with pytest.raises(SystemExit, match=r"differs in src/ \(commit a958d0b then, b000000 now\)"):
        compare.kept_rounds(str(path), other_code)
    with pytest.raises(SystemExit, match="src/ has uncommitted changes"):
        compare.kept_rounds(str(path), {**SETTINGS, "code": {**SETTINGS["code"], "src_modified": True}})
    path.write_text(json.dumps({"cifarkit": {}, "references": {}}))
    with pytest.raises(SystemExit, match="earlier version of this script"):
        compare.kept_rounds(str(path), SETTINGS)


def test_the_table_names_the_code_and_when_each_round_finished():
    result = json.loads((ROOT / "tests" / "fixtures" / "compare-reference-subset.json").read_text())
    assert "src/ at commit" not in render._reference_comparison(result)  # written before rounds were recorded
    rounds = [{"finished": "2026-12-03T23:50:00+00:00"}, {"finished": "2026-12-04T09:10:00+00:00"}]
    block = render._reference_comparison({**result, "settings": SETTINGS, "rounds": rounds})
    assert ("cifarkit's src/ at commit a958d0b; the rounds finished at 2026-12-03 23:50:00, 2026-12-04 09:10:00 UTC."
            in block)
    rounds[1]["commit"] = "c000000"  # a later checkout of the same src/ added the round (older files record none)
    block = render._reference_comparison({**result, "settings": SETTINGS, "rounds": rounds})
    assert "finished at 2026-12-03 23:50:00, 2026-12-04 09:10:00 (run from c000000) UTC." in block


def test_an_unfinished_comparison_says_how_many_rounds_it_holds_and_how_to_finish():
    result = json.loads((ROOT / "tests" / "fixtures" / "compare-reference-subset.json").read_text())
    rounds = [{"finished": "2026-12-04T16:10:00+00:00"}, {"finished": "2026-12-04T17:25:00+00:00"}]
    asked_three = {**result, "settings": SETTINGS, "rounds": rounds,
                   "command": result["command"].replace("--runs 1", "--runs 3")}
    assert ("Unfinished: 2 of the command's 3 rounds so far. The same command"
            in render._reference_comparison(asked_three))
    assert "Unfinished" not in render._reference_comparison({**asked_three, "rounds": rounds * 2})
    assert "Unfinished" not in render._reference_comparison(result)  # the first form records no rounds


def test_a_variant_is_checked_first_trained_as_set_kept_apart_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["compare_reference.py", "--references", "airbench94", "--set", "train.epochs=x"])
    with pytest.raises(SystemExit, match=r"--recipe fast --set train.epochs=x: bad value for train.epochs"):
        compare.main()

    commands = []

    def stop(command, env):
        commands.append(command)
        raise RuntimeError("not trained here")
    monkeypatch.setattr(compare, "timed", stop)
    with pytest.raises(RuntimeError):
        compare.cifarkit_run("fast", ["train.epochs=7.59", "train.tta=false"], 3, None, tmp_path, {})
    assert commands[0][-4:] == ["--set", "train.epochs=7.59", "--set", "train.tta=false"]

    path = tmp_path / "compare.json"
    variant_settings = {**SETTINGS, "overrides": ["train.epochs=7.59"]}
    path.write_text(json.dumps({"settings": variant_settings, "rounds": [{"seed": 0}]}))
    with pytest.raises(SystemExit, match=r"it differs in overrides"):
        compare.kept_rounds(str(path), SETTINGS)
    assert compare.kept_rounds(str(path), json.loads(json.dumps(variant_settings))) == [{"seed": 0}]

    result = json.loads((ROOT / "tests" / "fixtures" / "compare-reference-subset.json").read_text())
    result["overrides"] = ["train.epochs=7.59"]
    block = render._reference_comparison(result)
    assert "| `cifarkit train --recipe fast --set train.epochs=7.59` |" in block
    assert "Mean test accuracy, `fast --set train.epochs=7.59` minus airbench94_muon" in block
    assert render._side_of(result) == "`fast` with `train.epochs=7.59`"
    assert render._side_of({**result, "overrides": []}) == "`fast`"
