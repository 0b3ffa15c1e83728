"""Evaluation precision (precision.eval; docs/guide/precision.md, "Evaluation precision"): the
validation metrics of a model in precisions other than the one it trains in, side by side.

An entry is `high` (every Linear layer unquantized, in the run's autocast or parameter dtype) or a
format of numerics/formats: post-training quantization of the weights and activations of the
Linear layers the run's plan would quantize (precision.rules, high_first and high_last apply; a
rule's format only says that a layer is quantized: every quantized layer takes the entry's format;
the output head stays high), their forward GEMM as QuantizedLinear computes it, rounded to nearest.
Where the run quantizes attention (precision.attention.format), its attention cores take the entry
too: high is torch's fused attention, a format QuantizedAttention's GEMMs in it. A quantized layer's
forward sums as the run's layer would (numerics/accumulate.py: the recipe's or attention's forward
preset, the layer's rule's, precision.accumulate) where that preset has an instruction for the
entry's format, else exactly (eval_sums); the start line says which.

`layers_in` swaps the layers for the evaluation, sharing their Parameters, and puts the very
modules it found back after it: the training's layers, their counters and statistics are not
touched, and the new layers are built on the meta device, so no random number is drawn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from halfprec.errors import ConfigError
from halfprec.numerics.accumulate import EXACT, PRESETS
from halfprec.numerics.attention import AttentionRecipe, QuantizedAttention, ScaledDotProduct
from halfprec.numerics.converters import layer_format
from halfprec.numerics.layers import attention_cores, layer_accumulate, plan_layers, planned_modules
from halfprec.numerics.quantized import QuantizedLinear, Recipe, format_kind
from halfprec.numerics.settings import HIGH, RuleSettings


def eval_key(metric: str, entry: str) -> str:
    """The key of a validation metric in an evaluation precision: val/loss@mxfp4."""
    return f"{metric}@{entry}"


@dataclass(frozen=True)
class EvalPrecision:
    """One entry of precision.eval as it applies to a model: each Linear layer's format or high."""

    entry: str
    plan: dict[str, str]
    recipe: Recipe  # what the quantized layers' forward reads of it: scale_rule, weight_2d
    attention: AttentionRecipe | None = None  # the attention cores' in the entry's format, where the run quantizes them
    # the preset each quantized layer's forward would sum with in the run (eval_sums: what it sums with here)
    accumulate: dict[str, str] = field(default_factory=dict)

    @property
    def quantized(self) -> int:
        return sum(f != HIGH for f in self.plan.values())

    def sums(self, name: str) -> str:
        """How layer `name`'s forward sums in the entry: the run's preset where it has an instruction
        for the entry's format (accumulate.KINDS), else exact."""
        preset = self.accumulate.get(name, EXACT)
        return preset if format_kind(self.entry) in PRESETS[preset].instructions else EXACT


def eval_plan(model: nn.Module, entry: str, rules: Sequence[RuleSettings], high_first: int = 0,
              high_last: int = 0, attention: str | None = None) -> dict[str, str]:  # fmt: skip
    """Each Linear layer's format in the evaluation `entry` (the module docstring), and each attention
    core's where the run quantizes attention (`attention`: its precision.attention.format); a
    ConfigError naming precision.eval for a format that quantizes no layer of this model."""
    if entry == HIGH:
        return dict.fromkeys(planned_modules(model, attention), HIGH)
    plan = plan_layers(model, entry, rules, high_first, high_last, attention=entry if attention else None)
    plan = {name: HIGH if f == HIGH else entry for name, f in plan.items()}
    if all(f == HIGH for f in plan.values()):
        raise ConfigError(
            "precision.eval", entry, f"quantizes no Linear layer of {type(model).__name__} (the output head, "
            "precision.rules sending layers high, high_first/high_last keep them all high): use high, or keep "
            "fewer high",
        )  # fmt: skip
    return plan


def eval_recipe(recipe: Recipe, entry: str) -> Recipe:
    """The recipe of the evaluation's layers in `entry`: the switches a forward GEMM reads, the run's
    (scale_rule, weight_2d where the format has square blocks), the forward in the entry's format."""
    if entry == HIGH:
        return Recipe()
    return Recipe(scale_rule=recipe.scale_rule, weight_2d=recipe.weight_2d).for_format(entry)


