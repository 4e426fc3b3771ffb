"""`auto` is decided on the machine that runs, from the release's recorded figures and the device's features, faked
here as each CPU kind's or a CUDA GPU's; and a shipped release loads through the choice for this machine."""
import json
from types import SimpleNamespace

import pytest
import torch

from cifarkit import Classifier
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.inference import backends

pytestmark = pytest.mark.unit

AMX = ["avx2", "avx512", "avx512_bf16", "amx"]
ZEN5 = ["avx2", "avx512", "avx512_bf16"]
ICE_LAKE = ["avx2", "avx512"]  # AVX-512 without BF16: oneDNN emulates bf16 there
ZEN3 = ["avx2"]


def rows(kind_speeds: dict[str, float | tuple[float, float]]) -> list[dict]:
    """Throughput rows at batch 1 and 256: one img/s for both, or (batch 1's, batch 256's)."""
    pairs = {b: v if isinstance(v, tuple) else (v, v) for b, v in kind_speeds.items()}
    return [{"backend": b, "batch_size": bs, "images_per_s": v, "ms_per_batch": 1000 * bs / v}
            for b, pair in pairs.items() for bs, v in zip((1, 256), pair)]


def release(agreement=None, accuracy=None, speeds=None) -> dict:
    """metrics.json of a release whose bf16 meets the accuracy rule unless told otherwise."""
    inference = {
        "top1_agreement_with_fp32": agreement or {"torch-fp32": 1.0, "torch-bf16": 0.998, "onnxruntime": 1.0},
        "test_acc_by_backend": accuracy or {"torch-fp32": 0.94, "torch-bf16": 0.9395, "onnxruntime": 0.94},
    }
    if speeds:
        inference["speed_by_cpu_kind"] = {kind: {"throughput": rows(s)} for kind, s in speeds.items()}
    return {"inference": inference}


@pytest.mark.parametrize("features, kind", [(AMX, "amx"), (ZEN5, "avx512_bf16"), (ICE_LAKE, "avx512"),
                                            (ZEN3, "avx2")])
def test_a_cpu_s_kind_is_its_most_capable_feature(features, kind):
    assert backends.cpu_kind(features) == kind


@pytest.mark.parametrize("features", [AMX, ZEN5])
def test_native_bf16_without_a_speed_table_takes_bf16(features):
    choice = backends.choose(release(), features=features)
    assert choice.backend == "torch-bf16"
    assert "no speed measured" in choice.reason


@pytest.mark.parametrize("features", [ICE_LAKE, ZEN3])
def test_emulated_bf16_is_never_chosen_even_where_it_was_fastest_elsewhere(features):
    measured = release(speeds={"amx": {"torch-fp32": 1000, "torch-bf16": 4500, "onnxruntime": 1040}})
    choice = backends.choose(measured, features=features)
    assert choice.backend == "onnxruntime"
    assert "no native bf16" in choice.reason


def test_the_speed_table_of_this_cpu_kind_decides():
    measured = release(speeds={"avx2": {"torch-fp32": 300, "torch-bf16": 20, "onnxruntime": 280},
                               "amx": {"torch-fp32": 1000, "torch-bf16": 4500, "onnxruntime": 1040}})
    zen3 = backends.choose(measured, features=ZEN3)
    assert (zen3.backend, zen3.cpu_kind) == ("torch-fp32", "avx2")
    assert "300 img/s" in zen3.reason
    assert backends.choose(measured, features=AMX).backend == "torch-bf16"


def test_a_backend_must_be_fast_at_both_batch_sizes():
    """fp32 a little faster at batch 256, ONNX Runtime twice as fast at batch 1: a server sees both."""
    measured = release(speeds={"avx2": {"torch-fp32": (280, 708), "onnxruntime": (541, 660)}})
    assert backends.choose(measured, features=ZEN3).backend == "onnxruntime"


