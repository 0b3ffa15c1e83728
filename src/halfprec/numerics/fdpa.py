"""One MMA instruction's fused dot-product-add (numerics/accumulate.py's model) in two steps, each
one fused kernel through torch.compile where it pays: `align` (the products' largest exponent, a
max-reduction over the instruction's k, the running sum's, and the power of two that lifts the
products to the instruction's bits) and `advance` (every product times that power, truncated and
summed, a reduction that never stores the products; then the running sum aligned, added and
truncated to the bits kept). The eager and the compiled steps compute the same bits: the sums are
of integers, exact in any order. Each step takes a leading batch of independent sums (promotion
intervals) as well as matrices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

ZERO_EXPONENT = -(2**14)  # an operand's zero: far below any product, so never the largest


class Steps(NamedTuple):
    """An instruction's two steps, and the products' largest exponents where a GEMM of powers cannot
    hold them (largest_exponent): eager (EAGER) or through torch.compile (compiled_steps)."""

    largest: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    decode: Callable[..., torch.Tensor]
    align: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    advance: Callable[..., torch.Tensor]


def exponents(x: torch.Tensor, subnormal: int) -> torch.Tensor:
    """floor(log2|x|) as int32, no lower than `subnormal` (an element's smallest normal exponent,
    where its subnormals sit); a zero gets ZERO_EXPONENT."""
    _, e = torch.frexp(x)
    e = (e - 1).clamp_(min=subnormal)
    return e.masked_fill_(x == 0, ZERO_EXPONENT)


def keep(value: torch.Tensor, bits: int) -> torch.Tensor:
    """fp64 `value` truncated toward zero to `bits` fraction bits (fp32's exponent range, its
    subnormals below 2^-126), as fp32; -0 comes back +0."""
    e = exponent(value).clamp(min=-126).double()  # from its bits: inductor's C++ fails on fp64 frexp
    kept = torch.trunc(value * torch.exp2(bits - e)) * torch.exp2(e - bits)
    return kept.float() + 0.0


def sum_exponent(c: torch.Tensor, e_zero: int) -> torch.Tensor:
    """The running sum's exponent in the alignment: fp32's (from its bits; -126 for subnormals),
    e_zero for a zero."""
    e = (c.view(torch.int32) >> 23).bitwise_and(255).sub(127).clamp(min=-126)
    return e.masked_fill(c == 0, e_zero)


def power_of_two(e: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^e in fp32 (or fp64) from its bits, e (int32) clamped to the dtype's normal exponents."""
    if dtype == torch.float64:
        return ((e.long().clamp(-1022, 1023) + 1023) << 52).view(torch.float64)
    return ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)


def exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) of fp32 or fp64 values, normal ones, from their bits (int32)."""
    if x.dtype == torch.float64:
        return ((x.view(torch.int64) >> 52).int() & 2047) - 1023
    return ((x.view(torch.int32) >> 23) & 255) - 127


def largest_exponent(pa: torch.Tensor, pb: torch.Tensor, e_zero: int) -> torch.Tensor:
    """The largest exponent among the products of pa (.. x R x k) and pb (.. x k x N), the powers of
    two of two operands' exponents (fp64; 0 for a zero), `e_zero` for a zero product (int32,
    .. x R x N): a max-reduction over the products of powers."""
    p = pa.unsqueeze(-2) * pb.transpose(-1, -2).unsqueeze(-3)
    return exponent(torch.where(p == 0, 2.0**e_zero, p).amax(-1))


def decode(sums: torch.Tensor, nonzero: torch.Tensor | None, k: int, width: int, emin: int, base: int,
           e_zero: int) -> torch.Tensor:  # fmt: skip
    """The largest exponents from a GEMM of powers' `sums` (accumulate.largest_exponents): each sum's
    exponent above `emin` over `width`, plus `base`; e_zero for a zero sum, and where `nonzero` (the
    nonzero products' count; None: every nonzero product is above 2^e_zero) is below k, at least."""
    largest = torch.div(exponent(sums) - emin, width, rounding_mode="floor") + base
    largest = largest.masked_fill(sums == 0, ZERO_EXPONENT)
    if nonzero is None:
        return largest.clamp(min=e_zero)
    return torch.where(nonzero < k, largest.clamp(min=e_zero), largest)


def align(c: torch.Tensor, largest: torch.Tensor, shift: torch.Tensor | None, fraction: int, e_zero: int,
          wide: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The alignment exponent of an instruction: its products' `largest` exponent (plus the block
    scales' `shift`, MXF8F6F4's) or the running sum c's if larger; and the power of two that lifts
    each product to `fraction` bits below it, fp32 (beyond its range only where every product is
    zero) or, `wide`, fp64."""
    if shift is not None:
        largest = largest + shift
    largest = torch.maximum(largest, sum_exponent(c, e_zero))
    lift = fraction - largest if shift is None else fraction - largest + shift
    return largest, power_of_two(lift, torch.float64 if wide else torch.float32)


def products(a: torch.Tensor, b: torch.Tensor, lift: torch.Tensor) -> torch.Tensor:
    """The sum over k of the products of a (.. x R x k) and b (.. x k x N), each times `lift`
    (.. x R x N) and truncated toward zero: in fp32 and int32 (the cast truncates) where lift is
    fp32, else in fp64 (exact: integers below 2^53)."""
    terms = a.unsqueeze(-2) * b.transpose(-1, -2).unsqueeze(-3) * lift.unsqueeze(-1)
    if lift.dtype == torch.float32:
        return terms.to(torch.int32).sum(-1, dtype=torch.int32)
    return terms.trunc().sum(-1)


def carry(terms: torch.Tensor, c: torch.Tensor, largest: torch.Tensor, fraction: int, kept: int) -> torch.Tensor:
    """The next running sum: c aligned at `largest` and truncated to `fraction` bits below it, added
    to the products' `terms`, and the sum truncated to `kept` fraction bits (fp32). int32 terms
    (narrow): the sum's low bits cleared; fp64 ones: keep."""
    if terms.dtype == torch.int32:
        total = (terms + (c * power_of_two(fraction - largest)).to(torch.int32)).float()
        total = total * power_of_two(largest - fraction)
        low = (1 << (23 - kept)) - 1  # fp32's fraction bits below `kept`, subnormals' too (keep's -126)
        return total.view(torch.int32).bitwise_and(~low).view(torch.float32) + 0.0
    total = terms + torch.trunc(c.double() * power_of_two(fraction - largest, torch.float64))
    return keep(total * power_of_two(largest - fraction, torch.float64), kept)


def advance(a: torch.Tensor, b: torch.Tensor, lift: torch.Tensor, c: torch.Tensor, largest: torch.Tensor,
            fraction: int, kept: int) -> torch.Tensor:  # fmt: skip
    """The running sum after one instruction: its products and c, aligned at `largest` (align)."""
    return carry(products(a, b, lift), c, largest, fraction, kept)


EAGER = Steps(largest_exponent, decode, align, advance)


@functools.cache
def compiled_steps() -> Steps:
    """The steps through torch.compile (inductor's C++ on a CPU, Triton on a GPU): static shapes,
    each GEMM shape compiling once (the recompile limit raised to 256 for a GPT's few dozen). The
    products' power of two is an input of its own so that the reduction does not recompute it for
    every product; the products' sum and the carry are one kernel."""
    import torch._dynamo  # a slow import: only for a run that compiles

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    compiled: list[Any] = [torch.compile(f, dynamic=False) for f in EAGER]
    return Steps(*compiled)
