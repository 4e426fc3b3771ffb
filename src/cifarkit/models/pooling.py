"""`MaxPool2x2`: nn.MaxPool2d(2) in every way that is saved or exported, with a faster kernel for CPU training.

Why: torch's CPU max-pool keeps an int64 index per output for the backward pass, which then zero-fills the whole
input's gradient and scatters into it. In bf16 training on an AMX Xeon, where the convolutions are fast, fastnet's
pools took about an eighth of a step (`cifarkit profile --recipe fast`). The C kernel in `max_pool_2x2.c` keeps
one byte per output and writes each gradient once, and computes the same values and gradients bit for bit. It runs
where training on the CPU needs a gradient through a channels-last bf16 or fp32 pool; elsewhere (evaluation,
export, CUDA, torch.compile, or no C compiler) the pool is torch's.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function

from cifarkit.core import native

SOURCE = Path(__file__).with_name("max_pool_2x2.c")
DTYPES = (torch.bfloat16, torch.float32)


def kernel() -> ctypes.CDLL | None:
    library = native.load(SOURCE)
    if library is not None and not library.max_pool_2x2_forward.argtypes:
        for function in (library.max_pool_2x2_forward, library.max_pool_2x2_backward):
            function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4 + [ctypes.c_int] * 2
            function.restype = None
    return library


class MaxPool2x2Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        y = torch.empty((n, c, h // 2, w // 2), dtype=x.dtype, memory_format=torch.channels_last)
        place = torch.empty(y.shape, dtype=torch.uint8, memory_format=torch.channels_last)
        with record_function("cifarkit::max_pool_2x2"):
            kernel().max_pool_2x2_forward(x.data_ptr(), y.data_ptr(), place.data_ptr(), n, h, w, c,
                                          x.element_size(), torch.get_num_threads())
        ctx.save_for_backward(place)
        ctx.input_size = (n, c, h, w)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (place,) = ctx.saved_tensors
        n, c, h, w = ctx.input_size
        grad = grad.contiguous(memory_format=torch.channels_last)
        grad_input = torch.empty((n, c, h, w), dtype=grad.dtype, memory_format=torch.channels_last)
        with record_function("cifarkit::max_pool_2x2_backward"):
            kernel().max_pool_2x2_backward(grad.data_ptr(), place.data_ptr(), grad_input.data_ptr(), n, h, w, c,
                                           grad.element_size(), torch.get_num_threads())
        return grad_input


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether a pool of `x` here and now runs the C kernel: CPU training of a channels-last bf16 or fp32 tensor,
    outside torch.compile, TorchScript and tracing, where the kernel could be built."""
    return (x.requires_grad and torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype in DTYPES
            and x.dim() == 4 and min(x.shape[-2:]) >= 2 and x.is_contiguous(memory_format=torch.channels_last)
            and not (torch.compiler.is_compiling() or torch.jit.is_scripting() or torch.jit.is_tracing())
            and kernel() is not None)


class MaxPool2x2(nn.MaxPool2d):
    def __init__(self):
        super().__init__(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MaxPool2x2Function.apply(x) if uses_kernel(x) else super().forward(x)
