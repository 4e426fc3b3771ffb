"""A stride-1 3x3 convolution (zero padding 1) by Winograd's minimal filtering F(m x m, 3x3), for CPU training.

Why: on a CPU without native bf16, training runs in fp32 and oneDNN's direct convolutions already run near the
cores' fp32 matmul peak, so only fewer multiplications make them faster. F(m x m, 3x3) computes each m x m block of
outputs from an (m + 2) x (m + 2) tile of the input with (m + 2)^2 products per channel pair instead of 9 m^2: the
input tiles and the filters are transformed, multiplied as (m + 2)^2 independent matmuls (tiles x C_in by C_in x
C_out), and transformed back. F(2x2, 3x3) takes 16 products for 4 outputs, F(4x4, 3x3) 36 for 16. The backward pass
stays in the same transformed space: the weight gradient is a matmul per tile position of the input tiles with the
output gradient's tiles, the input gradient one with the transposed filters, each transformed back.

The outputs are computed in whole blocks: a size that m does not divide is rounded up and cropped, and the extra
rows and columns are waste. So it pays where the blocks fit: the pooled layers whose odd last row and column a 2x2
max-pool drops (fastnet's 15x15 -> 14x14, 7x7 -> 6x6), or an unpooled layer whose rounding wastes less than the
smaller products save (fastnet's 7x7 layer as 8x8). The transforms are sums of a few scaled copies over the whole
tensor; they are done in slices of whole images so that a slice's tiles are still in cache when its matmuls read
them. The layers it was measured on, with the CPU kind, are in docs/recipes-and-speed.md ("Kernel plans").

In bf16 (an input in bf16) the transforms, the products and the input's gradient are bf16 and the weight's gradient
is summed in the weight's dtype (fp32 in training). Each transform then rounds, so only F(2x2, 3x3), whose
transforms add and subtract, is used there: F(4x4)'s larger coefficients multiply bf16's rounding error several
times over (tests/test_models.py bounds F(2x2)'s error against the direct kernel's).
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Transform:
    """The three matrices of F(m x m, 3x3) (Lavin and Gray, 2015): input B^T (t x t), filter G (t x 3) and output
    A^T (m x t), for tiles of t = m + 2, with the interpolation points 0, +-1, (+-2,) and infinity."""
    input_rows: tuple[tuple[float, ...], ...]
    filter_rows: tuple[tuple[float, ...], ...]
    output_rows: tuple[tuple[float, ...], ...]

    @property
    def outputs(self) -> int:
        return len(self.output_rows)

    @property
    def size(self) -> int:
        return len(self.input_rows)


TRANSFORMS = {
    2: Transform(
        input_rows=((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
        filter_rows=((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1)),
        output_rows=((1, 1, 1, 0), (0, 1, -1, -1))),
    4: Transform(
        input_rows=((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0),
                    (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1)),
        filter_rows=((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
                     (1 / 24, -1 / 12, 1 / 6), (0, 0, 1)),
        output_rows=((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))),
}

# Tiles per slice, by the outputs per tile: about as many rows as the matmuls need to run at full speed, few enough
# that a slice of 256 channels (t^2 transformed copies) stays near the cache. The sizes tried are in
# docs/recipes-and-speed.md.
TILE_ROWS = {2: 1536, 4: 1536}


def blocks(size: int, outputs_per_tile: int) -> int:
    """Blocks of `outputs_per_tile` outputs that cover `size` of them: the last one may stick out (and is cropped)."""
    return -(-size // outputs_per_tile)


def _slices(images: int, tiles_per_image: int, outputs_per_tile: int) -> list[tuple[int, int]]:
    step = max(1, TILE_ROWS[outputs_per_tile] // tiles_per_image)
    return [(start, min(images, start + step)) for start in range(0, images, step)]


def _combine(terms: Sequence[tuple[float, torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of c * t over the terms (c, t) of nonzero c, into `out` or a new tensor (a lone term of coefficient 1
    is returned as it is): one pass per term, the first two in one where a coefficient is 1."""
    terms = sorted(((c, t) for c, t in terms if c), key=lambda term: term[0] != 1)
    (first_coefficient, first), rest = terms[0], terms[1:]
    if first_coefficient == 1 and rest:
        coefficient, tensor = rest.pop(0)
        result = torch.add(first, tensor, alpha=coefficient, out=out)
    elif first_coefficient == 1 and out is None:
        return first
    else:
        result = torch.mul(first, first_coefficient, out=out)
    for coefficient, tensor in rest:
        result.add_(tensor, alpha=coefficient)
    return result


