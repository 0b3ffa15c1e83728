"""The optimizer step: one method, read top to bottom (docs/design.md, "The optimizer-step contract").

A Stepper holds what the step works with (the module forward/backward run through, the task, the
precision policy, the parameter strategy, optimizer, schedule, loss scaler, clipping), built once
(training/build.py); the rest of a run reads those parts here. A caller passes the micro-batches and,
from the loop, what this step is watched with (the module to run through, a gradient inspection,
whether to compute the norm, a context around forward and backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from halfprec.components.tasks import Task
from halfprec.numerics.grads import any_nonfinite, full, total_norm
from halfprec.numerics.params import ParamStrategy
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.numerics.scaling import LossScaler, TrainingAborted
from halfprec.training.distributed import any_rank, grad_sync, nonfinite_on_any_rank

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets): what the task's loss scores


@dataclass
class StepResult:
    loss: torch.Tensor  # mean unscaled loss over the window; stays on the device (no sync)
    grad_norm: torch.Tensor | None  # true (unscaled) norm, before clipping; None when not asked for
    skipped: bool
    culprit: str | None = None  # on a skipped step: where the inf/NaN gradients start (backward order)


@dataclass
class Stepper:
    net: nn.Module  # what forward and backward run through: the model, its DDP wrapper or FSDP shards
    task: Task
    policy: PrecisionPolicy
    params: ParamStrategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    clip_grad_norm: float | None = None
    loss_weight: float = 1.0  # < 1 shrinks every gradient: the loss_scaling experiment's simulated small gradients

    def step(
        self,
        micro_batches: Sequence[Batch],
        net: nn.Module | None = None,
        inspect: Callable[[ParamStrategy], None] | None = None,
        compute_norm: bool = True,
        compute: contextlib.AbstractContextManager | None = None,
    ) -> StepResult:
        """One optimizer step over `len(micro_batches)` accumulated micro-batches, through `net`
        (default: self.net; the loop passes the compiled module on steps without hooks).
        `inspect` sees the unscaled gradients before clipping (diagnostics); `compute_norm=False`
        leaves out the gradient norm (None) unless clipping needs it: the loop asks for it on the
        steps that log it. `compute` is entered around the forward and backward passes (the first
        step's FLOP count)."""
        # `is None`, not `or`: truth-testing a compiled module asks its len(), which a GPT lacks
        net, params, k = self.net if net is None else net, self.params, len(micro_batches)
        # dropped before the first backward, not after the step: same numerics, fewer large frees
        # and re-mmaps per step on a CPU (docs/benchmarks.md, "The optimizer step's costs")
        params.drop_grads()

        # 1. forward under autocast, loss in fp32, scaled backward of loss / k
        weight = self.loss_weight / k  # one multiply, none when it is 1 (docs/benchmarks.md)
        losses = []
        with compute or contextlib.nullcontext():
            for i, (inputs, targets) in enumerate(micro_batches):
                with grad_sync(net, sync=i == k - 1):  # DDP/FSDP: reduce the grads in the last backward only
                    with self.policy.autocast():
                        output = net(self.policy.cast_input(inputs))
                    loss = self.task.loss(output, targets)
                    self.scaler.scale_loss(loss if weight == 1.0 else loss * weight).backward()
                losses.append(loss.detach())

        # 2. unscale once for the whole window (into fp32 master grads in pure modes)
        grads = params.unscale_(1.0 / self.scaler.scale)
        if inspect is not None:  # diagnostics steps: look at the true gradients before clipping
            inspect(params)

        # 3. one inf/NaN check for the whole window and one host sync (reduced over ranks)
        grad_norm, found_inf = self.check(grads, compute_norm)
        del grads  # pure modes: their fp32 gradients are then freed one by one as finish_ rounds the update
        culprit = params.first_nonfinite() if found_inf else None  # overflow steps only: rare

        # 4. clip the unscaled gradients, then step; 5. unless the window overflowed: then
        # neither the weights, the optimizer state nor the LR schedule move
        if not found_inf:
            if self.clip_grad_norm is not None:
                assert grad_norm is not None  # check() computes the norm whenever clipping
                torch.nn.utils.clip_grads_with_norm_(params.params, self.clip_grad_norm, grad_norm)
            self.optimizer.step()
            self.scheduler.step()
        params.finish_(stepped=not found_inf)

        # 6. exactly one scale update per optimizer step (raises TrainingAborted on a skip storm)
        try:
            self.scaler.update(found_inf)
        except TrainingAborted as err:
            err.culprit = culprit
            raise
        mean_loss = losses[0] if k == 1 else torch.stack(losses).mean()
        return StepResult(loss=mean_loss, grad_norm=grad_norm, skipped=found_inf, culprit=culprit)

    def check(self, grads: list[torch.Tensor], compute_norm: bool) -> tuple[torch.Tensor | None, bool]:
        """(grad norm or None, found inf/NaN) with one host read, the same on every rank.

        Skip iff a gradient holds inf/NaN, as GradScaler does, checked by torch's fused AMP check.
        Clipping needs a finite norm, so when clipping the norm is the check (inf/NaN anywhere makes
        it inf/NaN; so does a sum of squares past fp32's range). FSDP's grads are shards and their
        norm a DTensor: `full` makes it the global norm. The norm, dearer than the fused check, is
        computed only where it is used (clipping, logged steps; docs/benchmarks.md)."""
        if not grads:  # nothing has a gradient: nothing to check
            return torch.zeros(()), False
        if self.clip_grad_norm is not None:
            grad_norm = full(total_norm(grads))
            return grad_norm, nonfinite_on_any_rank(grad_norm)
        norm = full(total_norm(grads)) if compute_norm else None
        return norm, any_rank(any_nonfinite(grads))
