"""precision.kernel=emulated: QuantizedLinear, every format of numerics/formats on any device, its
GEMMs on the formats' exact values (numerics/quantized.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from halfprec.numerics.converters import Conversion, Converter, register_converter
from halfprec.numerics.formats import FORMATS
from halfprec.numerics.layers import HIGH, layer_seed, recipe_reach
from halfprec.numerics.quantized import QuantizedLinear, Recipe, gemm_label, gemm_note

COMPILED_NOTE = (
    "quantizers: compiled (precision.quantizer), one or two fused kernels each; the first steps compile each "
    "(format, axis, shape) a layer meets, a few seconds each (precision.quantizer=eager: none)"
)


@register_converter("emulated")
class EmulatedConverter(Converter):
    reports_as = "emulated"

    def check_config(self, p: Any) -> None:
        """Every format and switch; a partial switch none of the formats named can use is an error
        (recipe_reach; which formats one misses is said at start, once the plan is known)."""
        listed = [p.format, *(r.format for r in p.rules), *(phase.format for phase in p.schedule)]
        named = [f for f in dict.fromkeys(listed) if f in FORMATS]
        if named:
            recipe_reach(named, Recipe(**p.recipe))

    def convert(self, model: nn.Module, plan: dict[str, str], how: Conversion) -> list[str]:
        notes = recipe_reach(list(dict.fromkeys(f for f in plan.values() if f != HIGH)), how.recipe)
        swap_emulated(model, plan, how.recipe, how.seed, how.rank, how.quantizer == "compiled")
        notes.append(gemm_note(how.device_type))
        return [*notes, COMPILED_NOTE] if how.quantizer == "compiled" else notes

    def layer_format(self, module: nn.Module) -> str | None:
        return gemm_label(module.gemms) if isinstance(module, QuantizedLinear) else None


def swap_emulated(
    model: nn.Module, plan: dict[str, str], recipe: Recipe, seed: int, rank: int, compiled: bool = False
) -> None:
    """Each planned Linear becomes a QuantizedLinear of its format, sharing its Parameters; `compiled`:
    its quantizers through torch.compile."""
    for name, fmt in plan.items():
        if fmt == HIGH:
            continue
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        layer = QuantizedLinear.from_linear(linear, fmt, recipe.for_format(fmt), layer_seed(seed, name, rank), compiled)
        model.set_submodule(name, layer)
