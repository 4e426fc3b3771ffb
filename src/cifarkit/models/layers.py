"""Layers shared by the model families.

`Conv3x3` is a stride-1, padding-1 3x3 convolution, an `nn.Conv2d` in every way that is saved or exported. Only its
bf16 training backward on the CPU differs, and only for small images. `cifarkit profile` showed the convolutions'
backward at half of a fastnet step, and in it oneDNN's weight-gradient kernel (brgconv_bwd_w, AMX) was the slow part
for small images: on the 2-core AMX machine this was measured on, it took 3-4x the forward's time for the 256-channel
layers at 7x7 and 3x3. The same sum computed as one matmul over the 9 shifted copies of the input (im2col in channels-
last) took 0.52x and 0.20x of oneDNN's time there (medians of 15 interleaved pairs, batch 500, bf16). At 15 and 31
pixels per row oneDNN was faster (1.9-5.9x), so larger images keep it, and so does fp32, where oneDNN's weight
gradient took 0.9-1.2x the forward's time and the matmul 0.8-1.6x of oneDNN's (batch 256).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The widest output row that goes to the matmul: rows of 7 and 3 were faster that way, rows of 15 were not.
MATMUL_WEIGHT_GRAD_MAX_WIDTH = 8


def weight_gradient_by_matmul(grad_output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The weight gradient of a stride-1, padding-1 3x3 convolution: (C_out, C_in, 3, 3), in the inputs' dtype.

    With the input's 9 shifted copies side by side, cols is (N*H*W, 9*C_in) and the gradient is grad^T @ cols. The
    copy takes 9x the input's memory (452 MB at batch 2000, 7x7, 256 channels, bf16). Slices of 500 images were not
    measurably faster over whole steps, so it is one matmul.
    """
    c_in, h, w = inputs.shape[1:]
    padded = F.pad(inputs, (1, 1, 1, 1)).permute(0, 2, 3, 1)  # N, H+2, W+2, C_in
    cols = torch.cat([padded[:, dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], dim=3)
    grad_rows = grad_output.permute(0, 2, 3, 1).reshape(-1, grad_output.shape[1])  # N*H*W, C_out
    # A contiguous C_out x N*H*W left operand: the transposed view made the matmul 1.3x slower.
    grad_weight = grad_rows.t().contiguous() @ cols.reshape(-1, 9 * c_in)  # C_out, (dy, dx, C_in)
    return grad_weight.view(-1, 3, 3, c_in).permute(0, 3, 1, 2)


class _Conv3x3MatmulWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        return F.conv2d(inputs, weight, padding=1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inputs, weight = ctx.saved_tensors
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.ops.aten.convolution_backward(
                grad_output, inputs, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False])[0]
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient_by_matmul(grad_output, inputs)
        return grad_input, grad_weight


class Conv3x3(nn.Conv2d):
    def __init__(self, c_in: int, c_out: int):
        super().__init__(c_in, c_out, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.training and torch.is_grad_enabled() and self.weight.requires_grad and x.device.type == "cpu"
                and x.shape[-1] <= MATMUL_WEIGHT_GRAD_MAX_WIDTH):
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
            # In fp32 oneDNN's weight gradient took about the forward's time, and the matmul was not faster.
            if dtype == torch.bfloat16:
                # The cast autocast would make inside conv2d, made here: the gradient then flows back to the fp32
                # weight through .to(), as it does through autocast's own cast.
                with torch.autocast("cpu", enabled=False):
                    return _Conv3x3MatmulWeightGrad.apply(x.to(dtype), self.weight.to(dtype))
        return super().forward(x)
