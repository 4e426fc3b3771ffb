"""Faster CPU training kernels for fastnet's pool and its BatchNorm + GELU pairs, in C (`cpu_kernels.c`).

Why: on an AMX Xeon, where the convolutions are fast, a `fast` step spent about a third of its time in torch's
max-pool, BatchNorm and GELU kernels (`cifarkit profile --recipe fast`), memory-bound passes over large tensors:
- torch's max-pool keeps an int64 index per output, then zero-fills the whole input's gradient and scatters into
  it. `MaxPool2x2` keeps one byte per output and writes each gradient once; values and gradients are torch's, bit
  for bit.
- BatchNorm then GELU take five passes over the tensor forward and eight backward as separate kernels;
  `norm_act` takes two each way. It rounds to bf16 where torch's kernels do and reads GELU and its derivative from
  tables of torch's own values, so it differs from torch only in how the batch statistics are summed.

Both run only in CPU training of channels-last tensors (bf16, and fp32 for the pool), outside torch.compile,
TorchScript and tracing, where the C file could be built (`core/native.py`). Elsewhere (evaluation, export, CUDA,
or no C compiler) the modules are plain torch, and the weights and state dicts are the same either way.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from cifarkit.core import native

SOURCE = Path(__file__).with_name("cpu_kernels.c")
POOL_DTYPES = (torch.bfloat16, torch.float32)

_pointer, _long, _int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
SIGNATURES = {
    "max_pool_2x2_forward": ([_pointer] * 3 + [_long] * 4 + [_int] * 2, None),
    "max_pool_2x2_backward": ([_pointer] * 3 + [_long] * 4 + [_int] * 2, None),
    "norm_act_statistics": ([_pointer, _long, _long, _int, _pointer], _int),
    "norm_act_forward": ([_pointer] * 5 + [_long, _long, _int], None),
    "norm_act_backward_sums": ([_pointer] * 7 + [_long, _long, _int, _pointer], _int),
    "norm_act_backward_apply": ([_pointer] * 6 + [_long, _long, _int], None),
}


def kernel() -> ctypes.CDLL | None:
    library = native.load(SOURCE)
    if library is not None and not library.max_pool_2x2_forward.argtypes:
        for name, (arguments, result) in SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, result
    return library


def _cpu_training(x: torch.Tensor) -> bool:
    return (x.requires_grad and torch.is_grad_enabled() and x.device.type == "cpu" and x.dim() == 4
            and x.is_contiguous(memory_format=torch.channels_last)
            and not (torch.compiler.is_compiling() or torch.jit.is_scripting() or torch.jit.is_tracing()))


def _threads() -> int:
    return torch.get_num_threads()


class MaxPool2x2Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        y = torch.empty((n, c, h // 2, w // 2), dtype=x.dtype, memory_format=torch.channels_last)
        place = torch.empty(y.shape, dtype=torch.uint8, memory_format=torch.channels_last)
        with record_function("cifarkit::max_pool_2x2"):
            kernel().max_pool_2x2_forward(x.data_ptr(), y.data_ptr(), place.data_ptr(), n, h, w, c,
                                          x.element_size(), _threads())
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
                                           grad.element_size(), _threads())
        return grad_input


def pool_uses_kernel(x: torch.Tensor) -> bool:
    """Whether a pool of `x` here and now runs the C kernel."""
    return (_cpu_training(x) and x.dtype in POOL_DTYPES and min(x.shape[-2:]) >= 2 and kernel() is not None)


class MaxPool2x2(nn.MaxPool2d):
    def __init__(self):
        super().__init__(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MaxPool2x2Function.apply(x) if pool_uses_kernel(x) else super().forward(x)


@functools.cache
def gelu_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """torch's bf16 GELU of every bf16 value and its derivative there, both in fp32 and indexed by the input's bits:
    the values GELU's forward and backward kernels compute, looked up (a bf16 value is exact in fp32, and fp32
    tables let the vector units gather)."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    derivative = torch.ops.aten.gelu_backward(torch.ones(1 << 16), values.float())
    return F.gelu(values).float().contiguous(), derivative.contiguous()


