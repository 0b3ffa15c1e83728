"""Number formats, emulated exactly on any device: the values a tensor takes in a format, in
ordinary floats (docs/design.md, "Number formats").

    from halfprec.numerics.formats import fake_quantize
    y = fake_quantize(x, "nvfp4")  # blocks of 16 along the last dim, same shape and dtype as x

A format is an element type (formats/elements.py), how many values share a scale along the
blocked axis (formats/blocks.py), and the kind of scale (formats/scales.py). Each value is divided
by its block's scale, rounded onto the element (to nearest with ties to even, or stochastically),
and multiplied back, in fp32. A block that holds inf or NaN comes back NaN: no element type here
has an infinity, and E8M0's only special value is NaN, so an overflow stays visible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from halfprec.numerics.formats import scales
from halfprec.numerics.formats.blocks import Blocks, per_block, restore, view
from halfprec.numerics.formats.elements import ELEMENTS, Element

SCALE_BITS = {"fp32": 32, "e8m0": 8, "nvfp4": 8}


@dataclass(frozen=True)
class Format:
    """`block`: the values per scale along the blocked axis, "row" or "tensor"; `scale`: fp32,
    e8m0 (a power of two) or nvfp4 (E4M3 per block times one fp32 per tensor); `tile`: the side of
    the square blocks a weight may take instead (fake_quantize's `tile=True`)."""

    name: str
    element: Element
    block: int | str
    scale: str
    tile: int | None = None

    @property
    def factor(self) -> str | None:
        """The part of the scale a GEMM applies to its fp32 output instead of to each operand value,
        as the hardware does: "tensor" (NVFP4's tensor scale, fp8 tensorwise), "row" (fp8 rowwise:
        a scale per row along the contraction) or "block" (fp8_block's 1x128: per 128-long chunk of
        the contraction, DeepSeek-V3's promotion); None where the scale is a power of two (MX)."""
        if self.scale == "nvfp4" or (self.scale == "fp32" and self.block == "tensor"):
            return "tensor"
        if self.scale == "fp32":
            return "row" if self.block == "row" else "block"
        return None

    @property
    def exact_in_bf16(self) -> bool:
        """Whether bf16 holds every GEMM operand value exactly, the factor split off (quantize's
        `split`): an MX value is an element of at most 8 significant bits (INT8's 7, E4M3's 4) times
        a power of two; an NVFP4 one an E2M1 element times its E4M3 block scale (at most 6 bits);
        fp8's, its element alone (element times an fp32 scale would take up to 24 bits). bf16's range
        is fp32's (its subnormals are coarser: an MX block whose largest value is below ~1e-35 can
        lose its smallest values)."""
        significant = self.element.bits - self.element.ebits
        return (self.scale == "e8m0" and significant <= 8) or self.factor is not None

    @property
    def bits(self) -> float:
        """Bits per value, the block scales included (MXFP8 and MXINT8 8.25, MXFP4 4.25, NVFP4 4.5)."""
        per_block = SCALE_BITS[self.scale] / self.block if isinstance(self.block, int) else 0.0
        return self.element.bits + per_block


E = ELEMENTS
FORMATS = {
    f.name: f
    for f in (
        Format("fp8_e4m3", E["e4m3"], "tensor", "fp32"),  # torchao's tensorwise float8
        Format("fp8_e5m2", E["e5m2"], "tensor", "fp32"),
        Format("fp8_e4m3_row", E["e4m3"], "row", "fp32"),  # a scale per row of the blocked axis
        Format("fp8_e5m2_row", E["e5m2"], "row", "fp32"),
        Format("fp8_block", E["e4m3"], 128, "fp32", tile=128),  # DeepSeek-V3: 1x128, weights 128x128
        Format("mxfp8", E["e4m3"], 32, "e8m0"),  # OCP MX v1.0
        Format("mxfp8_e5m2", E["e5m2"], 32, "e8m0"),
        Format("mxfp6_e2m3", E["e2m3"], 32, "e8m0"),
        Format("mxfp6_e3m2", E["e3m2"], 32, "e8m0"),
        Format("mxfp4", E["e2m1"], 32, "e8m0"),
        Format("mxint8", E["int8"], 32, "e8m0"),  # OCP MX v1.0's integer format: k/64, k in -127..127
        Format("nvfp4", E["e2m1"], 16, "nvfp4", tile=16),  # NVIDIA's: weights 16x16 in its recipe
    )
}
# the formats with a scale per block of values, the MX ones first (mxfp8 leads: a run without a
# format gets rules for it), then fp8_block and nvfp4: what `halfprec sensitivity` measures by default
BLOCK_SCALED = tuple(
    sorted((name for name, f in FORMATS.items() if isinstance(f.block, int)), key=lambda n: FORMATS[n].scale != "e8m0")
)
ROUNDINGS = ("nearest", "stochastic")
CHUNK = 2**16  # values quantized at a time on a CPU (fake_quantize's temporaries: 256 KB each)
SCALE_RULES = ("floor", "rceil")


def fake_quantize(
    x: torch.Tensor,
    name: str,
    axis: int = -1,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    tile: bool = False,
    scale_rule: str = "floor",
) -> torch.Tensor:
    """The values `x` takes in format `name`, blocked along `axis`, same shape and dtype.

    Args:
        rounding: "nearest" (ties to even) or "stochastic" (unbiased; `generator` seeds it).
        tile: square blocks over the last two dims (the blocked axis moved last), for weights:
            fp8_block 128x128, nvfp4 16x16.
        scale_rule: the MX formats' E8M0 scale: "floor" (OCP MX v1.0) or "rceil" (cuBLAS).
    """
    return quantize(x, name, axis, rounding, generator, tile, scale_rule).values


class Quantized(NamedTuple):
    """quantize's result: `values` times `factor` (None: 1) are the format's values."""

    values: torch.Tensor
    factor: torch.Tensor | None  # with `split`: Format.factor's scale, 0-dim or 1 along the axis
    saturated: torch.Tensor  # values past the element's largest once scaled (0-dim; 0 uncounted)
    scales: torch.Tensor | None = None  # with `block_scales`: each block's E8M0 or E4M3 scale (per_block)


def quantize(
    x: torch.Tensor,
    name: str,
    axis: int = -1,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    tile: bool = False,
    scale_rule: str = "floor",
    count_saturated: bool = False,
    compiled: bool = False,
    split: bool = False,
    block_scales: bool = False,
) -> Quantized:
    """fake_quantize's values; with `count_saturated`, how many values saturated (past the
    element's largest value once divided by their block's scale, so clamped to it): a 0-dim tensor
    on x's device, not read back. `compiled`: through compiled_quantizer, the same values.
    `split`: GEMM operands: the values in fp32 whatever x's dtype, without the part of their scale
    a GEMM applies to its output (Format.factor), and that part as `factor`, shaped to broadcast
    against them. `block_scales` (with `split`): also each block's inner scale, E8M0 or NVFP4's E4M3
    (the scales a block-scaled MMA takes), one per block along the axis as `factor` is shaped."""
    fmt = format_named(name)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: use one of {', '.join(ROUNDINGS)}")
    if tile and fmt.tile is None:
        raise ValueError(f"{name} has no square blocks: tile=True is for fp8_block and nvfp4")
    if scale_rule not in SCALE_RULES or (scale_rule != "floor" and fmt.scale != "e8m0"):
        raise ValueError(f"scale_rule={scale_rule!r}: floor or rceil, for the MX formats' E8M0 scales")
    size = fmt.tile if tile and fmt.tile else fmt.block
    bits = random_bits(x, generator) if rounding == "stochastic" else None
    if bits is not None and compiled and x.device.type == "cpu":
        bits = bits.int()  # inductor's C++ leaves int16 arithmetic scalar, and the whole loop with it
    core = compiled_quantizer() if compiled else quantize_blocks
    values, factor, saturated, stored = core(x, name, axis, size, tile, bits, scale_rule, count_saturated, split)
    if not block_scales:
        return Quantized(values, factor, saturated)
    assert split, "block_scales: the inner scales of split GEMM operands"
    return Quantized(values, factor, saturated, per_block(stored[1], view(x, axis, size, tile)[1], size))


def random_bits(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A random int16 per value of `x` (x's shape, x's order), for stochastic rounding: drawn as
    int32s, each giving two (random_ leaves an int32's sign bit clear: the low half's top bit is
    random, the high half's 0; Element.stochastic keeps 15 bits of each). Drawn before the values
    are blocked, outside the compiled quantizer: the same draws whichever path rounds them."""
    count = x.numel()
    bits = torch.empty((count + 1) // 2, dtype=torch.int32, device=x.device).random_(generator=generator)
    return bits.view(torch.int16)[:count].view(x.shape)


def quantize_blocks(x: torch.Tensor, name: str, axis: int, size: int | str, tile: bool, bits: torch.Tensor | None,
                    scale_rule: str, count_saturated: bool,
                    split: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple]:  # fmt: skip
    """`quantize` past its checks: x blocked, scaled, rounded (stochastically with `bits`) and back;
    last, each block's divisor, multiplier (and rceil's limit): returned so that inductor stores them
    once per block instead of recomputing a block's scale for each value."""
    fmt = FORMATS[name]
    split_off = split and fmt.factor is not None
    blocks, layout = view(x.float(), axis, size, tile)
    noise = None if bits is None else view(bits, axis, size, tile)[0]
    whole = blocks.device.type != "cpu" or torch.compiler.is_compiling()
    parts = [slice(None)] if whole else chunks(blocks)
    amax = torch.cat([blocks[p].abs().amax(dim=1, keepdim=True) for p in parts])  # NaN or inf where a block holds one
    finite = amax.isfinite()
    inner, outer = block_scales(fmt, torch.where(finite, amax, 0.0), scale_rule)
    scale = inner * outer  # exact but for NVFP4's, which divides by the fp32 product as torchao does
    # per block, not per value (the passes over every value are what cost): a block with inf or NaN
    # comes back NaN, one whose NVFP4 scale underflowed E4M3 comes back zeros
    divisor = torch.where(scale > 0, scale, 1.0)
    back = torch.where(finite, inner if split_off else scale, torch.nan)
    # rceil's scale for a block near fp32's largest value can round it up to 2^128: saturate below
    limit = scales.e8m0_limit(inner, fmt.element) if scale_rule == "rceil" else None
    values = torch.empty_like(blocks)
    saturated = torch.zeros((), device=x.device)
    for p in parts:
        scaled = blocks[p] / divisor[p]
        top = None if limit is None else limit[p]  # None: the element's max
        if count_saturated:
            saturated += (scaled.abs() > (fmt.element.max if top is None else top)).sum()
        rounded = fmt.element.nearest(scaled, top) if noise is None else fmt.element.stochastic(scaled, noise[p], top)
        torch.mul(rounded, back[p], out=values[p])
    factor = outer_factor(outer, layout, size) if split_off else None
    stored = (divisor, back) if limit is None else (divisor, back, limit)
    return restore(values, layout).to(torch.float32 if split else x.dtype), factor, saturated, stored


@functools.cache
def compiled_quantizer() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple]]:
    """quantize_blocks through torch.compile: one fused kernel where the eager code launches an op at
    a time, the same values bit for bit. Static shapes, since inductor leaves its CPU loops over
    symbolic-size views unvectorized: each (format, axis, shape) compiles once, so the recompile limit
    (8 by default, then eager) is raised to 256 for a GPT's few dozen."""
    import torch._dynamo  # a slow import: only for a run that compiles its quantizers

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(quantize_blocks, dynamic=False)


