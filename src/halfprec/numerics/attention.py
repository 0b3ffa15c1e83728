"""Attention whose GEMMs compute on the values of a number format, emulated on any device
(precision.attention; docs/design.md, "Number formats").

A model's attention is a parameter-free core module (`ScaledDotProduct`: torch's fused
scaled_dot_product_attention); the emulated converter swaps it for a `QuantizedAttention`, which
computes it explicitly. For each batch and head (Q, K, V: tokens x d, s = 1/sqrt(d), causal), as
FlashAttention does, with the GEMMs on quantized operands and the rest in fp32:

    forward    S  = q(Q along d) q(K along d)^T           P = softmax(s S, causal mask)
               O  = q(P along keys) q(V along keys)
    backward   dV = q(P along queries)^T q(dO along queries)
               dP = q(dO along d) q(V along d)^T           dS = s P (dP - rowsum(dO O))
               dQ = q(dS along keys) q(K along keys)
               dK = q(dS along queries)^T q(Q along queries)

each operand blocked along the dimension its GEMM contracts (as cuDNN's MXFP8 attention: Q and K
along d, P and V along the keys) and multiplied by quantized.gemm, batched over batch x heads: the
forward's two summed as one preset of numerics/accumulate.py says, the backward's four as another
(`accumulate`: AttentionRecipe's forward_accumulate and backward_accumulate, else the core's rule's
or precision.accumulate; exact by default).
rowsum(dO O) is FlashAttention's and cuDNN's form of rowsum(P dP), from the output as returned.
P is kept for the backward (FlashAttention recomputes it: the same values, less memory). With the
recipe's backward_source=forward, the backward's Q, K and V are the forward's quantized copies, its P
the fp32 one still (a kernel recomputes P in fp32 from the forward's Q and K).

On diagnostics steps (`stats` a dict) each operand's quantization statistics are kept as a
QuantizedLinear keeps its own, under the names of ATTENTION_OPERANDS: query, key, value, probs (P),
grad_output (dO) and grad_scores (dS), each where first quantized (the forward's, unless it is high;
Q and K rotated where the Hadamard rotates them). With the recipe's stochastic_grads, dO and dS are
rounded stochastically from a generator seeded as QuantizedLinear's (resumed exactly: extra state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn

from halfprec.numerics.accumulate import EXACT
from halfprec.numerics.formats import FORMATS, quantize
from halfprec.numerics.formats.hadamard import random_hadamard, rotate
from halfprec.numerics.quantized import (
    KEPT,
    BackwardDraws,
    Operand,
    Recipe,
    checked_presets,
    format_kind,
    gemm,
    held_bytes,
    quant_sums,
)
from halfprec.numerics.settings import HIGH
from halfprec.spec import Spec

ATTENTION_GEMMS = ("forward", "backward")  # S = QK^T and O = PV; dV, dP, dQ, dK
# the operands whose quantization statistics are kept (diagnostics=grads: quant/<core>/<operand>/...)
ATTENTION_OPERANDS = ("query", "key", "value", "probs", "grad_output", "grad_scores")
ATTENTION_DOC = "null = precision.attention.format; high = unquantized; or a format for its GEMMs' operands"
ATTENTION_ACCUMULATE_DOC = (
    "how {} sum: a preset of numerics/accumulate.py; null = the core's rule's accumulate, else precision.accumulate"
)


@dataclass(frozen=True)
class AttentionRecipe:
    """`precision.attention`'s keys, declared here alone (config validation reads their types and docs;
    conf/precision/fp32.yaml gives every option its values). The defaults are attention as before
    the key existed: torch's fused attention, unquantized."""

    format: Annotated[
        str | None, Spec(doc="the number format of attention's GEMMs, e.g. mxfp8; null = torch's fused attention")
    ] = None
    forward: Annotated[str | None, Spec(doc=f"S = QK^T and O = PV: {ATTENTION_DOC}")] = None
    backward: Annotated[str | None, Spec(doc=f"dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q: {ATTENTION_DOC}")] = (
        None
    )
    hadamard: Annotated[
        bool, Spec(doc="FlashAttention-3's random-sign Hadamard transform of Q and K along the head dimension")
    ] = False
    # how its GEMMs sum (numerics/accumulate.py): attention's own, as the recipe's per-GEMM keys are the Linear layers'
    forward_accumulate: Annotated[str | None, Spec(doc=ATTENTION_ACCUMULATE_DOC.format("S = QK^T and O = PV"))] = None
    backward_accumulate: Annotated[str | None, Spec(doc=ATTENTION_ACCUMULATE_DOC.format("dV, dP, dQ and dK"))] = None

    def gemms(self, fmt: str) -> dict[str, str]:
        """What the forward and the backward GEMMs of an attention in `fmt` compute in: a format, or high."""
        return {g: getattr(self, g) or fmt for g in ATTENTION_GEMMS}

    def accumulations(self, default: str, default_key: str) -> tuple[dict[str, str], dict[str, str]]:
        """The forward's and the backward's accumulation presets: attention's own, else `default`
        (the core's rule's, else precision.accumulate: `default_key`); and the key that chose each."""
        names = {g: getattr(self, f"{g}_accumulate") or default for g in ATTENTION_GEMMS}
        own = {g: f"precision.attention.{g}_accumulate" for g in ATTENTION_GEMMS if getattr(self, f"{g}_accumulate")}
        return names, {g: own.get(g, default_key) for g in ATTENTION_GEMMS}


