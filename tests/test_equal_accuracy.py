"""The speed-up at equal accuracy (cifarkit.tools.equal_accuracy) and the comparison's budgets and verdict around
it, on rounds whose accuracies and times are chosen so that the answer is known: the interpolation, its bootstrap
interval over the rounds, an extended line flagged, and no figure where the accuracy does not grow with the epochs."""
from __future__ import annotations

import json

import pytest

from cifarkit.core.errors import CifarkitError
from cifarkit.tools import equal_accuracy, reference

pytestmark = pytest.mark.unit

MUON, RECORD = reference.MUON, reference.RECORD
BUDGETS = {"cifarkit": 7.0, "cifarkit@8": 8.0}


def run(accuracy: float, seconds: float) -> dict:
    return {"test_acc": accuracy, "test_acc_6_views": accuracy, "wall_time_s": seconds, "train_time_s": seconds - 10}


def rounds(seven: list[float], eight: list[float], muon: list[float], times=(100.0, 120.0, 150.0)) -> list[dict]:
    """Rounds with these 6-view accuracies for `fast` at 7 and 8 epochs and for airbench94_muon, and these times."""
    return [{"seed": seed, "order": ["cifarkit", "cifarkit@8", MUON],
             "runs": {"cifarkit": run(a, times[0] + seed), "cifarkit@8": run(b, times[1] + seed),
                      MUON: run(c, times[2] + seed)}}
            for seed, (a, b, c) in enumerate(zip(seven, eight, muon))]


def test_the_time_is_read_where_the_accuracies_are_equal():
    found = equal_accuracy.speedup(rounds([0.938, 0.940], [0.942, 0.944], [0.9415, 0.9405]), BUDGETS, MUON)
    # Means: 93.9% at 7 epochs, 94.3% at 8, the reference 94.1%: half way, 7.5 epochs, 110.5 + 10 s whole process.
    assert found["defined"] and not found["extrapolated"]
    assert found["epochs"] == pytest.approx(7.5)
    assert found["cifarkit_times"]["wall_time_s"] == pytest.approx(110.5)
    assert found["whole_process"]["ratio"] == pytest.approx(150.5 / 110.5)
    assert found["training"]["ratio"] == pytest.approx(140.5 / 100.5)
    low, high = found["whole_process"]["ci95"]
    assert low < found["whole_process"]["ratio"] < high or low == high == pytest.approx(150.5 / 110.5)
    assert found["resamples"] == equal_accuracy.RESAMPLES


def test_the_interval_narrows_with_steadier_rounds_and_is_reproducible():
    spread = rounds([0.936, 0.942, 0.937, 0.941], [0.941, 0.945, 0.942, 0.944], [0.941, 0.942, 0.940, 0.941])
    steady = rounds([0.939] * 4, [0.943] * 4, [0.941] * 4)
    loose, tight = (equal_accuracy.speedup(r, BUDGETS, MUON)["whole_process"]["ci95"] for r in (spread, steady))
    assert tight[1] - tight[0] < loose[1] - loose[0]
    assert equal_accuracy.speedup(spread, BUDGETS, MUON)["whole_process"]["ci95"] == loose  # a fixed generator


def test_a_figure_beyond_the_budgets_is_flagged_and_none_is_given_where_accuracy_does_not_grow():
    beyond = equal_accuracy.speedup(rounds([0.930], [0.935], [0.940]), BUDGETS, MUON)
    assert beyond["extrapolated"] and beyond["epochs"] == pytest.approx(9.0)
    assert beyond["whole_process"]["ci95"] is None and beyond["resamples"] == 0  # one round: no interval
    flat = equal_accuracy.speedup(rounds([0.94, 0.94], [0.939, 0.939], [0.94, 0.94]), BUDGETS, MUON)
    assert not flat["defined"] and "does not grow with the epochs" in flat["why"]


