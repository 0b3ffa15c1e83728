"""The plan: which Linear layers compute in which number format (precision.format, precision.rules,
precision.high_first / high_last; docs/design.md, "Number formats"), and which of its formats each
recipe switch reaches.

The plan names a format, or `high`, for every Linear layer: the first rule whose glob matches the
layer's name; else `high` for the first/last N blocks and the output head; else precision.format.
As in NVIDIA's NVFP4 recipe, embeddings, norms, attention's softmax and convolutions are not Linear
layers and stay high; so does the output head (a model's `keep_high` names, else its last Linear
layer) unless a rule names it. With precision.attention.format set, the attention cores (the GPT's
blocks.N.attn.core) are planned too, by the same rules and high blocks, that format their default;
without it they stay torch's fused attention. A converter (numerics/converters) swaps the planned
modules. The rule that gives a layer its format may say how its GEMMs sum too (`accumulate`, else
precision.accumulate: layer_accumulate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

from torch import nn

from halfprec.errors import ConfigError
from halfprec.numerics.attention import ScaledDotProduct
from halfprec.numerics.formats import FORMATS
from halfprec.numerics.quantized import Recipe
from halfprec.numerics.settings import HIGH, PrecisionSettings, RuleSettings

Fits = Callable[[nn.Module], bool]  # whether the converter can take a Linear layer at all


def linear_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def attention_cores(model: nn.Module) -> list[str]:
    """The model's attention cores (numerics/attention.py: the GPT's blocks.N.attn.core)."""
    return [name for name, m in model.named_modules() if isinstance(m, ScaledDotProduct)]


def planned_modules(model: nn.Module, attention: str | None) -> list[str]:
    """What a plan gives formats, in model order: the Linear layers, and with attention quantized
    (precision.attention.format) the attention cores."""
    kinds = (nn.Linear, ScaledDotProduct) if attention else nn.Linear
    return [name for name, m in model.named_modules() if isinstance(m, kinds)]


def block_names(model: nn.Module) -> list[str]:
    """The model's transformer blocks (a `blocks` list, as the GPT and timm's ViTs name them)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return []
    return [f"blocks.{i}" for i in range(len(blocks))]


def output_heads(model: nn.Module, linears: list[str]) -> set[str]:
    """The layers that stay high by default: the model's `keep_high`, else its last Linear layer."""
    named = getattr(model, "keep_high", None)
    return set(named) if named is not None else set(linears[-1:])


def plan_precision(model: nn.Module, p: PrecisionSettings, fits: Fits, unfit: str) -> tuple[dict[str, str], list[str]]:
    """precision.*'s plan for `model` (`fits`, `unfit`: the converter's, as plan_layers and
    nothing_to_quantize take them) and the warnings of rules that change nothing; a ConfigError for
    a plan that quantizes no layer and has no schedule to."""
    attention = p.attention.format
    if attention and not attention_cores(model):
        raise ConfigError(
            "precision.attention.format", attention, f"{type(model).__name__} has no attention core to quantize (the "
            "GPT's blocks.N.attn.core, torch's fused attention in a module of its own): use precision.attention."
            "format=null",
        )  # fmt: skip
    plan = plan_layers(model, p.format, p.rules, p.high_first, p.high_last, fits, attention)
    warnings = shadowed_rules(model, p.rules, attention)
    if all(f == HIGH for f in plan.values()) and not p.schedule:
        raise nothing_to_quantize(model, p.format, p.rules, p.high_first, p.high_last, fits, unfit, p.name, attention)
    return plan, warnings


