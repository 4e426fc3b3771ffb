"""What a folder of results tells a user (cifarkit.tools.results, `cifarkit results`): the standing per device from
current files only, with the accuracy beside every speed-up and in words when under 94%, the index of every file, and
the history tables with each file marked current or superseded."""
import json
from pathlib import Path

import pytest

from cifarkit.cli import main
from cifarkit.tools import result_tables, results

pytestmark = pytest.mark.unit


@pytest.fixture
def folder(tmp_path):
    """An empty results folder, named as the tables name it."""
    (tmp_path / "results").mkdir()
    return tmp_path / "results"


def _speedrun(device: str, accuracies: list[float], day: str) -> dict:
    gpus = [{"name": "NVIDIA H200", "memory_gib": 139.8}] if device == "cuda" else []
    return {"command": "cifarkit speedrun --recipe fast", "recipe": "fast", "overrides": [], "target": 0.94,
            "accuracy": {"n": len(accuracies), "mean": sum(accuracies) / len(accuracies), "std": 0.001,
                         "ci95": [0.93, 0.95], "p_value_mean_above_target": 0.5},
            "wall_time_s": {"mean": 300.0, "max": 310.0, "min": 290.0},
            "environment": {"device": device, "gpus": gpus, "torch": "2.14.1", "processor": "AMD EPYC",
                            "cpu_model": "family 26 model 2", "cpu_features": ["avx2", "avx512_bf16"]},
            "runs": [{"seed": seed, "test_acc": acc, "wall_time_s": 300.0, "train_time_s": 290.0,
                      "finished": f"{day}T00:00:00+00:00", "run": {"precision": "bf16"}, "curve": [],
                      "machine_speed": None} for seed, acc in enumerate(accuracies)]}


@pytest.mark.unit
def test_the_readme_shows_current_files_only_and_says_when_the_mean_is_under_94(folder):
    (folder / "archive").mkdir()
    (folder / "archive" / "reasons.yaml").write_text("speedrun-fast-old.json: the recipe changed since\n"
                                                       "speedrun-fast-gpu.json: the recipe changed since\n")
    for name, device, accuracies, day in (("archive/speedrun-fast-old.json", "cpu", [0.95, 0.96], "2026-12-09"),
                                          ("speedrun-fast-new.json", "cpu", [0.938, 0.939, 0.936], "2026-12-01"),
                                          ("archive/speedrun-fast-gpu.json", "cuda", [0.94], "2026-12-01")):
        (folder / name).write_text(json.dumps(_speedrun(device, accuracies, day)))
        block = results.expect_table(folder)
    assert "speedrun-fast-new.json" in block and "speedrun-fast-old.json" not in block
    assert "93.77% mean test accuracy (n = 3, 95% interval" in block and "under 94% on the mean" in block
    assert "no reference timed on this processor yet" in block
    assert "| NVIDIA H200 | `cifarkit train` (`fast`) | not measured with the current `fast` yet" in block
    quickstart = results.quickstart_text(folder)
    assert "seed 0 scored 93.80%" in quickstart and "which is under 94%" in quickstart
    history = result_tables.speedrun_table(folder)
    assert "superseded: the recipe changed since" in history and "| current |" in history


@pytest.mark.unit
def test_of_two_files_measured_the_same_day_the_later_one_speaks_with_its_verdict(folder):
    """A morning speed run and an evening comparison on one processor: the row is the comparison's, to the second,
    and its goals' verdict is today's code's words on the figures the file holds, not the words it was written with
    (a ratio just under its goal once read "1.30x ..., under 1.3x")."""
    fixture = Path(__file__).parent / "fixtures" / "compare-reference-subset.json"
    speedrun = _speedrun("cpu", [0.941, 0.942], "2026-12-07")
    comparison = {**json.loads(fixture.read_text()), "subset": None, "measured": "2026-12-07T22:23:28+00:00",
                  "environment": speedrun["environment"], "rounds": [{}] * 8,
                  "verdict": "not met: airbench94_muon 1.30x at equal accuracy, under 1.3x"}
    comparison["references"]["airbench94_muon"]["equal_accuracy"] = {
        "defined": True, "extrapolated": False, "whole_process": {"ratio": 1.2996, "ci95": [1.26, 1.34]}}
    (folder / "speedrun-fast-morning.json").write_text(json.dumps(speedrun))
    (folder / "compare-reference-evening.json").write_text(json.dumps(comparison))
    block = results.expect_table(folder)
    seconds = comparison["cifarkit"]["wall_time_s"]
    assert f"{seconds / 60:.1f} min a run, whole process" in block and "speedrun-fast-morning.json" not in block
    assert "8 rounds (the goals: not met: airbench94_muon 1.2996x at equal accuracy, under 1.3x)" in block


