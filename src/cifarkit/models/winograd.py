"""A stride-1 3x3 convolution (zero padding 1) by Winograd's minimal filtering F(2x2, 3x3), for fp32 CPU training.

Why: on a CPU without native bf16, training runs in fp32 and oneDNN's direct convolutions already run near the
cores' fp32 matmul peak, so only fewer multiplications make them faster. F(2x2, 3x3) computes each 2x2 block of
outputs from a 4x4 tile of the input with 16 products per channel pair instead of 36: the input tiles and the
filters are transformed, multiplied as 16 independent matmuls (tiles x C_in by C_in x C_out), and transformed back.
The backward pass stays in the same transformed space: the weight gradient is 16 matmuls of the input tiles with
the output gradient's tiles, the input gradient 16 matmuls with the transposed filters, each transformed back.

It pays most where the outputs tile exactly: the pooled layers whose odd last row and column a 2x2 max-pool drops
(fastnet's 15x15 -> 14x14 and 7x7 -> 6x6). An odd layer that keeps all its outputs computes one row and one column
more and crops them, which still paid for fastnet's unpooled 7x7 layer (64 outputs for 49: 16 / 36 x 64 / 49 of
the direct convolution's products). The transforms are additions over the whole tensor; they are done in
slices of whole images so that a slice's tiles are still in cache when its matmuls read them. The layers it was
measured on, with the CPU kind, are in docs/recipes-and-speed.md ("Kernel plans").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Tiles per slice: about as many rows as the matmuls need to run at full speed, few enough that a slice of 256
# channels (16 transformed copies, 25 MB) stays near the cache. The sizes tried are in docs/recipes-and-speed.md.
TILE_ROWS = 1536

# The filter transform G (4 x 3) of F(2x2, 3x3); the input transform B^T and output transform A^T are written out as
# additions below, since their entries are 0 and +-1.
FILTER_TRANSFORM = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def _slices(images: int, tiles_per_image: int) -> list[tuple[int, int]]:
    step = max(1, TILE_ROWS // tiles_per_image)
    return [(start, min(images, start + step)) for start in range(0, images, step)]


def _transform_filters(weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 3, 3) -> (16, C_in, C_out): G g G^T for each filter, in tile-position-major order."""
    g = FILTER_TRANSFORM.to(weight.dtype)
    c_out, c_in = weight.shape[:2]
    return torch.einsum("ai,ocij,bj->abco", g, weight, g).reshape(16, c_in, c_out)


def _filter_gradient(grad_transformed: torch.Tensor, c_in: int, c_out: int) -> torch.Tensor:
    """The adjoint of `_transform_filters`: (16, C_in, C_out) -> (C_out, C_in, 3, 3)."""
    g = FILTER_TRANSFORM.to(grad_transformed.dtype)
    return torch.einsum("ai,abco,bj->ocij", g, grad_transformed.view(4, 4, c_in, c_out), g)


def _transform_tiles(padded: torch.Tensor, tiles_h: int, tiles_w: int, out: torch.Tensor) -> None:
    """B^T d B for every 4x4 tile d (stride 2) of `padded` (n, 2 tiles_h + 2, 2 tiles_w + 2, C), written to `out`
    (16, n, tiles_h, tiles_w, C). B^T's rows: (1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)."""
    d = [padded[:, i:i + 2 * tiles_h:2] for i in range(4)]
    for a, row in enumerate((d[0] - d[2], d[1] + d[2], d[2] - d[1], d[1] - d[3])):
        e = [row[:, :, j:j + 2 * tiles_w:2] for j in range(4)]
        torch.sub(e[0], e[2], out=out[4 * a])
        torch.add(e[1], e[2], out=out[4 * a + 1])
        torch.sub(e[2], e[1], out=out[4 * a + 2])
        torch.sub(e[1], e[3], out=out[4 * a + 3])


def _tiles_gradient(grad: torch.Tensor, tiles_h: int, tiles_w: int, grad_padded: torch.Tensor) -> None:
    """The adjoint of `_transform_tiles`: B dV B^T for each tile's (4, 4) gradient `grad` (4, 4, n, tiles_h,
    tiles_w, C), added into `grad_padded` where the tile came from (neighbouring tiles overlap by 2)."""
    for i, row in enumerate((grad[0], grad[1] - grad[2] + grad[3], grad[1] + grad[2] - grad[0], -grad[3])):
        columns = (row[0], row[1] - row[2] + row[3], row[1] + row[2] - row[0], -row[3])
        for j, column in enumerate(columns):
            grad_padded[:, i:i + 2 * tiles_h:2, j:j + 2 * tiles_w:2] += column