def plan_layers(model: nn.Module, fmt: str | None, rules: Sequence[RuleSettings], high_first: int = 0,
                high_last: int = 0, fits: Fits | None = None,
                attention: str | None = None) -> dict[str, str]:  # fmt: skip
    """Each Linear layer's format or `high` (the module docstring's order); `fits`: whether the
    converter can take a layer at all (float8: sides that are multiples of 16), else high. With
    `attention` (precision.attention.format), each attention core's too, by the same rules and high
    blocks, `attention` its default."""
    linears = linear_layers(model)
    modules = planned_modules(model, attention)
    cores = set(attention_cores(model))
    for i, rule in enumerate(rules):
        if not any(fnmatchcase(name, rule.match) for name in modules):
            if any(fnmatchcase(name, rule.match) for name in cores):
                raise ConfigError(
                    f"precision.rules[{i}].match", rule.match, "matches only attention cores, which stay torch's "
                    "fused attention: set precision.attention.format to quantize them",
                )  # fmt: skip
            shown = ", ".join(linears[:8]) + (", ..." if len(linears) > 8 else "")
            raise ConfigError(f"precision.rules[{i}].match", rule.match, f"matches no Linear layer; they are {shown}")
    blocks = block_names(model)
    if (high_first or high_last) and not blocks:
        raise ConfigError(
            "precision.high_first" if high_first else "precision.high_last", high_first or high_last,
            f"{type(model).__name__} names no transformer blocks (a `blocks` list): use precision.rules",
        )  # fmt: skip
    high_blocks = blocks[:high_first] + blocks[len(blocks) - high_last :]
    heads = output_heads(model, linears)
    plan = {}
    for name in modules:
        chosen = next((r for r in rules if fnmatchcase(name, r.match)), None)
        if chosen is not None:
            plan[name] = chosen.format
        elif name in heads or any(name.startswith(f"{b}.") for b in high_blocks):
            plan[name] = HIGH
        else:
            plan[name] = (attention if name in cores else fmt) or HIGH
        if fits is not None and name not in cores and not fits(model.get_submodule(name)):
            plan[name] = HIGH
    return plan


def layer_accumulate(name: str, rules: Sequence[RuleSettings], default: str) -> tuple[str, str]:
    """How a planned layer's GEMMs sum, and the key that says so: the accumulate of the rule that
    gives its format (the first whose glob matches), where it names one; else precision.accumulate
    (`default`). The recipe's per-GEMM presets (and attention's own) still override it, GEMM by GEMM."""
    for i, rule in enumerate(rules):
        if fnmatchcase(name, rule.match):
            if rule.accumulate is not None:
                return rule.accumulate, f"precision.rules[{i}].accumulate"
            break
    return default, "precision.accumulate"


def shadowed_rules(model: nn.Module, rules: Sequence[RuleSettings], attention: str | None = None) -> list[str]:
    """Rules that never apply because earlier ones take every layer they match (the first matching
    rule wins): a ConfigError when the rule's format or accumulate differs (what it asks for would not happen),
    else a warning line (it repeats an earlier rule: a no-op). `attention`: plan_layers'."""
    linears = planned_modules(model, attention)
    matches = [[n for n in linears if fnmatchcase(n, rule.match)] for rule in rules]
    first: dict[str, int] = {}  # each matched layer's deciding rule: the first that matches it
    for j, names in enumerate(matches):
        for name in names:
            first.setdefault(name, j)
    lines = []
    for i, (rule, names) in enumerate(zip(rules, matches)):
        if not names or any(first[n] == i for n in names):
            continue  # a rule that matches nothing is plan_layers' error
        takers = sorted({first[n] for n in names})
        by = ", ".join(f"precision.rules[{j}] (match {rules[j].match}, format {rules[j].format})" for j in takers)
        if any(decides(rules[first[n]]) != decides(rule) for n in names):
            raise ConfigError(
                f"precision.rules[{i}].match", rule.match, f"every layer it matches is taken by {by} first (the "
                f"first rule that matches a layer decides it): move it above, or narrow the earlier glob",
            )  # fmt: skip
        lines.append(f"warning: precision.rules[{i}].match={rule.match} changes nothing: {by} gives its layers "
                     f"{rule.format} first; drop it")  # fmt: skip
    return lines


