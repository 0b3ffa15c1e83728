"""A plain MLP: the digits default and the model most numerics tests compute by hand."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated

from torch import nn

from halfprec.components.models import register_model
from halfprec.spec import Spec


@register_model("mlp")
def create_mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    hidden: Annotated[Sequence[int], Spec(low=1, nonempty=True, doc="hidden layer widths, e.g. [64, 64]")] = (256, 256),
) -> nn.Module:
    """Flatten, then Linear+ReLU per entry of `hidden`, then a Linear classifier."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