def _per_channel(*values: torch.Tensor) -> list[torch.Tensor]:
    return [value.to(torch.float32).contiguous() for value in values]


class BatchNormGELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float):
        n, c, h, w = x.shape
        rows = n * h * w
        library = kernel()
        sums = torch.empty(2 * c, dtype=torch.float64)
        with record_function("cifarkit::batch_norm_gelu"):
            if library.norm_act_statistics(x.data_ptr(), rows, c, _threads(), sums.data_ptr()) != 0:
                raise MemoryError("no memory for the BatchNorm statistics' scratch space")
            mean = sums[:c] / rows
            variance = (sums[c:] / rows - mean * mean).clamp_(min=0)
            invstd = (variance + eps).rsqrt()
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((variance * rows / max(rows - 1, 1)).to(running_var.dtype),
                                                    alpha=momentum)
            mean, invstd = _per_channel(mean, invstd)
            alpha, = _per_channel(invstd * weight.detach())
            beta, = _per_channel(bias.detach() - mean * alpha)
            gelu, _ = gelu_tables()
            y = torch.empty_like(x, memory_format=torch.channels_last)
            library.norm_act_forward(x.data_ptr(), alpha.data_ptr(), beta.data_ptr(), gelu.data_ptr(), y.data_ptr(),
                                     rows, c, _threads())
        ctx.save_for_backward(x, mean, invstd, alpha, beta)
        ctx.parameters_need_grad = (weight.requires_grad, bias.requires_grad)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, mean, invstd, alpha, beta = ctx.saved_tensors
        n, c, h, w = x.shape
        rows = n * h * w
        library = kernel()
        grad = grad.contiguous(memory_format=torch.channels_last)
        grad_input = torch.empty_like(x, memory_format=torch.channels_last)
        sums = torch.empty(2 * c, dtype=torch.float64)
        _, derivative = gelu_tables()
        with record_function("cifarkit::batch_norm_gelu_backward"):
            if library.norm_act_backward_sums(x.data_ptr(), grad.data_ptr(), alpha.data_ptr(), beta.data_ptr(),
                                              mean.data_ptr(), derivative.data_ptr(), grad_input.data_ptr(), rows, c,
                                              _threads(), sums.data_ptr()) != 0:
                raise MemoryError("no memory for the BatchNorm gradient's scratch space")
            grad_sum, grad_dot = sums[:c], sums[c:]
            k, grad_mean = _per_channel(grad_dot * invstd * invstd / rows, grad_sum / rows)
            library.norm_act_backward_apply(x.data_ptr(), alpha.data_ptr(), mean.data_ptr(), k.data_ptr(),
                                            grad_mean.data_ptr(), grad_input.data_ptr(), rows, c, _threads())
        weight_needs, bias_needs = ctx.parameters_need_grad
        grad_weight = (grad_dot * invstd).float() if weight_needs else None
        grad_bias = grad_sum.float() if bias_needs else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def norm_act_uses_kernel(norm: nn.Module, act: nn.Module, x: torch.Tensor) -> bool:
    """Whether `act(norm(x))` here and now runs the C kernel: a training BatchNorm2d that keeps running statistics
    with a fixed momentum, then exact GELU, on a channels-last bf16 tensor."""
    return (isinstance(norm, nn.BatchNorm2d) and norm.training and norm.affine and norm.track_running_stats
            and norm.momentum is not None and isinstance(act, nn.GELU) and act.approximate == "none"
            and x.dtype == torch.bfloat16 and _cpu_training(x) and x.numel() > x.shape[1] and kernel() is not None)


def norm_act(norm: nn.BatchNorm2d, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`act(norm(x))`, by the C kernel where `norm_act_uses_kernel`, with nn.BatchNorm2d's bookkeeping."""
    if not norm_act_uses_kernel(norm, act, x):
        return act(norm(x))
    norm.num_batches_tracked.add_(1)
    return BatchNormGELUFunction.apply(x, norm.weight, norm.bias, norm.running_mean, norm.running_var,
                                       norm.momentum, norm.eps)
