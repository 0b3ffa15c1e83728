"""Element types: small floats with `ebits` exponent and `mbits` mantissa bits, subnormals, no
infinity, and a largest value past which a cast saturates. Rounding onto them: to nearest with ties
to even (torch's float8 dtypes, torchao's casts for the 4- and 6-bit ones), or stochastic (by hand:
no library rounds stochastically onto these grids)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from halfprec.numerics.formats.casts import nearest_cast


@dataclass(frozen=True)
class Element:
    name: str
    ebits: int
    mbits: int
    max: float  # the largest finite value (E4M3: 448, its all-ones pattern being NaN; E5M2: 57344)

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emax(self) -> int:
        """The exponent of the largest power of two it holds: OCP MX's emax (E2M1 2, E4M3 8, E5M2 15)."""
        return int(self.max).bit_length() - 1 if self.max >= 1 else 0

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @cached_property
    def grid(self) -> torch.Tensor:
        """Every non-negative value, ascending, in fp32 (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
        values = set()
        for e in range(2**self.ebits):
            for m in range(2**self.mbits):
                fraction = m / 2**self.mbits
                value = fraction * 2.0 ** (1 - self.bias) if e == 0 else (1 + fraction) * 2.0 ** (e - self.bias)
                if value <= self.max:
                    values.add(value)
        return torch.tensor(sorted(values), dtype=torch.float32)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 -> the nearest value (ties to even), saturating at +-max. Finite inputs only."""
        if self.name in ("e4m3", "e5m2"):
            dtype = torch.float8_e4m3fn if self.name == "e4m3" else torch.float8_e5m2
            return x.clamp(-self.max, self.max).to(dtype).float()
        return nearest_cast(self.name)(x)

    def stochastic(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """fp32 -> one of the two values around it, the upper with probability (|x| - lo) / (hi - lo),
        so that the expected value is x; saturating at +-max. Finite inputs only."""
        grid = self.grid.to(x.device)
        size = x.abs().clamp(max=self.max)
        upper = torch.searchsorted(grid, size, right=True).clamp(max=len(grid) - 1)  # first value above
        lower = (upper - 1).clamp(min=0)
        lo, hi = grid[lower], grid[upper]
        gap = hi - lo
        p_up = torch.where(gap > 0, (size - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
        draw = torch.rand(x.shape, generator=generator, device=x.device)
        return torch.copysign(torch.where(draw < p_up, hi, lo), x)


ELEMENTS = {
    "e2m1": Element("e2m1", 2, 1, 6.0),
    "e2m3": Element("e2m3", 2, 3, 7.5),
    "e3m2": Element("e3m2", 3, 2, 28.0),
    "e4m3": Element("e4m3", 4, 3, 448.0),
    "e5m2": Element("e5m2", 5, 2, 57344.0),
}
