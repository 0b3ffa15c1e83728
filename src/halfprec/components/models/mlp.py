"""A plain MLP: the digits default and the model most numerics tests compute by hand."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any

from torch import nn

from halfprec.components.models import register_model
from halfprec.spec import Spec


@register_model("mlp")
def create_mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    hidden: Annotated[Sequence[int], Spec(low=1, nonempty=True, doc="hidden layer widths, e.g. [64, 64]")] = (256, 256),
) -> nn.Module:
    """Flatten, then Linear+ReLU per entry of `hidden` (fc1, act1, fc2, ...), then a Linear classifier
    (head). Named, so that rules, diagnostics and plots say fc1 where an nn.Sequential says "1"."""
    layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
    width = math.prod(input_shape)
    for i, h in enumerate(hidden, start=1):
        layers += [(f"fc{i}", nn.Linear(width, h)), (f"act{i}", nn.ReLU())]
        width = h
    layers.append(("head", nn.Linear(width, num_classes)))
    model = nn.Sequential(OrderedDict(layers))
    model.register_load_state_dict_pre_hook(_numbered_keys_renamed)
    return model


def _numbered_keys_renamed(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Checkpoints from before the names keyed the layers by position ("1.weight"): read them as
    the layer at that position ("fc1.weight"), so that they resume."""
    names = [name for name, _ in module.named_children()]
    for key in [k for k in state_dict if k.startswith(prefix)]:
        first, _, rest = key[len(prefix) :].partition(".")
        if first.isdigit() and int(first) < len(names):
            state_dict[f"{prefix}{names[int(first)]}.{rest}"] = state_dict.pop(key)