def eval_precisions(model: nn.Module, entries: Sequence[str], recipe: Recipe, rules: Sequence[RuleSettings],
                    high_first: int = 0, high_last: int = 0, attention: AttentionRecipe | None = None,
                    accumulate: str = EXACT) -> list[EvalPrecision]:  # fmt: skip
    """precision.eval's entries planned on `model` (its layers as the run computes them); `attention`:
    the run's precision.attention (its cores take each entry too where it quantizes them);
    `accumulate`: precision.accumulate (the module docstring)."""
    on = attention.format if attention is not None else None
    hadamard = attention is not None and attention.hadamard
    cores, precisions = set(attention_cores(model)), []
    for e in entries:
        plan = eval_plan(model, e, rules, high_first, high_last, on)
        quantized = [n for n, f in plan.items() if f != HIGH]
        sums = {n: forward_preset(n, n in cores, recipe, attention, rules, accumulate) for n in quantized}
        core = None if e == HIGH or not on else AttentionRecipe(e, hadamard=hadamard)
        precisions.append(EvalPrecision(e, plan, eval_recipe(recipe, e), core, sums))
    return precisions


def forward_preset(name: str, core: bool, recipe: Recipe, attention: AttentionRecipe | None,
                   rules: Sequence[RuleSettings], accumulate: str) -> str:  # fmt: skip
    """The preset the run's layer `name` (an attention `core`, or a Linear layer) sums its forward with."""
    own = attention.forward_accumulate if core and attention is not None else recipe.forward_accumulate
    return own or layer_accumulate(name, rules, accumulate)[0]


def eval_note(precisions: Sequence[EvalPrecision]) -> str:
    """The start line saying what each validation adds (and how its layers sum, where the run models it)."""
    shown = ", ".join(HIGH if p.entry == HIGH else f"{p.entry} ({p.quantized} layers{summed(p)})" for p in precisions)
    return f"eval: each validation also in {shown}: val/<metric>@<precision>"


def summed(p: EvalPrecision) -> str:
    """How an entry's layers sum, where the run models its sums: the presets, exact where they have no
    instruction for the entry's format ("" where every layer of the run sums exactly)."""
    wanted = {n: a for n, a in p.accumulate.items() if a != EXACT}
    if not wanted:
        return ""
    used = sorted({p.sums(n) for n in wanted} - {EXACT})
    missing = sorted({a for n, a in wanted.items() if p.sums(n) == EXACT})
    parts = [f"summed as {', '.join(used)}"] if used else []
    if missing:
        parts.append(f"exactly where {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no {p.entry} MMA")
    return ", " + "; ".join(parts)


def eval_layer(module: nn.Module, fmt: str, precision: EvalPrecision, name: str = "") -> nn.Module:
    """`module` (a Linear layer or an attention core, plain or quantized) as the evaluation computes it
    in `fmt`, sharing its Parameters: high is a plain nn.Linear or torch's fused attention (or the
    module itself, if it is not quantized); a format is a QuantizedLinear or QuantizedAttention (the
    core's seed kept: the same Hadamard), summing as precision.sums(`name`). Built on the meta device:
    no memory, no random draws for an init."""
    if isinstance(module, ScaledDotProduct):
        if fmt == HIGH:
            return module if type(module) is ScaledDotProduct else ScaledDotProduct()
        assert precision.attention is not None
        seed = getattr(module, "seed", 0)
        return QuantizedAttention(fmt, precision.attention, precision.recipe, seed, precision.sums(name))
    assert isinstance(module, nn.Linear)
    if fmt == HIGH and layer_format(module) == HIGH:
        return module
    w = module.weight
    if fmt == HIGH:
        layer = nn.Linear(module.in_features, module.out_features, False, "meta", w.dtype)
    else:
        layer = QuantizedLinear(module.in_features, module.out_features, False, fmt, precision.recipe, 0, "meta",
                                w.dtype, accumulate=precision.sums(name))  # fmt: skip
    layer.weight, layer.bias = module.weight, module.bias
    return layer


@contextlib.contextmanager
def layers_in(model: nn.Module, precision: EvalPrecision) -> Iterator[None]:
    """Inside: the model's Linear layers (and attention cores) as `precision` computes them; after: the
    modules that were there, the very objects (a compiled model's guards see the same modules)."""
    originals = {name: model.get_submodule(name) for name in precision.plan}
    try:
        for name, fmt in precision.plan.items():
            model.set_submodule(name, eval_layer(originals[name], fmt, precision, name))
        yield
    finally:
        for name, module in originals.items():
            model.set_submodule(name, module)


@contextlib.contextmanager
def rng_kept(device: torch.device) -> Iterator[None]:
    """The random number generators of the CPU and of `device` as they were, after the block (a
    DataLoader draws a seed from torch's generator for each pass over the validation split)."""
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield
