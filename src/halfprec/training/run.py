"""run(cfg, run_dir): resume or start, build, train, and record how the run ended (summary.json)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from halfprec.config import Config, checked, config_warnings, from_saved, resolve_device
from halfprec.config.schema import CosineSchedule
from halfprec.errors import ConfigError, Interrupted, Preempted, naming
from halfprec.machine import launcher, torch_threads
from halfprec.numerics.layers import layer_table
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.numerics.scaling import DIVERGING, LossScaler, TrainingAborted
from halfprec.training import distributed
from halfprec.training.build import Components, build, lr_factor, optimizer_line, schedule_args
from halfprec.training.checkpoint import (
    check_resume_config,
    checkpoint_files,
    checkpoint_step,
    find_resume_checkpoint,
    load_checkpoint,
    logger_states,
    restore,
)
from halfprec.training.distributed import World
from halfprec.training.loop import train_loop
from halfprec.training.metrics import LoopState
from halfprec.training.perf import count_parameters, model_lines
from halfprec.training.progress import fmt
from halfprec.training.signals import resume_command
from halfprec.training.tracking import Tracker, build_tracker


def run(cfg: DictConfig | Config, run_dir: str | Path) -> dict:
    """Train as `cfg` says, writing metrics and checkpoints under `run_dir`; return the final metrics.
    A composed `cfg` is checked and typed first (halfprec.config.checked; train.py passes a Config)."""
    config = cfg if isinstance(cfg, Config) else checked(cfg)  # before any process group, checkpoint or model
    set_threads(config)
    device = resolve_device(config.trainer.device, config.precision)
    world = distributed.init(config.trainer.distributed, device.type)
    try:
        summary = _run(config, distributed.shared_run_dir(world, Path(run_dir)), world, device)
    except BaseException:
        distributed.finish(world, completed=False)
        raise
    distributed.finish(world, completed=True)
    return summary


def set_threads(cfg: Config) -> None:
    """torch's CPU threads from trainer.threads (auto: see halfprec.machine), set before anything is
    built; the number is written back into the config, so W&B and checkpoints record it."""
    threads = torch_threads(cfg.trainer.threads)
    torch.set_num_threads(threads)
    cfg.trainer.threads = threads


def resume_checkpoint(cfg: Config, run_dir: Path, world: World) -> tuple[Path | None, dict | None]:
    """The checkpoint `resume` names (None: a fresh start), loaded and checked against this config;
    the schedule's horizon set from it (or, fresh, from this config)."""
    path = find_resume_checkpoint(cfg.resume, run_dir / "checkpoints") if cfg.resume is not None else None
    ckpt = load_checkpoint(path) if path is not None else None
    old = from_saved(ckpt["config"]) if ckpt is not None else None
    set_horizon(cfg, old)
    if path is None or ckpt is None or old is None:  # all None together; the tests are for the type checker
        return None, None
    said = check_resume_config(old, cfg, path)  # another run's checkpoint: said before max_steps
    if int(ckpt["step"]) > cfg.trainer.max_steps:
        raise ConfigError(
            "trainer.max_steps", cfg.trainer.max_steps, f"{path} is at step {ckpt['step']} already: set "
            f"trainer.max_steps above {ckpt['step']} to train on from it (the run it resumes had "
            f"{old.trainer.max_steps})",
        )  # fmt: skip
    notes = [*said, lr_note(cfg, old, ckpt["scheduler"]["last_epoch"])]
    for note in filter(None, notes):
        print(f"resume: {note}", file=sys.stderr)
    if world.is_main and ckpt.get("world_size", 1) != world.size:
        print(
            f"resume: world size {ckpt.get('world_size', 1)} -> {world.size}: the effective batch becomes "
            f"{cfg.data.batch_size * cfg.accum * world.size} and the sample order differs from the first run",
            file=sys.stderr,
        )
    return path, ckpt


def horizon(cfg: Config) -> int:
    """The steps the config's lr schedule runs over."""
    total = cfg.sched.total_steps if isinstance(cfg.sched, CosineSchedule) else None
    return total or cfg.trainer.max_steps


def set_horizon(cfg: Config, old: Config | None) -> None:
    """sched.total_steps: null becomes the steps the cosine runs over: trainer.max_steps, or on
    resume the horizon the run started with, so that a longer trainer.max_steps does not restart
    the decay. Written into the config, so W&B and checkpoints record it."""
    if not isinstance(cfg.sched, CosineSchedule) or cfg.sched.total_steps is not None:
        return
    cfg.sched.total_steps = horizon(old) if old else cfg.trainer.max_steps


