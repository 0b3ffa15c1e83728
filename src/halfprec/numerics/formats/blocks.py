"""Which values share a scale: the blocks of a tensor, as a 3D view (block, value in the block,
position across the blocked axis), and back.

A GEMM blocks each operand along its contraction dimension (`axis`), so the same tensor is blocked
along another axis for another GEMM. `size` values along that axis share a scale (1x32 for MX,
1x16 for NVFP4, 1x128 for DeepSeek-V3's activations); "row" is the whole axis, "tensor" every
value. The axis is split in place, (before, axis, after) -> (before x blocks, size, after), so a
block's values are `size` apart in memory and the view needs no transposed copy whatever the axis
(moving it last had cost two copies of every operand blocked along its first axis). `tile` makes
size x size squares over the last two dimensions (the blocked axis moved last), which give a
weight the same quantized values whichever of its axes a GEMM contracts. A dimension that is not a
multiple of the size is padded with zeros, which change no block's largest value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Blocks:
    """How `view` cut a tensor into blocks, to put the values back with `restore`."""

    shape: torch.Size  # the tensor's
    axis: int  # the blocked axis, counted from the first
    length: int  # the blocked axis padded to whole blocks (tiles: the columns of the moved 2D view)
    tile: int | None = None
    rows: int = 0  # tiles: the rows of the moved 2D view, padded to whole tiles


def view(x: torch.Tensor, axis: int, size: int | str, tile: bool = False) -> tuple[torch.Tensor, Blocks]:
    """x (one dimension or more) as (blocks, values of a block, positions across the axis): each
    [i, :, j] one block, so reductions over dim 1 give every block's statistic."""
    axis = axis % x.dim()
    if tile:
        assert isinstance(size, int)
        return tiles(x, axis, size)
    n = x.shape[axis]
    before, after = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1 :])
    if size == "tensor":
        return x.reshape(1, -1, 1), Blocks(x.shape, axis, n)
    size = n if size == "row" else size
    assert isinstance(size, int)
    length = -(-n // size) * size
    flat = x.reshape(before, n, after)
    if length != n:
        flat = F.pad(flat, (0, 0, 0, length - n))
    return flat.reshape(before * (length // max(size, 1)), size, after), Blocks(x.shape, axis, length)


def tiles(x: torch.Tensor, axis: int, size: int) -> tuple[torch.Tensor, Blocks]:
    """Squares of size x size over the last two dimensions, the blocked axis moved last: one block
    per square (a weight, small: its transposed copy costs little)."""
    moved = x.movedim(axis, -1)
    columns = moved.shape[-1]
    flat = moved.reshape(-1, columns)
    rows, cols = -(-flat.shape[0] // size) * size, -(-columns // size) * size
    padded = F.pad(flat, (0, cols - columns, 0, rows - flat.shape[0]))
    squares = padded.reshape(rows // size, size, cols // size, size).transpose(1, 2)
    return squares.reshape(-1, size * size, 1), Blocks(x.shape, axis, cols, size, rows)


def restore(blocks: torch.Tensor, layout: Blocks) -> torch.Tensor:
    """The inverse of `view`: the values of `blocks` in the tensor's own shape (padding dropped)."""
    shape, axis = layout.shape, layout.axis
    if layout.tile is not None:
        size, rows, cols = layout.tile, layout.rows, layout.length
        flat = blocks.reshape(rows // size, cols // size, size, size).transpose(1, 2).reshape(rows, cols)
        moved = list(shape[:axis]) + list(shape[axis + 1 :]) + [shape[axis]]
        kept = flat[: math.prod(moved[:-1]), : shape[axis]]
        return kept.reshape(moved).movedim(-1, axis)
    before, after = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    return blocks.reshape(before, layout.length, after)[:, : shape[axis]].reshape(shape)


def per_block(scales: torch.Tensor, layout: Blocks, size: int | str) -> torch.Tensor:
    """One value per block (`scales`, as view's blocks reduced over dim 1) in the tensor's shape, the
    blocked axis shrunk to its number of blocks: 1 for "row", ceil(n / size) for blocks of `size`;
    tiles' repeated along the other axis, one per row of the tile."""
    shape, axis = layout.shape, layout.axis
    if layout.tile is not None:
        size = layout.tile
        per_row = scales.reshape(layout.rows // size, layout.length // size).repeat_interleave(size, dim=0)
        moved = list(shape[:axis]) + list(shape[axis + 1 :])
        kept = per_row[: math.prod(moved)]
        return kept.reshape(*moved, -1).movedim(-1, axis)
    blocks = 1 if size in ("row", "tensor") else layout.length // int(size)
    return scales.reshape(*shape[:axis], blocks, *shape[axis + 1 :])
