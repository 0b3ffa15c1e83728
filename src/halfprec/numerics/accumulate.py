"""How the tensor cores sum a GEMM's products: bit-exact, vectorised models of the MMA
instructions' accumulation, after MMA-Sim (microsoft/MMA-Sim; arXiv 2511.10909), on any device.

An instruction takes `k` products and the running sum c at once (MMA-Sim's fused dot-product-add):

    every product and c, with their exponents (an element's floor(log2|x|), its subnormals at the
    element's smallest normal exponent; a zero at `e_zero`), are aligned to the largest exponent
    among them, each truncated (toward zero) to `fraction` bits below it, summed exactly, and the
    sum truncated to `kept` fraction bits (fp32's 23, or 13 for Hopper's and Ada's FP8) as the next c.

The block-scaled ones (Blackwell's MXF8F6F4) fold each operand's power-of-two block scale into its
products' exponents; MXF4/NVF4 sum each group of 16 products exactly, scale the group sum by the
two block scales and align the groups (35 bits). A preset (`PRESETS`) says which instruction sums
each kind of operand (`KINDS`), and where the partial sum is promoted: added to an fp32 (round to
nearest) accumulator every `promote` values of K, as DeepSeek-V3 and TransformerEngine's split
accumulator do, or per 128-value chunk where fp8_block's scales apply (DeepGEMM).

Each instruction's alignment depends on the running sum, so the instructions of a partial sum are
a loop; partial sums that start from zero (each promotion interval's) are independent, so side by
side in one batch. An instruction is two steps over every output of a band of rows (numerics/fdpa.py:
the products' largest exponent, a max-reduction over powers of two; then the products aligned,
truncated and summed with the running sum): in fp64 (exact: the aligned terms are integers below
2^53), or for FP8's 13-bit instructions in fp32 and int32 (exact: their terms' sum stays below 2^24).
The steps run through torch.compile for a GEMM where that pays (COMPILE_PRODUCTS), one fused kernel
each that never stores the products; else op by op, a band's products at a time.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from halfprec.errors import ConfigError
from halfprec.numerics.fdpa import (
    EAGER,
    ZERO_EXPONENT,
    Steps,
    compiled_steps,
    exponents,
    keep,
    power_of_two,
    sum_exponent,
)

EXACT = "exact"
# the kinds of GEMM an instruction is chosen for: fp8 elements (their scales applied to the output
# or at promotion), bf16 values, MX elements of 6-8 bits with E8M0 block scales, 4-bit elements
# with E8M0 or E4M3 block scales
KINDS = ("fp8", "bf16", "mx", "fp4")
ROWS_VALUES = {"cpu": 2**18, "cuda": 2**26}  # eager temporaries' values per band of rows (M x N x k): a CPU's in cache
SUMS_VALUES = 2**24  # compiled: running sums per band (intervals x rows x N), the products never stored
COMPILE_PRODUCTS = 2**24  # a GEMM's products from which compiling its steps pays (docs/benchmarks.md)


@dataclass(frozen=True)
class Instruction:
    """One MMA instruction's arithmetic (MMA-Sim's T-FDPA, ST-FDPA and GST-FDPA)."""

    name: str  # the PTX instruction, for errors and the docs
    k: int  # products summed at once (MMA-Sim's L_max)
    fraction: int  # bits each aligned product keeps below the largest exponent (F)
    kept: int  # fraction bits of the sum between instructions (RZ-FP32: 23, RZ-E8M13: 13)
    e_zero: int  # the exponent a zero product (or sum) takes in the alignment
    group: int = 0  # block-scaled 4-bit: products summed exactly per group, then aligned (G)


@dataclass(frozen=True)
class Accumulation:
    """A preset: the instruction for each operand kind it has one for, and the promotion interval."""

    name: str
    doc: str
    instructions: dict[str, Instruction] = field(default_factory=dict)
    promote: int | None = None  # K values per partial sum added to the fp32 accumulator; None: never

    @property
    def exact(self) -> bool:
        return self.name == EXACT


WGMMA_FP8 = Instruction("wgmma.m64nNk32.f32.e4m3/e5m2", 32, 13, 13, -133)
WGMMA_BF16 = Instruction("wgmma.m64nNk16.f32.bf16.bf16", 16, 25, 23, -133)
MMA_BF16_SM80 = Instruction("mma.m16n8k16.f32.bf16.bf16.f32", 8, 24, 23, -132)
MMA_FP8_SM89 = Instruction("mma.m16n8k32.f32.e4m3/e5m2.f32", 16, 13, 13, -132)
TCGEN05_F8F6F4 = Instruction("tcgen05.mma.kind::f8f6f4.f32", 32, 25, 23, -133)
TCGEN05_BF16 = Instruction("tcgen05.mma.kind::f16.f32.bf16.bf16", 16, 25, 23, -133)
TCGEN05_MXF8F6F4 = Instruction("tcgen05.mma.kind::mxf8f6f4.block32.f32.ue8m0", 32, 25, 23, -133)
TCGEN05_MXF4NVF4 = Instruction("tcgen05.mma.kind::mxf4nvf4.f32.e2m1.e2m1", 64, 35, 23, -139, group=16)

HOPPER = {"fp8": WGMMA_FP8, "bf16": WGMMA_BF16}
PRESETS = {
    p.name: p
    for p in (
        Accumulation(EXACT, "fp32 products summed by an fp32 GEMM (no model of the tensor cores)"),
        Accumulation("hopper", "H100/H200 wgmma: FP8 13 fraction bits, sum kept with 13; bf16 25", HOPPER),
        Accumulation(
            "hopper_promoted", "hopper, the partial sum added in fp32 every 128 of K (DeepSeek-V3)", HOPPER, promote=128
        ),  # fmt: skip
        Accumulation("ampere", "A100 mma: bf16 24 fraction bits per 8 products", {"bf16": MMA_BF16_SM80}),
        Accumulation(
            "ada",
            "L40/RTX 40 mma: FP8 13 bits per 16 products, sum kept with 13; bf16 24",
            {"fp8": MMA_FP8_SM89, "bf16": MMA_BF16_SM80},
        ),  # fmt: skip
        Accumulation(
            "blackwell",
            "B200 tcgen05.mma: FP8, bf16, MXF8F6F4 25 bits; MXF4/NVF4 35",
            {"fp8": TCGEN05_F8F6F4, "bf16": TCGEN05_BF16, "mx": TCGEN05_MXF8F6F4, "fp4": TCGEN05_MXF4NVF4},
        ),  # fmt: skip
    )
}


def preset(name: str, key: str) -> Accumulation:
    """The preset `name`, or a one-line ConfigError naming `key` (precision.accumulate or a GEMM's)."""
    if name not in PRESETS:
        raise ConfigError(key, name, f"an accumulation preset: {', '.join(PRESETS)}")
    return PRESETS[name]


def instruction(acc: Accumulation, kind: str | None, gemm: str, key: str) -> Instruction | None:
    """The instruction that sums a `kind` GEMM under `acc`; None where the sums are exact (the preset
    exact, or fp32 operands: CUDA cores' FMAs, no tensor core). A one-line ConfigError where the
    preset's GPU has no such MMA (MXFP4 on Hopper, MXINT8 anywhere)."""
    if acc.exact or kind == "fp32":
        return None
    if kind not in acc.instructions:
        works = ", ".join(acc.instructions)
        what = f"a {kind} GEMM" if kind else "an MXINT8 GEMM"
        fix = f"{acc.name} has no MMA instruction for {what} ({gemm}); it models {works} GEMMs, exact any"
        raise ConfigError(key, acc.name, fix)
    return acc.instructions[kind]


def largest_exponents(ea: torch.Tensor, eb: torch.Tensor, ins: Instruction, subnormals: tuple[int, int],
                      steps: Steps = EAGER) -> torch.Tensor:  # fmt: skip
    """The largest of ea[r, i] + eb[i, n] over each instruction's k values of i, at least e_zero
    where a product is zero: chunks x R x N (int32), for a band's rows of ea (R x K) and eb (K x N),
    no lower than `subnormals`. One batched GEMM of powers 2^(w e) (2^w > k: the sum of k of them,
    however rounded, lies below the next power of 2^w, so its exponent names the largest exactly),
    in fp32 or fp64 where they hold the exponents' span; else a max-reduction (fdpa.largest_exponent)."""
    chunks = ea.shape[1] // ins.k
    xa, xb = ea.unflatten(1, (chunks, ins.k)).transpose(0, 1), eb.unflatten(0, (chunks, ins.k))
    za, zb = xa == ZERO_EXPONENT, xb == ZERO_EXPONENT
    width = ins.k.bit_length()
    da, db = (width * max(0, int(x.max()) - lo) for x, lo in ((xa, subnormals[0]), (xb, subnormals[1])))
    dtype = next((d for d in (torch.float32, torch.float64) if da + db + width <= RANGE[d][1] - RANGE[d][0] + 1), None)
    if dtype is None:
        pa, pb = power_of_two(xa, torch.float64), power_of_two(xb, torch.float64)
        return steps.largest(pa.masked_fill_(za, 0), pb.masked_fill_(zb, 0), ins.e_zero)
    emin, emax = RANGE[dtype]
    shift = max(0, db - emax)  # every power, and every product of two, a normal number
    pa = power_of_two(width * (xa - subnormals[0]) + emin + shift, dtype).masked_fill_(za, 0)
    pb = power_of_two(width * (xb - subnormals[1]) - shift, dtype).masked_fill_(zb, 0)
    base = sum(subnormals)
    nonzero = None if base >= ins.e_zero else (~za).to(dtype) @ (~zb).to(dtype)  # products below 2^e_zero
    return steps.decode(pa @ pb, nonzero, ins.k, width, emin, base, ins.e_zero)


RANGE = {torch.float32: (-126, 127), torch.float64: (-1022, 1023)}  # normal exponents


def normalised(x: torch.Tensor, subnormal: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as m * 2^e (fp64, int32), 1 <= |m| < 2 but where x is subnormal (e = `subnormal`)."""
    e = exponents(x, subnormal).clamp_(min=subnormal)
    return x.double() * torch.exp2(-e.double()), e


def gfdpa(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
          ins: Instruction, subnormal: int) -> torch.Tensor:  # fmt: skip
    """One block-scaled 4-bit instruction on a band (MMA-Sim's GST-FDPA): a (R x k), b (k x N) the
    elements, sa (R x k/G), sb (k/G x N) each group's scale (fp32). A group's products summed exactly
    (a batched GEMM: 16 products of 4-bit elements are exact in fp32), times both scales'
    significands, aligned at both scales' exponents (e_zero where every product or a scale is zero);
    `subnormal`: the scales' smallest normal exponent (UE4M3: -6; E8M0: -127)."""
    g = ins.group
    groups = a.shape[1] // g
    ag, bg = a.reshape(-1, groups, g).transpose(0, 1), b.reshape(groups, g, -1)
    sums = (ag.float() @ bg.float()).permute(1, 2, 0).double()  # R x N x groups
    nonzero = ((ag != 0).float() @ (bg != 0).float()).permute(1, 2, 0)
    (ma, ea), (mb, eb) = normalised(sa, subnormal), normalised(sb, subnormal)
    scale = ma.unsqueeze(1) * mb.t().unsqueeze(0)
    e = ea.unsqueeze(1) + eb.t().unsqueeze(0)
    e = e.masked_fill((nonzero == 0) | (scale == 0), ins.e_zero)
    largest = torch.maximum(e.amax(-1), sum_exponent(c, ins.e_zero))
    lift = (ins.fraction + e - largest.unsqueeze(-1)).double()
    terms = torch.trunc(sums * scale * torch.exp2(lift)).sum(-1)
    terms += torch.trunc(c.double() * torch.exp2(ins.fraction - largest.double()))
    return keep(terms * torch.exp2(largest.double() - ins.fraction), ins.kept)


def matmul(a: torch.Tensor, b: torch.Tensor, ins: Instruction, subnormals: tuple[int, int] = (-126, -126),
           promote: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
           block: int = 32, scale_subnormal: int = -127,
           factors: tuple[torch.Tensor, torch.Tensor] | None = None,
           compiled: bool | None = None) -> torch.Tensor:  # fmt: skip
    """a (M x K) @ b (K x N) in fp32 as successive `ins` sum it, from zero; every `promote` values
    of K (a multiple of ins.k) the partial sum is added to an fp32 accumulator (round to nearest)
    and the next one starts from zero; with `factors` (M x K/promote, K/promote x N) each partial is
    first multiplied by its two (a fused multiply-add: fp8_block's scales, as DeepGEMM applies them).

    a and b hold element values (their subnormals below 2^`subnormals`); `scales`: their block
    scales along K (M x K/block, K/block x N; `block` a multiple of ins.group or ins.k): powers of
    two folded into the products' exponents (MXF8F6F4's blocks of 32, one per instruction), or
    applied to each group's sum (4-bit: E8M0 or UE4M3 scales, `scale_subnormal` -6 for UE4M3).
    `compiled`: the instructions' steps through torch.compile (fdpa.py; the same bits); None: where
    it pays, a GEMM of COMPILE_PRODUCTS products or more but for the 4-bit instructions."""
    m, k = a.shape
    pad = -k % (promote or ins.k)
    length = k + pad
    dtype = torch.float32 if narrow(ins, subnormals, scales) else torch.float64
    a, b = F.pad(a.to(dtype), (0, pad)), F.pad(b.to(dtype), (0, 0, 0, pad))
    ea, eb = exponents(a, subnormals[0]), exponents(b, subnormals[1])
    operands = Band(a, b, ea, eb, None, None, scale_subnormal, subnormals)
    if scales is not None:  # one scale per group (4-bit) or per instruction
        per = ins.group or ins.k
        sa, sb = spread(scales[0], block // per, length // per, 1), spread(scales[1], block // per, length // per, 0)
        operands = operands._replace(sa=sa, sb=sb)
    if compiled is None:
        compiled = not ins.group and m * length * b.shape[1] >= COMPILE_PRODUCTS
    # under a dispatch mode (the first step's FLOP counter) torch.compile would run its functions
    # eagerly: the compiled sums run outside it (the model of one GEMM, not FLOPs of its own)
    outside = _disable_current_modes() if compiled and _get_current_dispatch_mode() is not None else nullcontext()
    with outside:
        return summed(operands, m, ins, promote or length, factors, compiled)


def summed(operands: Band, m: int, ins: Instruction, step: int,
           factors: tuple[torch.Tensor, torch.Tensor] | None, compiled: bool) -> torch.Tensor:  # fmt: skip
    """matmul's sums, a band of rows at a time: each `step` values of K from zero, then promoted."""
    a, b = operands.a, operands.b
    length = a.shape[1]
    out = torch.empty(m, b.shape[1], dtype=torch.float32, device=a.device)
    intervals = length // step
    for band in bands(m, b.shape[1] * intervals, ins.k, a.device, compiled):
        sums = interval_sums(operands, band, ins, step, compiled_steps() if compiled else EAGER)
        total = None
        for p in range(intervals):
            chunk = None if factors is None else (factors[0][band, p], factors[1][p])
            total = promoted(total, sums[p], chunk)
        assert total is not None
        out[band] = total
    return out


def bands(m: int, width: int, k: int, device: torch.device, compiled: bool) -> list[slice]:
    """The rows a step takes at once: eager, a band whose width x k products (each instruction's
    temporaries) stay within ROWS_VALUES; compiled, whose running sums (width each row) stay within
    SUMS_VALUES, the products never stored."""
    if compiled:
        rows = max(1, SUMS_VALUES // width)
    else:
        rows = max(1, ROWS_VALUES.get(device.type, ROWS_VALUES["cuda"]) // (width * k))
    return [slice(r, r + rows) for r in range(0, m, rows)]


def narrow(ins: Instruction, subnormals: tuple[int, int], scales: object) -> bool:
    """Whether fp32 sums an instruction exactly: elements of at most 16 bits (subnormal from 2^-14:
    fp8, fp16; products of <= 22 bits, normal in fp32) and aligned terms, each below 2^(fraction+2),
    whose k + 1 sum within fp32's 24 bits (FP8's 13 fraction bits; not bf16's 25)."""
    return scales is None and min(subnormals) >= -14 and (ins.k + 1) * 2 ** (ins.fraction + 2) <= 2**24


class Band(NamedTuple):
    """matmul's operands: elements in fp32 or fp64, their exponents, the scales per group or
    instruction."""

    a: torch.Tensor
    b: torch.Tensor
    ea: torch.Tensor
    eb: torch.Tensor
    sa: torch.Tensor | None
    sb: torch.Tensor | None
    scale_subnormal: int
    subnormals: tuple[int, int]


def interval_sums(o: Band, band: slice, ins: Instruction, step: int, steps: Steps) -> torch.Tensor:
    """The rows `band` of each promotion interval's sum (`step` values of K), each from zero:
    intervals x R x N. The intervals are independent, so side by side, one batch: only the
    instructions within one are a loop (all of K's without promotion)."""
    intervals, per = o.a.shape[1] // step, step // ins.k
    if ins.group:  # 4-bit: an interval at a time
        return torch.stack([partial(o, band, range(p, p + step, ins.k), ins) for p in range(0, o.a.shape[1], step)])

    def split(x: torch.Tensor, dim: int) -> torch.Tensor:  # per x intervals x (R x k or k x N)
        x = x.unflatten(dim, (intervals, per, ins.k))
        return x.permute(2, 1, 0, 3).contiguous() if dim == 1 else x.transpose(0, 1).contiguous()

    largest = largest_exponents(o.ea[band], o.eb, ins, o.subnormals, steps).unflatten(0, (intervals, per))
    a, b = split(o.a[band], 1), split(o.b, 0)
    shifts = None
    if o.sa is not None and o.sb is not None:  # MXF8F6F4: each instruction's two E8M0 exponents
        sa = exponents(o.sa[band], -127).unflatten(1, (intervals, per)).permute(2, 1, 0).unsqueeze(-1)
        shifts = sa + exponents(o.sb, -127).unflatten(0, (intervals, per)).transpose(0, 1).unsqueeze(-2)
    c = torch.zeros(intervals, a.shape[2], b.shape[3], dtype=torch.float32, device=o.a.device)
    wide = o.a.dtype == torch.float64
    for j in range(per):
        shift = None if shifts is None else shifts[j]
        aligned, lift = steps.align(c, largest[:, j], shift, ins.fraction, ins.e_zero, wide)
        c = steps.advance(a[j], b[j], lift, c, aligned, ins.fraction, ins.kept)
    return c


def partial(o: Band, band: slice, starts: range, ins: Instruction) -> torch.Tensor:
    """The rows `band` of the sum of the 4-bit instructions beginning at `starts` along K, from zero."""
    assert o.sa is not None and o.sb is not None
    c = torch.zeros(o.a[band].shape[0], o.b.shape[1], dtype=torch.float32, device=o.a.device)
    for j in starts:
        ks, g = slice(j, j + ins.k), slice(j // ins.group, (j + ins.k) // ins.group)
        c = gfdpa(o.a[band, ks], o.b[ks], c, o.sa[band, g], o.sb[g], ins, o.scale_subnormal)
    return c


def promoted(total: torch.Tensor | None, partial: torch.Tensor,
             factors: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
    """The fp32 accumulator after a partial sum is added (times its two factors, fused: exact in fp64
    but for a double rounding about once in 2^29)."""
    if factors is None:
        return partial if total is None else total + partial
    scaled = partial.double() * (factors[0].unsqueeze(1) * factors[1].unsqueeze(0)).double()
    return scaled.float() if total is None else (scaled + total.double()).float()


def spread(scales: torch.Tensor, times: int, count: int, dim: int) -> torch.Tensor:
    """Block scales repeated `times` along `dim`, then padded with ones to `count`."""
    s = scales.repeat_interleave(times, dim) if times > 1 else scales
    pad = count - s.shape[dim]
    return torch.nn.functional.pad(s, (0, pad) if dim == 1 else (0, 0, 0, pad), value=1.0) if pad else s
