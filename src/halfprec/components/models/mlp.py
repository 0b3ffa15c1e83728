"""A plain MLP: the digits default and the model most numerics tests compute by hand."""

from __future__ import annotations

import math

from torch import nn

from halfprec.components.models import register_model


@register_model("mlp")
def create_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] = (256, 256)) -> nn.Module:
    """Flatten, then Linear+ReLU per entry of `hidden`, then a Linear classifier."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
