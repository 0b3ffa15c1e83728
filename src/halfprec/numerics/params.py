"""The tensors the optimizer steps, and how gradients and updates move between them and the model.

Three strategies behind one interface (`build_params` picks one from the precision policy):

- FP32Params (fp32, tf32, autocast modes): the optimizer steps the model's own fp32 parameters;
  gradients are unscaled in place.
- MasterWeights (pure modes with master_weights): the optimizer owns fp32 copies; scaled
  low-precision gradients are unscaled into fp32 master gradients (torch's GradScaler refuses fp16
  gradients, so this is done here), and each update is copied back, rounded, to the model.
- LowPrecisionParams (pure modes without): for the step each parameter is upcast to fp32, so
  optimizer math and state are fp32, and the result is rounded back by a rounding rule
  (numerics/rounding.py: nearest, kahan, stochastic).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from halfprec.numerics.grads import full
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.numerics.rounding import ROUNDING_RULES, RoundingRule


def nbytes(tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> int:
    """Bytes of the distinct tensors in `tensors` (tied weights once), each in `dtype` or its own."""
    distinct = {id(t): t for t in tensors}.values()
    return sum(t.numel() * (dtype or t.dtype).itemsize for t in distinct)


class ParamStrategy:
    """What the optimizer steps (`params`) for the model's trainable parameters, and the moves
    around the step: `unscale_` before it, `finish_` after it (or after a skip)."""

    kind = ""  # fp32 | master | lowp: in tables and the memory benchmark

    def __init__(self, model: nn.Module):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        # the model's own Parameters, as Tensors: MasterWeights puts other tensors here
        self.params: list[torch.Tensor] = list(self.model_params)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name in the model, tensor the optimizer steps) pairs, for param groups."""
        return list(zip(self.names, self.params))

    @property
    def master(self) -> list[torch.Tensor]:
        """The fp32 master weights, where there are any."""
        return []

    @property
    def compensation(self) -> list[torch.Tensor]:
        """Per-parameter buffers a rounding rule carries between steps (Kahan)."""
        return []

    def unscale_(self, inv_scale: float) -> list[torch.Tensor]:
        """Unscale the model's gradients into the optimizer's parameters; return those gradients."""
        raise NotImplementedError

    def finish_(self, stepped: bool) -> None:
        """After the optimizer step (or the skip): bring the update into the model's weights."""

    def drop_grads(self) -> None:
        """model.zero_grad(set_to_none=True) from the list at hand, without Module.zero_grad's walk."""
        for p in self.model_params:
            p.grad = None

    def first_nonfinite(self) -> str | None:
        """Where inf/NaN gradients start: the first parameter, in the order backward reaches them
        (model order reversed), whose unscaled gradient is inf/NaN. An overflow flows back into
        every earlier layer, so the first in model order would nearly always be the input layer."""
        for name, p in reversed(self.named()):
            grad = None if p.grad is None else full(p.grad)  # FSDP: gathered, so all ranks agree
            if grad is not None and not bool(torch.isfinite(grad).all()):
                return name
        return None

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def update_bytes(self) -> tuple[int, int]:
        """(weights, gradients) in fp32 that the update holds beside the model's own, for the
        memory estimate (tools/memory.py)."""
        return 0, 0

    def optimizer_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype the optimizer's state for `param` is kept in."""
        return param.dtype

    # Checkpoints hold {"master": [...], "kahan": [...] or None} whatever the strategy, so that a
    # checkpoint of any version and mode loads (a missing part is left as it is).
    def state_dict(self) -> dict:
        return {
            "master": [m.detach().clone() for m in self.master],
            "kahan": [c.clone() for c in self.compensation] or None,
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            for c, saved in zip(self.compensation, state["kahan"] or []):
                c.copy_(saved)


class FP32Params(ParamStrategy):
    kind = "fp32"

    def unscale_(self, inv_scale: float) -> list[torch.Tensor]:
        grads = [p.grad for p in self.params if p.grad is not None]
        if inv_scale != 1.0 and grads:
            torch._foreach_mul_(grads, inv_scale)
        return grads

    # finish_: the optimizer stepped the model's own weights; nothing to bring, no no_grad to enter


class MasterWeights(ParamStrategy):
    kind = "master"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.params = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]

    @property
    def master(self) -> list[torch.Tensor]:
        return self.params

    def unscale_(self, inv_scale: float) -> list[torch.Tensor]:
        for m, p in zip(self.params, self.model_params):
            m.grad = None if p.grad is None else p.grad.float().mul_(inv_scale)
            p.grad = None
        return [m.grad for m in self.params if m.grad is not None]

    def finish_(self, stepped: bool) -> None:
        with torch.no_grad():
            if stepped:
                for m, p in zip(self.params, self.model_params):
                    p.copy_(m)
            for m in self.params:
                m.grad = None

    def update_bytes(self) -> tuple[int, int]:
        low = [p for p in self.model_params if p.dtype != torch.float32]  # an fp32 grad is moved, not copied
        return nbytes(self.model_params, torch.float32), nbytes(low, torch.float32)


