"""Block scales: the number a block's values are divided by before their elements are rounded.

- E8M0 (the MX formats): a power of two, 2^-127..2^127. OCP MX v1.0 takes
  2^(floor(log2(amax)) - emax), emax the element's (INT8's 0) ("floor": the block's largest value
  may then saturate to the element's max); cuBLAS and torchao's RCEIL take
  2^ceil(log2(amax / max)), so nothing saturates (but a value near fp32's largest, which can round
  up to 2^128: e8m0_limit).
  Exponents come from frexp, exact where a float log2 can round the wrong way near a power of two.
- fp32: amax / max (the fp8 recipes: per tensor, per row, DeepSeek-V3's 1x128 and 128x128 blocks).
- NVFP4's two levels: one fp32 scale for the tensor, amax(tensor) / (6 * 448), and per block
  (amax(block) / 6) / tensor scale rounded to E4M3 (to nearest, subnormals kept: torchao 0.18
  raises block scales below E4M3's smallest normal to it instead).

A block whose amax is 0 gets a scale its zeros divide by without harm; non-finite blocks are
handled by the caller (formats/__init__.py: NaN).
"""

from __future__ import annotations

import math

import torch

from halfprec.numerics.formats.elements import ELEMENTS, Element, float_only, power_below

E8M0_MIN, E8M0_MAX = -127, 127  # the exponents E8M0 holds (its 255 pattern is NaN)


def e8m0(amax: torch.Tensor, element: Element, rule: str = "floor") -> torch.Tensor:
    """The power-of-two scale of blocks with largest magnitude `amax` (fp32, finite, >= 0)."""
    if rule not in ("floor", "rceil"):
        raise ValueError(f"scale_rule={rule!r}: use floor (OCP MX v1.0) or rceil (cuBLAS, torchao's RCEIL)")
    if float_only(amax):
        return e8m0_by_powers(amax, element, rule)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    if rule == "floor":
        power = exponent - 1 - element.emax  # floor(log2(amax)) - emax
    else:
        # amax / max = (mantissa / max_mantissa) * 2^(exponent - max_exponent), the first factor in
        # (0.5, 2): its log2 rounds up to 1 if the mantissas compare so, else to 0 (compared, not
        # divided: a quotient just above 1 can round to 1); Python's frexp: a tensor's would end the
        # compiled quantizer's graph (its .item())
        max_mantissa, max_exponent = math.frexp(element.max)
        power = exponent - max_exponent + (mantissa > max_mantissa).int()
    power = torch.where(amax > 0, power, E8M0_MIN)  # a block of zeros
    return torch.exp2(power.clamp(E8M0_MIN, E8M0_MAX).float())


def e8m0_by_powers(amax: torch.Tensor, element: Element, rule: str) -> torch.Tensor:
    """e8m0's scales in float arithmetic alone (compiled for a CPU: elements.float_only), the same
    values: 2^floor(log2 amax) from power_below, then exact multiplications by powers of two."""
    below = power_below(amax)
    power = below * 2.0**-element.emax  # before any doubling: 2^127 doubled would overflow
    if rule == "rceil":
        # amax / max's log2 rounds up past floor(log2 amax) - emax when amax's mantissa exceeds max's
        # (both quotients exact, in [1, 2); a block of zeros compares NaN, so False)
        power = torch.where(amax / below > element.max / 2.0**element.emax, power * 2.0, power)
    return power.clamp(2.0**E8M0_MIN, 2.0**E8M0_MAX)


def e8m0_limit(scale: torch.Tensor, element: Element) -> torch.Tensor:
    """The largest element value whose product with a block's E8M0 `scale` fp32 holds, a value of the
    element's grid: the element's max, but below it for rceil's scales near fp32's largest value (E4M3
    at 2^120: 240, where 256 would give 2^128, inf). The hardware keeps a value no fp32 holds; this
    saturates to the largest finite one, which bf16 holds too."""
    top = (2.0 - 2.0**-element.mbits) * 2.0**E8M0_MAX
    return (top / scale).clamp(max=element.max)  # exact, over a power of two (inf for small scales: clamped)


def fp32(amax: torch.Tensor, element: Element) -> torch.Tensor:
    """amax / max, so the block's largest value lands on the element's largest; 1 for a block of zeros."""
    return torch.where(amax > 0, amax / element.max, 1.0)


def nvfp4(amax_blocks: torch.Tensor, amax_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor's fp32 scale, each block's scale as its E4M3 value, in fp32)."""
    e2m1, e4m3 = ELEMENTS["e2m1"], ELEMENTS["e4m3"]
    tensor = amax_tensor / (e2m1.max * e4m3.max)
    safe = torch.where(tensor > 0, tensor, 1.0)
    block = e4m3.nearest((amax_blocks / e2m1.max) / safe)
    return tensor, block
