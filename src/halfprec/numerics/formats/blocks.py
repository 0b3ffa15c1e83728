"""Which values share a scale: the blocks of a tensor, as rows of a 2D view, and back.

A GEMM blocks each operand along its contraction dimension (`axis`), so the same tensor is blocked
along another axis for another GEMM. `size` values along that axis share a scale (1x32 for MX,
1x16 for NVFP4, 1x128 for DeepSeek-V3's activations); "row" is the whole axis, "tensor" every
value; `tile` makes size x size squares over the last two dimensions (the blocked axis moved last),
which give a weight the same quantized values whichever of its axes a GEMM contracts. A dimension
that is not a multiple of the size is padded with zeros, which change no block's largest value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Blocks:
    """How `view` cut a tensor into blocks, to put the values back with `restore`."""

    shape: torch.Size  # the tensor with the blocked axis moved last
    padded: tuple[int, int]  # rows and columns of the 2D view after padding (tiles: both padded)
    axis: int
    tile: int | None


def view(x: torch.Tensor, axis: int, size: int | str, tile: bool = False) -> tuple[torch.Tensor, Blocks]:
    """x (one dimension or more) as (blocks, values of a block)."""
    moved = x.movedim(axis, -1)
    columns = moved.shape[-1]
    flat = moved.reshape(-1, columns)
    if size in ("tensor", "row"):
        layout = Blocks(moved.shape, (flat.shape[0], columns), axis, None)
        return (flat.reshape(1, -1) if size == "tensor" else flat), layout
    assert isinstance(size, int)
    rows = -(-flat.shape[0] // size) * size if tile else flat.shape[0]
    cols = -(-columns // size) * size
    padded = F.pad(flat, (0, cols - columns, 0, rows - flat.shape[0]))
    if not tile:
        return padded.reshape(-1, size), Blocks(moved.shape, (rows, cols), axis, None)
    squares = padded.reshape(rows // size, size, cols // size, size).transpose(1, 2)
    return squares.reshape(-1, size * size), Blocks(moved.shape, (rows, cols), axis, size)


def restore(blocks: torch.Tensor, layout: Blocks) -> torch.Tensor:
    """The inverse of `view`: the values of `blocks` in the tensor's own shape (padding dropped)."""
    rows, cols = layout.padded
    if layout.tile is not None:
        size = layout.tile
        flat = blocks.reshape(rows // size, cols // size, size, size).transpose(1, 2).reshape(rows, cols)
    else:
        flat = blocks.reshape(rows, cols)
    kept = flat[: layout.shape[:-1].numel(), : layout.shape[-1]]
    return kept.reshape(layout.shape).movedim(-1, layout.axis)
