"""The seam for quantized layers: a converter turns the Linear layers a plan gives a format
(numerics/layers.py) into layers that compute in it, and owns its facts: which formats and recipe
switches it computes, which devices it runs on, which layers it can take, the precision.* keys it
alone reads, and how to tell its layers apart at the first step. Its methods are given precision.*
typed (numerics/settings.PrecisionSettings). `precision.kernel` picks one:

    emulated   QuantizedLinear (emulated.py): every format of numerics/formats, every recipe switch,
               any device
    native     torchao's Float8Linear (torchao_float8.py): the fp8 formats torchao has a training
               kernel for, no recipe switch, fp8 GPUs (or torchao's own emulation)

A new kernel (another library's, a custom one) is one file here: a Converter subclass registered
with `@register_converter("<kernel>")`, and its value in config/schema.py's `Precision.kernel`.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

import torch
from torch import nn

from halfprec.numerics.settings import HIGH, PrecisionSettings


@dataclass(frozen=True)
class Conversion:
    """What a converter is told about the run (each reads what applies to it)."""

    precision: PrecisionSettings
    seed: int  # the run's seed: stochastic rounding draws per layer from it
    rank: int
    device_type: str
    steps: int | None  # trainer.max_steps (None: a tool's few steps)


class Converter:
    """One way of computing quantized layers. The checks raise ConfigError (one line naming the key)."""

    kernel = ""  # its precision.kernel value
    reports_as = ""  # precision/kernel in the step-1 row: what computes the layers
    unfit = ""  # what `fits` asks of a layer, for the error when no layer of a model fits

    def check_config(self, p: PrecisionSettings) -> None:
        """Whether it computes what precision.* asks (the format, the recipe's switches, the rules'
        formats, the dtypes around it), before anything is built; the format names are valid."""

    def check_device(self, p: PrecisionSettings, device: torch.device) -> None:
        """Whether it runs on `device` (and its library is installed)."""

    def fits(self, module: nn.Module) -> bool:
        """Whether it can take this Linear layer at all (a plan keeps the others high)."""
        return True

    def convert(self, model: nn.Module, plan: dict[str, str], how: Conversion) -> list[str]:
        """Swap each planned layer, in place, before any wrapping (DDP, FSDP2, torch.compile); return
        what the start of the run says about how they compute."""
        raise NotImplementedError

    def layer_format(self, module: nn.Module) -> str | None:
        """The format `module` computes in if it is one of this converter's layers, else None."""
        raise NotImplementedError


CONVERTERS: dict[str, Converter] = {}


def register_converter(kernel: str):
    def add(cls: type[Converter]) -> type[Converter]:
        converter = cls()
        converter.kernel = kernel
        CONVERTERS[kernel] = converter
        return cls

    return add


def layer_format(module: nn.Module) -> str:
    """The format a layer computes in, read off the layer itself (the first-step check compares it
    with the plan): the format of whichever converter made it, else high."""
    for converter in CONVERTERS.values():
        found = converter.layer_format(module)
        if found is not None:
            return found
    return HIGH


# Registration happens on import, as for models: a new converter is one file here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