def chunks(blocks: torch.Tensor, values: int = CHUNK) -> list[slice]:
    """Blocks about `values` values at a time, on a CPU, so a quantization's temporaries stay in a
    core's cache (not on a GPU, where each chunk's ops would be more kernel launches)."""
    rows = max(1, values // max(1, blocks.shape[1] * blocks.shape[2]))
    return [slice(i, i + rows) for i in range(0, blocks.shape[0], rows)] or [slice(0, 0)]


def block_scales(fmt: Format, amax: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's scale (fp32), from the largest magnitude of its finite values, as (inner, outer):
    the scale is inner * outer, outer the part Format.factor names (1 where it names none)."""
    if fmt.scale == "e8m0":
        return scales.e8m0(amax, fmt.element, rule), amax.new_ones(())
    if fmt.scale == "fp32":
        return amax.new_ones(()), scales.fp32(amax, fmt.element)
    tensor, block = scales.nvfp4(amax, amax.max())
    return block, tensor


def outer_factor(outer: torch.Tensor, layout: Blocks, size: int | str) -> torch.Tensor:
    """The outer scales in the tensor's shape: a 0-dim tensor for one per tensor, else one per block
    with the blocked axis shrunk to the number of blocks (blocks.per_block)."""
    return outer.reshape(()) if outer.numel() == 1 else per_block(outer, layout, size)


def format_named(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"no number format {name!r}: the formats are {', '.join(FORMATS)}")
    return FORMATS[name]