@pytest.mark.parametrize("accuracy, agreement, refused_because", [
    ({"torch-fp32": 0.94, "torch-bf16": 0.938, "onnxruntime": 0.94}, None, "points from fp32's"),
    (None, {"torch-fp32": 1.0, "torch-bf16": 0.99, "onnxruntime": 1.0}, "agrees with fp32 on 99.00%"),
])
def test_bf16_outside_the_accuracy_rule_is_refused_on_every_cpu(accuracy, agreement, refused_because):
    choice = backends.choose(release(agreement, accuracy), features=AMX)
    assert choice.backend == "onnxruntime"
    assert refused_because in choice.reason


def test_the_accuracy_rule_judges_the_figures_measured_on_this_cpu_s_kind():
    """bf16 rounds differently per kind: where the release holds figures from this kind, they decide; elsewhere the
    figures of the machine that made it."""
    measured = release()
    measured["inference"]["cpu_kind"] = "amx"
    measured["inference"]["accuracy_by_cpu_kind"] = {"avx512_bf16": {
        "test_acc_by_backend": {"torch-fp32": 0.94, "torch-bf16": 0.9385, "onnxruntime": 0.94},
        "top1_agreement_with_fp32": {"torch-fp32": 1.0, "torch-bf16": 0.997, "onnxruntime": 1.0}}}
    zen5, amx = backends.choose(measured, features=ZEN5), backends.choose(measured, features=AMX)
    assert zen5.backend == "onnxruntime" and "0.15 points from fp32's" in zen5.reason
    assert zen5.reason.endswith("accuracy rule on the figures measured on avx512_bf16")
    assert amx.backend == "torch-bf16" and amx.reason.endswith("figures measured on amx")


def test_a_release_without_recorded_accuracies_needs_the_agreement_that_bounds_the_gap():
    strict = {"top1_agreement_with_fp32": {"torch-fp32": 1.0, "torch-bf16": 0.9995, "onnxruntime": 1.0}}
    loose = {"top1_agreement_with_fp32": {"torch-fp32": 1.0, "torch-bf16": 0.997, "onnxruntime": 1.0}}
    assert backends.choose({"inference": strict}, features=AMX).backend == "torch-bf16"
    assert backends.choose({"inference": loose}, features=AMX).backend == "onnxruntime"


def test_weights_without_metrics_run_in_fp32():
    assert backends.choose(None, features=AMX).backend == "torch-fp32"


@pytest.mark.parametrize("version", ["A", "B"])
def test_a_shipped_release_loads_through_this_machine_s_choice(version):
    metrics = json.loads((SHIPPED / f"version_{version}" / "metrics.json").read_text())
    classifier = Classifier.pretrained(version)
    expected = backends.choose(metrics)
    assert classifier.backend == expected.backend
    assert classifier.backend_choice == expected
    if not device.cpu_has_bf16():
        assert classifier.backend != "torch-bf16"


@pytest.fixture
def cuda_capability(monkeypatch):
    """A CUDA GPU of the compute capability given, faked for core.device.cuda_has_bf16: CI has no GPU."""
    def fake(major: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(major=major))
    return fake


def measured_on_cuda(fp16_agreement=0.999, speeds=None) -> dict:
    """A release whose figures on a CPU admit bf16, with figures measured on a CUDA GPU too."""
    measured = release(speeds={"amx": {"torch-fp32": 1000, "torch-bf16": 4500, "onnxruntime": 1040}})
    measured["inference"]["accuracy_by_cpu_kind"] = {"cuda": {
        "test_acc_by_backend": {"torch-fp32": 0.94, "torch-bf16": 0.9396, "torch-fp16": 0.9401},
        "top1_agreement_with_fp32": {"torch-fp32": 1.0, "torch-bf16": 0.998, "torch-fp16": fp16_agreement}}}
    if speeds:
        measured["inference"]["speed_by_cpu_kind"]["cuda"] = {"throughput": rows(speeds)}
    return measured


