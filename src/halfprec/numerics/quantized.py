"""A Linear layer whose three GEMMs compute on the values of a number format, emulated on any
device (docs/design.md, "Number formats").

For y = x W^T + b (x: tokens x in, W: out x in), as block-scaled tensor cores do:

    forward        y  = q(x  along in)      q(W along in)^T
    input grad     dx = q(dy along out)     q(W along out)
    weight grad    dW = q(dy along tokens)^T q(x along tokens)

each operand blocked along the dimension its GEMM contracts: the same tensor is re-blocked along
another axis for another GEMM (square weight blocks give W one set of values for both). As the
hardware computes: the operands' values (elements times their power-of-two or E4M3 block scales)
multiplied exactly with fp32 accumulation, and the fp32 scales applied to the fp32 output, per
tensor (NVFP4's, fp8 tensorwise), per row (fp8 rowwise) or per 128-long chunk of the contraction
(fp8_block) (`Operand`, `gemm`). bf16 holds every such value: bf16 operands on a GPU and on a CPU
with bf16 units (`product`), fp32 ones elsewhere. The output comes back in the autocast dtype (or
the input's). Operands are quantized from the values they hold: the fp32
weight, the input as the layer before gave it; or, with `precision.recipe.backward_source=forward`, the
backward's x and W re-quantized from the forward's quantized copies, as kernels that keep only
those (`QuantizedMatmul`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, NamedTuple, get_type_hints

import torch
import torch.nn.functional as F
from torch import nn

from halfprec.machine import cpu_flags, native_bf16
from halfprec.numerics import accumulate
from halfprec.numerics.accumulate import Accumulation
from halfprec.numerics.formats import FORMATS, SCALE_BITS, quantize
from halfprec.numerics.formats.elements import ELEMENTS
from halfprec.numerics.formats.hadamard import random_hadamard, rotate
from halfprec.numerics.settings import HIGH
from halfprec.spec import Spec

OPERANDS = ("input", "weight", "grad_output")  # the operands quantization statistics are kept for
GEMMS = ("forward", "dgrad", "wgrad")  # y = x W^T, dx = dy W, dW = dy^T x
HADAMARD_SIZE = 16
# a 64-bit odd constant (2^64 / golden ratio): seeds of successive backward passes far apart
SEED_STRIDE = 0x9E3779B97F4A7C15


GEMM_DOC = "the {}: null = the layer's format; high = unquantized; or a format for both its operands"
BACKWARD_SOURCE_DOC = (
    "what the backward GEMMs quantize x and W from: high = the high-precision tensors; forward = the forward's "
    "quantized copies, dequantized (kernels that save only those: double quantization)"
)
KEPT = "kept_bytes"  # the attribute by which a saved forward copy says what a kernel would hold of it
ACCUMULATE_DOC = "how the {}'s products are summed: a preset of numerics/accumulate.py; null = precision.accumulate"


@dataclass(frozen=True)
class Recipe:
    """How a layer's GEMMs use its format: `precision.recipe`'s keys, declared here alone (config
    validation reads their types and docs; conf/precision/fp32.yaml gives every option its values).
    A field's default is its off value, what a checkpoint from before the switch existed implies.
    A new switch: a field here, what it does below, and its line in fp32.yaml's recipe block."""

    grad_format: Annotated[
        str | None, Spec(doc="the gradients' number format; null = the layer's (e.g. fp8_e4m3 forward, fp8_e5m2 grads)")
    ] = None
    stochastic_grads: Annotated[bool, Spec(doc="round gradient operands stochastically (seeded, resumed exactly)")] = (
        False
    )
    hadamard: Annotated[bool, Spec(doc="a random 16x16 Hadamard transform of both weight-gradient operands")] = False
    weight_2d: Annotated[bool, Spec(doc="square weight blocks (nvfp4 16x16, fp8_block 128x128)")] = False
    scale_rule: Annotated[Literal["floor", "rceil"], Spec(doc="the MX formats' E8M0 scale")] = "floor"
    forward: Annotated[str | None, Spec(doc=GEMM_DOC.format("forward GEMM, y = x W^T"))] = None
    dgrad: Annotated[str | None, Spec(doc=GEMM_DOC.format("input-gradient GEMM, dx = dy W"))] = None
    wgrad: Annotated[str | None, Spec(doc=GEMM_DOC.format("weight-gradient GEMM, dW = dy^T x"))] = None
    backward_source: Annotated[Literal["high", "forward"], Spec(doc=BACKWARD_SOURCE_DOC)] = "high"
    # how each GEMM's tensor cores sum (numerics/accumulate.py): TE's Hopper recipe is forward hopper,
    # dgrad and wgrad hopper_promoted
    forward_accumulate: Annotated[str | None, Spec(doc=ACCUMULATE_DOC.format("forward GEMM"))] = None
    dgrad_accumulate: Annotated[str | None, Spec(doc=ACCUMULATE_DOC.format("input-gradient GEMM"))] = None
    wgrad_accumulate: Annotated[str | None, Spec(doc=ACCUMULATE_DOC.format("weight-gradient GEMM"))] = None

    def for_format(self, fmt: str) -> Recipe:
        """The recipe a layer in `fmt` follows: square weight blocks only where the format has them,
        so that one recipe serves a plan of several formats."""
        return replace(self, weight_2d=False) if self.weight_2d and FORMATS[fmt].tile is None else self

    def accumulations(self, default: str) -> dict[str, str]:
        """Each GEMM's accumulation preset: its own, else precision.accumulate (`default`)."""
        return {g: getattr(self, f"{g}_accumulate") or default for g in GEMMS}

    def gemms(self, fmt: str) -> dict[str, str]:
        """What each GEMM of a layer in `fmt` computes in: its format, or high."""
        return {g: getattr(self, g) or fmt for g in GEMMS}