def attention_label(gemms: dict[str, str]) -> str:
    """An attention's formats in one word: the format when both share one, else forward-backward."""
    return gemms["forward"] if gemms["forward"] == gemms["backward"] else f"{gemms['forward']}-{gemms['backward']}"


class ScaledDotProduct(nn.Module):
    """Causal attention of (batch, heads, tokens, d) queries, keys and values through torch's fused
    scaled_dot_product_attention, its attention weights dropped out with probability `dropout` in
    training. A module of its own (no parameters, no state) so that rules can name it and a
    converter swap it."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


class QuantizedAttention(BackwardDraws, ScaledDotProduct):
    """Causal attention computed explicitly with its GEMMs in `format` (the module docstring); `gemms`
    says what its forward and backward GEMMs compute in (a precision schedule may change it). The
    recipe's grad_format gives the gradient operands (dO, dS) their format where the backward keeps
    the attention's, and its scale_rule the MX scales. With `hadamard`, Q and K are rotated along d
    for S = QK^T by a random-sign Hadamard matrix drawn from `seed` (the largest power of two dividing
    d: the whole head where d is one, as FlashAttention-3 does). No dropout (a ConfigError). With
    `stats` a dict, each forward and backward adds its operands' statistics to it (diagnostics steps);
    stochastic rounding counts backward passes as QuantizedLinear does (StochasticAttention keeps
    the count in the state dict)."""

    eager_under_compile = True  # quantized.keep_eager

    def __init__(self, fmt: str, attention: AttentionRecipe, recipe: Recipe, seed: int, accumulate: str = EXACT,
                 accumulate_key: str = "precision.accumulate"):  # fmt: skip
        super().__init__()
        self.format, self.attention, self.recipe, self.seed = fmt, attention, recipe, seed
        self.gemms = attention.gemms(fmt)
        # how the forward's and the backward's GEMMs sum: attention's presets, else `accumulate` (accumulate_key's)
        names, keys = attention.accumulations(accumulate, accumulate_key)
        self.accumulate = checked_presets(names, self.gemms, keys)
        self.hadamard_matrix: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] | None = None
        self.backward_passes = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return QuantizedAttentionFunction.apply(q, k, v, self)

    def extra_repr(self) -> str:
        return f"format={self.format}, forward={self.gemms['forward']}, backward={self.gemms['backward']}, " + (
            f"hadamard={self.attention.hadamard}"
        )

    def operand(self, t: torch.Tensor, gemm_group: str, axis: int, high: torch.dtype, grad: bool = False,
                record: str | None = None, generator: torch.Generator | None = None) -> Operand:  # fmt: skip
        """`t` (batch x heads flattened, tokens, d) as a GEMM of `gemm_group` takes it: blocked along
        `axis` in its format, in fp32, its outer scale split off for the GEMM's output; where the
        GEMM is high, rounded to `high` (the run's compute dtype). `grad`: a gradient operand, rounded
        stochastically with a `generator`; `record`: its name in `stats`, where they are kept."""
        name = self.gemms[gemm_group]
        if grad and name == self.format and self.recipe.grad_format:
            name = self.recipe.grad_format
        if name == HIGH:  # fp32 for the 16-bit dtypes; fp64 stays (a gradient check's)
            values = t.to(high).to(torch.promote_types(high, torch.float32))
            return Operand(values, None, high == torch.bfloat16, element=str(high).removeprefix("torch."))
        fmt = FORMATS[name]
        rule = self.recipe.scale_rule if fmt.scale == "e8m0" else "floor"
        counting = record is not None and self.stats is not None
        rounding = "nearest" if generator is None else "stochastic"
        scaled = not self.accumulate[gemm_group].exact and format_kind(name) in ("mx", "fp4")  # a block-scaled MMA's
        q = quantize(t, name, axis, rounding, generator, scale_rule=rule, count_saturated=counting, split=True,
                     block_scales=scaled)  # fmt: skip
        if counting:
            self.record(str(record), t, q.values if q.factor is None else q.values * q.factor, q.saturated)
        block = fmt.block if fmt.factor == "block" and isinstance(fmt.block, int) else None
        per = fmt.block if q.scales is not None and isinstance(fmt.block, int) else 0
        return Operand(q.values, q.factor, fmt.exact_in_bf16, block, fmt.element.name, q.scales, per)

    def saved_operands(self, qkv: tuple[torch.Tensor, ...], quantized: tuple[torch.Tensor, ...],
                       operands: tuple[Operand, ...], high: torch.dtype) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """What the backward GEMMs quantize Q, K and V from (the recipe's backward_source): `qkv` as they
        came, or the forward's copies of `quantized` (Q and K rotated where the Hadamard rotates them,
        V), which the forward quantized to `operands`. Not P: a kernel that keeps only the forward's
        copies recomputes P in fp32 from them, the values the forward computed (and kept here)."""
        if self.recipe.backward_source == "high":
            return qkv
        return tuple(self.forward_copy(t, op, axis, high) for t, op, axis in zip(quantized, operands, (-1, -1, -2)))

    def forward_copy(self, t: torch.Tensor, q: Operand, axis: int, high: torch.dtype) -> torch.Tensor:
        """What a kernel that keeps only the forward's copy of `t` (quantized to `q` along `axis`) hands
        the backward: its values dequantized in fp32 (NVFP4's as QuantizedLinear.forward_copy's),
        rotated back where the Hadamard rotated it, or `t` rounded to `high` where the forward is
        high; tagged (KEPT) with the bytes that kernel holds of it, for the memory estimate."""
        name = self.gemms["forward"]
        if name == HIGH:
            copy, held = q.values.detach(), t.numel() * high.itemsize
        else:
            if FORMATS[name].scale == "nvfp4":  # split values times the tensor scale round otherwise
                copy = quantize(t, name, axis, split=False).values
            else:
                copy = q.values if q.factor is None else q.values * q.factor
            if self.hadamard_matrix is not None and axis == -1:  # Q and K: their rotation undone
                copy = rotate(copy, self.hadamard_matrix.T, -1)
            held = held_bytes(name, t.shape if axis == -1 else t.transpose(-2, -1).shape, False)
        setattr(copy, KEPT, held)
        return copy

    @torch.no_grad()
    def record(self, operand: str, t: torch.Tensor, q: torch.Tensor, saturated: torch.Tensor) -> None:
        """Sums over the step's micro-batches, on the device (quant_sums, compared in fp32)."""
        assert self.stats is not None
        self.stats[operand] = quant_sums(t.float(), q, saturated) + self.stats.get(operand, 0)

    def rotated(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q and K for S = QK^T: with `hadamard` (and a quantized forward), both rotated along d by the
        same orthogonal matrix, which leaves QK^T unchanged in exact arithmetic."""
        if not self.attention.hadamard or self.gemms["forward"] == HIGH:
            return q, k
        if self.hadamard_matrix is None:  # one per layer, drawn from its seed
            d = q.shape[-1]
            self.hadamard_matrix = random_hadamard(d & -d, torch.Generator().manual_seed(self.seed))
        return rotate(q.float(), self.hadamard_matrix, -1), rotate(k.float(), self.hadamard_matrix, -1)


class StochasticAttention(QuantizedAttention):
    """A QuantizedAttention whose recipe rounds dO and dS stochastically: its count of backward passes
    is in the state dict (a resumed run draws what an unbroken one would). Only these cores have one,
    so that the others' state dict stays that of torch's fused attention."""

    def get_extra_state(self) -> dict:
        return {"backward_passes": self.backward_passes}

    def set_extra_state(self, state: dict) -> None:
        self.backward_passes = int(state["backward_passes"])


def causal_softmax(s: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * s) over the keys, each query seeing itself and the keys before it, in fp32."""
    time = s.shape[-1]
    causal = torch.ones(time, time, dtype=torch.bool, device=s.device).tril()
    return torch.softmax((s * scale).masked_fill(~causal, float("-inf")), dim=-1)


class QuantizedAttentionFunction(torch.autograd.Function):
    """Causal attention and its gradients on quantized operands (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core: QuantizedAttention) -> torch.Tensor:
        device = q.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
        shape, scale = q.shape, 1 / math.sqrt(q.shape[-1])
        q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))  # batch x heads as one batch dimension
        with torch.autocast(device, enabled=False):
            qr, kr = core.rotated(q3, k3)
            f, high = "forward", out_dtype
            acc = core.accumulate[f]
            qq, kq = core.operand(qr, f, -1, high, record="query"), core.operand(kr, f, -1, high, record="key")
            s = gemm(qq, kq.t(), acc)
            p = causal_softmax(s, scale)
            pq, vq = core.operand(p, f, -1, high, record="probs"), core.operand(v3, f, -2, high, record="value")
            o = gemm(pq, vq, acc)
        # laid out as a fused kernel writes it, tokens before heads: merging the heads (the GPT's transpose
        # and reshape) is then a view of it, and the next layer keeps no copy
        o = o.unflatten(0, shape[:-2]).transpose(-3, -2).to(out_dtype, memory_format=torch.contiguous_format)
        o = o.transpose(-3, -2)
        # Q, K, V as they came (views of one storage, as a fused kernel keeps them), or the forward's copies
        ctx.save_for_backward(*core.saved_operands((q, k, v), (qr, kr, v3), (qq, kq, vq), out_dtype), p, o)
        ctx.core, ctx.shapes, ctx.scale, ctx.high = core, (q.shape, k.shape, v.shape), scale, out_dtype
        ctx.dtypes = q.dtype, k.dtype, v.dtype
        return o

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, p, o = ctx.saved_tensors
        q, k, v, o = (t.reshape(-1, *t.shape[-2:]) for t in (*saved, o))
        core: QuantizedAttention = ctx.core
        high, b = ctx.high, "backward"
        acc = core.accumulate[b]
        do = grad.reshape(o.shape)
        gen = core.generator(do.device)
        # statistics: each operand where first quantized (Q, K, V and P in the forward, unless it is high)
        first = {n: n if core.gemms["forward"] == HIGH else None for n in ("query", "key", "value", "probs")}
        dv = gemm(core.operand(p, b, -2, high, record=first["probs"]).t(),
                  core.operand(do, b, -2, high, True, "grad_output", gen), acc)  # fmt: skip
        dp = gemm(core.operand(do, b, -1, high, True, generator=gen),
                  core.operand(v, b, -1, high, record=first["value"]).t(), acc)  # fmt: skip
        rows = (do.to(p.dtype) * o.to(p.dtype)).sum(-1, keepdim=True)  # rowsum(P dP) in exact arithmetic
        ds = p * (dp - rows) * ctx.scale
        dq = gemm(core.operand(ds, b, -1, high, True, "grad_scores", gen),
                  core.operand(k, b, -2, high, record=first["key"]), acc)  # fmt: skip
        dk = gemm(core.operand(ds, b, -2, high, True, generator=gen).t(),
                  core.operand(q, b, -2, high, record=first["query"]), acc)  # fmt: skip
        dq, dk, dv = (g.to(dtype).reshape(shape) for g, dtype, shape in zip((dq, dk, dv), ctx.dtypes, ctx.shapes))
        return dq, dk, dv, None