Terms = tuple[tuple[float, int], ...]  # (coefficient, slot); the slots are the inputs, then the temporaries
Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Program:
    """y = M x as straight-line code: sums that rows share (`temporaries`, in order), then each output's terms."""
    temporaries: tuple[Terms, ...]
    outputs: tuple[Terms, ...]


@functools.cache
def program(matrix: Matrix) -> Program:
    """`matrix` with the butterflies of its symmetric interpolation points (+-1, +-2) taken out, so that F(4x4, 3x3)'s
    transforms take 10-18 passes over the data where their matrices have 18-22 nonzero entries. Two inputs that
    every row reads with equal magnitudes enter through their sum and difference, made once; two rows that read the
    same inputs with equal magnitudes share their parts of equal and of opposite sign: E + O and E - O."""
    rows = [{k: c for k, c in enumerate(row) if c} for row in matrix]
    inputs = len(matrix[0])
    temporaries: list[Terms] = []

    def temporary(terms: Terms) -> tuple[float, int]:
        """`terms` as (scale, slot): a lone term is its own slot; a sum is stored with a coefficient factored out
        (the smallest, positive if it can be), so that one of its terms has coefficient 1."""
        if len(terms) == 1:
            return terms[0]
        scale = min((c for c, _ in terms), key=lambda c: (abs(c), c < 0))
        temporaries.append(tuple((c / scale, k) for c, k in terms))
        return scale, inputs + len(temporaries) - 1

    paired: set[int] = set()
    for i, j in itertools.combinations(range(inputs), 2):
        readers = [row for row in rows if i in row or j in row]
        if {i, j} & paired or len(readers) < 2 or not all(
                i in row and j in row and abs(row[i]) == abs(row[j]) for row in readers):
            continue
        paired |= {i, j}
        sums: dict[bool, int] = {}  # by whether x_j enters with x_i's sign: the slot of x_i + x_j or x_i - x_j
        for row in readers:
            coefficient = row.pop(i)
            same_sign = row.pop(j) == coefficient
            if same_sign not in sums:
                sums[same_sign] = temporary(((1, i), (1 if same_sign else -1, j)))[1]
            row[sums[same_sign]] = coefficient
    outputs = [tuple((c, k) for k, c in row.items()) for row in rows]
    matched: set[int] = set()
    for a, b in itertools.combinations(range(len(rows)), 2):
        first, second = rows[a], rows[b]
        if {a, b} & matched or first.keys() != second.keys() or not all(
                abs(first[k]) == abs(second[k]) for k in first):
            continue
        same = tuple((c, k) for k, c in first.items() if second[k] == c)
        opposite = tuple((c, k) for k, c in first.items() if second[k] != c)
        if same and opposite:
            matched |= {a, b}
            (same_scale, same_slot), (opposite_scale, opposite_slot) = temporary(same), temporary(opposite)
            outputs[a] = ((same_scale, same_slot), (opposite_scale, opposite_slot))
            outputs[b] = ((same_scale, same_slot), (-opposite_scale, opposite_slot))
    return Program(tuple(temporaries), tuple(outputs))


def _apply(matrix: Matrix, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor] | None = None,
           accumulate: bool = False) -> list[torch.Tensor]:
    """matrix @ inputs over a sequence of equally shaped tensors, by `program(matrix)`: new tensors, or written into
    `outs`, or added to them (`accumulate`)."""
    code = program(matrix)
    slots = list(inputs)
    for terms in code.temporaries:
        slots.append(_combine([(c, slots[k]) for c, k in terms]))
    results = []
    for index, terms in enumerate(code.outputs):
        if accumulate:
            for coefficient, slot in terms:
                outs[index].add_(slots[slot], alpha=coefficient)
        else:
            results.append(_combine([(c, slots[k]) for c, k in terms], out=None if outs is None else outs[index]))
    return results


def _transpose(matrix: Matrix) -> Matrix:
    return tuple(zip(*matrix, strict=True))


