"""The random Hadamard transform of NVIDIA's NVFP4 recipe: both operands of the weight-gradient
GEMM are multiplied, 16 values at a time along the dimension it contracts, by the same orthogonal
16x16 matrix H D (Sylvester's Hadamard matrix over 4, times a diagonal of random signs). Since
(Q a)^T (Q b) = a^T b for an orthogonal Q, the exact GEMM is unchanged; the transform spreads an
outlier over its 16 values before they are quantized. No library does this on a CPU: by hand."""

from __future__ import annotations

import torch


def hadamard(size: int = 16) -> torch.Tensor:
    """Sylvester's Hadamard matrix of a power-of-two size, scaled to be orthogonal (fp32)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"size={size}: a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / size**0.5


def random_hadamard(size: int = 16, generator: torch.Generator | None = None) -> torch.Tensor:
    """H D: the Hadamard matrix with each column's sign drawn at random (still orthogonal)."""
    signs = torch.randint(0, 2, (size,), generator=generator).float() * 2 - 1
    return hadamard(size) * signs


def rotate(x: torch.Tensor, matrix: torch.Tensor, axis: int) -> torch.Tensor:
    """Each run of len(matrix) values along `axis` multiplied by `matrix` (a block-diagonal
    transform, computed in fp32); same shape and dtype as x. The axis must be a multiple of the
    size: rotated padding would not be zeros, and cutting it off would lose what it holds."""
    size = matrix.shape[0]
    moved = x.float().movedim(axis, 0)
    if moved.shape[0] % size:
        raise ValueError(f"a dimension of {moved.shape[0]} along axis {axis}: a multiple of {size} is rotated")
    # matrix @ (groups, size, the rest): wide products (the skinny (values / size, size) @ matrix^T is
    # slow on a CPU), and no copy when the axis is already the first
    groups = moved.reshape(moved.shape[0] // size, size, -1)
    turned = (matrix.to(moved.device) @ groups).reshape(moved.shape)
    return turned.movedim(0, axis).to(x.dtype)
