"""Optimizers whose state is stored in low precision (`optim.state_dtype=bfloat16`), the update
computed in fp32 (docs/design.md, "Optimizer").

torch.optim keeps an optimizer's state in its parameter's dtype: fp32 moments for fp32 weights and
master weights, 8 bytes per parameter for AdamW. Megatron (`--exp-avg-dtype`) and
TransformerEngine's FusedAdam store them in bf16 instead: each step reads the stored moments, updates
them in fp32 with the gradient, steps the weight with the fp32 values, and stores them back rounded
(`optim.state_rounding`: to nearest, or stochastically so that small changes survive in
expectation). These classes do that in eager PyTorch, one parameter at a time so the fp32 moments
exist for one tensor at a time. Their update is torch.optim.AdamW's and SGD's; with float32 state it
is theirs to rounding (tests/test_optimizers.py). Each declares its state (`state_layout`), which
the memory estimate asks.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from halfprec.errors import ConfigError
from halfprec.numerics.rounding import stochastic_round_to_bf16

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rounder(dtype: torch.dtype, rounding: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """fp32 -> the state dtype: to nearest (ties to even), or stochastically (bf16; torch's global
    generator, which checkpoints keep)."""
    if rounding == "stochastic" and dtype == torch.bfloat16:
        return stochastic_round_to_bf16
    return lambda x: x.to(dtype)


class LowPrecisionState(torch.optim.Optimizer):
    """The state's dtype and rounding, and keeping them through load_state_dict (torch casts loaded
    state to each parameter's dtype: bf16 moments would come back fp32)."""

    STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict, state_dtype: str, state_rounding: str):
        super().__init__(params, defaults)
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.round = rounder(self.state_dtype, state_rounding)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in self.STATE_KEYS:
                if key in state:  # bf16 -> fp32 -> bf16: the saved values exactly
                    state[key] = state[key].to(self.state_dtype)

    def state_layout(self, group: dict) -> list[torch.dtype]:
        """The parameter-sized tensors this optimizer keeps per parameter of `group`, by dtype."""
        return [self.state_dtype] * len(self.STATE_KEYS)


class AdamW(LowPrecisionState):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction), moments in state_dtype."""

    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, state_dtype: str = "bfloat16",
                 state_rounding: str = "nearest"):  # fmt: skip
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, state_dtype, state_rounding)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # `step` as torch keeps it: a float32 tensor on the host
                    state["step"] = torch.tensor(0.0)
                    state.update({k: torch.zeros_like(p, dtype=self.state_dtype) for k in self.STATE_KEYS})
                state["step"] += 1
                t = state["step"].item()
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                p.mul_(1 - lr * decay)
                denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
                state["exp_avg"].copy_(self.round(m))
                state["exp_avg_sq"].copy_(self.round(v))


class SGD(LowPrecisionState):
    """torch.optim.SGD's update (coupled weight decay, dampening, Nesterov), momentum in state_dtype."""

    STATE_KEYS = ("momentum_buffer",)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, state_dtype: str = "bfloat16",
                 state_rounding: str = "nearest"):  # fmt: skip
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov}  # fmt: skip
        super().__init__(params, defaults, state_dtype, state_rounding)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            momentum, dampening = group["momentum"], group["dampening"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float().add(p, alpha=group["weight_decay"])
                if momentum:
                    state = self.state[p]
                    if "momentum_buffer" not in state:  # the first step's buffer is the gradient itself
                        buf = g.clone()
                    else:
                        buf = state["momentum_buffer"].float().mul_(momentum).add_(g, alpha=1 - dampening)
                    state["momentum_buffer"] = self.round(buf)
                    g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.add_(g, alpha=-group["lr"])

    def state_layout(self, group: dict) -> list[torch.dtype]:
        return [self.state_dtype] if group["momentum"] else []


# The torch optimizers optim.state_dtype can replace, and the class that keeps their state low
LOW_PRECISION_STATE: dict[str, type[LowPrecisionState]] = {"torch.optim.AdamW": AdamW, "torch.optim.SGD": SGD}


def optimizer_arguments(kwargs: dict, dtype: str, rounding: str) -> dict:
    """What hydra instantiates: the optimizer's `_target_` and arguments (`kwargs`), and where the
    state `dtype` (optim.state_dtype) is not float32, `_target_` swapped for the class of
    LOW_PRECISION_STATE that keeps the state low, rounded as `rounding` says. A torch-only argument
    set to anything but its off value (optim.fused=true) is a config error then: the step is no
    longer torch's."""
    target = kwargs["_target_"]
    if dtype == "float32":
        return kwargs
    cls = LOW_PRECISION_STATE.get(target)
    if cls is None:
        raise ConfigError(
            "optim.state_dtype", dtype, f"{target} keeps its own state; halfprec keeps it low for "
            f"{', '.join(LOW_PRECISION_STATE)}",
        )  # fmt: skip
    accepted = inspect.signature(cls).parameters
    for key, value in kwargs.items():
        if key != "_target_" and key not in accepted and value not in (None, False):
            raise ConfigError(
                f"optim.{key}", value, f"with optim.state_dtype={dtype} the step is halfprec's {cls.__name__}, "
                f"which has no {key}: leave it null",
            )  # fmt: skip
    kept = {k: v for k, v in kwargs.items() if k in accepted}
    return {
        **kept,
        "_target_": f"{cls.__module__}.{cls.__qualname__}",
        "state_dtype": dtype,
        "state_rounding": rounding,
    }