def _transform_filters(transform: Transform, weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 3, 3) -> (t^2, C_in, C_out): G g G^T for each filter, in tile-position-major order."""
    g = torch.tensor(transform.filter_rows, dtype=weight.dtype)
    c_out, c_in = weight.shape[:2]
    return torch.einsum("ai,ocij,bj->abco", g, weight, g).reshape(-1, c_in, c_out)


def _filter_gradient(transform: Transform, grad_transformed: torch.Tensor, c_in: int, c_out: int) -> torch.Tensor:
    """The adjoint of `_transform_filters`: (t^2, C_in, C_out) -> (C_out, C_in, 3, 3)."""
    g = torch.tensor(transform.filter_rows, dtype=grad_transformed.dtype)
    t = transform.size
    return torch.einsum("ai,abco,bj->ocij", g, grad_transformed.view(t, t, c_in, c_out), g)


def _transform_tiles(transform: Transform, padded: torch.Tensor, tiles_h: int, tiles_w: int,
                     out: torch.Tensor) -> None:
    """B^T d B for every t x t tile d (stride m) of `padded` (n, m tiles_h + 2, m tiles_w + 2, C), written to `out`
    (t^2, n, tiles_h, tiles_w, C): along the rows, then along the columns of all t rows at once (each pass a few
    large operations rather than many small ones)."""
    m, t = transform.outputs, transform.size
    rows = padded.new_empty(t, padded.shape[0], tiles_h, *padded.shape[2:])
    _apply(transform.input_rows, [padded[:, i:i + m * tiles_h:m] for i in range(t)], outs=rows)
    _apply(transform.input_rows, [rows[:, :, :, j:j + m * tiles_w:m] for j in range(t)],
           outs=out.unflatten(0, (t, t)).transpose(0, 1))


def _tiles_gradient(transform: Transform, grad: torch.Tensor, tiles_h: int, tiles_w: int,
                    grad_padded: torch.Tensor) -> None:
    """The adjoint of `_transform_tiles`: B dV B^T for each tile's (t, t) gradient `grad` (t, t, n, tiles_h,
    tiles_w, C), added into `grad_padded` where the tile came from. Neighbouring tiles overlap by 2, so the rows are
    added one at a time: an in-place sum into overlapping views would be undefined."""
    m, t = transform.outputs, transform.size
    adjoint = _transpose(transform.input_rows)
    rows = grad.new_empty(grad.shape)
    _apply(adjoint, list(grad), outs=rows)
    for i, row in enumerate(rows):
        targets = [grad_padded[:, i:i + m * tiles_h:m, j:j + m * tiles_w:m] for j in range(t)]
        _apply(adjoint, list(row), outs=targets, accumulate=True)


def _inverse_transform(transform: Transform, products: torch.Tensor, out: torch.Tensor) -> None:
    """A^T M A for each tile's (t, t) products `products` (t, t, n, tiles_h, tiles_w, C_out), into its m x m block
    of `out` (n, tiles_h, m, tiles_w, m, C_out)."""
    m = transform.outputs
    rows = products.new_empty(m, *products.shape[1:])
    _apply(transform.output_rows, list(products), outs=rows)
    _apply(transform.output_rows, list(rows.transpose(0, 1)), outs=out.permute(4, 2, 0, 1, 3, 5))


def _output_gradient(transform: Transform, grad: torch.Tensor, out: torch.Tensor) -> None:
    """The adjoint of `_inverse_transform`: each m x m output block's gradient `grad` (n, tiles_h, m, tiles_w, m,
    C_out) spread over the tile's t^2 products, into `out` (t^2, n, tiles_h, tiles_w, C_out)."""
    m, t = transform.outputs, transform.size
    adjoint = _transpose(transform.output_rows)
    rows = grad.new_empty(t, *grad[:, :, 0].shape)
    _apply(adjoint, [grad[:, :, p] for p in range(m)], outs=rows)
    _apply(adjoint, [rows[..., q, :] for q in range(m)], outs=out.unflatten(0, (t, t)).transpose(0, 1))


def _slice_tiles(tiles: torch.Tensor, start: int, end: int, positions: int, tiles_h: int, tiles_w: int,
                 channels: int) -> torch.Tensor:
    """Images start:end's part of the flat buffer `tiles`, as (positions, end - start, tiles_h, tiles_w, channels):
    each slice is contiguous, so its matmuls read one dense block (in bf16 they were slower on a strided slice)."""
    per_image = positions * tiles_h * tiles_w * channels
    return tiles[start * per_image:end * per_image].view(positions, end - start, tiles_h, tiles_w, channels)


