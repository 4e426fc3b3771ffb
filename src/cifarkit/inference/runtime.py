"""Models as ONNX Runtime, TensorRT and exported artifacts run them: serialization, sessions and engines."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from cifarkit.artifacts import preprocess
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import home

log = logging.getLogger(__name__)

ONNX_OPSET = 18
MAX_BATCH = 4096
# Any batch size from 1 to MAX_BATCH (batch 2 in the example, so the dimension is not specialized to 1).
DYNAMIC_BATCH = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},)
CPU = torch.device("cpu")
# onnxruntime's providers on a CUDA device, best first: TensorRT compiles the whole graph into one engine, CUDA runs
# it node by node with cuDNN. Either falls back to the next when its libraries cannot be loaded.
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
# The batch the TensorRT execution provider tunes its engine for: the server's largest batch by default
# (serving.settings.ServeSettings.max_batch); any batch up to MAX_BATCH runs on it.
TENSORRT_OPT_BATCH = 64


def example_input(batch: int = 2) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, 3, preprocess.SIZE, preprocess.SIZE),)


def onnx_bytes(model: torch.nn.Module, batch: int | None = None) -> bytes:
    """The serialized ONNX model: input 'image' (N x 3 x 32 x 32 float32), output 'logits', with a dynamic batch
    dimension, or N fixed at `batch`. The same bytes as the saved file, and the same for the same weights every
    time."""
    for name in ("onnxscript", "onnx_ir"):  # their graph passes log every rewrite at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    program = torch.onnx.export(model, example_input(batch or 2), input_names=["image"], output_names=["logits"],
                                dynamic_shapes=None if batch else DYNAMIC_BATCH, opset_version=ONNX_OPSET,
                                dynamo=True, verbose=False)
    return program.model_proto.SerializeToString()


def onnx_providers(device: torch.device = CPU) -> list:
    """The execution providers an onnxruntime session on `device` asks for, best first: on a CUDA device those of
    GPU_PROVIDERS that the installed onnxruntime has (onnxruntime-gpu; the plain onnxruntime package has none), then
    the CPU for any node they cannot run."""
    import onnxruntime
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    available = onnxruntime.get_available_providers()
    gpu = [name for name in GPU_PROVIDERS if name in available]
    if device.type != "cuda" or not gpu:
        raise CifarkitError(f"the installed onnxruntime has no provider for {device.type} (it has "
                            f"{', '.join(available)}); for CUDA install onnxruntime-gpu in its place (docs/releases.md"
                            f"), or choose a torch backend, or --device cpu")
    index = device.index if device.index is not None else torch.cuda.current_device()
    options = {"TensorrtExecutionProvider": _tensorrt_provider_options(index),
               "CUDAExecutionProvider": {"device_id": index}}
    return [(name, options[name]) for name in gpu] + ["CPUExecutionProvider"]


def _tensorrt_provider_options(index: int) -> dict:
    """One engine for every batch size the server pads to, kept in the cache: building it delays the TensorRT
    provider's first session, and later starts skip that. A cache that cannot be made costs the reuse."""
    shape = f"{preprocess.SIZE}x{preprocess.SIZE}"
    options = {"device_id": index, "trt_profile_min_shapes": f"image:1x3x{shape}",
               "trt_profile_opt_shapes": f"image:{TENSORRT_OPT_BATCH}x3x{shape}",
               "trt_profile_max_shapes": f"image:{MAX_BATCH}x3x{shape}"}
    cache = home() / "tensorrt"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("cannot keep TensorRT engines in %s (%s); each start builds its engine again", cache, e)
        return options
    return {**options, "trt_engine_cache_enable": True, "trt_engine_cache_path": str(cache)}


def onnx_session(model: Path | bytes, device: torch.device = CPU):
    """An onnxruntime session on `device`, on as many threads as torch (OMP_NUM_THREADS, torch.set_num_threads)
    rather than onnxruntime's own default of one per core: one setting holds for every backend, and a process given
    one core does not spin a second thread on a core where another process computes. On a GPU, the session's first
    provider (`session.get_providers()[0]`) is the one that runs: onnxruntime drops a provider whose libraries it
    cannot load, and a GPU session that is left with the CPU alone is refused."""
    import onnxruntime
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    asked = onnx_providers(device)
    session = onnxruntime.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                           providers=asked)
    if device.type != "cpu" and session.get_providers()[0] == "CPUExecutionProvider":
        raise CifarkitError(f"onnxruntime could not start {' or '.join(p[0] for p in asked[:-1])} on {device} (its "
                            f"messages above say why: most often a CUDA or cuDNN library it cannot find); choose a "
                            f"torch backend, or --device cpu")
    return session


def run_artifact(fmt: str, path: Path | bytes, device: torch.device = CPU):
    """A function N x 3 x 32 x 32 float32 numpy -> N x 10 logits numpy, running the artifact at `path` (an ONNX
    model may also come as its serialized bytes) on `device`."""
    if fmt == "onnx":
        session = onnx_session(path, device)
        return lambda x: session.run(None, {"image": x})[0]
    if fmt == "tensorrt":
        return run_engine(Path(path).read_bytes(), device)
    module = torch.export.load(str(path)).module() if fmt == "exported" else torch.jit.load(str(path))
    return lambda x: module(torch.from_numpy(x)).detach().numpy()


def tensorrt():
    """NVIDIA's TensorRT for Python, imported only where an engine is built or run: it is a GPU-only package."""
    try:
        import tensorrt as trt
    except ImportError:
        raise CifarkitError("TensorRT engines need NVIDIA's TensorRT for Python: pip install tensorrt (on a machine "
                            "with a CUDA GPU)") from None
    return trt


def run_engine(engine: bytes, device: torch.device):
    """A function N x 3 x 32 x 32 float32 numpy -> N x 10 logits numpy, running a serialized fixed-batch TensorRT
    engine on `device` (a GPU of the kind that built it), chunk by chunk of its batch, the last chunk padded."""
    trt = tensorrt()
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(engine)
    if engine is None:
        raise CifarkitError("TensorRT cannot load this engine here (see its messages above): an engine runs only with "
                            "the TensorRT version and the kind of GPU that built it; build it again on this machine")
    context = engine.create_execution_context()
    inputs = torch.zeros(tuple(engine.get_tensor_shape("image")), device=device)
    outputs = torch.zeros(tuple(engine.get_tensor_shape("logits")), device=device)
    context.set_tensor_address("image", inputs.data_ptr())
    context.set_tensor_address("logits", outputs.data_ptr())
    batch, stream = len(inputs), torch.cuda.current_stream(device)

    def run(x: np.ndarray) -> np.ndarray:
        chunks = []
        for start in range(0, len(x), batch):
            chunk = torch.from_numpy(x[start:start + batch])
            inputs[:len(chunk)] = chunk  # the rows past it keep the previous chunk's images; their logits are dropped
            # One stream: the copy in, the engine and the copy out run in that order.
            if not context.execute_async_v3(stream.cuda_stream):
                raise CifarkitError("the TensorRT engine failed to run (see its messages above)")
            chunks.append(outputs[:len(chunk)].to("cpu", copy=True).numpy())  # a copy: the buffer is the next chunk's
        return np.concatenate(chunks)

    return run