class LowPrecisionParams(ParamStrategy):
    kind = "lowp"

    def __init__(self, model: nn.Module, rule: type[RoundingRule]):
        super().__init__(model)
        self.rule = rule(self.model_params)
        self._before: list[torch.Tensor] = []
        # Set to {} by the diagnostics for one step (training/diagnostics.py, watch_updates): finish_
        # then puts there, per low-precision parameter index, the rule's `lost_to_nearest` counts.
        # None on every other step, so that the step does nothing more than round.
        self.lost: dict[int, torch.Tensor] | None = None

    @property
    def compensation(self) -> list[torch.Tensor]:
        return self.rule.buffers

    def unscale_(self, inv_scale: float) -> list[torch.Tensor]:
        # fp32 storage for the duration of the update (see finish_)
        self._before = [p.data for p in self.params]
        for i, p in enumerate(self.params):
            grad = None if p.grad is None else p.grad.float().mul_(inv_scale)
            p.grad = None
            p.data = self.rule.upcast(i, p.data)
            p.grad = grad
        return [p.grad for p in self.params if p.grad is not None]

    def finish_(self, stepped: bool) -> None:
        with torch.no_grad():
            for i, (p, before) in enumerate(zip(self.params, self._before)):
                p.grad = None
                if not stepped:
                    p.data = before
                elif before.dtype != torch.float32:  # a module kept in fp32 (norms) needs no rounding
                    if self.lost is not None:  # before `round`, which may update p.data in place
                        self.lost[i] = self.rule.lost_to_nearest(i, before, p.data)
                    p.data = self.rule.round(i, before, p.data)
            self._before = []

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Optimizer.load_state_dict casts state to each parameter's dtype; here the state is fp32
        while the parameters are not, so it is loaded while they are upcast."""
        stored = [p.data for p in self.params]
        for p in self.params:
            p.data = p.data.float()
        optimizer.load_state_dict(state)
        for p, data in zip(self.params, stored):
            p.data = data

    def update_bytes(self) -> tuple[int, int]:
        # no persistent copy, but from unscale_ to finish_ every low-precision parameter is upcast
        # (its stored data kept aside) and gets an fp32 gradient
        upcast = nbytes([p for p in self.model_params if p.dtype != torch.float32], torch.float32)
        return upcast, upcast

    def optimizer_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32  # it steps fp32 upcasts


def build_params(model: nn.Module, policy: PrecisionPolicy) -> ParamStrategy:
    """The strategy the policy asks for: fp32 weights, fp32 master weights, or low-precision
    weights with the rounding rule `precision.update` names."""
    if not policy.is_pure:
        return FP32Params(model)
    if policy.master_weights:
        return MasterWeights(model)
    return LowPrecisionParams(model, ROUNDING_RULES[policy.update])