class WinogradConv3x3(torch.autograd.Function):
    """The top-left `out_h` x `out_w` outputs of conv2d(x, weight, padding=1), in x's dtype, by F(m x m, 3x3) with
    m = `outputs_per_tile` (a key of TRANSFORMS). Sizes that m does not divide are rounded up and cropped. The filters
    are transformed in the weight's dtype, and its gradient comes back in it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_h: int, out_w: int,
                outputs_per_tile: int) -> torch.Tensor:
        transform = TRANSFORMS[outputs_per_tile]
        m, t = transform.outputs, transform.size
        n, c_in, h, w = x.shape
        c_out = weight.shape[0]
        tiles_h, tiles_w = blocks(out_h, m), blocks(out_w, m)
        # Channels last: each tile's channels are contiguous, the matmuls' inner dimension.
        padded = F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, m * tiles_w + 1 - w, 1, m * tiles_h + 1 - h)).contiguous()
        filters = _transform_filters(transform, weight).to(x.dtype)
        out = x.new_empty(n, tiles_h, m, tiles_w, m, c_out)
        # The transformed tiles are kept for the backward pass, which would otherwise make them again: t^2 / m^2 x
        # the input's size in memory (4x for F(2x2), 2.25x for F(4x4)) against a second transform of every tile.
        tiles = x.new_empty(t * t * n * tiles_h * tiles_w * c_in)
        for start, end in _slices(n, tiles_h * tiles_w, m):
            slice_tiles = _slice_tiles(tiles, start, end, t * t, tiles_h, tiles_w, c_in)
            _transform_tiles(transform, padded[start:end], tiles_h, tiles_w, slice_tiles)
            products = torch.bmm(slice_tiles.view(t * t, -1, c_in), filters)
            _inverse_transform(transform, products.view(t, t, end - start, tiles_h, tiles_w, c_out), out[start:end])
        ctx.save_for_backward(tiles, filters)
        ctx.input_size, ctx.input_channels, ctx.outputs_per_tile, ctx.weight_dtype = (h, w), c_in, m, weight.dtype
        out = out.view(n, m * tiles_h, m * tiles_w, c_out)
        if (out_h, out_w) != out.shape[1:3]:
            out = out[:, :out_h, :out_w].contiguous()
        return out.permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        tiles, filters = ctx.saved_tensors
        transform = TRANSFORMS[ctx.outputs_per_tile]
        m, t = transform.outputs, transform.size
        n, c_in = grad_output.shape[0], ctx.input_channels
        c_out, out_h, out_w = grad_output.shape[1:]
        tiles_h, tiles_w = blocks(out_h, m), blocks(out_w, m)
        grad_nhwc = grad_output.permute(0, 2, 3, 1)
        if (out_h, out_w) != (m * tiles_h, m * tiles_w):
            # The rounded-up rows and columns were cropped away: their gradient is zero. Only then: a pad copies.
            grad_nhwc = F.pad(grad_nhwc, (0, 0, 0, m * tiles_w - out_w, 0, m * tiles_h - out_h))
        grad_blocks = grad_nhwc.reshape(n, tiles_h, m, tiles_w, m, c_out)
        grad_filters = torch.zeros(filters.shape, dtype=ctx.weight_dtype)
        want_input = ctx.needs_input_grad[0]
        grad_padded = tiles.new_zeros(n, m * tiles_h + 2, m * tiles_w + 2, c_in) if want_input else None
        for start, end in _slices(n, tiles_h * tiles_w, m):
            grad_products = tiles.new_empty(t * t, end - start, tiles_h, tiles_w, c_out)
            _output_gradient(transform, grad_blocks[start:end], grad_products)
            grad_products = grad_products.view(t * t, -1, c_out)
            tiles_by_channel = _slice_tiles(tiles, start, end, t * t, tiles_h, tiles_w, c_in).view(t * t, -1, c_in).mT
            if tiles.dtype == grad_filters.dtype:
                grad_filters.baddbmm_(tiles_by_channel, grad_products)
            else:  # bf16 products, summed over the slices in the weight's dtype
                grad_filters += torch.bmm(tiles_by_channel, grad_products)
            if want_input:
                grad_tiles = torch.bmm(grad_products, filters.transpose(1, 2))
                _tiles_gradient(transform, grad_tiles.view(t, t, end - start, tiles_h, tiles_w, c_in), tiles_h,
                                tiles_w, grad_padded[start:end])
        grad_input = None
        if want_input:
            h, w = ctx.input_size
            grad_input = grad_padded[:, 1:1 + h, 1:1 + w].permute(0, 3, 1, 2)
        return grad_input, _filter_gradient(transform, grad_filters, c_in, c_out), None, None, None
