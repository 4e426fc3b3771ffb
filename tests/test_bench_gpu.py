"""`cifarkit bench --devices cpu cuda` on a GPU, driven on the CPU: torch.cuda says yes, each measuring process is
answered with the figures a GPU's would write, and the inference pass is faked. What is checked is what the report
does with them: the configurations it asks for, cuDNN's autotuning off for the last mode, the three GPU tables in the
output, the JSON and the rendered page, and nothing of a GPU where none was measured."""
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cifarkit.cli import main
from cifarkit.core import device
from cifarkit.tools import benchmark, results
from cifarkit.tools.result_tables import devices_table
from conftest import ROOT

MIB = 2**20
# (device, MODES entry, autotuning off) -> (training img/s, peak memory): round numbers, so that the ratios are exact.
CHILDREN = {
    ("cpu", "fp32", False): (500.0, 900 * MIB),
    ("cpu", "bf16+cl", False): (1000.0, 800 * MIB),
    ("cuda", "fp32", False): (5000.0, 400 * MIB),
    ("cuda", "fp16+cl", False): (10_000.0, 200 * MIB),
    ("cuda", "fp16+cl", True): (8000.0, 250 * MIB),
}
TITLES = ["Each device against the CPU", "Each mode against fp32", "cuDNN's autotuning"]


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUDA available with a T4 in it (no native bf16: amp is fp16 with a GradScaler there), a CPU with native
    bf16, so that the two devices' amp differ; returns the measuring processes' commands and the
    inference passes' arguments, as the report made them."""
    asked = {"commands": [], "inference": []}
    run = subprocess.run

    def child(command, **kwargs):
        if command[1:4] != ["-m", "cifarkit", "bench"]:
            return run(command, **kwargs)  # git, for the results' commit
        asked["commands"].append(command)
        where = command[command.index("--device") + 1]
        rate, peak = CHILDREN[(where, command[command.index("--modes") + 1], "--no-cudnn-benchmark" in command)]
        # As `cifarkit bench` writes them: the peak of each configuration on CUDA, of the process elsewhere.
        on_cuda = where == "cuda"
        Path(command[command.index("--json") + 1]).write_text(json.dumps(
            {"results": [{"images_per_s": rate, "peak_memory_bytes": peak if on_cuda else None}],
             "peak_memory": {"bytes": None if on_cuda else peak, "kind": "peak RSS of the process"}}))
        return subprocess.CompletedProcess(command, 0, "", "")

    def inference(model_name, mode, where, cudnn_benchmark=True):
        asked["inference"].append((where.type, mode, cudnn_benchmark))
        return 20_000.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: SimpleNamespace(
        name="Tesla T4", total_memory=16 * 2**30, major=7, minor=5))
    monkeypatch.setattr(device, "cpu_has_bf16", lambda features=None: True)
    monkeypatch.setattr(subprocess, "run", child)
    monkeypatch.setattr(benchmark, "eval_throughput", inference)
    return asked


def test_the_report_on_a_gpu_prints_and_writes_the_three_gpu_tables(fake_gpu, tmp_path, capsys):
    out = tmp_path / "bench-devices.json"
    assert main(["bench", "--devices", "cpu", "cuda", "--models", "simplecnn", "--rounds", "1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    asked = [(c[c.index("--device") + 1], c[c.index("--modes") + 1], "--no-cudnn-benchmark" in c)
             for c in fake_gpu["commands"]]
    # The last mode (amp: fp16 + GradScaler on CUDA) once more with the autotuning off; fp32 as training runs it.
    assert asked == list(CHILDREN)
    assert fake_gpu["inference"][-2:] == [("cuda", "fp16+cl", True), ("cuda", "fp16+cl", False)]
    result = json.loads(out.read_text())
    assert [r["cudnn_benchmark"] for r in result["rows"]] == [None, None, True, True, False]
    kinds = [r["peak_memory_kind"] for r in result["rows"]]
    assert kinds == ["peak RSS of the process"] * 2 + [benchmark.CUDA_PEAK] * 3
    comparisons = result["comparisons"]
    assert [(c["mode"], c["speedup"], c["cpu_measured_as"], c["measured_as"]) for c in comparisons["against_cpu"]] \
        == [("fp32", 10.0, "fp32", "fp32"), ("amp", 10.0, "bf16+cl", "fp16+cl")]
    assert [(c["mode"], c["speedup"], c["peak_memory_bytes"], c["memory_vs_fp32"])
            for c in comparisons["against_fp32"]] == [("fp32", 1.0, 400 * MIB, 1.0), ("amp", 2.0, 200 * MIB, 0.5)]
    assert [(c["mode"], c["epoch_s_on"], c["epoch_s_off"], c["speedup"]) for c in comparisons["autotuning"]] == \
        [("amp", 5.0, 6.25, 1.25)]
    assert "| cuda | simplecnn | amp (fp16+cl), cuDNN autotuning off | 8,000 | 6.25 s | 16.00x | 250 MiB |" in printed
    assert "| cuda | simplecnn | fp32 | 100.0 s | 10.0 s | 10.00x |" in printed
    assert "| cuda | simplecnn | amp (fp16+cl) | 50.0 s (bf16+cl) | 5.00 s | 10.00x |" in printed
    assert "| cuda | simplecnn | amp (fp16+cl) | 5.00 s | 2.00x | 200 MiB | 0.50x |" in printed
    assert "| cuda | simplecnn | amp (fp16+cl) | 5.00 s | 6.25 s | 1.25x |" in printed
    assert all(title in printed for title in TITLES)
    # The page renders the same tables from the file.
    page = devices_table(tmp_path)
    assert "Tesla T4" in page and "| 5.00 s | 6.25 s | 1.25x |" in page
    assert all(title in page for title in TITLES)
    # And the README's row for the GPU, the three tables in a line.
    row = next(line for line in results.expect_table(tmp_path).splitlines() if line.startswith("| Tesla T4 |"))
    assert row == ("| Tesla T4 | `cifarkit bench --devices cpu cuda` | training speed only: simplecnn 10.00x the CPU "
                   "in fp32, simplecnn 10.00x the CPU in amp; simplecnn in amp (fp16+cl) 2.00x fp32 at 0.50x its "
                   "peak memory; simplecnn 1.25x with cuDNN autotuning | [bench-devices.json](" + tmp_path.name
                   + "/bench-devices.json) |")


def test_a_report_without_a_gpu_renders_nothing_of_one():
    page = devices_table(ROOT / "results")
    assert "| cuda |" not in page and not any(title in page for title in TITLES)


@pytest.mark.unit
def test_autotuning_off_is_an_option_of_one_measurement_alone(capsys):
    assert main(["bench", "--devices", "cpu", "cuda", "--no-cudnn-benchmark"]) == 2
    assert "--devices measures cuDNN's autotuning on and off by itself" in capsys.readouterr().err


@pytest.mark.unit
def test_configure_turns_cudnn_autotuning_on_unless_told_not_to(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    device.configure(torch.device("cuda"))
    assert torch.backends.cudnn.benchmark
    device.configure(torch.device("cuda"), cudnn_benchmark=False)
    assert not torch.backends.cudnn.benchmark

