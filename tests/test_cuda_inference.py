"""The inference side's CUDA path, driven on the CPU: CI has no GPU. onnxruntime's provider list and sessions are
faked as onnxruntime-gpu's; the device options are checked where they end on a machine without CUDA, with the one-line
error a user meets. The choice of backend on a GPU is in test_backends.py, the TensorRT export in test_release.py."""
import onnxruntime
import pytest
import torch
from PIL import Image

from cifarkit.cli import main
from cifarkit.core.errors import CifarkitError
from cifarkit.inference import runtime
from cifarkit.serving import pipeline
from cifarkit.serving.settings import ServeSettings

pytestmark = pytest.mark.unit

GPU_BUILD = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
NO_CUDA = "device 'cuda' is not available here; use --device auto or --device cpu"
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA says")


def test_on_the_cpu_onnxruntime_asks_for_the_cpu_whatever_it_has(monkeypatch):
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: GPU_BUILD)
    assert runtime.onnx_providers(torch.device("cpu")) == ["CPUExecutionProvider"]


def test_on_cuda_onnxruntime_asks_for_tensorrt_then_cuda_then_the_cpu(monkeypatch, empty_home):
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: GPU_BUILD)
    (tensorrt, trt_options), (cuda, cuda_options), cpu = runtime.onnx_providers(torch.device("cuda", 1))
    assert (tensorrt, cuda, cpu) == tuple(GPU_BUILD)
    assert cuda_options == {"device_id": 1} and trt_options["device_id"] == 1
    # One engine for every batch the server pads to, kept where a later start finds it.
    assert trt_options["trt_profile_min_shapes"] == "image:1x3x32x32"
    assert trt_options["trt_profile_max_shapes"] == f"image:{runtime.MAX_BATCH}x3x32x32"
    assert trt_options["trt_engine_cache_path"] == str(empty_home / "tensorrt") and (empty_home / "tensorrt").is_dir()


def test_on_cuda_a_cpu_only_onnxruntime_is_refused_with_the_package_to_install(monkeypatch):
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["AzureExecutionProvider",
                                                                         "CPUExecutionProvider"])
    with pytest.raises(CifarkitError, match="has no provider for cuda .* install onnxruntime-gpu in its place"):
        runtime.onnx_providers(torch.device("cuda", 0))


class FakeSession:
    """onnxruntime.InferenceSession as onnxruntime-gpu makes it: it keeps the providers it could load."""
    loaded: list[str] = []

    def __init__(self, model, options, providers):
        self.asked = providers

    def get_providers(self) -> list[str]:
        return self.loaded


@pytest.mark.parametrize("loaded", [["CUDAExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]])
def test_a_gpu_session_names_the_provider_that_runs_and_one_left_on_the_cpu_is_refused(monkeypatch, empty_home,
                                                                                        loaded):
    """onnxruntime drops a provider whose libraries it cannot load (TensorRT's here), with a message of its own, and
    runs on what is left: the CPU alone must not pass for the GPU."""
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: GPU_BUILD)
    monkeypatch.setattr(onnxruntime, "InferenceSession", type("Session", (FakeSession,), {"loaded": loaded}))
    if loaded[0] == "CPUExecutionProvider":
        with pytest.raises(CifarkitError, match="could not start TensorrtExecutionProvider or CUDAExecutionProvider"):
            runtime.onnx_session(b"model", torch.device("cuda", 0))
        return
    session = runtime.onnx_session(b"model", torch.device("cuda", 0))
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    assert [p[0] if isinstance(p, tuple) else p for p in session.asked] == GPU_BUILD


@needs_no_cuda
def test_predict_on_a_device_that_is_not_here_is_a_one_line_error(tmp_path, capsys):
    image = tmp_path / "blue.png"
    Image.new("RGB", (32, 32), "blue").save(image)
    assert main(["predict", "--model", "B", "--device", "cuda", str(image)]) == 2
    assert capsys.readouterr().err.strip() == f"cifarkit: error: {NO_CUDA}"
    assert main(["predict", "--model", "B", "--device", "cpu", "--backend", "torch-fp16", str(image)]) == 2
    assert "backend torch-fp16 runs on a GPU only" in capsys.readouterr().err


@needs_no_cuda
def test_the_server_loads_on_its_device_and_says_which(monkeypatch):
    asked, load = [], pipeline.Classifier.load

    def recording(path, **options):
        asked.append(options["device"])
        return load(path, **options)

    monkeypatch.setattr(pipeline.Classifier, "load", recording)
    served = pipeline.load_models(["B"], ServeSettings(device="cpu", backend="torch-fp32"))
    assert asked == ["cpu"]
    assert served["B"].classifier.device == torch.device("cpu")
    assert served["B"].describe()["device"] == "cpu" and served["B"].describe()["onnx_provider"] is None
    with pytest.raises(CifarkitError, match=NO_CUDA):
        pipeline.load_models(["B"], ServeSettings(device="cuda"))