@pytest.mark.unit
def test_serving_defaults_are_compared_with_backends_of_the_same_processor(folder):
    """Zen 2 and Zen 3 are both of the AVX2 kind: a faster backend on one must not set the other's 'best here'."""
    def bench(name, cpu_model, backend, req_per_s):
        goals = {"req_per_s": req_per_s, "p99_ms": 200.0, "p99_met": False, "ratio": 1.5, "ratio_met": False}
        result = {"command": f"cifarkit bench-serve --backend {backend}",
                  "environment": {"processor": "AMD EPYC", "cpu_model": cpu_model, "cpu_features": ["avx2"]},
                  "model_alone": {"batch_1_images_per_s": 100.0, "batch_32_images_per_s": 200.0,
                                  "batch_64_images_per_s": 150.0},
                  "servers": {"batched": {"served": {"backend": "onnxruntime"}}},
                  "summary": {"goals": {"concurrency_64": goals},
                              "goal_constants": {"concurrency": 64, "p99_ms": 100, "ratio": 2.5}}}
        (folder / f"serve-bench-{name}.json").write_text(json.dumps(result))
    bench("a-defaults", "family 23 model 49", "auto", 300.0)
    bench("b-fp32", "family 23 model 49", "torch-fp32", 400.0)
    bench("c-other", "family 25 model 1", "torch-fp32", 600.0)
    rows = [line for line in result_tables.serving_goals_table(folder).splitlines() if "`results/" in line]
    assert "family 23 model 49" in rows[0] and "| 0.75x |" in rows[0]
    assert "family 25 model 1" in rows[2]


def _speedrun_report(device: str, curve_points: int) -> dict:
    gpus = [{"name": "NVIDIA H200", "memory_gib": 139.8}] if device == "cuda" else []
    return {"recipe": "fast", "overrides": [f"train.device={device}"], "target": 0.94,
            "accuracy": {"n": 2, "mean": 0.9395, "std": 0.001, "ci95": [0.93, 0.95], "p_value_mean_above_target": 0.5},
            "wall_time_s": {"mean": 5.0, "max": 8.0, "min": 2.0},
            "environment": {"device": device, "gpus": gpus, "torch": "2.11.0+cu130", "processor": "AMD EPYC",
                            "cpu_features": ["avx2"]},
            "runs": [{"train_time_s": t, "run": {"precision": "fp16" if device == "cuda" else "fp32"},
                      "curve": [{"epoch": e} for e in range(curve_points)], "machine_speed": None}
                     for t in (6.04, 2.96)]}


@pytest.mark.unit
def test_the_history_names_each_speed_run_s_command_as_its_file_tells_it(folder):
    """Files from before the command was recorded: the overrides, and --no-curve where no run has a curve."""
    (folder / "speedrun-fast-cuda.json").write_text(json.dumps(_speedrun_report("cuda", 1)))
    (folder / "speedrun-fast-avx2.json").write_text(json.dumps(_speedrun_report("cpu", 8)))
    rows = [line for line in result_tables.speedrun_table(folder).splitlines() if "`results/" in line]
    cpu, gpu = (next(row for row in rows if name in row) for name in ("avx2.json", "cuda.json"))
    assert "`cifarkit speedrun --recipe fast --runs 2 --set train.device=cpu` " in cpu
    assert "`cifarkit speedrun --recipe fast --runs 2 --set train.device=cuda --no-curve`" in gpu
    assert "| 5.0 s / 8.0 s | NVIDIA H200 | fp16 |" in gpu and "| current |" in gpu
    assert gpu.endswith("(`results/speedrun-fast-cuda.json`) |")


