"""Layers shared by the model families.

`Conv3x3` is a stride-1, padding-1 3x3 convolution, an `nn.Conv2d` in every way that is saved or exported. Only its
bf16 training backward on the CPU differs, and only for small images. `cifarkit profile` showed the convolutions'
backward at half of a fastnet step, and in it oneDNN's weight-gradient kernel (brgconv_bwd_w, AMX) was the slow part
for small images: on the 2-core AMX machines this was measured on, at batch 2000 in bf16, it ran at 0.56 TFLOP/s
for the 256-channel layer at 7x7 and 0.18 at 3x3, where the forward ran at 1.6 and 1.4. The same sum computed as
matmuls over the 9 shifted copies of the input (im2col in channels-last), in slices of about 2,048 rows, took
176-191 ms against oneDNN's 205-220 at 7x7, and 33-45 against 121-128 at 3x3 (medians of 5; one matmul over the
whole batch took 245-296 and 41-44). At 15 and 31 pixels per row oneDNN was faster (1.9-5.9x), so larger images keep
it, and so does fp32, where oneDNN's weight gradient took 0.9-1.2x the forward's time and the matmul 0.8-1.6x of
oneDNN's (batch 256).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The widest output row that goes to the matmul: rows of 7 and 3 were faster that way, rows of 15 were not.
MATMUL_WEIGHT_GRAD_MAX_WIDTH = 8
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
    """conv2d(padded, weight) with no further padding; its weight gradient by `weight_gradient_by_matmul`."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The weight comes in its own dtype (fp32 under autocast) and is cast here, so that the fp32 sum of the
        # gradient reaches it without a round trip through bf16.
        low_weight = weight.to(padded.dtype)
        ctx.save_for_backward(padded, low_weight)
        ctx.weight_dtype = weight.dtype
        return F.conv2d(padded, low_weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        padded, low_weight = ctx.saved_tensors
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.ops.aten.convolution_backward(
                grad_output, padded, low_weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                [True, False, False])[0]
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient_by_matmul(grad_output, padded).to(ctx.weight_dtype)
        return grad_input, grad_weight


class Conv3x3(nn.Conv2d):
    """A 3x3 convolution with zero padding 1. `pooled`: a 2x2 max-pool with floor rounding follows, which never
    reads an odd last row or column of this output. Where the matmul computes the weight gradient, which pads the
    input itself, those are then not computed (no padding on that side): fastnet's last group has its first
    convolution at 6x6 instead of 7x7, 27% less work forward and backward, and 1.05x per whole step in an
    interleaved A/B (12 pairs, 11 faster). For oneDNN's path the explicit padding this needs cost more than it saved
    (1.02x for cropping the 31 and 15 pixel layers too), so those compute all of their outputs."""

    def __init__(self, c_in: int, c_out: int, pooled: bool = False):
        super().__init__(c_in, c_out, 3, padding=1, bias=False)
        self.pooled = pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if (self.training and torch.is_grad_enabled() and self.weight.requires_grad and x.device.type == "cpu"
                and w <= MATMUL_WEIGHT_GRAD_MAX_WIDTH):
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
            # In fp32 oneDNN's weight gradient took about the forward's time, and the matmul was not faster.
            if dtype == torch.bfloat16:
                padding = (1, 1 - w % 2, 1, 1 - h % 2) if self.pooled else (1, 1, 1, 1)  # left, right, top, bottom
                # The input cast autocast would make inside conv2d, made here.
                with torch.autocast("cpu", enabled=False):
                    return _Conv3x3MatmulWeightGrad.apply(F.pad(x.to(dtype), padding), self.weight)
        return super().forward(x)
