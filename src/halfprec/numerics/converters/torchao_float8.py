"""precision.kernel=native: torchao's Float8Linear, a real float8 kernel on GPUs with fp8 tensor
cores (compute capability 8.9+), for the fp8 formats torchao's recipes compute as the formats
define them (rowwise: fp32 scales, as fp8_e4m3_row defines them, not torchao's default power-of-two
ones). torchao 0.18 trains MX formats only in MoE grouped GEMMs and NVFP4 not at all, so they have
none here. precision=fp8 is this kernel with fp8_e4m3 forward and fp8_e5m2 gradients. Its own key:
precision.fp8_emulate."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import torch
from torch import nn

from halfprec.errors import ConfigError
from halfprec.numerics.converters import Conversion, Converter, register_converter
from halfprec.numerics.formats.casts import quiet_import
from halfprec.numerics.quantized import GEMMS, RECIPE_SWITCHES
from halfprec.numerics.settings import HIGH, PrecisionSettings

# (format, recipe.grad_format) -> torchao.float8's recipe that computes it
RECIPES = {("fp8_e4m3", "fp8_e5m2"): "tensorwise", ("fp8_e4m3_row", None): "rowwise"}
LACKS = (*RECIPE_SWITCHES, *GEMMS)  # the recipe's switches and per-GEMM formats it has no kernel for
KEY = "precision.kernel"


@register_converter("native")
class TorchaoFloat8Converter(Converter):
    reports_as = "torchao"
    unfit = "in and out features divisible by 16 (torchao's float8 kernel)"

    def check_config(self, p: PrecisionSettings) -> None:
        """A format torchao has a training kernel for, as the format defines it (no recipe switch the
        kernel lacks, no rule naming another format), inside bf16 autocast on fp32 weights."""
        if RECIPES.get((p.format or "", p.recipe.grad_format)) is None:
            have = "; ".join(f"format={f}" + (f" recipe.grad_format={g}" if g else "") for f, g in RECIPES)
            raise ConfigError(
                KEY, "native", f"torchao has no training kernel for format={p.format} with recipe.grad_format="
                f"{p.recipe.grad_format or 'null'} (it has: {have}): use precision.kernel=emulated",
            )  # fmt: skip
        if p.attention.format is not None:
            raise ConfigError(KEY, "native", "torchao has no quantized attention kernel: use precision.kernel=emulated "
                              "for precision.attention, or precision.attention.format=null")  # fmt: skip
        switches = [f"recipe.{k}" for k in LACKS if getattr(p.recipe, k)] + ["schedule"] * bool(p.schedule)
        switches += ["recipe.backward_source=forward"] * (p.recipe.backward_source != "high")  # it keeps x and W
        others = [r.format for r in p.rules if r.format not in (HIGH, p.format)]
        if switches or others:
            what = f"precision.{switches[0]}" if switches else f"a rule's format {others[0]}"
            raise ConfigError(KEY, "native", f"torchao's float8 kernel has no {what}: use precision.kernel=emulated")
        if p.autocast != "bfloat16" or p.param_dtype != "float32":
            raise ConfigError(
                KEY, "native", f"torchao's float8 layers run inside bf16 autocast on fp32 weights, not "
                f"precision={p.name}'s (autocast {p.autocast}, weights {p.param_dtype}): use precision=fp8, or "
                "precision=bf16 with this format",
            )  # fmt: skip

    def check_device(self, p: PrecisionSettings, device: torch.device) -> None:
        """torchao, and unless emulated, fp8 tensor cores: say which is missing."""
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("precision", p.name, 'needs torchao: pip install -e ".[fp8]"')
        if p.fp8_emulate:
            return
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            where = torch.cuda.get_device_name(device) if device.type == "cuda" else "a CPU"
            raise ConfigError(
                KEY, "native", f"precision={p.name} computes in torchao's float8 kernel, and float8 matmuls need a "
                f"CUDA GPU of compute capability 8.9+ (H100, H200, L4, RTX 4090); this is {where}: use precision."
                "kernel=emulated (the same format, emulated), or precision.fp8_emulate=true to check torchao's "
                "numerics (slowly)",
            )  # fmt: skip

    def fits(self, module: nn.Module) -> bool:
        assert isinstance(module, nn.Linear)
        return module.in_features % 16 == 0 and module.out_features % 16 == 0  # what float8 matmuls need

    def convert(self, model: nn.Module, plan: dict[str, str], how: Conversion) -> list[str]:
        """torchao's Float8Linear for each planned layer, before any wrapping, as torchao asks."""
        with quiet_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        fmt = next(f for f in plan.values() if f != HIGH)  # one format: check_config allows no other
        recipe = RECIPES[(fmt, how.precision.recipe.grad_format)]
        config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=how.precision.fp8_emulate)
        if recipe == "rowwise":
            config = replace(config, round_scales_to_power_of_2=False)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: plan.get(name, HIGH) != HIGH)
        for name, planned in plan.items():
            if planned != HIGH:
                setattr(model.get_submodule(name), "halfprec_format", planned)  # noqa: B010 (not a declared attribute)
        return []

    def layer_format(self, module: nn.Module) -> str | None:
        # torchao is imported by convert; a model it never converted has none of its layers
        linear = sys.modules.get("torchao.float8.float8_linear")
        if linear is None or not isinstance(module, linear.Float8Linear):
            return None
        return str(getattr(module, "halfprec_format", "float8"))