@pytest.mark.unit
def test_a_figure_taken_under_isa_caps_names_them_beside_the_processor():
    # An AVX-512 CPU capped to AVX2 measures as an AVX2 kind, but it is not an AVX2 CPU: the rows say so.
    environment = {"processor": "AMD EPYC", "cpu_model": "family 25 model 17",
                   "isa_caps": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
    assert results.processor_of(environment, "AMX") == ("AMD EPYC (family 25 model 17, capped by ONEDNN_MAX_CPU_ISA="
                                                       "AVX2, capped by ATEN_CPU_CAPABILITY=avx2, AMX)")
    assert results.processor_of({"processor": "AMD EPYC", "isa_caps": {}}) == "AMD EPYC"


@pytest.mark.parametrize("recorded, shown", [(1536, "batch 1,536, tcmalloc | 6.0 s per step (256 img/s)"),
                                             (None, "batch 2,000, tcmalloc | 6.0 s per step (333 img/s)")])
def test_an_ab_row_names_the_batch_its_runs_timed(folder, recorded, shown):
    """The A/B file's own batch; a file from before the A/B recorded it timed `fast` at its old batch, 2,000."""
    runs = [{"step_s": step, "precision": "fp32", "allocator": "tcmalloc"} for step in (5.5, 6.5)]
    for run in runs:
        if recorded is not None:
            run["batch_size"] = recorded
    ab = {"cpu_kind": "avx2", "environment": {"processor": "AMD EPYC"}, "before": "aaaaaaa", "after": "bbbbbbb",
          "runs": {"before": runs, "after": runs}, "speedup_mean": 1.0, "speedup_ci95_half_width": 0.1,
          "command": "python lab/ab_profile.py --before aaaaaaa"}
    (folder / "profile-ab-fast-avx2.json").write_text(json.dumps(ab))
    rows = [line for line in result_tables.step_table(folder).splitlines() if "profile-ab-fast-avx2.json" in line]
    assert len(rows) == 1 and f"`fast` training step, fp32, {shown} at bbbbbbb" in rows[0]



def test_the_results_command_prints_the_standing_and_the_index_of_a_folder(folder, capsys):
    (folder / "archive").mkdir()
    (folder / "archive" / "reasons.yaml").write_text("speedrun-fast-old.json: the recipe changed since\n")
    (folder / "archive" / "speedrun-fast-old.json").write_text(json.dumps(_speedrun("cpu", [0.95], "2026-12-09")))
    (folder / "speedrun-fast-new.json").write_text(json.dumps(_speedrun("cpu", [0.941, 0.943], "2026-12-01")))
    assert main(["results", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "94.20% mean test accuracy (n = 2" in printed and "under 94%" not in printed
    assert "| [speedrun-fast-new.json](speedrun-fast-new.json) | `fast`, 2 run(s) |" in printed
    assert "| [archive/speedrun-fast-old.json](archive/speedrun-fast-old.json) |" in printed
    assert "| superseded: the recipe changed since |" in printed


def test_the_results_command_names_a_missing_folder_and_the_fix(tmp_path, capsys):
    assert main(["results", str(tmp_path / "nothing")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "is not a folder" in error and "(default: results)" in error


def test_an_archived_file_without_a_reason_says_so(folder):
    (folder / "archive").mkdir()
    (folder / "archive" / "speedrun-fast-old.json").write_text(json.dumps(_speedrun("cpu", [0.95], "2026-12-09")))
    assert results.status(folder, folder / "archive" / "speedrun-fast-old.json") == (
        "superseded: no reason given in archive/reasons.yaml")
    assert "| superseded: no reason given in archive/reasons.yaml |" in results.index_table(folder)
