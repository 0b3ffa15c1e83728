"""What watches an optimizer step without changing it: the first step's dtype check and FLOP count,
gradient diagnostics, and which module the step runs through (steps that hook into layers run
eagerly: a hook added to a compiled model recompiles it). Also the one test hook: overflows injected
to check the skip path (trainer.inject_nonfinite_at)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from halfprec.config import Config
from halfprec.numerics.params import ParamStrategy
from halfprec.numerics.policy import COMPUTE_TYPES, observe_compute_dtypes
from halfprec.training.build import Components
from halfprec.training.diagnostics import Diagnostics
from halfprec.training.step import StepResult


@dataclass
class Probe:
    """One step's watchers: the module to run through (None: the stepper's own) and the gradient
    inspection; after the step, the dtypes its layers computed in."""

    step: int
    net: nn.Module | None
    inspect: Callable[[ParamStrategy], None] | None
    scale_before: float
    # around the forward and backward passes alone (the FLOP count of the first step): an optimizer
    # that compiles its update (torchao's low-bit AdamW) cannot run under a dispatch mode
    compute: contextlib.AbstractContextManager | None = None
    seen: set[torch.dtype] = field(default_factory=set)


class StepProbes:
    def __init__(self, cfg: Config, c: Components, first: int):
        self.c, self.first, self.accum = c, first, cfg.accum
        self.inject = set(cfg.trainer.inject_nonfinite_at)
        self.count_flops = cfg.trainer.count_flops
        self.diag = Diagnostics(cfg.diagnostics, c.model, c.stepper.params)
        self.step_flops = 0  # this rank's forward + backward FLOPs per optimizer step, counted on the first step

    def injects(self, step: int) -> bool:
        """The test hook trainer.inject_nonfinite_at: overflow at `step`, under DDP on rank 0 only (the
        other ranks skip the step all the same)."""
        return step in self.inject and self.c.world.is_main

    def probe(self, step: int) -> Probe:
        """What `step` runs through: eagerly where hooks watch it (a hook added to a compiled module
        recompiles it), with the gradient inspection on diagnostics steps, the FLOP count on the first."""
        c, first, due = self.c, step == self.first, self.diag.due(step)
        eager = c.compiled is None or first or due or self.injects(step)
        inspect = self.diag.inspect_gradients if due else None
        counter = count_flops() if first and self.count_flops else None
        return Probe(step, None if eager else c.compiled, inspect, c.stepper.scaler.scale, counter)

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[Probe]:
        c, probe = self.c, self.probe(step)
        with contextlib.ExitStack() as hooks:  # in this order: the diagnostics see an injected overflow
            if self.injects(step):
                hooks.enter_context(inject_nonfinite_grad(c.model, self.accum))
            if step == self.first:
                probe.seen = hooks.enter_context(observe_compute_dtypes(c.model))
            if self.diag.due(step):
                for watcher in self.diag.watchers(probe.scale_before):
                    hooks.enter_context(watcher)
            yield probe
        if probe.compute is not None:
            self.step_flops = probe.compute.get_total_flops()  # type: ignore[attr-defined]

    def row(self, probe: Probe, result: StepResult) -> dict:
        """The dtypes at the first step (checked against the policy: never silently train in another
        precision than asked, also on resume), diagnostics, and where a skipped step's inf/NaN began."""
        c, diag, row = self.c, self.diag, {}
        policy, scaler = c.stepper.policy, c.stepper.scaler
        if probe.step == self.first:
            dtypes = policy.check(c.model, probe.seen, c.stepper.params.master)
            if probe.step == 1:
                row.update(dtypes)
        if probe.inspect is not None:
            row.update(diag.collect())
        if result.skipped and diag.skips:  # the loss is read back only on skipped steps
            source = diag.skip_source(result.loss, result.culprit)
            row["diag/skip_source"] = source
            if c.world.is_main:
                print(
                    f"step {probe.step}: skipped, inf/NaN gradients from {source}; "
                    f"scale {probe.scale_before:g} -> {scaler.scale:g}",
                    file=sys.stderr,
                    flush=True,
                )
        return row


def count_flops() -> contextlib.AbstractContextManager:
    """torch's FLOP counter (matmuls, convolutions, attention; from shapes, no host sync), for the
    first step only: it sees every op through Python dispatch, which would slow every step."""
    from torch.utils.flop_counter import FlopCounterMode  # a slow import: not for --help or a config error

    # An op without a FLOP formula is run as its decomposition, which for SiLU's backward differs from
    # the kernel in the last bit, so a resumed run's first step would not be the straight run's: counted
    # as 0 FLOPs (elementwise, as the counter counts every activation) and run as the kernel.
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.silu_backward.default: no_flops})


def no_flops(*args: object, **kwargs: object) -> int:
    return 0


def inject_nonfinite_grad(model: nn.Module, accum: int) -> torch.utils.hooks.RemovableHandle:
    """Make the window's last micro-batch produce inf gradients in the first Linear/Conv layer, for
    checking the skip path end to end. Through a hook on that layer's output gradient, so the
    forward (and BatchNorm statistics) stay finite, and it works the same on a sharded model."""
    layer = next(m for m in model.modules() if isinstance(m, COMPUTE_TYPES))
    calls = [0]

    def forward_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == accum and out.requires_grad:
            out.register_hook(lambda grad: grad * float("inf"))

    return layer.register_forward_hook(forward_hook)
