"""Element types: small floats with `ebits` exponent and `mbits` mantissa bits, subnormals, no
infinity, and a largest value past which a cast saturates; with no exponent bits, fixed-point
integers (OCP MX's INT8: k/64, every value a "subnormal", one spacing over the whole range).
Rounding onto them: to nearest with ties to even (by arithmetic, equal bit for bit to torch's float8
casts and torchao's 4- and 6-bit ones), or stochastic (by hand: no library rounds stochastically
onto these grids)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Element:
    """A float element, or with `ebits=0` an integer one: a sign and `mbits` magnitude bits read as
    a subnormal, m * 2^(emin - mbits) with bias 0 and emin 1, i.e. a fixed-point number with one
    integer bit (INT8, mbits 7: m/64). The float arithmetic below then holds unchanged: below 2^emin
    the spacing is the constant 2^(emin - mbits), and everything above saturates."""

    name: str
    ebits: int
    mbits: int
    max: float  # the largest finite value (E4M3: 448, its all-ones pattern being NaN; E5M2: 57344)

    @property
    def bias(self) -> int:
        # 2^(ebits-1) - 1 would be -1/2 without exponent bits; 0 puts an integer's top bit at 2^0
        return 2 ** (self.ebits - 1) - 1 if self.ebits else 0

    @property
    def emax(self) -> int:
        """The exponent of the largest power of two it holds: OCP MX's emax (E2M1 2, E4M3 8, E5M2 15,
        INT8 0: its max 127/64 is below 2)."""
        return int(self.max).bit_length() - 1 if self.max >= 1 else 0

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @cached_property
    def grid(self) -> torch.Tensor:
        """Every non-negative value, ascending, in fp32 (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6; INT8: k/64,
        k = 0..127, 128 values: the negative ones mirror them, -2 = -128/64 is not used)."""
        values = set()
        for e in range(2**self.ebits):
            for m in range(2**self.mbits):
                fraction = m / 2**self.mbits
                value = fraction * 2.0 ** (1 - self.bias) if e == 0 else (1 + fraction) * 2.0 ** (e - self.bias)
                if value <= self.max:
                    values.add(value)
        return torch.tensor(sorted(values), dtype=torch.float32)

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal value (E2M1: 0, E4M3: -6); an integer element has no
        normals, and 1 places its values m * 2^(1 - mbits) (INT8: m/64)."""
        return 1 - self.bias

    def spacing(self, x: torch.Tensor) -> torch.Tensor:
        """The gap between neighbouring values around `x` (fp32; finite, or the result is inf or
        NaN): a power of two, 2^(exponent - mbits), the exponent held at emin below the normals
        (subnormals; an integer element's whole range: INT8's 2^-6). The power of two below |x| is
        x's fp32 exponent field alone (sign and mantissa masked off): one integer op where frexp and
        exp2 were two slow float ones."""
        if float_only(x):
            return power_below(x).clamp(min=2.0**self.emin) * 2.0**-self.mbits
        power = (x.view(torch.int32) & 0x7F800000).view(torch.float32)
        return power.clamp_(min=2.0**self.emin).mul_(2.0**-self.mbits)

    def nearest(self, x: torch.Tensor, limit: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 -> the nearest value (ties to even), saturating at +-max (or +-`limit`, a value of the
        grid, one per block: scales.e8m0_limit). Finite inputs only.

        By arithmetic rather than through the casts that define it (torch's float8 dtypes, torchao's
        4- and 6-bit casts): x / spacing is exact (a power of two) and torch.round rounds half to
        even, so this is the cast, bit for bit (tests/test_formats.py holds it against them), and
        faster: the float8 casts are slow on a CPU."""
        if float_only(x):
            return self.nearest_by_splitting(x, limit)
        step = self.spacing(x)
        # in place past the first op: a fresh large tensor per op costs page faults
        rounded = x.div(step).round_().mul_(step)
        return rounded.clamp_(-self.max, self.max) if limit is None else rounded.clamp_(-limit, limit)

    def nearest_by_splitting(self, x: torch.Tensor, limit: torch.Tensor | None = None) -> torch.Tensor:
        """`nearest` in float arithmetic alone (no bit views; see float_only), the same values: from
        2^emin up, Veltkamp's splitting rounds to the element's 1 + mbits significant bits, ties to
        even; below, where the spacing is the constant 2^(emin - mbits), adding and subtracting
        1.5 * 2^(23 + emin - mbits) rounds to its multiples (the fp32 sum's own rounding does it)."""
        # max or limit, a value of the grid: saturating first rounds the same
        size = x.abs().clamp(max=self.max if limit is None else limit)
        fixed = 1.5 * 2.0 ** (23 + self.emin - self.mbits)
        below = (size + fixed) - fixed
        return torch.where(size < 2.0**self.emin, below, split(size, 1 + self.mbits)).copysign(x)

    def stochastic(self, x: torch.Tensor, bits: torch.Tensor, limit: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 -> one of the two values around it, the upper with probability (|x| - lo) / (hi - lo),
        so that the expected value is x; saturating at +-max (or +-`limit`, as for `nearest`). Finite
        inputs only. By hand: no library rounds stochastically onto these grids.

        floor(|x| / gap + u), u uniform on the 2^15 multiples of 2^-15 in [0, 1), from the low 15
        bits of `bits` (an integer tensor of x's shape, formats.random_bits): the probability is
        exact to 2^-15 of a gap (hardware draws a few random bits per value too)."""
        size = x.abs().clamp(max=self.max if limit is None else limit)
        step = self.spacing(size)
        if float_only(x):  # out of place: compiled, each in-place op became a pass of its own
            u = (bits & 0x7FFF).float() * 2.0**-15  # int32 bits: formats.quantize converts them
            return torch.floor(size / step + u).mul(step).copysign(x)
        # u = k * 2^-15 for the low 15 bits k, added in the same pass (the product is exact)
        return size.div_(step).add_(bits & 0x7FFF, alpha=2.0**-15).floor_().mul_(step).copysign_(x)


def float_only(x: torch.Tensor) -> bool:
    """Whether to round without viewing a float's bits as an integer: when torch.compile writes C++
    for a CPU, where inductor turns each int/float view into a scalar loop. Elsewhere the bit view
    stays: eagerly it is fewer passes, and Triton fuses a product and a sum into one FMA, which would
    skip the rounding `split` relies on."""
    return x.device.type == "cpu" and torch.compiler.is_compiling()


def split(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 x rounded to `bits` significant bits, to nearest with ties to even: Veltkamp's splitting
    (Dekker 1971), g = x * (2^(24 - bits) + 1), g + (x - g), for |x| below 2^(103 + bits); exact
    round-to-nearest-even as the casts do it (tests/test_formats.py holds it for every fp32 in [1, 4))."""
    g = x * float(2 ** (24 - bits) + 1)
    return g + (x - g)


def power_below(x: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 |x|) for finite x (subnormals included; 0 for 0), in float arithmetic alone:
    |x| rounded to one significant bit is that power or the next; `split` overflows from 2^104, so
    larger values are brought down by 2^64 first (exact both ways)."""
    size = x.abs()
    large = size >= 2.0**64
    size = torch.where(large, size * 2.0**-64, size)
    once = split(size, 1)
    power = torch.where(once > size, once * 0.5, once)
    return torch.where(large, power * 2.0**64, power)


ELEMENTS = {
    "e2m1": Element("e2m1", 2, 1, 6.0),
    "e2m3": Element("e2m3", 2, 3, 7.5),
    "e3m2": Element("e3m2", 3, 2, 28.0),
    "e4m3": Element("e4m3", 4, 3, 448.0),
    "e5m2": Element("e5m2", 5, 2, 57344.0),
    # OCP MX v1.0's INT8: two's complement with an implicit scale 2^-6, the code -128 (-2.0) unused,
    # so a symmetric grid of 255 values k/64, k in -127..127: the values of a sign and 7 magnitude bits.
    # Rounding: ties to even, as for the floats here (torch.round on k). The spec's conversion
    # (section 6.3) requires roundTiesToEven to be supported and allows other rules; microxcaling,
    # its reference code, rounds "nearest" by floor(|x| + 1/2), ties away from zero, with "even" as
    # an option. The two differ only at exact ties k + 1/2, where ties to even is unbiased.
    "int8": Element("int8", 0, 7, 127 / 64),
}