def decides(rule: RuleSettings) -> tuple[str, str | None]:
    """What a rule gives its layers: a format, and how their GEMMs sum."""
    return rule.format, rule.accumulate


def nothing_to_quantize(model: nn.Module, fmt: str | None, rules: Sequence[RuleSettings], high_first: int,
                        high_last: int, fits: Fits | None, unfit: str, name: str,
                        attention: str | None = None) -> ConfigError:  # fmt: skip
    """Why a plan keeps every Linear layer (and, with `attention`, every attention core) high, as one
    line naming the setting that does it: the high blocks, a rule sending the rest high, layers the
    converter cannot take (`fits`, which asks `unfit`: float8's multiples of 16), or a model whose
    only Linear layer is its output head. Each cause is found by planning again without it."""

    def quantizes(rules: Sequence[RuleSettings], first: int, last: int, fits: Fits | None) -> bool:
        return any(f != HIGH for f in plan_layers(model, fmt, rules, first, last, fits, attention).values())

    layers = "Linear layer and attention core" if attention else "Linear layer"

    blocks = len(block_names(model))
    if (high_first or high_last) and quantizes(rules, 0, 0, fits):
        key, value = ("precision.high_last", high_last) if high_last else ("precision.high_first", high_first)
        return ConfigError(
            key, value, f"with precision.high_first={high_first} and high_last={high_last} all {blocks} blocks of "
            f"this model stay high, and nothing is left to quantize: keep fewer (their sum below {blocks})",
        )  # fmt: skip
    for i, rule in enumerate(rules):
        if rule.format == HIGH and quantizes([*rules[:i], *rules[i + 1 :]], high_first, high_last, fits):
            return ConfigError(
                f"precision.rules[{i}].match", rule.match, f"sends every {layers} left to quantize high (the "
                "output head is high already): narrow the glob, or use precision=bf16 for no quantized layer",
            )  # fmt: skip
    if fits is not None and quantizes(rules, high_first, high_last, None):
        return ConfigError("precision", name, f"no Linear layer of this model has {unfit}, so none can compute in "
                           f"{fmt} on this kernel (the output head stays high unless a precision.rules entry names "
                           "it): widen the model, or use precision.kernel=emulated or precision=bf16")  # fmt: skip
    if not linear_layers(model):
        return ConfigError("precision", name, f"{type(model).__name__} has no Linear layer (convolutions, embeddings "
                           "and norms are not quantized): use precision=bf16")  # fmt: skip
    return ConfigError(
        "precision", name, f"{type(model).__name__} has no Linear layer to quantize but its output head, which stays "
        "high unless a precision.rules entry names it: name it in a rule, or use precision=bf16",
    )  # fmt: skip


# The recipe switches only some formats can use (the others apply to every quantized layer): for
# each, whether a layer of format f with gradients in g uses it, what it needs, and its off value.
def has_tiles(fmt: str, grad_format: str) -> bool:
    return FORMATS[fmt].tile is not None


def has_e8m0(fmt: str, grad_format: str) -> bool:
    return "e8m0" in (FORMATS[fmt].scale, FORMATS[grad_format].scale)


PARTIAL_SWITCHES: dict[str, tuple[Callable[[str, str], bool], str, object]] = {
    "weight_2d": (has_tiles, "square blocks (nvfp4 16x16, fp8_block 128x128)", False),
    "scale_rule": (has_e8m0, "E8M0 scales (the MX formats)", "floor"),
}
ATTENTION_SWITCHES = ("scale_rule",)  # those attention's GEMMs take too (they have no weight for weight_2d)


