"""Layers shared by the model families.

`Conv3x3` is a stride-1, padding-1 3x3 convolution, an `nn.Conv2d` in every way that is saved or exported. Only its
bf16 training on the CPU differs, and only where it was measured to be faster; the function it computes is the same.

Why: in bf16 on the CPU, oneDNN's weight-gradient kernel is slow for small images (rows of a few pixels), and the
same sum computed as matmuls over the input's 9 shifted copies (im2col in channels-last) is faster there; for wider
rows, and in fp32, oneDNN's own kernel is the faster one. Where the line falls depends on the CPU's bf16 engine (AMX,
or AVX512-BF16 alone), so `KERNEL_PLANS` holds a plan per engine. The per-layer timings behind each plan, with the
CPU kinds they were taken on, are in docs/recipes-and-speed.md ("Kernel plans").

In fp32 training on the CPU (where bf16 is not native) the pooled layers of odd width that the pool crops to an even
one, and the unpooled layers of the widths where it was measured to pay, take Winograd's F(2x2, 3x3) or F(4x4, 3x3)
instead (`models/winograd.py`), whichever needs fewer products for the layer's size: fewer multiplications where
oneDNN's direct kernels already run near the fp32 matmul peak. In bf16, where the plan says so, a pooled layer of odd
width takes F(2x2, 3x3) in bf16 on its cropped outputs: oneDNN's bf16 kernels run near the bf16 matmul peak too.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cifarkit.core.device import cpu_features
from cifarkit.models.winograd import TRANSFORMS, WinogradConv3x3, blocks

# Rows of the shifted-copy matrix per matmul: few enough that each matmul reads its copies while they are still in
# cache (41 images at 7x7, 9 MB of copies for 256 channels, against 452 MB for the whole batch), enough that the
# matmuls' fixed cost stays small. The slice sizes tried are in docs/recipes-and-speed.md ("Kernel plans").
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


class Conv3x3MatmulWeightGrad(torch.autograd.Function):
    """conv2d of `x` padded by `padding` (left, right, top, bottom); its weight gradient by
    `weight_gradient_by_matmul`. With padding 1 on every side, the input's gradient is taken with that padding
    inside oneDNN, over the input's own pixels: over the padded copy it would cost (h + 2)^2 / h^2 as much, 2.8x at
    3x3."""

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
    # pooled layers of odd width: Winograd's F(2x2, 3x3) in bf16 on the kept outputs up to this, before the others
    winograd_cropped_max_width: int = 0


# By the CPU's bf16 engine. AMX: rows of 7 and 3 by matmul, 15 and 31 by oneDNN, and no pad-crop for oneDNN. Without
# AMX (AVX512-BF16): oneDNN for the 7x7 layer, the matmul for 3x3, Winograd for the cropped pooled 7x7, and the
# pad-crop for the pooled 15x15 layer. Each choice was the faster in interleaved timings on that kind
# (docs/recipes-and-speed.md); Winograd in bf16 was not timed with AMX.
KERNEL_PLANS = {"amx": KernelPlan(8, 8, 0), "no_amx": KernelPlan(4, 8, 16, winograd_cropped_max_width=8)}

# fp32 training: pooled layers of odd width up to this take Winograd on their cropped, even outputs. At 31 pixels
# (24 input channels) oneDNN's direct kernel was the faster (docs/recipes-and-speed.md, "Kernel plans").
WINOGRAD_MAX_WIDTH = 16
# fp32 training: unpooled layers of these widths take Winograd on their outputs rounded up to whole blocks, then
# cropped. At 7 and 3 pixels (256 channels) F(4x4, 3x3) on 8x8 and 4x4 outputs was the faster; at 15 (64 input
# channels) oneDNN was.
WINOGRAD_UNPOOLED_WIDTHS = (7, 3)
# fp32 training: the largest Winograd block (outputs a side) a layer may take; 2 is F(2x2, 3x3) alone.
WINOGRAD_MAX_TILE = 4
# bf16 training: F(2x2, 3x3) alone (see models/winograd.py).
BF16_WINOGRAD_TILE = 2


def winograd_tile(kept: int) -> int:
    """The Winograd block with the fewest products for `kept` x `kept` outputs: (m + 2)^2 for each of the
    ceil(kept / m)^2 blocks of m x m. A tie goes to the smaller block, whose transforms cost less per product:
    fastnet's 14x14 and 8x8 (unpooled 7x7) outputs take F(4x4), its 6x6 ones F(2x2)."""
    return min((m for m in TRANSFORMS if m <= WINOGRAD_MAX_TILE), key=lambda m: ((m + 2) * blocks(kept, m), m))


