"""Weight init schemes: default (the model's own), kaiming, xavier, fixup."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Protocol, cast, runtime_checkable

import torch
from torch import nn

from halfprec.errors import InitError
from halfprec.numerics.policy import COMPUTE_TYPES, NORM_TYPES
from halfprec.spec import Choice, Spec

Mode = Literal["fan_in", "fan_out"]
Distribution = Literal["normal", "uniform"]


@runtime_checkable
class ZeroInitLast(Protocol):
    """A residual block that can zero its branch's last norm or multiplier (init.zero_init_last)."""

    def zero_init_last(self) -> None: ...


def init_kaiming(
    model: nn.Module,
    conv_mode: Mode = "fan_out",
    linear_mode: Mode = "fan_in",
    nonlinearity: Annotated[str, Spec(doc="the activation the gain is for, e.g. relu")] = "relu",
    distribution: Distribution = "normal",
    zero_init_last: Annotated[bool, Spec(doc="zero each residual branch's last norm or multiplier")] = False,
) -> None:
    """He et al. 2015: std = gain / sqrt(fan); biases zero, norms (1, 0)."""
    fill = nn.init.kaiming_normal_ if distribution == "normal" else nn.init.kaiming_uniform_
    for m in model.modules():
        if isinstance(m, COMPUTE_TYPES):
            mode = linear_mode if isinstance(m, nn.Linear) else conv_mode
            # torch types `nonlinearity` as a Literal of the names it knows, and checks the string itself
            fill(m.weight, mode=mode, nonlinearity=cast(Any, nonlinearity))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, NORM_TYPES) and getattr(m, "weight", None) is not None:
            nn.init.ones_(m.weight)
            bias = getattr(m, "bias", None)  # RMSNorm has none
            if bias is not None:
                nn.init.zeros_(bias)
    if zero_init_last:
        _zero_init_last(model)


def init_xavier(
    model: nn.Module, distribution: Distribution = "uniform", gain: Annotated[float, Spec(above=0)] = 1.0
) -> None:
    """Glorot & Bengio 2010: var = 2 gain^2 / (fan_in + fan_out); biases zero."""
    fill = nn.init.xavier_uniform_ if distribution == "uniform" else nn.init.xavier_normal_
    for m in model.modules():
        if isinstance(m, COMPUTE_TYPES):
            fill(m.weight, gain=gain)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def init_fixup(model: nn.Module) -> None:
    """Zhang et al. 2019, as in the authors' code.

    With L residual branches of m weight layers each: the last layer of every branch and the
    classifier start at zero, the other branch layers get He init (fan_out) times
    L^(-1/(2m-2)); the scalar biases start at 0 and the branch multipliers at 1. The stem keeps
    the model's default init.
    """
    residual_blocks = getattr(model, "residual_blocks", None)  # a method of the models with residual branches
    blocks = residual_blocks() if residual_blocks is not None else []
    if not blocks:
        raise InitError(f"init=fixup needs a model with residual branches; {type(model).__name__} has none")
    depth = len(blocks)
    for block in blocks:
        layers = block.branch_layers
        m = len(layers)
        factor = depth ** (-1.0 / (2 * m - 2))
        for layer in layers[:-1]:
            w = layer.weight
            fan_out = w.shape[0] * math.prod(w.shape[2:])
            nn.init.normal_(w, mean=0.0, std=math.sqrt(2.0 / fan_out) * factor)
        nn.init.zeros_(layers[-1].weight)
        for name, p in block.named_parameters(recurse=False):
            nn.init.constant_(p, 1.0 if name == "scale" else 0.0)
    nn.init.zeros_(model.get_parameter("classifier.weight"))
    nn.init.zeros_(model.get_parameter("classifier.bias"))


def _zero_init_last(model: nn.Module) -> None:
    blocks = [m for m in model.modules() if isinstance(m, ZeroInitLast) and m is not model]
    if not blocks:
        raise InitError(f"init.zero_init_last=true: {type(model).__name__} has no residual blocks to zero")
    for block in blocks:
        block.zero_init_last()


def init_default(model: nn.Module) -> None:
    """Keep the init each layer was constructed with."""


INIT_SCHEMES = {"default": init_default, "kaiming": init_kaiming, "xavier": init_xavier, "fixup": init_fixup}


def apply_init(model: nn.Module, init: Choice) -> None:
    """Apply the scheme `init.scheme` names with the other `init.*` keys as arguments
    (`scalar_lr_scale` is the optimizer's)."""
    kwargs = {k: v for k, v in init.args.items() if k != "scalar_lr_scale"}
    with torch.no_grad():
        INIT_SCHEMES[init.name](model, **kwargs)