def recipe_reach(formats: Sequence[str], recipe: Recipe, attention: Sequence[dict[str, str]] = ()) -> list[str]:
    """Which of `formats` (a plan's Linear layers', high aside) each partial switch of the recipe
    reaches: a line for each switch that some of them cannot use (their layers go without it, as
    QuantizedLinear's recipe says), a ConfigError for a switch that none can use (a setting that
    changes nothing). `attention`: the quantized attention cores' GEMMs (AttentionRecipe.gemms),
    which take the recipe's scale_rule and stochastic_grads too (no weights: no weight_2d; their
    Hadamard is precision.attention.hadamard)."""
    lines = []
    cores = list(dict.fromkeys(f for gemms in attention for f in gemms.values() if f != HIGH))
    for switch, (uses, needs, off) in PARTIAL_SWITCHES.items():
        value = getattr(recipe, switch)
        if value == off:
            continue
        reached = [f for f in formats if any(uses(g, recipe.grad_format or g) for g in gemm_formats(f, recipe))]
        missed = [f for f in formats if f not in reached]
        core_formats = cores if switch in ATTENTION_SWITCHES else []
        in_cores = any(uses(f, recipe.grad_format or f) for f in core_formats)
        if not reached and not in_cores:
            shown = [*formats, *(f"attention {f}" for f in core_formats)]
            computed = ", ".join(shown) or "no Linear layer is quantized"
            raise ConfigError(
                f"precision.recipe.{switch}", value, f"is for formats with {needs} and no layer computes in one "
                f"({computed}): set precision.recipe.{switch}={str(off).lower()}",
            )  # fmt: skip
        if missed:
            lines.append(f"recipe: {switch} applies to the {', '.join([*reached, *['attention'] * in_cores])} "
                         f"layers, not to {', '.join(missed)}: no {needs}")  # fmt: skip
    # the GEMMs each switch acts in (weight_2d: those with the weight as an operand)
    unused = {"hadamard": ("wgrad",), "stochastic_grads": ("dgrad", "wgrad"), "weight_2d": ("forward", "dgrad")}
    rounds_attention = any(gemms["backward"] != HIGH for gemms in attention)  # its dO and dS
    for switch, gemms in unused.items():
        if not getattr(recipe, switch):
            continue
        acts = f"the GEMMs it acts in ({', '.join(gemms)}) are high"
        if not formats and attention:
            acts = "no Linear layer is quantized"
        elif not all(getattr(recipe, g) == HIGH for g in gemms):
            continue
        if switch == "stochastic_grads" and rounds_attention:
            lines.append(f"recipe: stochastic_grads rounds attention's gradient operands (dO, dS) only: {acts}")
        else:
            lines.append(f"recipe: {switch} does nothing: {acts}")
    return lines


def gemm_formats(fmt: str, recipe: Recipe) -> list[str]:
    """The formats a layer in `fmt` computes its GEMMs in (the recipe may give one GEMM another format)."""
    return [f for f in dict.fromkeys(recipe.gemms(fmt).values()) if f != HIGH]


def layer_table(plan: dict[str, str], shown: int = 4, title: str = "layers:") -> list[str]:
    """The plan as a few lines for the start of a run: each format, how many Linear layers (or
    attention cores: `title`) compute in it, and the first few of them (`high` last)."""
    by_format: dict[str, list[str]] = {}
    for name, fmt in plan.items():
        by_format.setdefault(fmt, []).append(name)
    order = sorted(by_format, key=lambda f: f == HIGH)  # stable: formats in model order, high last
    width = max(len(f) for f in order) if order else 0
    indent = max(8, len(title) + 1)
    lines = []
    for i, fmt in enumerate(order):
        names = by_format[fmt]
        listed = ", ".join(names[:shown]) + (f", +{len(names) - shown} more" if len(names) > shown else "")
        lines.append(f"{title if i == 0 else '':{indent}}{fmt:{width}}  {len(names):3d}  {listed}")
    if any("-" in fmt for fmt in order):
        gemms = "forward, input-gradient and weight-gradient" if title == "layers:" else "forward and backward"
        lines.append(f"{'':{indent}}({'a-b-c' if title == 'layers:' else 'a-b'}: the formats of the {gemms} GEMMs)")
    return lines