def lr_note(cfg: Config, old: Config, step: int) -> str | None:
    """What the lr does from the checkpoint on (`step`: the scheduler steps taken, skips aside), when
    the horizon changed or the run outgrows it."""
    if cfg.sched.name != "cosine":
        return None
    name, warmup, total, low = schedule_args(cfg)
    before = horizon(old)
    lr = cfg.optim.lr
    last = lr * lr_factor(step - 1, name, warmup, before, low)
    if total != before:
        new = lr * lr_factor(step, name, warmup, total, low)
        return f"sched.total_steps {before} -> {total}: the lr goes from {last:.3g} at the checkpoint to {new:.3g}"
    if cfg.trainer.max_steps <= total:
        return None
    longer = lr * lr_factor(step, name, warmup, cfg.trainer.max_steps, low)
    return (
        f"the cosine keeps its horizon of {total} steps: past them the lr stays at {lr * low:.3g} (its end); "
        f"add sched.total_steps={cfg.trainer.max_steps} to decay over the new length (the lr goes from {last:.3g} "
        f"to {longer:.3g})"
    )


def say_where(cfg: Config, run_dir: Path, resumed_from: Path | None, step: int, policy: PrecisionPolicy,
              model: list[str]) -> None:  # fmt: skip
    """Once everything is built: where this run writes, the `model` lines (its size; on a CPU, a long
    step ahead), which Linear layers compute in which number format (if any is quantized) and which
    recipe switches they follow, the optimizer's values, and where it continues from; then the
    settings that work but rarely do what was meant."""
    print(f"run dir: {run_dir}", file=sys.stderr)
    phases = [] if policy.schedule is None else policy.schedule.lines()
    plan = [*layer_table(policy.layers), *layer_table(policy.attention, title="attention:")]
    for line in [*model, optimizer_line(cfg.optim), *plan, *phases, *policy.notes]:
        print(line, file=sys.stderr)
    for line in config_warnings(cfg, policy.device_type):
        print(f"warning: {line}", file=sys.stderr)
    if resumed_from is not None:
        print(f"resume: from {resumed_from} at step {step} of {cfg.trainer.max_steps}", file=sys.stderr)
    elif cfg.resume is not None:
        print(
            f"resume={cfg.resume}: no checkpoint in {run_dir / 'checkpoints'} yet; starting at step 0", file=sys.stderr
        )
    elif launcher() == "submitit":
        print("resume=null: if submitit requeues this job (preemption, time limit) it starts again at step 0; "
              "add resume=auto to continue from its checkpoint", file=sys.stderr)  # fmt: skip


def _run(cfg: Config, run_dir: Path, world: World, device: torch.device) -> dict:
    path, ckpt = resume_checkpoint(cfg, run_dir, world)
    c = build(cfg, world, device)
    batches = c.data.train_batches(cfg.data.batch_size, cfg.seed, c.device, world.rank, world.size)
    loop = restore(ckpt, c, batches) if ckpt else LoopState()
    if world.is_main:
        model = model_lines(cfg, c.model, c.data.input_shape, c.device.type)
        say_where(cfg, run_dir, path, loop.step, c.stepper.policy, model)
        resume_step = loop.step if ckpt else None
        tracker = build_tracker(cfg, run_dir, resume_step=resume_step, states=logger_states(ckpt) if ckpt else None)
    else:
        tracker = Tracker([])  # rank 0 alone writes metrics and owns the loggers' runs
    summary: dict = {"exit_code": 1}
    start, resumed_at = time.perf_counter(), loop.step
    try:
        train_loop(cfg, c, batches, tracker, loop, run_dir / "checkpoints")
        summary = complete(cfg, c, loop, run_dir, cfg.trainer.max_steps - resumed_at, time.perf_counter() - start)
    except (TrainingAborted, Preempted) as err:
        # how far it got, with the counters of the moment it stopped (sweep.jsonl, halfprec report)
        status, code = ("stopped", 4) if isinstance(err, Preempted) else ("diverged", 3)  # stopped: resumable
        summary = end_summary(cfg, c, loop, status, code, time.perf_counter() - start)
        summary["error"] = str(err)  # all of it: the culprit, the scale history, the crash checkpoint
        raise
    except OSError as err:  # the run dir cannot be written (a full disk): one line, exit 6 (launch/exits.py)
        summary = end_summary(cfg, c, loop, "failed", 6, time.perf_counter() - start)
        summary["error"] = f"{type(err).__name__}: {err}"
        raise
    except KeyboardInterrupt:  # a second Ctrl-C (StopSignals): say what is on disk, exit 130
        summary = end_summary(cfg, c, loop, "interrupted", 130, time.perf_counter() - start)
        summary["error"] = interrupted_line(loop.step, run_dir, world)
        raise Interrupted(summary["error"]) from None
    finally:
        try:
            if world.is_main and summary.get("status"):
                write_summary(run_dir / "summary.json", summary)
        finally:
            tracker.finish(summary)  # W&B's run ends, even when the disk refused summary.json
    return summary


