"""The rows the loop logs: the training window's train/*, scaler/* and perf/* metrics, and the
task's validation metrics (docs/design.md, "Metrics"). Each part says when it is due."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from halfprec.components.data import Dataset
from halfprec.components.data.batches import num_samples
from halfprec.components.tasks import Task
from halfprec.config import Config
from halfprec.numerics.evaluation import EvalPrecision, eval_key, layers_in, rng_kept
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.training import distributed
from halfprec.training.build import Components
from halfprec.training.distributed import World
from halfprec.training.perf import math_kind, peak_tflops
from halfprec.training.step import StepResult


@dataclass
class LoopState:
    """What the loop carries between steps; checkpointed so a resumed run logs identical rows."""

    step: int = 0
    last_row_step: int = 0
    skipped_before: int = 0  # scaler.skipped_steps at the last row
    clean_loss_sum: float | torch.Tensor = 0.0  # sum of non-skipped step losses since the last row (on the device)
    clean_steps: int = 0
    final: dict = field(default_factory=dict)  # the latest value of every metric logged


class MetricsWindow:
    """train/*, scaler/* and perf/* over the steps since the last row, at step 1, every
    trainer.log_every steps and at the last step."""

    def __init__(self, cfg: Config, c: Components, loop: LoopState):
        self.c, self.loop = c, loop
        self.log_every, self.max_steps = cfg.trainer.log_every, cfg.trainer.max_steps
        self.per_step = cfg.data.batch_size * cfg.accum * c.world.size  # the effective batch
        self.peak = peak_tflops(c.device, math_kind(c.stepper.policy))  # None on a CPU or a chip not in the table
        self.last_time = time.perf_counter()

    def due(self, step: int) -> bool:
        return step == 1 or step % self.log_every == 0 or step == self.max_steps

    def add(self, result: StepResult) -> None:
        if not result.skipped:  # a skipped step's loss is often inf: keep it out of the mean
            # accumulate on the device; the host reads it back only when a row is logged
            self.loop.clean_loss_sum = result.loss + self.loop.clean_loss_sum
            self.loop.clean_steps += 1

    def restart_clock(self) -> None:
        """After a validation: keep it out of perf/step_ms."""
        self.last_time = time.perf_counter()

    def row(self, step: int, result: StepResult, lr: float, step_flops: int) -> dict:
        loop, scaler, now = self.loop, self.c.stepper.scaler, time.perf_counter()
        n, seconds = step - loop.last_row_step, now - self.last_time
        loss = loop.clean_loss_sum / loop.clean_steps if loop.clean_steps else result.loss
        if self.c.world.size > 1:  # DDP: each rank saw its own slice of the batch (a float after a checkpoint)
            loss = distributed.mean_over_ranks(torch.as_tensor(loss, device=result.loss.device))
        assert result.grad_norm is not None  # the loop asks for the norm on the steps that log a row
        row = {
            "train/loss": float(loss),
            "train/lr": lr,
            "train/grad_norm": result.grad_norm.item(),
            "scaler/skipped": scaler.skipped_steps - loop.skipped_before,
            **scaler.metrics(),
            "perf/samples_per_s": n * self.per_step / seconds,
            **self.c.stepper.task.throughput(n * self.per_step / seconds, self.c.data),
            "perf/step_ms": 1000 * seconds / n,
        }
        if step_flops:  # matmuls, convolutions, attention; not the optimizer's elementwise math
            row["perf/tflops"] = step_flops * n / seconds / 1e12
            if self.peak is not None:
                row["perf/mfu"] = row["perf/tflops"] / self.peak[1]
        if self.c.device.type == "cuda":
            row["perf/max_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
        loop.clean_loss_sum, loop.clean_steps = 0.0, 0
        loop.last_row_step, loop.skipped_before, self.last_time = step, scaler.skipped_steps, now
        return row

    def stop_row(self) -> dict:
        """The counters of the step that stopped a run: the last row, which reports read."""
        scaler = self.c.stepper.scaler
        return {**scaler.metrics(), "scaler/skipped": scaler.skipped_steps - self.loop.skipped_before}


class Validator:
    """The task's validation metrics every trainer.val_every steps (0: only at the end) and at the last."""

    def __init__(self, cfg: Config, c: Components):
        self.c, self.every, self.max_steps, self.batch_size = (
            c,
            cfg.trainer.val_every,
            cfg.trainer.max_steps,
            cfg.data.batch_size,
        )

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def run(self) -> dict:
        """val/* in the training precision, then val/*@<entry> for each of precision.eval."""
        c, policy = self.c, self.c.stepper.policy
        metrics = evaluate(c.model, c.data, c.stepper.task, policy, self.batch_size, c.device, c.world)
        for precision in policy.evals:
            metrics |= evaluate_in(precision, c.model, c.data, c.stepper.task, policy, self.batch_size, c.device,
                                   c.world)  # fmt: skip
        return metrics


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Dataset,
    task: Task,
    policy: PrecisionPolicy,
    batch_size: int,
    device: torch.device,
    world: World | None = None,
) -> dict:
    """The task's validation metrics over the whole validation split. Under DDP/FSDP each rank takes
    its share of the samples and the sums are added over ranks."""
    world = world or World()
    model.eval()
    if world.size > 1:
        distributed.broadcast_buffers(model)  # BatchNorm statistics: rank 0's, the ones its checkpoint holds
    evaluator = task.evaluator(device, data)
    for inputs, targets in data.val_batches(task.val_batch_size(batch_size), device, world.rank, world.size):
        with policy.autocast():
            evaluator.add(model(policy.cast_input(inputs)), targets)
    model.train()
    sums = evaluator.sums()
    return evaluator.metrics(
        (distributed.sum_over_ranks(sums) if world.size > 1 else sums).tolist(), num_samples(data.val)
    )


def evaluate_in(
    precision: EvalPrecision,
    model: nn.Module,
    data: Dataset,
    task: Task,
    policy: PrecisionPolicy,
    batch_size: int,
    device: torch.device,
    world: World | None = None,
) -> dict:
    """evaluate() with the model's Linear layers as `precision` computes them (numerics/evaluation.py),
    its keys val/<metric>@<entry>; the model's modules and the random number generators as they were
    after it, so that evaluating changes nothing the training computes. Eager, on `model` itself: a
    compiled copy of the model is not called (nor recompiled)."""
    with rng_kept(device), layers_in(model, precision):
        metrics = evaluate(model, data, task, policy, batch_size, device, world)
    return {eval_key(k, precision.entry): v for k, v in metrics.items()}