def test_the_time_to_a_mark_is_interpolated_within_the_budgets_only():
    found = equal_accuracy.time_to(rounds([0.938], [0.942], [0.941]), BUDGETS, [MUON], 0.94)
    assert found["cifarkit"]["epochs"] == pytest.approx(7.5)
    assert found["cifarkit"]["wall_time_s"] == pytest.approx(110.0)
    assert found[MUON] == {"wall_time_s": 150.0, "train_time_s": 140.0}
    missed = equal_accuracy.time_to(rounds([0.930], [0.935], [0.938]), BUDGETS, [MUON], 0.94)
    assert missed["cifarkit"] is None and missed[MUON] is None


def test_budgets_are_the_recipe_s_own_and_the_brackets_each_checked():
    assert reference.budgets("fast", [], [8.0]) == {"cifarkit": 7, "cifarkit@8": 8.0}
    assert reference.budgets("fast", ["train.epochs=7.5"], [6.5, 8.5]) == {
        "cifarkit": 7.5, "cifarkit@6.5": 6.5, "cifarkit@8.5": 8.5}
    with pytest.raises(CifarkitError, match="must differ from the others and from the recipe's own 7 epochs"):
        reference.budgets("fast", [], [7.0])
    with pytest.raises(CifarkitError, match="must differ"):
        reference.budgets("fast", [], [8.0, 8.0])


def test_the_verdict_reads_the_figure_at_equal_accuracy_and_waits_for_eight_rounds(tmp_path):
    muon_file = tmp_path / "airbench94_muon.py"
    muon_file.write_text("# the user's copy\n")
    settings = {"recipe": "fast", "references": [MUON], "subset": None, "cpu_kind": "amx", "precision_policy": "bf16",
                "newton_schulz_dtype": "bfloat16", "preloaded_by_all": None, "budgets": BUDGETS}

    def result(count: int, times) -> dict:
        spread = [0.0005 * (-1) ** seed for seed in range(count)]  # runs differ; an even count keeps the means
        made = rounds([0.938 + d for d in spread], [0.942 - d for d in spread], [0.941 + d for d in spread], times)
        return reference.results(made, json.loads(json.dumps(settings)), {}, "cifarkit reference",
                                 {MUON: muon_file})
    fast = result(8, (100.0, 110.0, 150.0))
    figure = fast["references"][MUON]["equal_accuracy"]
    assert figure["epochs"] == pytest.approx(7.75) and fast["verdict"] == "met"
    assert fast["brackets"]["cifarkit@8"]["epochs"] == 8.0
    printed = reference.table(fast)
    assert "at airbench94_muon's accuracy (94.10%, 6 views): cifarkit needs 7.75 epochs" in printed
    assert "| cifarkit --recipe fast --set train.epochs=8 | 8 |" in printed
    assert "time to a 94.0% mean (6 views), whole process: cifarkit 108.5 s; airbench94_muon 153.5 s" in printed
    slow = result(8, (130.0, 140.0, 150.0))
    assert slow["verdict"].startswith(f"not met: {MUON} 1.09x at equal accuracy, under 1.3x")
    assert result(3, (100.0, 110.0, 150.0))["verdict"] == "not judged: 3 of the 8 rounds a verdict needs; so far met"


def test_a_verdict_prints_a_ratio_under_its_goal_as_under_it_and_says_where_its_interval_is_too_wide():
    def judged(ratio: float, extrapolated: bool = False, interval: list[float] | None = None) -> str:
        figure = {"defined": True, "extrapolated": extrapolated, "whole_process": {"ratio": ratio, "ci95": interval}}
        return reference.verdict({MUON: {"equal_accuracy": figure}}, None, 8)
    assert judged(1.2996) == f"not met: {MUON} 1.2996x at equal accuracy, under 1.3x"
    assert judged(1.2949) == f"not met: {MUON} 1.29x at equal accuracy, under 1.3x"
    assert judged(1.30) == "met"
    assert judged(1.35, extrapolated=True) == (f"not met: {MUON} 1.35x at equal accuracy (extrapolated beyond the "
                                               f"budgets), not a measurement")
    assert judged(1.30, interval=[1.26, 1.34]) == "met"
    assert judged(1.30, interval=[1.23, 1.36]) == (f"met; {MUON}'s interval 1.23-1.36 is +-0.07x, wider than +-0.05x: "
                                                   f"about 14 rounds would narrow it to that")
