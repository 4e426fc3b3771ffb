"""A stand-in for NVIDIA's `tensorrt` package, for the tests of `cifarkit export --format tensorrt` on the CPU.

It is a fake: CI has no GPU, and TensorRT (a GPU-only package) neither installs nor runs without one. It answers the
calls cifarkit makes of TensorRT 10's API (the builder, the ONNX parser, the runtime, an execution context fed
through tensor addresses), and records them. Its "engine" is the ONNX model the parser was given, run by onnxruntime
on the CPU: the fp16 graph and its fixed batch are the real export's, and the context reads its input from, and
writes its logits to, the memory at the addresses cifarkit set, as TensorRT does with a GPU's buffers. What it cannot
check is TensorRT itself: its kernels, and whether it accepts the graph; the GPU check runs the real one.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import types

import numpy as np
import onnxruntime


class FakeTensorRT(types.ModuleType):
    def __init__(self):
        super().__init__("tensorrt")
        self.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)  # torch.export reads every module's spec
        self.__version__ = "10.0.0 (fake)"
        self.calls: list[tuple] = []  # (what, a figure of it), in the order cifarkit asked
        self.Logger = Logger
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
        self.Builder = lambda logger: Builder(self.calls)
        self.OnnxParser = OnnxParser
        self.Runtime = lambda logger: Runtime(self.calls)


class Logger:
    WARNING = 2

    def __init__(self, severity):
        self.severity = severity


class Network:
    def __init__(self, flags: int):
        self.flags, self.onnx = flags, None


class Builder:
    def __init__(self, calls: list):
        self.calls = calls

    def create_network(self, flags: int) -> Network:
        self.calls.append(("create_network", flags))
        return Network(flags)

    def create_builder_config(self):
        return types.SimpleNamespace()

    def build_serialized_network(self, network: Network, config) -> bytes:
        self.calls.append(("build", network.onnx))
        return network.onnx


class OnnxParser:
    num_errors = 0

    def __init__(self, network: Network, logger):
        self.network = network

    def parse(self, model: bytes) -> bool:
        self.network.onnx = model
        return True


class Runtime:
    def __init__(self, calls: list):
        self.calls = calls

    def deserialize_cuda_engine(self, engine: bytes) -> Engine:
        return Engine(bytes(engine), self.calls)


class Engine:
    def __init__(self, model: bytes, calls: list):
        self.session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
        self.calls = calls

    def get_tensor_shape(self, name: str) -> list[int]:
        return {t.name: t.shape for t in self.session.get_inputs() + self.session.get_outputs()}[name]

    def create_execution_context(self) -> Context:
        return Context(self.session, self.calls)


class Context:
    def __init__(self, session, calls: list):
        self.session, self.calls, self.addresses = session, calls, {}

    def set_tensor_address(self, name: str, address: int) -> None:
        self.addresses[name] = address

    def execute_async_v3(self, stream: int) -> bool:
        (image,), (logits,) = self.session.get_inputs(), self.session.get_outputs()
        x = _view(self.addresses["image"], image.shape)
        self.calls.append(("execute", x.shape[0]))
        _view(self.addresses["logits"], logits.shape)[...] = self.session.run(None, {"image": x.copy()})[0]
        return True


def _view(address: int, shape: list[int]) -> np.ndarray:
    """The float32 array of `shape` at `address`: the buffer cifarkit handed the context."""
    count = int(np.prod(shape))
    return np.ctypeslib.as_array((ctypes.c_float * count).from_address(address)).reshape(shape)