def gemm_label(gemms: dict[str, str]) -> str:
    """A layer's formats in one word for the logs: the format when its three GEMMs share one, else
    forward-dgrad-wgrad (nvfp4-high-high: the forward alone quantized)."""
    formats = [gemms[g] for g in GEMMS]
    return formats[0] if len(set(formats)) == 1 else "-".join(formats)


# Recipe's on/off switches: what a precision option turns on, and what a kernel or tool may lack
RECIPE_SWITCHES = tuple(name for name, hint in get_type_hints(Recipe).items() if hint is bool)


class BackwardDraws:
    """The stochastic rounding of a quantized layer's backward passes (the recipe's stochastic_grads):
    each pass draws from a generator seeded by the layer's `seed` and its count of passes so far."""

    seed: int
    recipe: Recipe
    backward_passes: int

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of this backward pass's stochastic rounding (None: rounded to nearest)."""
        if not self.recipe.stochastic_grads:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed + self.backward_passes * SEED_STRIDE) % 2**63)
        self.backward_passes += 1
        return gen


class QuantizedLinear(BackwardDraws, nn.Linear):
    """nn.Linear whose forward and backward GEMMs take their operands in `format` (see the module
    docstring). Stochastic rounding draws from a generator seeded by the layer's `seed` and the
    number of backward passes so far, which the state dict keeps: a resumed run draws what an
    unbroken one would. With `stats` a dict, each forward and backward adds its quantization
    statistics to it (diagnostics steps)."""

    eager_under_compile = True  # keep_eager

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str, recipe: Recipe, seed: int,
                 device: Any = None, dtype: torch.dtype | None = None, compiled: bool = False,
                 accumulate: str = accumulate.EXACT, accumulate_key: str = "precision.accumulate"):  # fmt: skip
        super().__init__(in_features, out_features, bias, device, dtype)
        self.format, self.recipe, self.seed = fmt, recipe, seed
        self.compiled = compiled  # the quantizer through torch.compile (formats.compiled_quantizer)
        # each GEMM's format or high: the recipe's, then what a precision schedule's phase sets
        self.gemms = recipe.gemms(fmt)
        # each GEMM's preset: the recipe's, else `accumulate` (precision.accumulate or the rule's: accumulate_key)
        self.accumulate = accumulations(recipe, accumulate, self.gemms, accumulate_key)
        self.backward_passes = 0
        self.stats: dict[str, torch.Tensor] | None = None
        self.hadamard_matrix: torch.Tensor | None = None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, fmt: str, recipe: Recipe, seed: int, compiled: bool = False,
        accumulate: str = accumulate.EXACT, accumulate_key: str = "precision.accumulate",
    ) -> QuantizedLinear:  # fmt: skip
        """The same Parameters (a tied weight stays tied) in a layer that quantizes them."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, False, fmt, recipe, seed, w.device, w.dtype, compiled,
                    accumulate, accumulate_key)  # fmt: skip
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # eager under trainer.compile: keep_eager
        return QuantizedMatmul.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        gemms = ", ".join(f"{g}={self.gemms[g]}" for g in GEMMS)
        return f"{super().extra_repr()}, format={self.format}, {gemms}, grad_format={self.recipe.grad_format}"

    def get_extra_state(self) -> dict:
        return {"backward_passes": self.backward_passes}

    def set_extra_state(self, state: dict) -> None:
        self.backward_passes = int(state["backward_passes"])

    def operand_format(self, gemm: str, operand: str) -> str:
        """The format `operand` takes in `gemm`: the GEMM's; the gradient, where the GEMM keeps the
        layer's format, in the recipe's grad_format if it names one (fp8's e5m2 gradients)."""
        name = self.gemms[gemm]
        if operand == "grad_output" and name == self.format and self.recipe.grad_format:
            return self.recipe.grad_format
        return name

    def quantize(self, t: torch.Tensor, operand: str, axis: int, gemm: str, high: torch.dtype,
                 generator: torch.Generator | None = None, record: bool = False,
                 split: bool = True) -> Operand:  # fmt: skip
        """`t` (an `operand` of OPERANDS) as `gemm` takes it: blocked along `axis` in its format, in
        fp32, its outer scale split off for the GEMM's output (Format.factor) unless not `split`, or,
        where the GEMM is high, rounded to `high` (the run's compute dtype) as an unquantized layer's
        GEMM takes it; `record`: add its statistics to `stats` when they are kept."""
        name = self.operand_format(gemm, operand)
        if name == HIGH:
            return Operand(t.to(high).float(), None, high == torch.bfloat16, element=str(high).removeprefix("torch."))
        fmt = FORMATS[name]
        rule = self.recipe.scale_rule if fmt.scale == "e8m0" else "floor"
        rounding = "nearest" if generator is None else "stochastic"
        counting = record and self.stats is not None
        if counting:  # the statistics compare in fp32; the quantizer reads a bf16 operand as it is
            t = t.float()
        tile = self.tiled(name, operand)
        scaled = not self.accumulate[gemm].exact and format_kind(name) in ("mx", "fp4")  # a block-scaled MMA's
        q = quantize(t, name, axis, rounding, generator, tile, rule, counting, self.compiled, split, scaled)
        if counting:
            self.record(operand, t, q.values if q.factor is None else q.values * q.factor, q.saturated)
        block = fmt.block if fmt.factor == "block" and isinstance(fmt.block, int) else None
        per = fmt.block if q.scales is not None and isinstance(fmt.block, int) else 0
        return Operand(q.values, q.factor, fmt.exact_in_bf16, block, fmt.element.name, q.scales, per)

    def tiled(self, name: str, operand: str) -> bool:
        """Whether `operand` takes square blocks in format `name` (the recipe's weight_2d)."""
        return self.recipe.weight_2d and operand == "weight" and FORMATS[name].tile is not None

    def saved_operands(self, x: torch.Tensor, xq: Operand, w: torch.Tensor, wq: Operand,
                       high: torch.dtype) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
        """What the backward GEMMs quantize x and W from (the recipe's backward_source): the tensors
        as they came, or the forward's copies (forward_copy). Square weight blocks in one format for
        the forward and dgrad make W's forward copy its backward one too: no re-quantization (the
        fp32 weight quantized again gives it). Third, x as it came where the statistics need the
        exact dW (record_noise), else None."""
        if self.recipe.backward_source == "high":
            return x, w, None
        name = self.operand_format("forward", "weight")
        shared = name != HIGH and name == self.operand_format("dgrad", "weight") and self.tiled(name, "weight")
        if shared:
            w = w.detach()
            setattr(w, KEPT, held_bytes(name, w.shape, True))  # the kernel keeps the forward copy
        else:
            w = self.forward_copy(w, wq, "weight", high)
        exact = x if self.stats is not None and self.gemms["wgrad"] != HIGH else None
        return self.forward_copy(x, xq, "input", high), w, exact

    def forward_copy(self, t: torch.Tensor, q: Operand, operand: str, high: torch.dtype) -> torch.Tensor:
        """What a kernel that keeps only the forward's copy of `operand` (`t`, quantized to `q` along
        `in`) hands the backward: its values dequantized in fp32 (elements times scales; NVFP4's element
        times the fp32 product of its two scales, as TransformerEngine dequantizes: fake_quantize's
        values), or `t` rounded to `high` where the forward GEMM is high; tagged (KEPT) with the bytes
        that kernel holds of it, for the memory estimate."""
        name = self.operand_format("forward", operand)
        if name == HIGH:
            copy, held = q.values.detach(), t.numel() * high.itemsize
        else:
            if FORMATS[name].scale == "nvfp4":  # split values times the tensor scale round otherwise
                copy = self.quantize(t, operand, -1, "forward", high, split=False).values
            else:
                copy = q.values if q.factor is None else q.values * q.factor
            held = held_bytes(name, t.shape, self.tiled(name, operand))
        setattr(copy, KEPT, held)
        return copy

    @torch.no_grad()
    def record(self, operand: str, t: torch.Tensor, q: torch.Tensor, saturated: torch.Tensor) -> None:
        """Sums over the step's micro-batches, on the device (quant_sums)."""
        assert self.stats is not None
        self.stats[operand] = quant_sums(t, q, saturated) + self.stats.get(operand, 0)

    @torch.no_grad()
    def record_noise(self, dw: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
        """On diagnostics steps, the weight gradient's quantization noise: sums over the step's
        micro-batches of the exact dW = dy^T x (fp32 operands as they came, no rotation: a Hadamard
        transform is orthogonal) and of the quantized GEMM's difference from it, for the
        gradient-to-noise ratio (training/diagnostics.py)."""
        if self.stats is None or self.gemms["wgrad"] == HIGH:
            return
        exact = dy.float().T @ x.float()
        for key, value in (("wgrad_exact", exact), ("wgrad_noise", dw - exact)):
            self.stats[key] = value + self.stats[key] if key in self.stats else value

    def weight_grad_operands(self, dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dy and x for dW = dy^T x; with the recipe's Hadamard transform, both rotated along the
        tokens by the same orthogonal 16x16 matrix (tokens padded with zeros to a multiple of 16:
        zero rows add nothing to dy^T x, rotated or not)."""
        if not self.recipe.hadamard or self.gemms["wgrad"] == HIGH:
            return dy, x
        dy = dy.float()  # rotated in fp32, and kept so
        pad = -dy.shape[0] % HADAMARD_SIZE
        if pad:  # F.pad copies even when it adds nothing
            dy, x = F.pad(dy, (0, 0, 0, pad)), F.pad(x, (0, 0, 0, pad))
        if self.hadamard_matrix is None:  # one per layer, drawn from its seed
            self.hadamard_matrix = random_hadamard(HADAMARD_SIZE, torch.Generator().manual_seed(self.seed))
        return rotate(dy, self.hadamard_matrix, 0), rotate(x, self.hadamard_matrix, 0)


def held_bytes(name: str, shape: torch.Size, tile: bool) -> int:
    """The bytes a kernel holds of a tensor of `shape` in format `name`, blocked along its last axis or
    in square tiles: the elements at their bits, packed; the scales: one per block (E8M0 or E4M3: a
    byte; fp8_block's fp32), per row or per tensor (fp32), and NVFP4's fp32 tensor scale."""
    fmt = FORMATS[name]
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if tile and fmt.tile is not None:
        scales = math.ceil(rows / fmt.tile) * math.ceil(cols / fmt.tile)
    elif isinstance(fmt.block, int):
        scales = rows * math.ceil(cols / fmt.block)
    else:
        scales = rows if fmt.block == "row" else 1
    tensor_scale = 4 if fmt.scale == "nvfp4" else 0
    return math.ceil(rows * cols * fmt.element.bits / 8) + math.ceil(scales * SCALE_BITS[fmt.scale] / 8) + tensor_scale


def kept_bytes(t: torch.Tensor) -> int | None:
    """The bytes a kernel holds of `t` where `t` is a forward copy saved for the backward
    (QuantizedLinear.forward_copy), else None."""
    return getattr(t, KEPT, None)


@torch.no_grad()
def quant_sums(t: torch.Tensor, q: torch.Tensor, saturated: torch.Tensor) -> torch.Tensor:
    """The quantization statistics of `t` (fp32) quantized to `q`, as 6 fp32 sums on its device, to be
    added over a step's micro-batches and read back once (training/diagnostics.py): squared error,
    squared norm, values, non-zero values, non-zero values that became 0, saturated values."""
    nonzero = t != 0
    parts = [(q - t).square().sum(), t.square().sum(), torch.tensor(t.numel(), device=t.device),
             nonzero.sum(), (nonzero & (q == 0)).sum(), saturated]  # fmt: skip
    return torch.stack([p.float() for p in parts])


@torch.no_grad()
def what_if_sums(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """quant_sums of `t` as `fmt` would quantize it along its last axis, without being a GEMM's operand:
    rounded to nearest (no random draws, so the run's generators are left as they were), plain 1-D
    blocks (no square weight tiles), the E8M0 floor rule; `t` itself is left untouched (diagnostics.shadow)."""
    t = t.detach().float()  # as record compares: in fp32, whatever the operand's dtype
    q = quantize(t, fmt, -1, count_saturated=True)
    return quant_sums(t, q.values, q.saturated)


class QuantizedMatmul(torch.autograd.Function):
    """x W^T + b and its two gradients on quantized operands (QuantizedLinear's module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: QuantizedLinear) -> torch.Tensor:  # fmt: skip
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        flat = x.reshape(-1, x.shape[-1])
        with torch.autocast(device, enabled=False):  # the product of the quantized values, in fp32
            xq = layer.quantize(flat, "input", -1, "forward", out_dtype, record=True)
            wq = layer.quantize(weight, "weight", -1, "forward", out_dtype, record=True)
            y = gemm(xq, wq.t(), layer.accumulate["forward"])
            if bias is not None:
                y = y + bias.float()
            # the backward GEMMs block them along other axes: the operands as they came, or the forward's copies
            ctx.save_for_backward(*layer.saved_operands(flat, xq, weight, wq, out_dtype))
        ctx.layer, ctx.shape, ctx.bias_dtype = layer, x.shape, None if bias is None else bias.dtype
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.high = out_dtype  # what a high GEMM's operands are rounded to
        return y.to(out_dtype).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, weight, exact = ctx.saved_tensors  # exact: x as it came, where flat is the forward's copy
        layer: QuantizedLinear = ctx.layer
        dy = grad.reshape(-1, grad.shape[-1])  # as it came: the quantizer reads it in its dtype
        gen = layer.generator(dy.device)
        dx = dw = db = None
        # statistics: each operand where first quantized (the forward's, unless it is high)
        forward_high, recorded_dy = layer.gemms["forward"] == HIGH, False
        if ctx.needs_input_grad[0]:
            dyq = layer.quantize(dy, "grad_output", -1, "dgrad", ctx.high, gen, record=True)
            wq = layer.quantize(weight, "weight", 0, "dgrad", ctx.high, record=forward_high)
            dx = gemm(dyq, wq, layer.accumulate["dgrad"]).to(ctx.x_dtype).reshape(ctx.shape)
            recorded_dy = layer.gemms["dgrad"] != HIGH
        if ctx.needs_input_grad[1]:
            g, x = layer.weight_grad_operands(dy, flat)
            dyq = layer.quantize(g, "grad_output", 0, "wgrad", ctx.high, gen, record=not recorded_dy)
            xq = layer.quantize(x, "input", 0, "wgrad", ctx.high, record=forward_high)
            dw = gemm(dyq.t(), xq, layer.accumulate["wgrad"])
            layer.record_noise(dw, dy, flat if exact is None else exact)
            dw = dw.to(ctx.w_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)  # no GEMM: a sum, in fp32 as in a fused kernel
        return dx, dw, db, None


class Operand(NamedTuple):
    """A GEMM operand in a format: `values` times `factor` (None: 1) are its quantized values; the
    GEMM multiplies `values` and applies the factors to its output, as the hardware applies NVFP4's
    tensor scales, fp8's tensorwise and rowwise ones and fp8_block's per chunk of `block` values of
    the contraction (None: the factor is per tensor or per row). `bf16`: bf16 holds every value.
    For a modelled accumulation (numerics/accumulate.py): `element`, the values' element type (an
    element of formats/elements.py, or the dtype of a high GEMM's operands); `scales`, block-scaled
    formats' E8M0 or E4M3 scales per `scale_block` values of the contraction, which `values` include."""

    values: torch.Tensor
    factor: torch.Tensor | None
    bf16: bool
    block: int | None = None
    element: str = "float32"
    scales: torch.Tensor | None = None
    scale_block: int = 0

    def t(self) -> Operand:
        """The operand transposed (its last two dimensions: each matrix of a batch)."""

        def flip(x: torch.Tensor | None) -> torch.Tensor | None:
            return x if x is None or x.dim() < 2 else x.transpose(-2, -1)

        return self._replace(values=self.values.transpose(-2, -1), factor=flip(self.factor), scales=flip(self.scales))


def gemm(a: Operand, b: Operand, accumulation: Accumulation | None = None) -> torch.Tensor:
    """a @ b in fp32: the product of the values with fp32 accumulation, times the two factors (their
    product first, as cuBLAS takes one alpha and DeepGEMM one scale per chunk); with a modelled
    `accumulation`, summed as its tensor cores sum (matrices only). Matrices, or batches of them with
    the same leading dimensions (attention's batch x heads)."""
    if accumulation is not None and not accumulation.exact and a.values.dim() > 2:  # one batch dimension
        return torch.stack([modelled(matrix(a, i), matrix(b, i), accumulation) for i in range(a.values.shape[0])])
    if accumulation is not None and not accumulation.exact:
        return modelled(a, b, accumulation)
    block = a.block or b.block
    if block:
        return blockwise(a, b, block)
    y = product(a.values, b.values, a.bf16 and b.bf16)
    factor = times(a.factor, b.factor)
    return y if factor is None else y * factor


def matrix(op: Operand, i: int) -> Operand:
    """Matrix `i` of a batch of operands (a per-tensor factor is the whole batch's)."""

    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return x if x is None or x.dim() < op.values.dim() else x[i]

    return op._replace(values=op.values[i], factor=pick(op.factor), scales=pick(op.scales))


def blockwise(a: Operand, b: Operand, size: int) -> torch.Tensor:
    """a @ b with scales per `size` values of the contraction, as DeepSeek-V3 promotes them: each
    chunk's product scaled by its scales and the chunks summed in fp32. One batched GEMM, whatever the
    contraction's length, at the cost of two chunks x M x N fp32 temporaries."""
    k = a.values.shape[-1]
    pad = -k % size
    chunks = (k + pad) // size
    av = F.pad(a.values, (0, pad)).unflatten(-1, (chunks, size)).transpose(-3, -2)
    bv = F.pad(b.values, (0, 0, 0, pad)).unflatten(-2, (chunks, size))
    partial = product(av, bv, a.bf16 and b.bf16)  # (batch x) chunks x m x n
    # a's factor: per (row, chunk), per row or per tensor; b's: per (chunk, column), per column or tensor
    fa = None if a.factor is None else (a.factor if a.factor.dim() == 0 else a.factor.transpose(-2, -1).unsqueeze(-1))
    fb = None if b.factor is None else (b.factor if b.factor.dim() == 0 else b.factor.unsqueeze(-2))
    scale = times(fa, fb)
    return (partial if scale is None else partial.mul_(scale)).sum(-3)


def modelled(a: Operand, b: Operand, acc: Accumulation) -> torch.Tensor:
    """a @ b as `acc`'s instruction for their kind sums it (accumulate.matmul): fp8 elements, their
    factors applied to the output or, fp8_block's, at each 128-long promotion (DeepGEMM); MX and
    NVFP4 elements with their block scales inside the instruction, NVFP4's tensor scale after."""
    kind = operand_kind(a)
    ins = accumulate.instruction(acc, kind, "a GEMM", "precision.accumulate")
    if ins is None:
        return gemm(a, b)
    subnormals = (SUBNORMAL.get(a.element, -126), SUBNORMAL.get(b.element, -126))
    if a.scales is not None and b.scales is not None:  # block-scaled: the elements, and their scales
        nvfp4 = a.scale_block == 16  # E4M3 scales (subnormal below 2^-6), the others E8M0
        y = accumulate.matmul(elements(a, 1), elements(b, 0), ins, subnormals, acc.promote,
                              (a.scales, b.scales), a.scale_block, -6 if nvfp4 else -127)  # fmt: skip
        factor = times(a.factor, b.factor)  # NVFP4's tensor scales
        return y if factor is None else y * factor
    block = a.block or b.block
    if block:  # fp8_block: each 128's partial sum times its two scales, then added in fp32
        m, n = a.values.shape[0], b.values.shape[1]
        chunks = -(-a.values.shape[1] // block)
        fa = torch.broadcast_to(a.factor if a.factor is not None else torch.ones(()), (m, chunks))
        fb = torch.broadcast_to(b.factor if b.factor is not None else torch.ones(()), (chunks, n))
        return accumulate.matmul(a.values, b.values, ins, subnormals, block, factors=(fa.float(), fb.float()))
    y = accumulate.matmul(a.values, b.values, ins, subnormals, acc.promote)
    factor = times(a.factor, b.factor)
    return y if factor is None else y * factor


SUBNORMAL = {name: e.emin for name, e in ELEMENTS.items()}  # where each element's subnormals sit


def operand_kind(op: Operand) -> str | None:
    """The kind of MMA a GEMM's operand takes (accumulate.KINDS): None for MXINT8, which has none."""
    if op.element in ("bfloat16", "float16", "float32", "float64"):  # float64: a gradient check's, no tensor core
        return {"bfloat16": "bf16", "float32": "fp32", "float64": "fp32"}.get(op.element, op.element)
    if op.element == "int8":
        return None
    if op.scales is None:
        return "fp8"
    return "fp4" if op.element == "e2m1" else "mx"


def format_kind(name: str) -> str | None:
    """The kind of MMA a format's operands take (as operand_kind); high: decided by the autocast dtype."""
    if name == HIGH:
        return "bf16"
    fmt = FORMATS[name]
    if fmt.element.name == "int8":
        return None
    if fmt.scale == "fp32":
        return "fp8"
    return "fp4" if fmt.element.name == "e2m1" else "mx"


def elements(op: Operand, axis: int) -> torch.Tensor:
    """A block-scaled operand's elements: its values divided by their scales along the contraction
    `axis` (exact: the values are elements times them; a zero scale's block is zeros)."""
    assert op.scales is not None
    size = op.values.shape[axis]
    scales = op.scales.repeat_interleave(op.scale_block, axis).narrow(axis, 0, size)
    return torch.where(scales > 0, op.values / scales, 0.0)


def accumulations(recipe: Recipe, default: str, gemms: dict[str, str],
                  default_key: str = "precision.accumulate") -> dict[str, Accumulation]:  # fmt: skip
    """Each GEMM's preset: the recipe's for it, else `default` (precision.accumulate, or the layer's
    rule's: `default_key`, the key an error names)."""
    keys = {g: f"precision.recipe.{g}_accumulate" for g in GEMMS if getattr(recipe, f"{g}_accumulate")}
    return checked_presets(recipe.accumulations(default), gemms, {g: keys.get(g, default_key) for g in GEMMS})


def checked_presets(names: dict[str, str], gemms: dict[str, str], keys: dict[str, str]) -> dict[str, Accumulation]:
    """Each GEMM's preset `names[g]` (accumulate.preset), checked at build against its operands' kind:
    a GEMM the preset's GPU has no instruction for is a one-line ConfigError naming `keys[g]` (a high
    GEMM's operands are checked when it runs, once its dtype is known)."""
    chosen = {}
    for g, name in names.items():
        chosen[g] = accumulate.preset(name, keys[g])
        if gemms[g] != HIGH:
            accumulate.instruction(chosen[g], format_kind(gemms[g]), f"{g} in {gemms[g]}", keys[g])
    return chosen


def times(fa: torch.Tensor | None, fb: torch.Tensor | None) -> torch.Tensor | None:
    """The product of two operands' factors, None standing for 1 (None when both are)."""
    if fa is None or fb is None:
        return fb if fa is None else fa
    return fa * fb


def product(a: torch.Tensor, b: torch.Tensor, bf16: bool) -> torch.Tensor:
    """a @ b (matrices or batches) with fp32 accumulation. Where bf16 holds both operands' values (the
    conversion is exact), the GEMM takes them as bf16 with fp32 sums and output: on a GPU through
    out_dtype, on a CPU with bf16 units through oneDNN's bf16 math mode (mm's out_dtype is CUDA-only,
    and a bf16 GEMM would round its output to bf16)."""
    if bf16 and a.device.type == "cuda" and a.dim() > 3:  # bmm takes one batch dimension
        return product(a.flatten(0, -3), b.flatten(0, -3), bf16).unflatten(0, a.shape[:-2])
    if bf16 and a.device.type == "cuda":
        return (torch.mm if a.dim() == 2 else torch.bmm)(a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)
    if bf16 and a.device.type == "cpu" and cpu_bf16():
        with onednn_bf16_math():
            return a @ b
    return a @ b


@functools.cache
def cpu_bf16() -> bool:
    """Whether oneDNN's bf16 math mode takes effect on this CPU's fp32 GEMMs. bf16 units are not enough
    (without AMX the mode may keep IEEE fp32), so a probe decides: 1 + 2^-10 comes back as 1 only where
    the mode rounds to bf16."""
    if native_bf16(cpu_flags()) is not True:
        return False
    ones = torch.full((32, 32), 1 + 2**-10)
    with onednn_bf16_math():
        return bool((ones @ torch.eye(32) == 1).all())


@contextlib.contextmanager
def onednn_bf16_math() -> Iterator[None]:
    """oneDNN may compute fp32 GEMMs with bf16 operands (its fpmath mode; torch's "bf16" precision for
    mkldnn matmuls) inside the block, and only there: other fp32 GEMMs keep IEEE fp32."""
    matmul = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]  # set at import, not in the stubs
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def gemm_note(device_type: str) -> str:
    """The start line that says how the quantized layers' GEMMs compute on this device."""
    exact = "quantized GEMMs: bf16 operands (exact for the formats' values), fp32 sums"
    if device_type == "cuda":
        return f"{exact}: tensor cores"
    if device_type == "cpu" and cpu_bf16():
        return f"{exact}: oneDNN on the CPU's bf16 units"
    if device_type == "cpu" and native_bf16(cpu_flags()):
        return "quantized GEMMs: fp32 operands and sums (oneDNN's bf16 math does not take effect on this CPU: no AMX)"
    return "quantized GEMMs: fp32 operands and sums (no bf16 units on this CPU)"


def keep_eager(model: nn.Module) -> None:
    """Leave the quantized layers eager under torch.compile: inductor fails on their blocked views, and
    their Python state (statistics, draws) would recompile them. Per instance, not
    `@torch.compiler.disable` on the class, which imports torch._dynamo at import: config validation
    imports this module, and a config error should not wait for dynamo."""
    for layer in model.modules():
        if getattr(layer, "eager_under_compile", False):  # QuantizedLinear, numerics/attention's QuantizedAttention
            layer.forward = torch.compiler.disable(layer.forward)