@pytest.mark.parametrize("device_type", ["cuda", "mps"])
def test_on_a_gpu_figures_measured_on_a_cpu_admit_fp32_alone_and_the_reason_says_so(cuda_capability, device_type):
    cuda_capability(9)
    choice = backends.choose(release(), device_type)
    assert (choice.backend, choice.cpu_kind) == ("torch-fp32", device_type)
    assert f"none on {device_type}" in choice.reason
    assert f"lab/measure_release_backends.py --device {device_type}" in choice.reason


@pytest.mark.parametrize("major, speeds, expected", [
    (8, None, "torch-fp16"),  # no speed measured on cuda: fp16 first
    (8, {"torch-fp32": 9000, "torch-bf16": 30000, "torch-fp16": 28000}, "torch-bf16"),  # the fastest admitted
    (7, {"torch-fp32": 9000, "torch-bf16": 30000, "torch-fp16": 28000}, "torch-fp16"),  # bf16 emulated before Ampere
])
def test_figures_measured_on_cuda_admit_fp16_and_native_bf16(cuda_capability, major, speeds, expected):
    cuda_capability(major)
    choice = backends.choose(measured_on_cuda(speeds=speeds), "cuda")
    assert choice.backend == expected and choice.reason.endswith("accuracy rule on the figures measured on cuda")
    assert ("no native bf16" in choice.reason) == (major < 8)


def test_on_cuda_fp16_outside_the_accuracy_rule_is_refused_and_onnxruntime_is_never_auto(cuda_capability):
    cuda_capability(7)
    speeds = {"torch-fp32": 9000, "torch-fp16": 28000, "onnxruntime": 50000}
    choice = backends.choose(measured_on_cuda(fp16_agreement=0.99, speeds=speeds), "cuda")
    assert choice.backend == "torch-fp32"
    assert "not torch-fp16: it agrees with fp32 on 99.00%" in choice.reason


def test_fp16_is_a_gpu_backend_a_cpu_neither_chooses_nor_runs():
    measured = measured_on_cuda()
    measured["inference"]["accuracy_by_cpu_kind"]["amx"] = measured["inference"]["accuracy_by_cpu_kind"]["cuda"]
    measured["inference"]["speed_by_cpu_kind"]["amx"] = {"throughput": rows({"torch-fp16": 9e9, "torch-fp32": 1})}
    assert backends.choose(measured, features=AMX).backend == "torch-fp32"
    with pytest.raises(CifarkitError, match="backend torch-fp16 runs on a GPU only"):
        Classifier.load("B", backend="torch-fp16", device="cpu")


@pytest.mark.parametrize("cap, features", [(None, AMX), ("AVX512_CORE_AMX", AMX), ("avx512_core_bf16", ZEN5),
                                           ("AVX512_CORE", ICE_LAKE), ("AVX2", ZEN3), ("SSE41", [])])
def test_onednn_s_isa_cap_removes_the_features_above_it(monkeypatch, cap, features):
    """ONEDNN_MAX_CPU_ISA imitates an older CPU (on an AMX machine, faked here): bf16 above the cap is emulated."""
    monkeypatch.setattr(device, "is_x86", lambda: True)
    for probe in device.X86_FEATURES.values():
        monkeypatch.setattr(torch.cpu, probe, lambda: True)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert device.cpu_features() == features
    assert device.cpu_has_bf16() == ("avx512_bf16" in features)


@pytest.mark.parametrize("threads", [1, 2])
def test_onnxruntime_runs_on_torch_s_thread_count(threads):
    """One thread setting for every backend: a worker given one core must not spin a second onnxruntime thread."""
    from cifarkit import models
    from cifarkit.inference import runtime
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        session = runtime.onnx_session(runtime.onnx_bytes(models.create("simplecnn").eval()))
    finally:
        torch.set_num_threads(before)
    assert session.get_session_options().intra_op_num_threads == threads
