"""Models as ONNX Runtime and exported artifacts run them: serialization and sessions."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from cifarkit.artifacts import preprocess

ONNX_OPSET = 18
# Any batch size from 1 to 4096 (batch 2 in the example, so the dimension is not specialized to 1).
DYNAMIC_BATCH = ({0: torch.export.Dim("batch", min=1, max=4096)},)


def example_input() -> tuple[torch.Tensor]:
    return (torch.zeros(2, 3, preprocess.SIZE, preprocess.SIZE),)


def onnx_bytes(model: torch.nn.Module) -> bytes:
    """The serialized ONNX model: a dynamic batch dimension, input 'image' (N x 3 x 32 x 32 float32), output
    'logits'. The same bytes as the saved file, and the same for the same weights every time."""
    for name in ("onnxscript", "onnx_ir"):  # their graph passes log every rewrite at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    program = torch.onnx.export(model, example_input(), input_names=["image"], output_names=["logits"],
                                dynamic_shapes=DYNAMIC_BATCH, opset_version=ONNX_OPSET, dynamo=True, verbose=False)
    return program.model_proto.SerializeToString()


def onnx_session(model: Path | bytes):
    """An onnxruntime session on the CPU, on as many threads as torch (OMP_NUM_THREADS, torch.set_num_threads)
    rather than onnxruntime's own default of one per core: one setting holds for every backend, and a process given
    one core does not spin a second thread on a core where another process computes."""
    import onnxruntime
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    return onnxruntime.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                        providers=["CPUExecutionProvider"])


def run_artifact(fmt: str, path: Path | bytes):
    """A function N x 3 x 32 x 32 float32 numpy -> N x 10 logits numpy, running the artifact at `path` (an ONNX
    model may also come as its serialized bytes)."""
    if fmt == "onnx":
        session = onnx_session(path)
        return lambda x: session.run(None, {"image": x})[0]
    module = torch.export.load(str(path)).module() if fmt == "exported" else torch.jit.load(str(path))
    return lambda x: module(torch.from_numpy(x)).detach().numpy()