@functools.cache
def cpu_plan() -> KernelPlan:
    return KERNEL_PLANS["amx" if "amx" in cpu_features() else "no_amx"]


class Conv3x3(nn.Conv2d):
    """A 3x3 convolution with zero padding 1. `pooled`: a 2x2 max-pool with floor rounding follows, which never
    reads an odd last row or column of this output. In bf16 training on the CPU those are then not computed, where
    it pays (`cpu_plan`): fastnet's pooled 7x7 layer computes 6x6 outputs, 27% less work forward and backward."""

    def __init__(self, c_in: int, c_out: int, pooled: bool = False):
        super().__init__(c_in, c_out, 3, padding=1, bias=False)
        self.pooled = pooled

    def path(self, x: torch.Tensor) -> str:
        """How a call on `x` computes, here and now: "plain" (nn.Conv2d), "matmul" (the weight gradient by
        `weight_gradient_by_matmul`), "matmul-cropped" (the same on the pooled layer's kept rows and columns),
        "onednn-cropped" (oneDNN on a pad that crops them), "winograd-bf16" (`WinogradConv3x3` in bf16 on the kept
        ones, in blocks of BF16_WINOGRAD_TILE) or, in fp32, "winograd" (`WinogradConv3x3` on the kept rows and
        columns, or on all of an unpooled layer's, in blocks of `winograd_tile`). Only training on the CPU leaves
        the plain path, and not under torch.compile (`train.compile`): its graph then takes oneDNN's convolution
        whole, which these autograd functions would break at every layer."""
        h, w = x.shape[-2:]
        if not (self.training and torch.is_grad_enabled() and self.weight.requires_grad and x.device.type == "cpu") \
                or torch.compiler.is_compiling():
            return "plain"
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        crop = self.pooled and w % 2 == 1 and h % 2 == 1
        if dtype == torch.float32 and x.dtype == torch.float32:
            winograd = (crop and w <= WINOGRAD_MAX_WIDTH) or (not self.pooled and w in WINOGRAD_UNPOOLED_WIDTHS)
            return "winograd" if winograd else "plain"
        if dtype != torch.bfloat16:
            return "plain"
        plan = cpu_plan()
        if crop and w <= plan.winograd_cropped_max_width:
            return "winograd-bf16"
        if w <= (plan.cropped_matmul_max_width if crop else plan.matmul_max_width):
            return "matmul-cropped" if crop else "matmul"
        if crop and w <= plan.onednn_crop_max_width:
            return "onednn-cropped"
        return "plain"

    def computed_outputs(self, path: str, h: int, w: int) -> tuple[int, int, int]:
        """The rows and columns of outputs that `path` computes on an h x w input (a pooled layer's kept ones where
        the path crops), and its Winograd block (0: none)."""
        if path == "winograd":
            crop = int(self.pooled)  # a pooled layer's path is Winograd only where its size is odd
            return h - crop, w - crop, winograd_tile(max(h, w) - crop)
        if path == "winograd-bf16":
            return h - 1, w - 1, BF16_WINOGRAD_TILE
        if path in ("matmul-cropped", "onednn-cropped"):
            return h - 1, w - 1, 0
        return h, w, 0

    def multiply_adds(self, x: torch.Tensor) -> int:
        """The forward pass's multiply-adds per image of `x`, as this layer computes them here and now: 9 per output
        it computes, or Winograd's (m + 2)^2 per block of m x m outputs, for each pair of channels."""
        rows, columns, tile = self.computed_outputs(self.path(x), *x.shape[-2:])
        products = blocks(rows, tile) * blocks(columns, tile) * (tile + 2) ** 2 if tile else rows * columns * 9
        return products * self.in_channels * self.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x)
        if path == "plain":
            return super().forward(x)
        if path == "winograd":
            return WinogradConv3x3.apply(x, self.weight, *self.computed_outputs(path, *x.shape[-2:]))
        # The input cast autocast would make inside conv2d, made here.
        with torch.autocast("cpu", enabled=False):
            low = x.to(torch.bfloat16)
            if path == "winograd-bf16":
                return WinogradConv3x3.apply(low, self.weight, *self.computed_outputs(path, *low.shape[-2:]))
            if path == "onednn-cropped":
                return F.conv2d(F.pad(low, (1, 0, 1, 0)), self.weight.to(torch.bfloat16))
            padding = (1, 0, 1, 0) if path == "matmul-cropped" else (1, 1, 1, 1)  # left, right, top, bottom
            return Conv3x3MatmulWeightGrad.apply(low, self.weight, padding)
