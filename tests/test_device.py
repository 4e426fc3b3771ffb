import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cifarkit.cli import main
from cifarkit.core import device
from cifarkit.core.errors import CifarkitError


@pytest.mark.unit
def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.pick_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert device.pick_device("auto").type == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert device.pick_device("auto").type == "cpu"


@pytest.mark.unit
def test_unavailable_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CifarkitError, match="device 'cuda' is not available here; use --device auto"):
        device.pick_device("cuda")


@pytest.mark.parametrize("dev, has_bf16, expected, scaler", [
    ("cuda", True, "fp16", True), ("cpu", True, "bf16", False), ("cpu", False, "fp32", False),
    ("mps", True, "fp32", False),
])
@pytest.mark.unit
def test_auto_precision(monkeypatch, dev, has_bf16, expected, scaler):
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: has_bf16)
    precision = device.pick_precision("auto", torch.device(dev))
    assert (precision.name, precision.grad_scaler) == (expected, scaler)


@pytest.mark.unit
@pytest.mark.skipif(not (device.is_x86() and Path("/proc/cpuinfo").exists()), reason="reads Linux's x86 CPU flags")
def test_native_bf16_means_the_bf16_instructions_not_avx512_alone():
    # oneDNN's check says yes on any AVX-512 CPU and emulates bf16 there at a third of fp32's training speed, so
    # auto must not pick bf16 on such a CPU. The kernel's flags for this CPU are the independent answer.
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split())
    assert device.cpu_has_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert ("avx512" in device.cpu_features()) == ("avx512f" in flags)
    expected = "bf16" if device.cpu_has_bf16() else "fp32"
    assert device.pick_precision("auto", torch.device("cpu")).name == expected


@pytest.mark.skipif(not device.is_x86(), reason="the caps are x86 instruction sets")
def test_env_names_the_isa_caps_that_imitate_an_older_cpu():
    # A figure taken under the caps is not the CPU's own: the report, which every results file carries, says so,
    # and the features it reads are the capped ones. A real process: ATen reads its cap when torch loads.
    capped = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    run = [sys.executable, "-m", "cifarkit", "env"]
    info = json.loads(subprocess.run(run + ["--json"], env=capped, capture_output=True, text=True,
                                     check=True).stdout)
    assert info["isa_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert info["cpu_features"] == (["avx2"] if torch.cpu._is_avx2_supported() else [])
    text = subprocess.run(run, env=capped, capture_output=True, text=True, check=True).stdout
    assert "capped by ONEDNN_MAX_CPU_ISA=AVX2, capped by ATEN_CPU_CAPABILITY=avx2" in text
    uncapped = {name: value for name, value in os.environ.items() if name not in device.ISA_CAP_VARIABLES}
    info = json.loads(subprocess.run(run + ["--json"], env=uncapped, capture_output=True, text=True,
                                     check=True).stdout)
    assert info["isa_caps"] == {}


@pytest.mark.unit
def test_cpu_model_is_the_first_processors_family_and_model(tmp_path):
    # Two AMD EPYCs of one kind (avx512_bf16) that a VM names alike: only the numbers tell Zen 4 from Zen 5.
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
    assert device.cpu_model(device.first_cpu_info(cpuinfo)) == "family 25 model 17"
    assert device.cpu_model(device.first_cpu_info(tmp_path / "absent")) is None
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Apple M2\n")  # no x86 family: nothing to tell
    assert device.cpu_model(device.first_cpu_info(cpuinfo)) is None


@pytest.mark.unit
def test_fp16_training_on_cpu_is_refused():
    with pytest.raises(CifarkitError, match="use --precision bf16 or fp32"):
        device.pick_precision("fp16", torch.device("cpu"))


def test_bench_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--models", "simplecnn", "--modes", "fp32", "fp32+cl", "--steps", "2", "--rounds", "1",
                 "--batch-size", "16", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "median of 1 round of 2 steps" in table
    assert "| simplecnn | fp32 |" in table and "| simplecnn | fp32+cl |" in table
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["results"]] == ["fp32", "fp32+cl"]
    fp32, channels_last = result["results"]
    # The ratio is taken against the first mode's rate of the same model, from the same interleaved rounds.
    assert channels_last["speedup_vs_fp32"] == pytest.approx(channels_last["images_per_s"] / fp32["images_per_s"])
    assert f"| {channels_last['speedup_vs_fp32']:.2f}x |" in table


def test_device_report_measures_each_configuration_in_its_own_process(tmp_path, capsys):
    out = tmp_path / "devices.json"
    assert main(["bench", "--devices", "cpu", "cuda", "--models", "simplecnn", "--steps", "2", "--rounds", "1",
                 "--batch-size", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    amp = "bf16+cl" if device.cpu_has_bf16() else None
    assert [(r["device"], r["mode"], r["measured_as"]) for r in result["rows"] if r["device"] == "cpu"] == \
        [("cpu", "fp32", "fp32")] + ([("cpu", "amp", amp)] if amp else [])
    if not amp:
        assert result["skipped"]["cpu amp"] == "no mixed precision on this device"
    if not torch.cuda.is_available():
        assert result["skipped"]["cuda"] == "not available here" and "skipped cuda: not available here" in printed
        assert result["comparisons"] == {"against_cpu": [], "against_fp32": [], "autotuning": []}
    fp32 = result["rows"][0]
    assert fp32["speedup_vs_cpu_fp32"] == 1.0 and fp32["epoch_s"] == pytest.approx(50_000 / fp32["images_per_s"])
    for row in result["rows"]:
        # the child process that imported torch and trained: far more than 50 MiB
        assert row["peak_memory_kind"] == "peak RSS of the process" and row["peak_memory_bytes"] > 50 * 2**20
        assert row["inference_images_per_s"] > 0 and len(row["samples"]) == 1
        assert f"| {row['device']} | simplecnn |" in printed
    assert (tmp_path / "devices.png").stat().st_size > 10_000
    assert result["command"].startswith("cifarkit bench --devices cpu cuda")


@pytest.mark.unit
def test_device_report_needs_the_cpu_baseline(capsys):
    assert main(["bench", "--devices", "cuda", "--models", "simplecnn"]) == 2
    assert "include cpu in --devices and fp32 in --modes" in capsys.readouterr().err
