"""Model registry: `model.arch` names a factory; the rest of `model.*` are its keyword arguments.

Every factory takes `input_shape` (C, H, W) and `num_classes` from the data, so a model config
never repeats them. Add a model: write a factory, decorate it with `@register_model("name")`,
and add `conf/model/name.yaml` with `arch: name`.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from halfprec.spec import Choice


@dataclass(frozen=True)
class ModelEntry:
    factory: Callable[..., nn.Module]
    residual: bool  # has residual branches, so init=fixup applies
    reads: str  # its inputs: "tensors" (images, feature vectors) or "tokens"; the data's must match

    def arguments(self) -> list[str]:
        skip = {"input_shape", "num_classes"}
        return [n for n in inspect.signature(self.factory).parameters if n not in skip]


MODELS: dict[str, ModelEntry] = {}


def register_model(name: str, residual: bool = False, reads: str = "tensors"):
    def add(factory):
        MODELS[name] = ModelEntry(factory, residual, reads)
        return factory

    return add


def create_model(model: Choice, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model `model.arch` names, made with the other `model.*` keys as arguments."""
    return MODELS[model.name].factory(input_shape=tuple(input_shape), num_classes=num_classes, **model.args)


# Registration happens on import: every module of this package is imported, so a new model is one
# file here (and its conf/model/ YAML). They import nothing heavy at module level (timm: when used).
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
