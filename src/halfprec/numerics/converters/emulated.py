"""precision.kernel=emulated: QuantizedLinear, every format of numerics/formats and every recipe
switch on any device, its GEMMs on the formats' exact values (numerics/quantized.py), and
QuantizedAttention for precision.attention (numerics/attention.py). Its own key: precision.quantizer
(quantizer_for)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from torch import nn

from halfprec.errors import ConfigError
from halfprec.numerics.attention import (
    AttentionRecipe,
    QuantizedAttention,
    ScaledDotProduct,
    StochasticAttention,
    attention_label,
)
from halfprec.numerics.converters import Conversion, Converter, register_converter
from halfprec.numerics.layers import layer_accumulate
from halfprec.numerics.quantized import QuantizedLinear, Recipe, gemm_label, gemm_note
from halfprec.numerics.settings import HIGH, RuleSettings

# A cold compile (inductor's on-disk cache empty) costs more than a CPU's eager quantizer loses over
# a short run: precision.quantizer=auto compiles on a CPU from this many steps (docs/benchmarks.md).
COMPILE_PAYS_FROM = 1000
COMPILED_NOTE = (
    "quantizers: compiled (precision.quantizer), one or two fused kernels each; the first steps compile each "
    "(format, axis, shape) a layer meets, a few seconds each (precision.quantizer=eager: none)"
)


@register_converter("emulated")
class EmulatedConverter(Converter):
    reports_as = "emulated"

    def convert(self, model: nn.Module, plan: dict[str, str], how: Conversion) -> list[str]:
        compiled = quantizer_for(how.precision.quantizer, how.device_type, how.steps) == "compiled"
        p = how.precision
        swap_emulated(model, plan, p.recipe, how.seed, how.rank, compiled, p.attention, p.accumulate, p.rules)
        notes = [gemm_note(how.device_type)]
        return [*notes, COMPILED_NOTE] if compiled else notes

    def layer_format(self, module: nn.Module) -> str | None:
        if isinstance(module, QuantizedAttention):
            return attention_label(module.gemms)
        return gemm_label(module.gemms) if isinstance(module, QuantizedLinear) else None


def quantizer_for(choice: str, device_type: str, steps: int | None = None) -> str:
    """precision.quantizer: auto compiles on a GPU, where each op of the eager quantizer launches a
    kernel, and on a CPU for a run of COMPILE_PAYS_FROM `steps` or more; a shorter one (or `steps`
    None: a tool's few steps) stays eager."""
    if choice == "auto":
        long_run = steps is not None and steps >= COMPILE_PAYS_FROM
        return "compiled" if device_type == "cuda" or long_run else "eager"
    return choice


def swap_emulated(model: nn.Module, plan: dict[str, str], recipe: Recipe, seed: int, rank: int,
                  compiled: bool = False, attention: AttentionRecipe | None = None,
                  accumulate: str = "exact", rules: Sequence[RuleSettings] = ()) -> None:  # fmt: skip
    """Each planned Linear becomes a QuantizedLinear of its format, sharing its Parameters; `compiled`:
    its quantizers through torch.compile; `accumulate`: precision.accumulate (numerics/accumulate.py),
    or the accumulate of the rule of `rules` that gives a layer its format. Each planned attention core
    a QuantizedAttention (`attention`: precision.attention), which has no dropout (a
    StochasticAttention where the recipe rounds gradients stochastically)."""
    for name, fmt in plan.items():
        if fmt == HIGH:
            continue
        summed = layer_accumulate(name, rules, accumulate)  # the preset and the key that chose it
        linear = model.get_submodule(name)
        if isinstance(linear, ScaledDotProduct):
            if linear.dropout:
                raise ConfigError("model.dropout", linear.dropout, "quantized attention (precision.attention) has no "
                                  "dropout of its attention weights: set model.dropout=0, or "
                                  "precision.attention.format=null")  # fmt: skip
            kind = StochasticAttention if recipe.stochastic_grads else QuantizedAttention
            core = kind(fmt, attention or AttentionRecipe(fmt), recipe.for_format(fmt), layer_seed(seed, name, rank),
                        *summed)  # fmt: skip
            model.set_submodule(name, core)
            continue
        assert isinstance(linear, nn.Linear)
        seeded = layer_seed(seed, name, rank)
        layer = QuantizedLinear.from_linear(linear, fmt, recipe.for_format(fmt), seeded, compiled, *summed)
        model.set_submodule(name, layer)


def layer_seed(seed: int, name: str, rank: int) -> int:
    """A layer's stochastic-rounding seed: the run's seed, the layer's name (crc32: the same in every
    process, where str hashes are not) and the rank (ranks round their own gradients independently)."""
    return (seed << 40) ^ (rank << 32) ^ zlib.crc32(name.encode())
