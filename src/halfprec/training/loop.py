"""The training loop (docs/design.md, "The training loop"): each part knows when it is due, and the
loop calls them in order: the precision phases, probes around the step, the step, the metrics row,
validation, the checkpoint, the stop signals."""

from __future__ import annotations

from pathlib import Path

from halfprec.components.data.batches import TrainBatches
from halfprec.config import Config
from halfprec.numerics.scaling import TrainingAborted
from halfprec.training.build import Components
from halfprec.training.checkpoint import Checkpointer
from halfprec.training.metrics import LoopState, MetricsWindow, Validator
from halfprec.training.phases import PhaseSwitches
from halfprec.training.probes import StepProbes
from halfprec.training.progress import Progress
from halfprec.training.signals import StopSignals
from halfprec.training.tracking import Tracker


def train_loop(
    cfg: Config, c: Components, batches: TrainBatches, tracker: Tracker, loop: LoopState, ckpt_dir: Path
) -> None:
    """Train from the step after `loop.step` to trainer.max_steps."""
    t, stepper = cfg.trainer, c.stepper
    phases, probes = PhaseSwitches(c), StepProbes(cfg, c, first=loop.step + 1)
    window, validator = MetricsWindow(cfg, c, loop), Validator(cfg, c)
    stop = StopSignals()
    saver = Checkpointer(cfg, c, batches, loop, tracker, ckpt_dir, hold=stop.holding)
    abort_on_nonfinite = t.nonfinite == "abort" and stepper.scaler.kind == "none"
    c.model.train()
    objective = (
        cfg.objective if cfg.objective is not None and cfg.objective.startswith("val/") else stepper.task.objective
    )
    with Progress(t.max_steps, enabled=t.progress and c.world.is_main, shown=objective) as progress, stop:
        for step in range(loop.step + 1, t.max_steps + 1):
            loop.step = step
            micro = [next(batches) for _ in range(cfg.accum)]
            lr = float(stepper.optimizer.param_groups[0]["lr"])  # this step's lr (torchao's optimizers: a tensor)
            switched = phases.begin(step)  # precision.schedule: the phases due begin in the layers
            with probes.around(step) as probe:
                try:  # the grad norm is computed on the steps that log it only
                    result = stepper.step(micro, probe.net, probe.inspect, window.due(step), probe.compute)
                except TrainingAborted as err:
                    raise crash(err, err.culprit, saver, window, tracker) from None
            if result.skipped and abort_on_nonfinite:
                nonfinite = Exception("non-finite gradients and trainer.nonfinite=abort")
                raise crash(nonfinite, result.culprit, saver, window, tracker)
            row = probes.row(probe, result)
            row.update(phases.row(step, switched, row))
            window.add(result)
            if window.due(step):
                row.update(window.row(step, result, lr, probes.step_flops))
            if validator.due(step):
                row.update(validator.run())
                window.restart_clock()
            if row:
                row = {"step": step, "samples": step * window.per_step, **row}
                tracker.log(row)
                loop.final.update(row)
                progress.update(step, loop.final, stepper.scaler)
            stopping = stop.agreed(c.world)  # DDP/FSDP: every rank stops at this step
            if saver.due(step) or stopping:
                saved = saver.save()
            if stopping and step < t.max_steps:
                stop.stop(c.world, step, saved, ckpt_dir.parent)


def crash(
    err: Exception, culprit: str | None, saver: Checkpointer, window: MetricsWindow, tracker: Tracker
) -> TrainingAborted:
    """Training cannot go on: a crash checkpoint (the weights are finite: the step was skipped), a
    last row with the counters of this step, and the report: where the inf/NaN started, the scale history."""
    loop, scaler = window.loop, window.c.stepper.scaler
    path = saver.save(f"crash-step-{loop.step:08d}.pt")
    row = {"step": loop.step, "samples": loop.step * window.per_step, **window.stop_row()}
    tracker.log(row)
    loop.final.update(row)
    where = f"non-finite gradients start at: {culprit}" if culprit else "no non-finite gradient found"
    return TrainingAborted(
        f"step {loop.step}: {err}\n  {where}\n  scale history (step:scale, ! = overflow): "
        f"{scaler.history_tail()}\n  the weights are finite (the step was skipped); crash checkpoint: {path}"
    )
