"""What watches an optimizer step from outside it: the first step's dtype check and FLOP count,
gradient diagnostics, overflows injected for testing the skip path, and which module the step runs
through (steps that hook into layers run eagerly: a hook added to a compiled model recompiles it)."""

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
from halfprec.training.distributed import any_rank
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
    switched: bool = False  # a precision.schedule phase began at this step


class StepProbes:
    def __init__(self, cfg: Config, c: Components, first: int):
        self.c, self.first, self.accum = c, first, cfg.accum
        self.inject = set(cfg.trainer.inject_nonfinite_at)
        self.count_flops = cfg.trainer.count_flops
        self.diag = Diagnostics(cfg.diagnostics, c.model, c.stepper.params)
        self.step_flops = 0  # this rank's forward + backward FLOPs per optimizer step, counted on the first step
        self.schedule = c.stepper.policy.schedule

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[Probe]:
        c, diag, first = self.c, self.diag, step == self.first
        # under DDP on rank 0 only: the other ranks must skip the step all the same
        injected = inject_nonfinite_grad(c.model, self.accum) if step in self.inject and c.world.is_main else None
        watch: contextlib.AbstractContextManager[set[torch.dtype]] = (
            observe_compute_dtypes(c.model) if first else contextlib.nullcontext(set())
        )
        counter = count_flops() if first and self.count_flops else None
        due = diag.due(step)
        acts = diag.watch_activation_gradients(c.stepper.scaler.scale) if due and diag.activations else None
        logits = diag.watch_logits() if due else contextlib.nullcontext()
        quant = diag.watch_quantization() if due and diag.quantized else contextlib.nullcontext()
        updates = diag.watch_updates() if due else contextlib.nullcontext()  # bf16/fp16 weights without masters
        shadow = diag.watch_shadow() if due and diag.shadow else contextlib.nullcontext()
        hooked = first or injected is not None or acts is not None or due
        net = c.compiled if c.compiled is not None and not hooked else None
        probe = Probe(step, net, diag.inspect_gradients if due else None, c.stepper.scaler.scale, counter)
        if self.schedule is not None and self.schedule.advance(step):
            c.stepper.policy.enter_phase(c.model, self.schedule.phase_at(step))
            probe.switched = True
        try:
            with watch as probe.seen, acts or contextlib.nullcontext(), logits, quant, updates, shadow:
                yield probe
        finally:
            if injected is not None:
                injected.remove()
        if counter is not None:
            self.step_flops = counter.get_total_flops()  # type: ignore[attr-defined]

    def row(self, probe: Probe, result: StepResult) -> dict:
        """The dtypes at the first step (checked against the policy: never silently train in another
        precision than asked, also on resume), diagnostics, and where a skipped step's inf/NaN began."""
        c, diag, row = self.c, self.diag, {}
        if probe.step == self.first:
            dtypes = c.stepper.policy.check(c.model, probe.seen, c.stepper.params.master)
            if probe.step == 1:
                row.update(dtypes)
        if probe.inspect is not None:
            row.update(diag.collect())
        if self.schedule is not None:
            row.update(self.phase_row(probe, row))
        if result.skipped and diag.skips:  # the loss is read back only on skipped steps
            source = diag.skip_source(result.loss, result.culprit)
            row["diag/skip_source"] = source
            if c.world.is_main:
                print(
                    f"step {probe.step}: skipped, inf/NaN gradients from {source}; "
                    f"scale {probe.scale_before:g} -> {c.stepper.scaler.scale:g}",
                    file=sys.stderr,
                    flush=True,
                )
        return row

    def phase_row(self, probe: Probe, row: dict) -> dict:
        """precision.schedule: at step 1 and where a phase begins, the phase and the layer counts (the
        first-step check's, which also checks each layer computes as the phase says), printed; on a
        diagnostics step, whether the trigger the next phase waits for holds (then it begins next step)."""
        c, schedule, step = self.c, self.schedule, probe.step
        assert schedule is not None
        pending = schedule.pending_trigger()
        if pending is not None and pending[0] in row:  # every rank decides alike: the ranks' rows differ
            key, threshold = pending
            if any_rank(torch.tensor(float(row[key] < threshold), device=c.device)):
                schedule.fire(step)
        if not (probe.switched or step == 1):
            return {}
        phase = schedule.phase_at(step)
        if probe.switched and c.world.is_main:
            for i in range(schedule.phase_at(step - 1), phase):
                print(f"step {step}: {schedule.describe(i)}", file=sys.stderr, flush=True)
        return {"precision/phase": phase, **c.stepper.policy.check_layers(c.model)}


def count_flops() -> contextlib.AbstractContextManager:
    """torch's FLOP counter (matmuls, convolutions, attention; from shapes, no host sync), for the
    first step only: it sees every op through Python dispatch, which would slow every step."""
    from torch.utils.flop_counter import FlopCounterMode  # 0.2 s of imports; not for --help or a config error

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