def interrupted_line(step: int, run_dir: Path, world: World) -> str:
    """What a quit at `step` left: the checkpoint saved at that step, an older one, or none."""
    saved = checkpoint_files(run_dir / "checkpoints")
    if not saved:
        return f"quit during step {step}; no checkpoint was saved yet: nothing to resume from"
    last = checkpoint_step(saved[-1])
    if last == step:  # the quit waited for this step's checkpoint
        done = f"quit at step {step} after saving {saved[-1]}"
    else:
        done = f"quit during step {step}; the last checkpoint is {saved[-1]} (step {last})"
    return f"{done}; continue from it with: {resume_command(run_dir, world)}"


def end_summary(cfg: Config, c: Components, loop: LoopState, status: str, exit_code: int, wall_s: float) -> dict:
    """summary.json and the W&B summary: how the run ended and its final numbers."""
    final, scaler = loop.final, c.stepper.scaler
    return {
        "status": status,
        "train/loss": final.get("train/loss"),
        **{k: v for k, v in final.items() if k.startswith("val/")},  # the task's validation metrics
        "scaler/skipped_steps": scaler.skipped_steps,
        "scaler/min_scale": scaler.min_seen,
        "scaler/max_scale": scaler.max_seen,
        "scaler/final_scale": scaler.scale,
        **{k: v for k, v in final.items() if k.startswith("precision/")},
        "steps": loop.step,
        "effective_batch": cfg.data.batch_size * cfg.accum * c.world.size,
        "world_size": c.world.size,
        "threads": cfg.trainer.threads,
        "params": count_parameters(c.model),  # tied tensors once
        "wall_s": wall_s,
        "exit_code": exit_code,
    }


def write_summary(path: Path, summary: dict) -> None:
    # strict JSON, as metrics.jsonl: a non-finite number (a diverged loss) is written as null
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
    try:
        path.write_text(json.dumps(clean, indent=1, allow_nan=False) + "\n")
    except OSError as err:
        raise naming(err, path) from None


def complete(cfg: Config, c: Components, loop: LoopState, run_dir: Path, steps: int, wall_s: float) -> dict:
    """A run that reached trainer.max_steps: the ranks agree, the losses are finite; its summary."""
    distributed.check_ranks_agree(c.model, c.stepper.scaler.scale, c.stepper.scaler.skipped_steps)
    check_finite(loop.final, cfg.trainer.max_steps)
    summary = end_summary(cfg, c, loop, "completed", 0, wall_s)
    summary["checkpoint"] = str(checkpoint_files(run_dir / "checkpoints")[-1])
    if c.world.is_main:
        print(done_line(summary, steps, c.stepper.scaler, run_dir), file=sys.stderr)
    return summary


def check_finite(final: dict, step: int) -> None:
    """A run whose last losses are inf/NaN diverged, however few of its steps were skipped."""
    for key in ("train/loss", "val/loss"):
        if not math.isfinite(final[key]):
            raise TrainingAborted(f"step {step}: the run ended with {key} = {final[key]}; {DIVERGING}")


def done_line(summary: dict, steps: int, scaler: LossScaler, run_dir: Path) -> str:
    # the training precision's val/* but val/loss; of each of precision.eval, its val/loss
    shown = [
        f"{k} {fmt(v)}"
        for k, v in summary.items()
        if k.startswith("val/") and k != "val/loss" and ("@" not in k or k.startswith("val/loss@"))
    ]
    return (
        f"done: {steps} steps in {summary['wall_s']:.1f}s | train/loss {fmt(summary['train/loss'])} | "
        f"{' | '.join(shown)} | skipped {scaler.skipped_steps} | scale {scaler.scale:g} "
        f"(min {scaler.min_seen:g}, max {scaler.max_seen:g}) | {run_dir}"
    )
