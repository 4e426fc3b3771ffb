"""Layers shared by the model families.

`Conv3x3` is a stride-1, padding-1 3x3 convolution, an `nn.Conv2d` in every way that is saved or exported. Only its
bf16 training on the CPU differs, and only where it was measured to be faster; the function it computes is the same.

`cifarkit profile` showed the convolutions' backward at half of a fastnet step, and in it oneDNN's weight-gradient
kernel was the slow part for small images: on the 2-core AMX machines this was first measured on, at batch 2000 in
bf16, it ran at 0.56 TFLOP/s for the 256-channel layer at 7x7 and 0.18 at 3x3, where the forward ran at 1.6 and 1.4.
The same sum computed as matmuls over the 9 shifted copies of the input (im2col in channels-last), in slices of about
2,048 rows, took 176-191 ms against oneDNN's 205-220 at 7x7, and 33-45 against 121-128 at 3x3 (medians of 5; one
matmul over the whole batch took 245-296 and 41-44). At 15 and 31 pixels per row oneDNN was faster (1.9-5.9x), and
so it was in fp32, where oneDNN's weight gradient took 0.9-1.2x the forward's time.

A CPU with AVX512-BF16 but no AMX (an AMD EPYC, Zen 5) weighs these differently: there oneDNN's forward ran at
0.81-0.87 TFLOP/s, its weight gradient at 0.58 at 7x7, the matmul's at 0.48. Each of fastnet's layers timed there
in the paths below (forward + backward, batch 2000, medians of 5, ms): 256 channels at 7x7, oneDNN 479 against the
matmul's 549; the pooled 7x7 layer, cropped by the matmul path to 6x6, 395 against oneDNN's 459; 3x3, 102 against
111; the pooled 64->256 layer at 15x15, cropped to 14x14 by an explicit pad for oneDNN, 495 against 539 (at 31x31
the same crop cost more than it saved, 202 against 171). `KERNEL_PLANS` holds each CPU's choices.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cifarkit.device import cpu_features

# Rows of the shifted-copy matrix per matmul. Slices of ~2,048 rows (41 images at 7x7, 9 MB of copies for 256
# channels) let each matmul read its copies while they are still in cache; one matmul over the whole batch (452 MB of
# copies at batch 2000) took 1.3-1.5x as long, slices of 1,024 rows were slower again (matmul overhead), 4,096 no faster.
SLICE_ROWS = 2048


def weight_gradient_by_matmul(grad_output: torch.Tensor, padded: torch.Tensor,
                              slice_rows: int = SLICE_ROWS) -> torch.Tensor:
    """The weight gradient of a stride-1 3x3 convolution of the already padded input: (C_out, C_in, 3, 3), in fp32.

    With the input's 9 shifted copies side by side, cols is (N*H*W, 9*C_in) for the output's H x W, and the gradient
    is grad^T @ cols, taken over slices of whole images of about `slice_rows` rows each, and added up in fp32.
    """
    n, c_in = padded.shape[:2]
    c_out, h, w = grad_output.shape[1:]
    padded_nhwc = padded.permute(0, 2, 3, 1)
    grad_nhwc = grad_output.permute(0, 2, 3, 1)
    grad_weight = torch.zeros(c_out, 9 * c_in, dtype=torch.float32, device=padded.device)
    images = max(1, slice_rows // (h * w))
    for start in range(0, n, images):
        window = padded_nhwc[start:start + images]
        cols = torch.cat([window[:, dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], dim=3)
        # A contiguous C_out x rows left operand: the transposed view made the matmul slower.
        grad_rows = grad_nhwc[start:start + images].reshape(-1, c_out).t().contiguous()
        grad_weight += grad_rows @ cols.reshape(-1, 9 * c_in)  # C_out, (dy, dx, C_in)
    return grad_weight.view(-1, 3, 3, c_in).permute(0, 3, 1, 2)


class _Conv3x3MatmulWeightGrad(torch.autograd.Function):
    """conv2d of `x` padded by `padding` (left, right, top, bottom); its weight gradient by
    `weight_gradient_by_matmul`. With padding 1 on every side, the input's gradient is taken with that padding
    inside oneDNN, over the input's own pixels: over the padded copy it would cost (h + 2)^2 / h^2 as much, 2.8x at
    3x3 (102 against 119 ms for the whole layer there)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, int, int, int]) -> torch.Tensor:
        # The weight comes in its own dtype (fp32 under autocast) and is cast here, so that the fp32 sum of the
        # gradient reaches it without a round trip through bf16.
        low_weight = weight.to(x.dtype)
        padded = F.pad(x, padding)
        ctx.save_for_backward(x, padded, low_weight)
        ctx.weight_dtype, ctx.padding = weight.dtype, padding
        return F.conv2d(padded, low_weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, padded, low_weight = ctx.saved_tensors
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = _input_gradient(grad_output, x, padded, low_weight, ctx.padding)
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient_by_matmul(grad_output, padded).to(ctx.weight_dtype)
        return grad_input, grad_weight, None


def _input_gradient(grad_output, x, padded, weight, padding) -> torch.Tensor:
    if padding == (1, 1, 1, 1):
        return torch.ops.aten.convolution_backward(grad_output, x, weight, None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, [True, False, False])[0]
    # A cropped layer: its missing last row and column have no gradient, and the padding's share is dropped.
    grad_padded = torch.ops.aten.convolution_backward(grad_output, padded, weight, None, [1, 1], [0, 0], [1, 1],
                                                      False, [0, 0], 1, [True, False, False])[0]
    left, _, top, _ = padding
    return grad_padded[..., top:top + x.shape[-2], left:left + x.shape[-1]]


@dataclass(frozen=True)
class KernelPlan:
    """Which path each 3x3 convolution of bf16 CPU training takes, by the width of its output rows."""
    matmul_max_width: int  # unpooled layers: the matmul weight gradient up to this width, oneDNN above
    cropped_matmul_max_width: int  # pooled layers of odd width: the matmul path, cropped, up to this width
    onednn_crop_max_width: int  # pooled layers of odd width past the matmul's: oneDNN on a cropping pad up to this


# By the CPU's bf16 engine, each value measured (this module's docstring). AMX: rows of 7 and 3 by matmul, 15 and 31
# by oneDNN, and no pad-crop for oneDNN (cropping its 15 and 31 pixel layers too gave 1.021x per step against 1.047x
# without). Without AMX (AVX512-BF16): oneDNN for the 7x7 layer, the matmul for 3x3 and the cropped pooled 7x7, and
# the pad-crop for the pooled 15x15 layer only. On that CPU, whole fastnet steps with this plan (and the unpadded input
# gradient) took 0.93x the time of the AMX plan with the padded one, in an interleaved A/B (8 pairs, all faster).
KERNEL_PLANS = {"amx": KernelPlan(8, 8, 0), "no_amx": KernelPlan(4, 8, 16)}


@functools.cache
def cpu_plan() -> KernelPlan:
    return KERNEL_PLANS["amx" if "amx" in cpu_features() else "no_amx"]


class Conv3x3(nn.Conv2d):
    """A 3x3 convolution with zero padding 1. `pooled`: a 2x2 max-pool with floor rounding follows, which never
    reads an odd last row or column of this output. In bf16 training on the CPU those are then not computed, where
    it pays (`cpu_plan`): fastnet's pooled 7x7 layer computes 6x6 outputs, 27% less work forward and backward, and
    1.05x per whole step in an interleaved A/B on an AMX machine (12 pairs, 11 faster)."""

    def __init__(self, c_in: int, c_out: int, pooled: bool = False):
        super().__init__(c_in, c_out, 3, padding=1, bias=False)
        self.pooled = pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if self.training and torch.is_grad_enabled() and self.weight.requires_grad and x.device.type == "cpu":
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
            # In fp32 oneDNN's weight gradient took about the forward's time, and the matmul was not faster.
            if dtype == torch.bfloat16:
                plan = cpu_plan()
                crop = self.pooled and w % 2 == 1 and h % 2 == 1
                # The input cast autocast would make inside conv2d, made here.
                with torch.autocast("cpu", enabled=False):
                    if w <= (plan.cropped_matmul_max_width if crop else plan.matmul_max_width):
                        padding = (1, 0, 1, 0) if crop else (1, 1, 1, 1)  # left, right, top, bottom
                        return _Conv3x3MatmulWeightGrad.apply(x.to(dtype), self.weight, padding)
                    if crop and w <= plan.onednn_crop_max_width:
                        return F.conv2d(F.pad(x.to(dtype), (1, 0, 1, 0)), self.weight.to(dtype))
        return super().forward(x)