def _inverse_transform(products: torch.Tensor, out: torch.Tensor) -> None:
    """A^T m A for each tile's (4, 4) products `products` (4, 4, n, tiles_h, tiles_w, C_out), into its 2x2 block of
    `out` (n, tiles_h, 2, tiles_w, 2, C_out). A^T's rows: (1, 1, 1, 0), (0, 1, -1, -1)."""
    m = products
    for p, row in enumerate((m[0] + m[1] + m[2], m[1] - m[2] - m[3])):
        torch.add(row[0] + row[1], row[2], out=out[:, :, p, :, 0])
        torch.sub(row[1] - row[2], row[3], out=out[:, :, p, :, 1])


def _output_gradient(grad: torch.Tensor, out: torch.Tensor) -> None:
    """The adjoint of `_inverse_transform`: each 2x2 output block's gradient `grad` (n, tiles_h, 2, tiles_w, 2,
    C_out) spread over the tile's 16 products, into `out` (16, n, tiles_h, tiles_w, C_out)."""
    top, bottom = grad[:, :, 0], grad[:, :, 1]
    for a, row in enumerate((top, top + bottom, top - bottom, -bottom)):
        left, right = row[:, :, :, 0], row[:, :, :, 1]
        out[4 * a].copy_(left)
        torch.add(left, right, out=out[4 * a + 1])
        torch.sub(left, right, out=out[4 * a + 2])
        torch.neg(right, out=out[4 * a + 3])


class WinogradConv3x3(torch.autograd.Function):
    """The top-left `out_h` x `out_w` outputs of conv2d(x, weight, padding=1), in fp32. Odd sizes are computed
    rounded up to even and cropped: the extra row and column are waste."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
        n, c_in, h, w = x.shape
        c_out = weight.shape[0]
        tiles_h, tiles_w = (out_h + 1) // 2, (out_w + 1) // 2
        # Channels last: each tile's channels are contiguous, the matmuls' inner dimension.
        padded = F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 2 * tiles_w + 1 - w, 1, 2 * tiles_h + 1 - h)).contiguous()
        filters = _transform_filters(weight)
        out = x.new_empty(n, tiles_h, 2, tiles_w, 2, c_out)
        for start, end in _slices(n, tiles_h * tiles_w):
            tiles = x.new_empty(16, end - start, tiles_h, tiles_w, c_in)
            _transform_tiles(padded[start:end], tiles_h, tiles_w, tiles)
            products = torch.bmm(tiles.view(16, -1, c_in), filters)
            _inverse_transform(products.view(4, 4, end - start, tiles_h, tiles_w, c_out), out[start:end])
        ctx.save_for_backward(padded, filters)
        ctx.input_size = (h, w)
        out = out.view(n, 2 * tiles_h, 2 * tiles_w, c_out)
        if (out_h, out_w) != out.shape[1:3]:
            out = out[:, :out_h, :out_w].contiguous()
        return out.permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        padded, filters = ctx.saved_tensors
        n, c_in = padded.shape[0], padded.shape[3]
        c_out, out_h, out_w = grad_output.shape[1:]
        tiles_h, tiles_w = (out_h + 1) // 2, (out_w + 1) // 2
        grad_nhwc = grad_output.permute(0, 2, 3, 1)
        if (out_h, out_w) != (2 * tiles_h, 2 * tiles_w):
            # The rounded-up row and column were cropped away: their gradient is zero. Only then: a pad copies.
            grad_nhwc = F.pad(grad_nhwc, (0, 0, 0, 2 * tiles_w - out_w, 0, 2 * tiles_h - out_h))
        grad_blocks = grad_nhwc.reshape(n, tiles_h, 2, tiles_w, 2, c_out)
        grad_filters = torch.zeros_like(filters)
        want_input = ctx.needs_input_grad[0]
        grad_padded = torch.zeros_like(padded) if want_input else None
        for start, end in _slices(n, tiles_h * tiles_w):
            # The tiles are transformed again rather than kept from the forward pass: 4x the input's size per layer.
            tiles = padded.new_empty(16, end - start, tiles_h, tiles_w, c_in)
            _transform_tiles(padded[start:end], tiles_h, tiles_w, tiles)
            grad_products = padded.new_empty(16, end - start, tiles_h, tiles_w, c_out)
            _output_gradient(grad_blocks[start:end], grad_products)
            grad_products = grad_products.view(16, -1, c_out)
            grad_filters.baddbmm_(tiles.view(16, -1, c_in).transpose(1, 2), grad_products)
            if want_input:
                grad_tiles = torch.bmm(grad_products, filters.transpose(1, 2))
                _tiles_gradient(grad_tiles.view(4, 4, end - start, tiles_h, tiles_w, c_in), tiles_h, tiles_w,
                                grad_padded[start:end])
        grad_input = None
        if want_input:
            h, w = ctx.input_size
            grad_input = grad_padded[:, 1:1 + h, 1:1 + w].permute(0, 3, 1, 2)
        return grad_input, _filter_gradient(grad_filters, c_in, c_out), None, None
