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
weight, the input as the layer before gave it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, NamedTuple, get_type_hints

import torch
import torch.nn.functional as F
from torch import nn

from halfprec.machine import cpu_flags, native_bf16
from halfprec.numerics.formats import FORMATS, quantize
from halfprec.numerics.formats.hadamard import random_hadamard, rotate
from halfprec.numerics.settings import HIGH
from halfprec.spec import Spec

OPERANDS = ("input", "weight", "grad_output")  # the operands quantization statistics are kept for
GEMMS = ("forward", "dgrad", "wgrad")  # y = x W^T, dx = dy W, dW = dy^T x
HADAMARD_SIZE = 16
# a 64-bit odd constant (2^64 / golden ratio): seeds of successive backward passes far apart
SEED_STRIDE = 0x9E3779B97F4A7C15


GEMM_DOC = "the {}: null = the layer's format; high = unquantized; or a format for both its operands"


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

    def for_format(self, fmt: str) -> Recipe:
        """The recipe a layer in `fmt` follows: square weight blocks only where the format has them,
        so that one recipe serves a plan of several formats."""
        return replace(self, weight_2d=False) if self.weight_2d and FORMATS[fmt].tile is None else self

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


class QuantizedLinear(nn.Linear):
    """nn.Linear whose forward and backward GEMMs take their operands in `format` (see the module
    docstring). Stochastic rounding draws from a generator seeded by the layer's `seed` and the
    number of backward passes so far, which the state dict keeps: a resumed run draws what an
    unbroken one would. With `stats` a dict, each forward and backward adds its quantization
    statistics to it (diagnostics steps)."""

    eager_under_compile = True  # keep_eager

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str, recipe: Recipe, seed: int,
                 device: Any = None, dtype: torch.dtype | None = None, compiled: bool = False):  # fmt: skip
        super().__init__(in_features, out_features, bias, device, dtype)
        self.format, self.recipe, self.seed = fmt, recipe, seed
        self.compiled = compiled  # the quantizer through torch.compile (formats.compiled_quantizer)
        # each GEMM's format or high: the recipe's, then what a precision schedule's phase sets
        self.gemms = recipe.gemms(fmt)
        self.backward_passes = 0
        self.stats: dict[str, torch.Tensor] | None = None
        self.hadamard_matrix: torch.Tensor | None = None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, fmt: str, recipe: Recipe, seed: int, compiled: bool = False
    ) -> QuantizedLinear:
        """The same Parameters (a tied weight stays tied) in a layer that quantizes them."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, False, fmt, recipe, seed, w.device, w.dtype, compiled)
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
                 generator: torch.Generator | None = None, record: bool = False) -> Operand:  # fmt: skip
        """`t` (an `operand` of OPERANDS) as `gemm` takes it: blocked along `axis` in its format, in
        fp32, its outer scale split off for the GEMM's output (Format.factor), or, where the GEMM is
        high, rounded to `high` (the run's compute dtype) as an unquantized layer's GEMM takes it;
        `record`: add its statistics to `stats` when they are kept."""
        name = self.operand_format(gemm, operand)
        if name == HIGH:
            return Operand(t.to(high).float(), None, high == torch.bfloat16)
        fmt = FORMATS[name]
        rule = self.recipe.scale_rule if fmt.scale == "e8m0" else "floor"
        tile = self.recipe.weight_2d and operand == "weight" and fmt.tile is not None
        rounding = "nearest" if generator is None else "stochastic"
        counting = record and self.stats is not None
        if counting:  # the statistics compare in fp32; the quantizer reads a bf16 operand as it is
            t = t.float()
        q = quantize(t, name, axis, rounding, generator, tile, rule, counting, self.compiled, split=True)
        if counting:
            self.record(operand, t, q.values if q.factor is None else q.values * q.factor, q.saturated)
        block = fmt.block if fmt.factor == "block" and isinstance(fmt.block, int) else None
        return Operand(q.values, q.factor, fmt.exact_in_bf16, block)

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

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of this backward pass's stochastic rounding (None: rounded to nearest)."""
        if not self.recipe.stochastic_grads:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed + self.backward_passes * SEED_STRIDE) % 2**63)
        self.backward_passes += 1
        return gen

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
            y = gemm(xq, layer.quantize(weight, "weight", -1, "forward", out_dtype, record=True).t())
            if bias is not None:
                y = y + bias.float()
        # the operands as they came: the backward GEMMs block them along other axes
        ctx.save_for_backward(flat, weight)
        ctx.layer, ctx.shape, ctx.bias_dtype = layer, x.shape, None if bias is None else bias.dtype
        ctx.high = out_dtype  # what a high GEMM's operands are rounded to
        return y.to(out_dtype).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, weight = ctx.saved_tensors
        layer: QuantizedLinear = ctx.layer
        dy = grad.reshape(-1, grad.shape[-1])  # as it came: the quantizer reads it in its dtype
        gen = layer.generator(dy.device)
        dx = dw = db = None
        # statistics: each operand where first quantized (the forward's, unless it is high)
        forward_high, recorded_dy = layer.gemms["forward"] == HIGH, False
        if ctx.needs_input_grad[0]:
            dyq = layer.quantize(dy, "grad_output", -1, "dgrad", ctx.high, gen, record=True)
            wq = layer.quantize(weight, "weight", 0, "dgrad", ctx.high, record=forward_high)
            dx = gemm(dyq, wq).to(flat.dtype).reshape(ctx.shape)
            recorded_dy = layer.gemms["dgrad"] != HIGH
        if ctx.needs_input_grad[1]:
            g, x = layer.weight_grad_operands(dy, flat)
            dyq = layer.quantize(g, "grad_output", 0, "wgrad", ctx.high, gen, record=not recorded_dy)
            dw = gemm(dyq.t(), layer.quantize(x, "input", 0, "wgrad", ctx.high, record=forward_high))
            layer.record_noise(dw, dy, flat)
            dw = dw.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)  # no GEMM: a sum, in fp32 as in a fused kernel
        return dx, dw, db, None


class Operand(NamedTuple):
    """A GEMM operand in a format: `values` times `factor` (None: 1) are its quantized values; the
    GEMM multiplies `values` and applies the factors to its output, as the hardware applies NVFP4's
    tensor scales, fp8's tensorwise and rowwise ones and fp8_block's per chunk of `block` values of
    the contraction (None: the factor is per tensor or per row). `bf16`: bf16 holds every value."""

    values: torch.Tensor
    factor: torch.Tensor | None
    bf16: bool
    block: int | None = None

    def t(self) -> Operand:
        """The operand transposed (its last two dimensions: each matrix of a batch)."""
        factor = self.factor if self.factor is None or self.factor.dim() < 2 else self.factor.transpose(-2, -1)
        return self._replace(values=self.values.transpose(-2, -1), factor=factor)


def gemm(a: Operand, b: Operand) -> torch.Tensor:
    """a @ b in fp32: the product of the values with fp32 accumulation, times the two factors (their
    product first, as cuBLAS takes one alpha and DeepGEMM one scale per chunk). Matrices, or batches
    of them with the same leading dimensions (attention's batch x heads)."""
    block = a.block or b.block
    if block:
        return blockwise(a, b, block)
    y = product(a.values, b.values, a.bf16 and b.bf16)
    factor = times(a.factor, b.factor)
    return y if factor is None else y * factor


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
